"""A two-optimizer training job for the kill-and-resume tests (run as a script).

``--mode auto``: automatic optimization (``optimizer_idx``), gradient accumulation over 3
batches, a per-step schedule on one optimizer and ``ReduceLROnPlateau`` on the other;
``--mode manual``: the training step runs the discriminator twice per generator step, the
discriminator accumulating over 3 calls of its own. Dropout and shuffling are on; a checkpoint
is written after every batch. ``--kill N`` SIGKILLs the process at the N-th training batch
end (``--crash N`` raises there); ``--resume`` continues from ``ckpt_path="last"``. The last
line is ``digest=<hash>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from purestep import Task, Trainer
from purestep.engine import optim
from purestep.loops.callbacks import LambdaCallback, ModelCheckpoint
from purestep.loops.loggers import CSVLogger
from tests.helpers import digest


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] * x[:, 1] > 0).float())


class Pair(Task):
    def __init__(self, manual: bool) -> None:
        torch.manual_seed(0)
        net = nn.ModuleDict(
            {
                "body": nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2)),
                "head": nn.Linear(16, 1),
            }
        )
        super().__init__(net)
        self.automatic_optimization = not manual

    @staticmethod
    def objective(apply, batch, which):
        x, y = batch
        logits = apply["head"](apply["body"](x)).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        return loss if which == 0 else loss + 1e-3 * logits.pow(2).mean()

    def training_step(self, apply_or_opt, batch, optimizer_idx=None):
        if self.automatic_optimization:
            return self.objective(apply_or_opt, batch, optimizer_idx)
        opt = apply_or_opt
        for _ in range(2):
            d = opt.step("body", lambda a, b: self.objective(a, b, 0), batch)
        g = opt.step("head", lambda a, b: self.objective(a, b, 1), batch)
        return {"loss": g.loss, "d_loss": d.loss}

    def validation_step(self, apply, batch):
        return self.objective(apply, batch, 0)

    def configure_optimizers(self):
        inject = optim.inject_hyperparams
        body = {"optimizer": inject(optim.adam)(lr=1e-2), "params": "body"}
        # manual: two calls a batch, an update every third one, each at its schedule's value
        body["lr_scheduler"] = {
            "scheduler": optim.schedules.exponential(1e-2, transition_steps=1, decay_rate=0.97),
            "interval": "step",
        }
        if not self.automatic_optimization:
            body["accumulate"] = 3
        head = {
            "optimizer": inject(optim.sgd)(lr=0.1, momentum=0.9),
            "params": "head",
            "lr_scheduler": {
                "scheduler": optim.ReduceLROnPlateau(patience=0, factor=0.5, threshold=0.5),
                "monitor": "val_loss",
            },
        }
        return {"body": body, "head": head}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["auto", "manual"], default="auto")
    parser.add_argument("--kill", type=int, default=None)
    parser.add_argument("--crash", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    count = [0]

    def maybe_die(ctx):
        count[0] += 1
        if args.kill == count[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.crash == count[0]:
            raise RuntimeError(f"crash at batch {count[0]}")

    trainer = Trainer(
        max_epochs=3,
        accumulate_grad_batches=3 if args.mode == "auto" else 1,
        log_every_n_steps=1,
        default_root_dir="runs",
        logger=CSVLogger("runs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            LambdaCallback(name="killer", on_train_batch_end=maybe_die),
            ModelCheckpoint(every_n_train_steps=1, save_top_k=0, save_last=True),
        ],
    )
    train = DataLoader(data(40, 1), batch_size=4, shuffle=True)
    val = DataLoader(data(16, 2), batch_size=8)
    state = trainer.fit(
        Pair(args.mode == "manual"),
        train_dataloaders=train,
        val_dataloaders=val,
        seed=5,
        ckpt_path="last" if args.resume else None,
    )
    head_lr = optim.injected_values(state.opt_state.states["head"], "lr")
    print(f"steps={state.opt_state.steps} head_lr={head_lr} ran_batches={count[0]}")
    print(f"digest={digest(state)}")


if __name__ == "__main__":
    main()
