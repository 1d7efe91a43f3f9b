"""Per-step time of the compiled engine step against hand-written eager and compiled loops.

Run from the repository root::

    .venv/bin/python benchmarks/compile_step.py           # full run, a few minutes
    .venv/bin/python benchmarks/compile_step.py --quick   # smoke run
    .venv/bin/python benchmarks/compile_step.py --quick --backend aot_eager  # the tests' run

``--backend`` (default ``inductor``) is the ``torch.compile`` backend of both compiled sides;
the test suite's smoke run uses ``aot_eager`` (dynamo and AOT autograd trace the same graphs,
torch's own kernels run them: no code generation, so no C++ compiler on the clock), the
inductor path itself being tested in ``tests/test_compile.py``.

Three sides, in this one process, on the same model (the same initial weights), the same
batches in the same order and Adam with lr 1e-3 (torch's defaults otherwise):

* eager: the hand-written loop, ``torch.optim.Adam(model.parameters(), lr)``,
  ``zero_grad()`` / forward / ``F.cross_entropy`` / ``backward()`` / ``step()``;
* hand_compiled: the strongest form a PyTorch user writes by hand, the same loop with
  ``torch.compile(model)`` and a compiled ``opt.step`` (``torch.compile(opt.step)``);
* engine: ``engine.train_step(model, loss_fn, optim.adam(lr), compile=True, donate=True,
  grad_norm=False)``: the forward pass, the backward pass (``torch.func.grad``) and the
  Adam update traced into one inductor graph, writing the state in place (donation; the
  hand loops update in place too, and compute no gradient norm either).

Sizes: "small", an MLP 32-64-10 at batch 32 (per-op and Python overhead dominate), and
"mid", an MLP 1024-1024-1024-1024-10 with ReLU at batch 256 (matrix products dominate).

Compile time: ``compile_s`` is the engine step's first call in this process with an empty
inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR`` made for this run: dynamo's tracing,
AOT autograd, inductor's code generation and the C++ compiler); ``warm_compile_s`` is the
same first call in a second process started afterwards on the same cache directory (dynamo
traces again; inductor's compiled graph comes from the on-disk FX graph cache). Both for
the small model.

Threads: ``torch.set_num_threads(1)`` for every side (and the generated kernels), as in
``step_overhead.py``: on a 2-core machine shared with other jobs one thread keeps the
kernels identical and the measurement stable. Timing: ``_harness.interleaved`` rounds in a
rotating order; medians of the per-block time per step.

Output: microseconds per step for each side and size, then as the last line
``ratio_small=<engine/eager> ratio_small_vs_compiled=<engine/hand_compiled>
ratio_mid=<engine/eager> compile_s=<cold> warm_compile_s=<warm>``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__" and "--quick" not in sys.argv:
    # a fresh inductor cache for this run (read by torch at import); --quick uses the default
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="purestep_ind_"))

import torch
import torch.nn.functional as F
from step_overhead import loss_fn, make_batches, mlp  # the same models and batches
from torch import nn

from purestep import engine
from purestep.engine import optim

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.compile_step``
    from benchmarks import _harness

LR = 1e-3
N_BATCHES = 4
# name -> (layer widths, batch size, warm-up steps, rounds, steps per block); then --quick's
SIZES = {
    "small": ([32, 64, 10], 32, 20, 31, 200),
    "mid": ([1024, 1024, 1024, 1024, 10], 256, 3, 21, 3),
}
QUICK = {"small": (3, 2, 5), "mid": (2, 2, 1)}
#: --quick's stand-in for the mid model (compiling the real one takes long)
QUICK_MID = ([64, 64, 64, 10], 16)


class Hand:
    """The hand-written loop (``compiled``: model and ``opt.step`` under torch.compile)."""

    def __init__(
        self, template: nn.Module, batches: list, compiled: bool, backend: str = "inductor"
    ) -> None:
        self.model = copy.deepcopy(template)
        self.opt = torch.optim.Adam(self.model.parameters(), LR)
        self.forward = torch.compile(self.model, backend=backend) if compiled else self.model
        self.opt_step = torch.compile(self.opt.step, backend=backend) if compiled else self.opt.step
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        x, y = self.batches[self.i % N_BATCHES]
        self.i += 1
        self.opt.zero_grad()
        loss = F.cross_entropy(self.forward(x), y)
        loss.backward()
        self.opt_step()

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


class Engine:
    """The compiled engine step, threading its state."""

    def __init__(self, template: nn.Module, batches: list, backend: str = "inductor") -> None:
        tx = optim.adam(LR)
        self.state = engine.init(template, tx)
        self.step_fn = engine.train_step(
            template, loss_fn, tx, compile={"backend": backend}, donate=True, grad_norm=False
        )
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        batch = self.batches[self.i % N_BATCHES]
        self.i += 1
        self.state, _ = self.step_fn(self.state, batch)

    def params(self) -> dict[str, torch.Tensor]:
        return self.state.params


def first_call_seconds(widths: list[int], batch: int, backend: str = "inductor") -> float:
    """Seconds of the engine step's first call (compilation included) in this process."""
    torch.manual_seed(0)
    side = Engine(mlp(widths), make_batches(widths, batch), backend)
    t0 = time.perf_counter()
    side.step()
    return time.perf_counter() - t0


def build(
    size: str, warmup: int, quick: bool, backend: str
) -> tuple[dict[str, Hand | Engine], float]:
    widths, batch = QUICK_MID if quick and size == "mid" else SIZES[size][:2]
    torch.manual_seed(0)
    template = mlp(widths)
    batches = make_batches(widths, batch)
    sides: dict[str, Hand | Engine] = {
        "eager": Hand(template, batches, compiled=False),
        "hand_compiled": Hand(template, batches, compiled=True, backend=backend),
        "engine": Engine(template, batches, backend),
    }
    t0 = time.perf_counter()
    sides["engine"].step()
    first = time.perf_counter() - t0
    for name, side in sides.items():
        for _ in range(warmup - (name == "engine")):
            side.step()
    # The same work on every side: parameters agree after the warm-up to within Adam's
    # step per update (its normalised step turns the rounding of a near-zero gradient into
    # up to 2 * lr per step in either direction; different kernels round differently).
    ref = sides["eager"].params()
    for name in ("hand_compiled", "engine"):
        for n, p in sides[name].params().items():
            bound = 2 * LR * warmup + 1e-5
            torch.testing.assert_close(p, ref[n], rtol=0, atol=bound, msg=f"{name} {n}")
    return sides, first


def time_size(size: str, quick: bool, backend: str) -> dict[str, float]:
    warmup, rounds, steps = QUICK[size] if quick else SIZES[size][2:]
    sides, first = build(size, warmup, quick, backend)
    samples = _harness.interleaved({n: s.step for n, s in sides.items()}, rounds, steps)
    for name, values in samples.items():
        print(f"  {size:5s} {name:14s} {_harness.summary(values, 1e6)} us/step")
    print(f"  {size:5s} engine first call (compilation included): {first:.1f} s")
    return {n: statistics.median(v) for n, v in samples.items()}


_WARM = """
import sys, time, torch
sys.path.insert(0, {here!r})
torch.set_num_threads(1)
import compile_step
print(compile_step.first_call_seconds({widths!r}, {batch!r}, {backend!r}))
"""


def warm_compile_seconds(backend: str) -> float:
    """The small engine step's first call in a second process on this run's cache."""
    widths, batch = SIZES["small"][:2]
    here = os.path.dirname(os.path.abspath(__file__))
    code = _WARM.format(here=here, widths=widths, batch=batch, backend=backend)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default")
    print(f"torch {torch.__version__}, 1 thread, {args.backend}, inductor cache {cache}")
    t0 = time.perf_counter()
    widths, batch = SIZES["small"][:2]
    cold = first_call_seconds(widths, batch, args.backend)  # this process's first compilation
    print(f"cold compile (small engine step, empty cache): {cold:.1f} s")
    small = time_size("small", args.quick, args.backend)
    mid = time_size("mid", args.quick, args.backend)
    warm = warm_compile_seconds(args.backend)
    print(f"warm compile (second process, on-disk cache): {warm:.1f} s")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    print(
        f"ratio_small={small['engine'] / small['eager']:.3f} "
        f"ratio_small_vs_compiled={small['engine'] / small['hand_compiled']:.3f} "
        f"ratio_mid={mid['engine'] / mid['eager']:.3f} "
        f"compile_s={cold:.2f} warm_compile_s={warm:.2f}"
    )


if __name__ == "__main__":
    main()
