"""A GAN in the Trainer: two optimizers, manual optimization, the critic twice per generator step.

The same GAN as ``custom_loop.py`` (8 Gaussians on a circle; the score is the share of the 8
modes the generator covers), written as a ``Task`` instead of a hand-made loop. The model
is one ``nn.ModuleDict`` holding both networks; ``configure_optimizers`` gives each its own
optimizer over its own parameters; ``automatic_optimization = False`` hands the training
step an ``opt`` through which it runs the optimizer steps itself. Each ``opt.step`` is a
pure step: gradients for that optimizer's parameters only (the other network is a
constant), its own clipping, its own state in the ``TrainState`` — so checkpoints,
``ckpt_path="last"`` resumes and the loggers work as for one optimizer. The noise comes
from ``torch.randn`` inside the loss functions, which the step scopes to its own key, so a
run is a pure function of its seed. The last line printed is ``mode_coverage=<x>``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from purestep import Task, Trainer, engine, seed_everything
from purestep.engine import optim
from purestep.loops.loggers import CSVLogger

try:  # run as a script, or imported from the tests with examples/ on the path
    from custom_loop import NOISE, coverage, mlp, ring
except ImportError:  # pragma: no cover - imported as a module of a package
    from .custom_loop import NOISE, coverage, mlp, ring


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


class GAN(Task):
    """Generator and critic trained against each other (non-saturating GAN loss)."""

    automatic_optimization = False

    def __init__(self, critic_steps: int = 2, lr: float = 1e-3) -> None:
        self.save_hyperparameters()
        super().__init__(nn.ModuleDict({"generator": mlp(NOISE, 2), "critic": mlp(2, 1)}))

    def critic_loss(self, apply, real):
        fake = apply["generator"](torch.randn(len(real), NOISE))  # a constant here
        real_logits, fake_logits = apply["critic"](real), apply["critic"](fake)
        loss = _bce(real_logits, 1.0) + _bce(fake_logits, 0.0)
        return loss, {"real_score": real_logits.sigmoid().mean()}

    def generator_loss(self, apply, real):
        fake = apply["generator"](torch.randn(len(real), NOISE))
        return _bce(apply["critic"](fake), 1.0)  # the critic is a constant here

    def training_step(self, opt, real):
        for _ in range(self.hparams["critic_steps"]):
            d = opt.step("critic", self.critic_loss, real)
        g = opt.step("generator", self.generator_loss, real)
        return {"d_loss": d.loss, "g_loss": g.loss, "real_score": d.metrics["real_score"]}

    def configure_optimizers(self):
        lr = self.hparams["lr"]
        return {
            "critic": {"optimizer": optim.adam(lr, betas=(0.5, 0.999)), "params": "critic"},
            "generator": {
                "optimizer": optim.adam(lr, betas=(0.5, 0.999)),
                "params": "generator",
                "gradient_clip_val": 5.0,
            },
        }


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--root", default="runs/gan_trainer")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    seed_everything(args.seed)  # the networks' initial weights; fit's seed defaults to it
    task = GAN()
    trainer = Trainer(
        max_epochs=args.epochs,
        default_root_dir=args.root,
        logger=CSVLogger(args.root, name="gan"),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=4,
    )
    real = torch.utils.data.DataLoader(ring(args.samples, seed=3), batch_size=args.batch_size)
    state = trainer.fit(task, train_dataloaders=real, ckpt_path="last" if args.resume else None)
    sample = engine.predict_step(task.model, lambda apply, z: apply["generator"](z))
    z = torch.randn(2000, NOISE, generator=torch.Generator().manual_seed(4))
    score = coverage(sample(state, z))
    steps = state.opt_state.steps
    print(f"critic_steps={steps['critic']} generator_steps={steps['generator']}")
    print(f"mode_coverage={score:.3f}")
    return score


if __name__ == "__main__":
    main()
