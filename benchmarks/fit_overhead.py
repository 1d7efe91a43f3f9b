"""Per-step cost of one epoch of ``Trainer.fit`` against a hand-written PyTorch loop.

Run from the repository root::

    .venv/bin/python benchmarks/fit_overhead.py             # full run, about a minute
    .venv/bin/python benchmarks/fit_overhead.py --quick     # smoke run, a few seconds
    .venv/bin/python benchmarks/fit_overhead.py --profile   # also cProfile one fit epoch

Both sides run in this one process and train the same MLP 64-128-10 (ReLU; the same initial
weights) for one epoch over the same data: a ``torch.utils.data.DataLoader`` over a
``TensorDataset`` of 8192 samples (64 features, 10 classes), ``batch_size=32,
shuffle=True``, no workers, so 256 batches per epoch; Adam with lr 1e-3 and torch's defaults
otherwise:

* raw: a copy of the template, ``torch.optim.Adam(model.parameters(), lr)`` and
  ``zero_grad()`` / forward / ``F.cross_entropy`` / ``backward()`` / ``step()`` per batch of
  a fresh DataLoader;
* fit: ``Trainer(enable_progress_bar=False, logger=False, enable_checkpointing=False,
  enable_model_summary=False, num_sanity_val_steps=0, max_epochs=1).fit(template, loss_fn,
  engine.optim.adam(lr), loader)`` with a fresh DataLoader of the same settings. This is the
  fair baseline: the raw loop has no progress bar, no logger, no checkpoint and no summary
  either. The Trainer re-creates the loader on its deterministic order (same dataset, same
  batch size, per-sample ``__getitem__`` and ``default_collate`` as the raw loader), so both
  sides load data the same way; only the order of the samples differs.

The Trainer runs with its default ``donate_state=True``: the updates write parameters and
Adam's state in place, as the raw loop's ``torch.optim`` does (results bitwise those of
``donate_state=False``; see the README).

Two diagnostic sides split the difference:

* step_loop: the raw side's DataLoader loop calling the very step the Trainer builds
  (``engine.train_step`` with the Trainer's strategy, ``hardware.single_device("cpu")``
  here, ``grad_norm=False`` as the Trainer builds it, run as ``step.donating(backward=False)``
  on a state it built, as the Trainer runs it). ``step_loop - raw`` is what the engine
  step costs over torch's; ``fit - step_loop`` is what the Trainer's loop adds (events,
  metric aggregation, loop state, commit points, its data path, its start-up).
* fit_immutable: ``Trainer(donate_state=False)``, every state a new one: what immutability
  costs on this model (new tensors for the parameters and Adam's state at every step).

Every side builds what it needs inside the timed call (model copy and optimizer, or Trainer
and state), as a user's script would; a side's figure is the epoch's time divided by its 256
batches. Each fit is checked to have taken exactly 256 optimizer steps.

For information only, the Trainer with its defaults (progress bar, TensorBoard logger,
checkpointing, model summary; ``max_epochs=1``, in a temporary folder, the bar's output
captured) is timed in a second, shorter interleaved run against raw.

Threads: ``torch.set_num_threads(1)`` for every side (see ``benchmarks/step_overhead.py``:
2 shared cores; one thread makes the kernels identical and the measurement stable).
Timing: ``_harness.interleaved_calls``, one epoch per side per round in rotating order, the
median (min..max) over rounds per side. The ratios of the last line are paired medians, the
median over rounds of the per-round ratio of the two sides' epochs: a background job that
slows a whole round cancels out of it, while the ratio of two medians (printed too) can
swing by 0.1-0.2 on this shared machine. The last line is ``ratio=<fit / raw>
step_ratio=<step_loop / raw> loop_ratio=<fit / step_loop> immutable_ratio=<fit_immutable /
raw>``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import engine
from purestep.engine import optim
from purestep.loops import Trainer

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.fit_overhead``
    from benchmarks import _harness

LR = 1e-3
BATCH = 32
WIDTHS = (64, 128, 10)
FAIR = {
    "enable_progress_bar": False,
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "max_epochs": 1,
}
# (samples, rounds, rounds of the informational defaults run); then --quick's
FULL = (8192, 31, 7)
QUICK = (512, 2, 1)


def mlp() -> nn.Module:
    a, b, c = WIDTHS
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))


def loss_fn(apply: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(apply(x), y)


class Workload:
    """The shared template and dataset; each method runs one epoch of one side."""

    def __init__(self, samples: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.dataset = TensorDataset(
            torch.randn(samples, WIDTHS[0], generator=g),
            torch.randint(0, WIDTHS[-1], (samples,), generator=g),
        )
        self.batches = -(-samples // BATCH)
        torch.manual_seed(0)
        self.template = mlp()
        self.strategy = Trainer(**FAIR).strategy
        self.messages: list[str] = []

    def loader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH, shuffle=True)

    def raw(self) -> int:
        model = copy.deepcopy(self.template)
        opt = torch.optim.Adam(model.parameters(), LR)
        n = 0
        for x, y in self.loader():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            n += 1
        return n

    def step_loop(self) -> int:
        state = engine.init(self.template, optim.adam(LR), seed=0, strategy=self.strategy)
        step = engine.train_step(
            self.template, loss_fn, optim.adam(LR), strategy=self.strategy, grad_norm=False
        )
        in_place = step.donating(backward=False)
        for batch in self.loader():
            state, _ = in_place(state, batch)
        return state.progress.step

    def fit(self, **flags: Any) -> int:
        trainer = Trainer(**{**FAIR, **flags})
        said = io.StringIO()
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            state = trainer.fit(self.template, loss_fn, optim.adam(LR), self.loader())
        if not self.messages:
            self.messages = [line for line in said.getvalue().splitlines() if line.strip()]
        return state.progress.step


def checked(run: Callable[[], int], expected: int, name: str) -> Callable[[None], int]:
    """``run`` as a timed call that verifies it took ``expected`` optimizer steps."""

    def call(_: None) -> int:
        steps = run()
        if steps != expected:
            raise AssertionError(f"{name} took {steps} steps, expected {expected}")
        return steps

    return call


def nothing() -> None:
    return None


def paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of ``a / b`` (robust to rounds a background job slowed down)."""
    return statistics.median(x / y for x, y in zip(a, b))


def report(samples: dict[str, list[float]], batches: int, base: str = "raw") -> dict[str, float]:
    """Print each side's per-step figures; return the paired-median ratios to ``base``."""
    us = {n: [s / batches * 1e6 for s in v] for n, v in samples.items()}
    ref = statistics.median(us[base])
    ratios = {}
    for name, v in us.items():
        ratios[name] = paired(v, us[base])
        print(
            f"  {name:13s} {_harness.summary(v)} us/step  ratio {statistics.median(v) / ref:.3f}  "
            f"paired-median ratio {ratios[name]:.3f}"
        )
    spread = ref / min(us[base])
    if spread > 1.2:
        print(
            f"  note: heavy background load (the median raw epoch took {spread:.2f}x the "
            "fastest); the paired ratios are the more robust figures, or rerun when quieter"
        )
    return ratios


def profile(work: Workload) -> None:
    """cProfile one fit epoch; print the library's functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    work.fit()
    prof.disable()
    print(
        f"\n[profile] one fit epoch ({work.batches} batches) under cProfile, the library's "
        "functions by own time (cProfile inflates per-call costs; compare calls, not seconds)"
    )
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(r"/(loops|engine|hardware)/", 25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few epochs only (smoke run)")
    parser.add_argument("--profile", action="store_true", help="also cProfile one fit epoch")
    args = parser.parse_args()

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    samples, rounds, default_rounds = QUICK if args.quick else FULL
    work = Workload(samples)
    n = work.batches
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, python "
        f"{sys.version.split()[0]}; MLP {'-'.join(map(str, WIDTHS))}, Adam lr {LR}; "
        f"DataLoader(TensorDataset of {samples} samples, batch_size={BATCH}, shuffle=True, "
        f"num_workers=0): {n} batches per epoch"
    )
    print("Trainer (fair baseline): " + ", ".join(f"{k}={v!r}" for k, v in FAIR.items()))
    sides = {
        "raw": (nothing, checked(work.raw, n, "raw")),
        "step_loop": (nothing, checked(work.step_loop, n, "step_loop")),
        "fit": (nothing, checked(work.fit, n, "fit")),
        "fit_immutable": (
            nothing,
            checked(lambda: work.fit(donate_state=False), n, "fit_immutable"),
        ),
    }
    for _, run in sides.values():  # warm-up: one epoch each
        run(None)
    if work.messages:
        print("the Trainer said (captured): " + " | ".join(work.messages))
    print(f"\n[one epoch] {rounds} rounds, median (min..max) per step over the epoch")
    times = _harness.interleaved_calls(sides, rounds)
    ratios = report(times, n)
    loop_ratio = paired(times["fit"], times["step_loop"])
    raw_us = statistics.median(times["raw"]) / n * 1e6
    print(
        f"  split (paired ratios x the raw median): engine step over torch's "
        f"{(ratios['step_loop'] - 1) * raw_us:+.1f} us/step; Trainer loop over a hand loop "
        f"with the same step {(ratios['fit'] - ratios['step_loop']) * raw_us:+.1f} us/step"
    )

    with tempfile.TemporaryDirectory(prefix="fit_overhead_") as root:
        defaults = {
            "enable_progress_bar": True,
            "logger": True,
            "enable_checkpointing": True,
            "enable_model_summary": True,
            "default_root_dir": root,
        }
        info = {
            "raw": sides["raw"],
            "fit_defaults": (nothing, checked(lambda: work.fit(**defaults), n, "fit_defaults")),
        }
        info["fit_defaults"][1](None)
        print(
            f"\n[informational] Trainer defaults (progress bar, TensorBoard logger, "
            f"checkpointing, model summary; max_epochs=1, in a temporary folder): "
            f"{default_rounds} rounds against raw"
        )
        report(_harness.interleaved_calls(info, default_rounds), n)

    if args.profile:
        profile(work)

    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    print(
        f"ratio={ratios['fit']:.3f} step_ratio={ratios['step_loop']:.3f} "
        f"loop_ratio={loop_ratio:.3f} immutable_ratio={ratios['fit_immutable']:.3f}"
    )


if __name__ == "__main__":
    main()
