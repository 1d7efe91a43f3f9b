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
  either. The Trainer re-creates the loader on its deterministic order; for a
  ``TensorDataset`` under the default collate it gathers each batch by index
  (``loops.data.TensorDatasetBatches``: the same batches the raw loader's per-sample
  ``__getitem__`` and ``default_collate`` build, without the per-sample Python), so the
  Trainer's data path is cheaper than the raw loop's; the order of the samples differs.

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
* fit_profiled: ``Trainer(profiler=SimpleProfiler(dirpath=<a temporary folder>))``: what
  timing every action (batch fetch, step halves, batch, epoch, callback events) costs; the
  report is printed (captured) and written at the end, inside the timed call. The ``fit``
  side is the profiler-off figure: without a profiler the loops run their unprofiled code.

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
raw> profiler_ratio=<fit_profiled / fit> compiled_ratio=<fit_compiled / raw>
lightning_ratio=<fit_lightning / fit_task_logged>`` (target for profiler_ratio: within
1.05; for compiled_ratio: at most 0.5; for lightning_ratio: at most 1.05).

Three more sides compare the two ways of writing the model for the Trainer: fit_lightning
is the MLP as a ``purestep.LightningModule`` (``self.log("train_loss", loss)``, a torch
``Adam(self.parameters())``); fit_task_logged is its Task form doing the same work: the same
optimizer (``optim.from_torch(torch.optim.Adam)``), its step returning ``(loss,
{"train_loss": loss})`` with ``log_loss = False``, so both log the one value
``train_loss`` as a step metric. Their ratio, ``lightning_ratio``, is what the
Lightning-style adapter costs (binding the module, the ``self.log`` buffer, reading the
loop's position). fit_task_torch_adam is the Task form that logs nothing but its loss (the
loop's cheaper loss channel); ``fit_lightning / fit_task_torch_adam`` (printed) adds what
logging one value as a metric costs any step.

The compiled side, ``Trainer(compile=True)``, runs in its own interleaved rounds against raw
(fewer of them: each fit compiles its step anew): each round fits two epochs and times the
second one by epoch-start/end callbacks, so ``compiled_ratio`` is the steady state; the
first epoch's extra time (compiling the step, warm from inductor's on-disk cache after the
first round) is printed. ``--backend`` (default ``inductor``) is its ``torch.compile`` backend;
the test suite's smoke run uses ``aot_eager`` (no code generation).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
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

import purestep
from purestep import engine
from purestep.engine import optim
from purestep.loops import Trainer
from purestep.loops.callbacks import LambdaCallback
from purestep.loops.profiling import SimpleProfiler

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
#: rounds of the compiled side (each compiles its Trainer's step anew: slow)
COMPILED_ROUNDS = 7


def mlp() -> nn.Module:
    a, b, c = WIDTHS
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))


def loss_fn(apply: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(apply(x), y)


class LitMLP(purestep.LightningModule):
    """The same MLP written as a Lightning user writes it: ``self.log`` of the loss and a
    torch Adam over ``self.parameters()``."""

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


class Workload:
    """The shared template and dataset; each method runs one epoch of one side."""

    def __init__(self, samples: int) -> None:
        # the profiled side's report files (removed at exit)
        self._reports = tempfile.TemporaryDirectory(prefix="fit_overhead_profile_")
        self.reports = self._reports.name
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

    def fit_task_torch_adam(self) -> int:
        """The Task form with the optimizer the Lightning-style module uses (torch's Adam,
        through ``optim.from_torch``): the baseline of ``lightning_ratio``."""
        trainer = Trainer(**FAIR)
        template = copy.deepcopy(self.template)
        with contextlib.redirect_stderr(io.StringIO()):
            state = trainer.fit(
                _Wrapped(template),
                loss_fn,
                optim.from_torch(torch.optim.Adam, lr=LR),
                self.loader(),
            )
        return state.progress.step

    def fit_task_logged(self) -> int:
        """The Task form of ``LitMLP`` with its logging: ``train_loss`` as a step metric
        and no loss of its own (``log_loss = False``): the baseline of ``lightning_ratio``."""
        trainer = Trainer(**FAIR)
        with contextlib.redirect_stderr(io.StringIO()):
            state = trainer.fit(_LoggedTask(_Wrapped(copy.deepcopy(self.template))), self.loader())
        return state.progress.step

    def fit_lightning(self) -> int:
        """The Lightning-style module (``LitMLP``) under the same Trainer."""
        trainer = Trainer(**FAIR)
        with contextlib.redirect_stderr(io.StringIO()):
            state = trainer.fit(LitMLP(self.template), self.loader())
        return state.progress.step

    def fit_compiled(self, backend: str = "inductor") -> tuple[int, float, float]:
        """``Trainer(compile=True)`` for two epochs: ``(steps, first epoch s, second epoch s)``;
        the first pays for compiling the step, the second is the steady state."""
        marks: list[float] = []

        def mark(ctx: Any) -> None:
            marks.append(time.perf_counter())

        timer = LambdaCallback(on_train_epoch_start=mark, on_train_epoch_end=mark)
        compile = {"backend": backend}
        trainer = Trainer(**{**FAIR, "max_epochs": 2, "compile": compile, "callbacks": [timer]})
        said = io.StringIO()
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            state = trainer.fit(self.template, loss_fn, optim.adam(LR), self.loader())
        return state.progress.step, marks[1] - marks[0], marks[3] - marks[2]


def compiled_rounds(work: Workload, rounds: int, backend: str = "inductor") -> float:
    """Interleaved rounds of raw (one epoch) and the compiled Trainer (its second epoch);
    prints both and the compile overhead of the first epoch; returns the paired ratio."""
    raw_s, steady_s, first_s = [], [], []
    for r in range(rounds):
        order = ("raw", "compiled") if r % 2 == 0 else ("compiled", "raw")
        for side in order:
            gc.collect()
            if side == "raw":
                t0 = time.perf_counter()
                work.raw()
                raw_s.append(time.perf_counter() - t0)
            else:
                steps, first, steady = work.fit_compiled(backend)
                if steps != 2 * work.batches:
                    raise AssertionError(f"fit_compiled took {steps} steps")
                first_s.append(first)
                steady_s.append(steady)
    n = work.batches
    us = {"raw": [t / n * 1e6 for t in raw_s], "fit_compiled": [t / n * 1e6 for t in steady_s]}
    for name, v in us.items():
        print(f"  {name:13s} {_harness.summary(v)} us/step")
    compile_s = statistics.median(f - t for f, t in zip(first_s, steady_s))
    print(f"  fit_compiled's first epoch over its second (compiling the step): {compile_s:.1f} s")
    return paired(us["fit_compiled"], us["raw"])


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


paired = _harness.paired


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


class _LoggedTask(purestep.Task):
    """``LitMLP`` as a Task: the same step, optimizer and logged value."""

    log_loss = False

    def training_step(self, apply: nn.Module, batch: Any) -> Any:
        x, y = batch
        loss = F.cross_entropy(apply(x), y)
        return loss, {"train_loss": loss.detach()}

    def configure_optimizers(self) -> Any:
        return optim.from_torch(torch.optim.Adam, lr=LR)


class _Wrapped(nn.Module):
    """The template under a ``net`` attribute, so both sides' parameters are named alike."""

    def __init__(self, template: nn.Module) -> None:
        super().__init__()
        self.net = template

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few epochs only (smoke run)")
    parser.add_argument("--profile", action="store_true", help="also cProfile one fit epoch")
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend of the compiled side"
    )
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
        "fit_profiled": (
            nothing,
            checked(
                lambda: work.fit(profiler=SimpleProfiler(dirpath=work.reports)),
                n,
                "fit_profiled",
            ),
        ),
        "fit_task_torch_adam": (
            nothing,
            checked(work.fit_task_torch_adam, n, "fit_task_torch_adam"),
        ),
        "fit_task_logged": (nothing, checked(work.fit_task_logged, n, "fit_task_logged")),
        "fit_lightning": (nothing, checked(work.fit_lightning, n, "fit_lightning")),
    }
    for _, run in sides.values():  # warm-up: one epoch each
        run(None)
    if work.messages:
        print("the Trainer said (captured): " + " | ".join(work.messages))
    print(f"\n[one epoch] {rounds} rounds, median (min..max) per step over the epoch")
    times = _harness.interleaved_calls(sides, rounds)
    ratios = report(times, n)
    loop_ratio = paired(times["fit"], times["step_loop"])
    profiler_ratio = paired(times["fit_profiled"], times["fit"])
    lightning_ratio = paired(times["fit_lightning"], times["fit_task_logged"])
    print(
        "  fit_lightning over the Task that logs only its loss (fit_task_torch_adam): "
        f"{paired(times['fit_lightning'], times['fit_task_torch_adam']):.3f}"
    )
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

    compiled_n = 2 if args.quick else COMPILED_ROUNDS
    print(
        f"\n[compiled] Trainer(compile=True), 2 epochs per round, its second epoch (steady "
        f"state) against raw's epoch: {compiled_n} interleaved rounds"
    )
    compiled_ratio = compiled_rounds(work, compiled_n, args.backend)

    if args.profile:
        profile(work)

    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    print(
        f"ratio={ratios['fit']:.3f} step_ratio={ratios['step_loop']:.3f} "
        f"loop_ratio={loop_ratio:.3f} immutable_ratio={ratios['fit_immutable']:.3f} "
        f"profiler_ratio={profiler_ratio:.3f} compiled_ratio={compiled_ratio:.3f} "
        f"lightning_ratio={lightning_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
