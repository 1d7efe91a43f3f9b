"""One epoch of a LightningModule under ``purestep.Trainer`` against ``lightning.Trainer``.

Run from the repository root (needs the ``lightning`` extra)::

    .venv/bin/python benchmarks/lightning_loop.py           # full run, under a minute
    .venv/bin/python benchmarks/lightning_loop.py --quick   # smoke run, a few seconds

The user's code is the same on both sides: one class, a subclass of the real
``lightning.pytorch.LightningModule`` (an MLP 64-128-10 whose ``training_step`` returns the
cross-entropy and ``self.log``-s it, ``configure_optimizers`` returning a torch Adam with lr
1e-3), trained for one epoch over a ``DataLoader`` of a ``TensorDataset`` (8192 samples,
``batch_size=32, shuffle=True``, no workers: 256 batches). Each side builds its Trainer and
a fresh module from the same initial weights inside the timed call, as a script does:

* lightning: ``lightning.pytorch.Trainer(accelerator="cpu", devices=1, max_epochs=1,
  enable_progress_bar=False, logger=False, enable_checkpointing=False,
  enable_model_summary=False, num_sanity_val_steps=0).fit(module, loader)``;
* purestep: ``purestep.Trainer`` with the same flags (the CPU on both sides, also where a
  GPU is present), ``.fit(module, loader)``;
* purestep_task (informational): the same model as a ``purestep.Task`` with the engine's
  own Adam (``engine.optim.adam``), the form purestep is written for.

Both fits are checked to take exactly 256 optimizer steps. Threads: one (``torch.set_num_threads
(1)``), as in the other benchmarks. Timing: ``_harness.interleaved_calls`` (one epoch per side
per round, rotating order); a side's figure is its epoch divided by the 256 batches, and the
ratios of the last line are paired medians (the median over rounds of the per-round ratio),
so a background job that slows a whole round cancels out. Last line: ``ratio=<purestep /
lightning> task_ratio=<purestep_task / lightning>``; ``1 / ratio`` is how many times lighter
purestep's loop is on the user's unchanged module.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import purestep
from purestep.engine import optim

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _harness

LR = 1e-3
BATCH = 32
WIDTHS = (64, 128, 10)
FLAGS = {
    "accelerator": "cpu",
    "devices": 1,
    "max_epochs": 1,
    "enable_progress_bar": False,
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}
FULL, QUICK = (8192, 9), (512, 2)  # (samples, rounds)


class LitMLP(pl.LightningModule):
    """The user's module, unchanged between the two Trainers."""

    def __init__(self, template: nn.Module) -> None:
        super().__init__()
        self.net = copy.deepcopy(template)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


class TaskMLP(purestep.Task):
    """The same model in purestep's own form, with the engine's Adam."""

    def __init__(self, template: nn.Module) -> None:
        super().__init__(copy.deepcopy(template))

    def training_step(self, apply: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(apply(x), y)

    def configure_optimizers(self) -> Any:
        return optim.adam(LR)


class Workload:
    """The shared template and data; each method runs one epoch of one side."""

    def __init__(self, samples: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.dataset = TensorDataset(
            torch.randn(samples, WIDTHS[0], generator=g),
            torch.randint(0, WIDTHS[-1], (samples,), generator=g),
        )
        self.batches = -(-samples // BATCH)
        torch.manual_seed(0)
        self.template = nn.Sequential(
            nn.Linear(WIDTHS[0], WIDTHS[1]), nn.ReLU(), nn.Linear(WIDTHS[1], WIDTHS[2])
        )

    def loader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH, shuffle=True)

    def lightning(self) -> int:
        trainer = pl.Trainer(**FLAGS)
        trainer.fit(LitMLP(self.template), self.loader())
        return trainer.global_step

    def purestep(self) -> int:
        state = purestep.Trainer(**FLAGS).fit(LitMLP(self.template), self.loader())
        return state.progress.step

    def purestep_task(self) -> int:
        state = purestep.Trainer(**FLAGS).fit(TaskMLP(self.template), self.loader())
        return state.progress.step


def checked(run: Any, steps: int, name: str) -> Any:
    """``run`` as an ``interleaved_calls`` side (output captured) that checks its step count."""

    def side(_: Any) -> None:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            done = run()
        if done != steps:
            raise AssertionError(f"{name} took {done} optimizer steps, expected {steps}")

    return side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    samples, rounds = QUICK if args.quick else FULL
    work = Workload(samples)
    n = work.batches
    print(
        f"torch {torch.__version__}, lightning {pl.__version__}, 1 thread; MLP "
        f"{'-'.join(map(str, WIDTHS))}, torch Adam lr {LR}; {n} batches of {BATCH} per epoch"
    )
    nothing = lambda: None
    sides = {
        "lightning": (nothing, checked(work.lightning, n, "lightning")),
        "purestep": (nothing, checked(work.purestep, n, "purestep")),
        "purestep_task": (nothing, checked(work.purestep_task, n, "purestep_task")),
    }
    for _, run in sides.values():  # warm-up: one epoch each
        run(None)
    t0 = time.perf_counter()
    times = _harness.interleaved_calls(sides, rounds)
    print(f"\n[one epoch] {rounds} rounds, median (min..max) per step over the epoch")
    for name, samples_s in times.items():
        print(f"  {name:14s} {_harness.summary(samples_s, 1e6 / n)} us/step")
    ratio = _harness.paired(times["purestep"], times["lightning"])
    task_ratio = _harness.paired(times["purestep_task"], times["lightning"])
    print(f"  purestep's loop is {1 / ratio:.2f}x lighter on the same LightningModule")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    print(f"ratio={ratio:.3f} task_ratio={task_ratio:.3f}")


if __name__ == "__main__":
    main()
