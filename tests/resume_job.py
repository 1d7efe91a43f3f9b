"""A training job for the kill-and-resume tests (run as a script in its own folder).

Everything that makes resuming hard is on: shuffling, dropout, DataLoader workers with
per-sample random augmentation, gradient accumulation, a learning-rate schedule, early
stopping, a top-k checkpoint policy and a checkpoint at every step. ``--kill EVENT:N``
makes the process SIGKILL itself at the N-th ``EVENT`` (``train`` = train batch end,
``val`` = validation batch end); ``--signal EVENT:N`` sends itself SIGTERM instead
(preemption). ``--resume`` continues from ``ckpt_path="last"``. The last line printed is
``digest=<hash of the final TrainState>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from purestep.engine import metrics, optim
from purestep.loops import Trainer
from purestep.loops.callbacks import EarlyStopping, LambdaCallback, ModelCheckpoint
from purestep.loops.data import keyed
from purestep.loops.loggers import CSVLogger
from tests.helpers import digest


class Points(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def jitter(sample, generator):
    x, y = sample
    return x + 0.05 * torch.randn(x.shape, generator=generator), y


def loss_fn(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": metrics.Accuracy.of(logits, y)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill", default=None)
    parser.add_argument("--signal", default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    counts = {"train": 0, "val": 0}

    def maybe_die(kind):
        def handler(ctx):
            counts[kind] += 1
            for spec, sig in ((args.kill, signal.SIGKILL), (args.signal, signal.SIGTERM)):
                if spec and spec == f"{kind}:{counts[kind]}":
                    os.kill(os.getpid(), sig)
            return None

        return handler

    killer = LambdaCallback(
        name="killer",
        on_train_batch_end=maybe_die("train"),
        on_validation_batch_end=maybe_die("val"),
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    schedule = optim.schedules.warmup_cosine(3e-2, 4, 40, end_value=1e-3)
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.inject_hyperparams(optim.adamw)(lr=schedule, weight_decay=1e-3),
    )
    trainer = Trainer(
        max_epochs=4,
        accumulate_grad_batches=3,
        val_check_interval=0.5,
        log_every_n_steps=1,
        default_root_dir="runs",
        logger=CSVLogger("runs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            killer,
            EarlyStopping("val_loss", patience=3),
            ModelCheckpoint(
                monitor="val_loss", save_top_k=2, filename="{epoch}-{step}-{val_loss:.3f}"
            ),
            ModelCheckpoint(name="resume", every_n_train_steps=1, save_top_k=0, save_last=True),
        ],
    )
    train = DataLoader(keyed(Points(66, 1), jitter), batch_size=4, shuffle=True, num_workers=2)
    val = DataLoader(Points(20, 2), batch_size=8)
    state = trainer.fit(
        net, loss_fn, opt, train, val, seed=11, ckpt_path="last" if args.resume else None
    )
    print(f"status={trainer.status} step={state.progress.step} ran_batches={counts['train']}")
    print(f"digest={digest(state)}")


if __name__ == "__main__":
    main()
