"""Time to the first training step of a run resumed at batch 0 and at batch 10,000 of an epoch.

Run from the repository root::

    .venv/bin/python benchmarks/resume_cost.py           # full run, about a minute
    .venv/bin/python benchmarks/resume_cost.py --quick   # smoke run, a few seconds

The data: a map-style dataset of 1,000,000 samples whose ``__getitem__`` sleeps 1 ms (a
slow disk or decoder) and returns one of 1024 fixed (64-feature, label) pairs; batch 32,
shuffled, so an epoch has 31,250 batches and every batch costs at least 32 ms to read. The
model: an MLP 64-128-10 trained with ``engine.optim.adam(1e-3)``.

Two measurements, each at batch 0 and at batch 10,000 of epoch 1:

* data path: ``loops.data.source(dataset, batch_size=32, shuffle=True, seed=...)``, then
  ``.iterate(1, start)`` and ``next()`` of it: the time until the first batch is in hand;
* Trainer: a checkpoint written with ``engine.checkpoint.save`` of a state whose
  ``Progress`` says epoch 1, batch ``start`` (``step = total_batches = 31,250 + start``,
  ``samples = 32 * step``), then ``Trainer(max_epochs=2, max_steps=step + 1, ...)
  .fit(model, loss_fn, adam, DataLoader(dataset, batch_size=32, shuffle=True),
  ckpt_path=path)``, timed from building the Trainer until ``fit`` returns after its one
  step: what a user waits for when relaunching a preempted job (the Python start-up and
  imports, the same at any batch, are not included). The Trainer runs as the fair baseline
  of ``fit_overhead.py`` (no progress bar, logger, checkpointing or model summary, no sanity
  check); each returned state is checked to have taken exactly one step from ``start``.

For context the script also prints what replaying the skipped batches would cost (what a
loop without O(1) resume does: 10,000 x the measured time to read one batch), and the parts
of the resumed start-up: building the epoch's index plan (``DatasetBatches.plan``), loading
the checkpoint, reading one batch. The full run also resumes twice at each point in a fresh
Python process (``--child``) and prints its wall time and the Trainer + fit time inside it,
which holds the one-time costs a warmed-up process no longer pays (first imports, first
DataLoader): what a relaunched job waits for.

Threads: ``torch.set_num_threads(1)``. Timing: ``_harness.interleaved_calls``, the four
sides in rotating order, one call each per round, medians over rounds. Each call returns
what it built, so freeing it (the plan of a million indices included) is not timed. The
last line is ``ratio=<Trainer: t_10000 / t_0> data_ratio=<data path: t_10000 / t_0>``, each
the paired median (the median over rounds of that round's ratio).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from purestep import engine
from purestep.engine import checkpoint, optim
from purestep.loops import Trainer, source

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.resume_cost``
    from benchmarks import _harness

LR = 1e-3
BATCH = 32
EPOCH = 1
SEED = 7
FAIR = {
    "enable_progress_bar": False,
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "max_epochs": EPOCH + 1,
}
# (samples, seconds per __getitem__, resume batch, rounds); then --quick's
FULL = (1_000_000, 1e-3, 10_000, 9)
QUICK = (64_000, 1e-4, 1_000, 2)


class SlowDataset(Dataset):
    """``n`` samples, each read taking ``delay`` seconds (a slow disk or decoder)."""

    def __init__(self, n: int, delay: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.n = n
        self.delay = delay
        self.x = torch.randn(1024, 64, generator=g)
        self.y = torch.randint(0, 10, (1024,), generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return self.x[i % 1024], self.y[i % 1024]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def loss_fn(apply: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(apply(x), y)


class Resume:
    """The dataset, the model and one checkpoint per resume point."""

    def __init__(self, samples: int, delay: float, folder: str) -> None:
        self.dataset = SlowDataset(samples, delay)
        self.per_epoch = -(-samples // BATCH)
        torch.manual_seed(0)
        self.model = mlp()
        self.folder = folder
        self.messages: list[str] = []
        self.strategy = Trainer(**FAIR).strategy

    def write_checkpoint(self, start: int) -> str:
        """A checkpoint of a run at batch ``start`` of epoch ``EPOCH``."""
        fresh = engine.init(self.model, optim.adam(LR), seed=0, strategy=self.strategy)
        step = EPOCH * self.per_epoch + start
        progress = fresh.progress.replace(
            epoch=EPOCH,
            step=step,
            batch_in_epoch=start,
            total_batches=step,
            samples=step * BATCH,
        )
        path = os.path.join(self.folder, f"batch_{start}.ckpt")
        checkpoint.save(fresh.replace(progress=progress), path)
        return path

    def first_batch(self, start: int) -> Any:
        """The data path: the source, then the first batch from ``start``."""
        batches = source(self.dataset, batch_size=BATCH, shuffle=True, seed=SEED)
        it = batches.iterate(EPOCH, start)
        return batches, it, next(it)

    def fit(self, start: int, path: str) -> Any:
        """The Trainer resumed from ``path``; one step, then fit returns."""
        step = EPOCH * self.per_epoch + start
        trainer = Trainer(**FAIR, max_steps=step + 1)
        loader = DataLoader(self.dataset, batch_size=BATCH, shuffle=True)
        said = io.StringIO()
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            state = trainer.fit(self.model, loss_fn, optim.adam(LR), loader, ckpt_path=path)
        if state.progress.step != step + 1 or state.progress.total_batches != step + 1:
            raise AssertionError(f"resumed at {start}: expected one step, got {state.progress}")
        if not self.messages:
            self.messages = [line for line in said.getvalue().splitlines() if line.strip()]
        return trainer, state


def nothing() -> None:
    return None


paired = _harness.paired


def parts(work: Resume, start: int, path: str, reps: int) -> dict[str, float]:
    """Median seconds of the start-up's parts: index plan, checkpoint load, one batch."""
    batches = source(work.dataset, batch_size=BATCH, shuffle=True, seed=SEED)
    plan, load = [], []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        p = batches.plan(EPOCH, start)
        plan.append(time.perf_counter() - t0)
        del p
        gc.collect()
        t0 = time.perf_counter()
        checkpoint.load(path)
        load.append(time.perf_counter() - t0)
    return {"plan": statistics.median(plan), "load": statistics.median(load)}


def batch_time(work: Resume, batches: int) -> float:
    """Median seconds to read one batch through a plain DataLoader (after the first)."""
    loader = DataLoader(work.dataset, batch_size=BATCH, shuffle=True)
    it = iter(loader)
    next(it)
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        next(it)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def child(start: int, path: str) -> None:
    """A fresh process resuming from ``path`` (``--child``): its Trainer + fit time, last."""
    torch.set_num_threads(1)
    samples, delay, _, _ = FULL
    t0 = time.perf_counter()
    Resume(samples, delay, os.path.dirname(path)).fit(start, path)
    print(f"fit_s={time.perf_counter() - t0:.6f}")


def cold(paths: dict[int, str], rounds: int) -> dict[int, list[tuple[float, float]]]:
    """``(process wall seconds, in-process Trainer + fit seconds)`` of fresh processes."""
    times: dict[int, list[tuple[float, float]]] = {at: [] for at in paths}
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for at in order:
            command = [sys.executable, os.path.abspath(__file__), "--child", str(at), paths[at]]
            t0 = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            wall = time.perf_counter() - t0
            last = done.stdout.strip().splitlines()[-1]
            times[at].append((wall, float(last.removeprefix("fit_s="))))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller epoch (smoke run)")
    parser.add_argument("--child", nargs=2, metavar=("START", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1])
        return

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    samples, delay, start, rounds = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="resume_cost_") as folder:
        work = Resume(samples, delay, folder)
        paths = {0: work.write_checkpoint(0), start: work.write_checkpoint(start)}
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} thread, python "
            f"{sys.version.split()[0]}; dataset of {samples:,} samples, {delay * 1e3:g} ms per "
            f"__getitem__, batch {BATCH}, shuffled: {work.per_epoch:,} batches per epoch; "
            f"resuming epoch {EPOCH} at batch 0 and at batch {start:,}"
        )
        sides = {
            "data@0": (nothing, lambda _: work.first_batch(0)),
            f"data@{start}": (nothing, lambda _: work.first_batch(start)),
            "fit@0": (nothing, lambda _: work.fit(0, paths[0])),
            f"fit@{start}": (nothing, lambda _: work.fit(start, paths[start])),
        }
        for _, run in sides.values():  # warm-up
            run(None)
        if work.messages:
            print("the Trainer said (captured): " + " | ".join(work.messages))
        times = _harness.interleaved_calls(sides, rounds)
        print(f"\n[time to the first step] {rounds} rounds, median (min..max) in ms")
        med = {}
        for name, v in times.items():
            med[name] = statistics.median(v)
            print(f"  {name:12s} {_harness.summary(v, 1e3)} ms")
        ratio = paired(times[f"fit@{start}"], times["fit@0"])
        data_ratio = paired(times[f"data@{start}"], times["data@0"])
        print(
            f"  Trainer: resuming at batch {start:,} takes {ratio:.3f}x the time of batch 0; "
            f"data path alone: {data_ratio:.3f}x (paired medians: the median over rounds of "
            f"the round's ratio)"
        )

        print("\n[parts of the start-up] median ms")
        for at in (0, start):
            p = parts(work, at, paths[at], 1 if args.quick else 5)
            print(
                f"  batch {at:>6,}: index plan of the epoch (DatasetBatches.plan) "
                f"{p['plan'] * 1e3:.1f}, checkpoint load {p['load'] * 1e3:.1f}"
            )
        per_batch = batch_time(work, 5)
        print(f"  one batch read (plain DataLoader) {per_batch * 1e3:.1f}")
        if not args.quick:
            fresh = cold(paths, 2)
            print(
                "\n[informational] a fresh process per resume (what a relaunched job waits "
                "for), 2 each, median: process wall time / Trainer + fit inside it"
            )
            for at, v in fresh.items():
                print(
                    f"  batch {at:>6,}: {statistics.median(w for w, _ in v):.2f} s / "
                    f"{statistics.median(f for _, f in v):.2f} s"
                )
        print(
            f"\n[context] replaying the {start:,} skipped batches would read {start * BATCH:,} "
            f"samples: about {start * per_batch:.0f} s ({start:,} x {per_batch * 1e3:.1f} ms), "
            f"against {med[f'fit@{start}'] * 1e3:.0f} ms to resume here through the Trainer"
        )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    print(f"ratio={ratio:.3f} data_ratio={data_ratio:.3f}")


if __name__ == "__main__":
    main()
