"""Per-step time of the compiled engine step against hand-written eager and compiled loops.

Run from the repository root::

    .venv/bin/python benchmarks/compile_step.py           # full run, a few minutes
    .venv/bin/python benchmarks/compile_step.py --quick   # smoke run
    .venv/bin/python benchmarks/compile_step.py --quick --backend aot_eager  # the tests' run
    .venv/bin/python benchmarks/compile_step.py --device cuda --mode reduce-overhead

``--backend`` (default ``inductor``) is the ``torch.compile`` backend of both compiled sides;
the test suite's smoke run uses ``aot_eager`` (dynamo and AOT autograd trace the same graphs,
torch's own kernels run them: no code generation, so no C++ compiler on the clock), the
inductor path itself being tested in ``tests/test_compile.py``. ``--mode`` (default none:
inductor's default) is inductor's mode for both compiled sides (``torch.compile(mode=...)``
by hand, ``compile={"backend": ..., "mode": ...}`` for the engine), e.g. ``reduce-overhead``
(CUDA graphs). ``--device cuda`` puts the models and batches on the GPU and waits for it
(``torch.cuda.synchronize``) at both ends of every timed block and of the first calls.
``--rounds N`` replaces the number of timed rounds of both sizes.

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
ratio_mid=<engine/eager> compile_s=<cold> warm_compile_s=<warm>
ratio_mid_vs_compiled=<engine/hand_compiled> ratio_vs_raw_compiled=<the same, mid>``: the
last field is the headline, the compiled engine step against the strongest hand-written
loop on the model where the arithmetic, not the overhead, dominates.
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
from collections.abc import Callable, Iterable
from typing import Any

if __name__ == "__main__" and "--quick" not in sys.argv:
    # a fresh inductor cache for this run (read by torch at import); --quick uses the default
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="purestep_ind_"))

import torch
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


def adam(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, LR)


def uses_cudagraphs(mode: str | None) -> bool:
    """Whether inductor's ``mode`` records CUDA graphs (``reduce-overhead``, ...)."""
    if mode is None:
        return False
    import torch._inductor

    return bool(torch._inductor.list_mode_options(mode).get("triton.cudagraphs", False))


class Hand:
    """The hand-written loop: ``zero_grad()`` / ``loss(model, batch)`` / ``backward()`` /
    ``opt.step()`` (``compiled``: the model and ``opt.step`` under ``torch.compile`` with
    ``backend`` and ``mode``). ``make_opt`` builds the optimizer from the parameters."""

    def __init__(
        self,
        template: nn.Module,
        batches: list,
        compiled: bool,
        backend: str = "inductor",
        mode: str | None = None,
        *,
        make_opt: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] = adam,
        loss: Callable[[nn.Module, Any], torch.Tensor] = loss_fn,
    ) -> None:
        self.model = copy.deepcopy(template)
        self.opt = make_opt(self.model.parameters())
        how = {"backend": backend, "mode": mode}
        self.forward = torch.compile(self.model, **how) if compiled else self.model
        self.opt_step = torch.compile(self.opt.step, **how) if compiled else self.opt.step
        # CUDA graphs: each step starts a new generation of the recorded graphs' outputs
        self.new_step = compiled and uses_cudagraphs(mode)
        self.loss = loss
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        if self.new_step:
            torch.compiler.cudagraph_mark_step_begin()
        self.opt.zero_grad()
        self.loss(self.forward, batch).backward()
        self.opt_step()

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


class Engine:
    """The compiled engine step, threading its state."""

    def __init__(
        self, template: nn.Module, batches: list, backend: str = "inductor", mode: str | None = None
    ) -> None:
        tx = optim.adam(LR)
        self.state = engine.init(template, tx)
        how = {"backend": backend, "mode": mode}
        self.step_fn = engine.train_step(
            template, loss_fn, tx, compile=how, donate=True, grad_norm=False
        )
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        batch = self.batches[self.i % N_BATCHES]
        self.i += 1
        self.state, _ = self.step_fn(self.state, batch)

    def params(self) -> dict[str, torch.Tensor]:
        return self.state.params


def on_device(batches: list, device: str) -> list:
    """``batches`` (tuples of tensors) moved to ``device``."""
    return [tuple(t.to(device) for t in b) for b in batches]


def synchronizer(device: str) -> Callable[[], Any] | None:
    """What makes a timed block wait for ``device``'s queued work (None on the CPU)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else None


def first_call_seconds(
    widths: list[int],
    batch: int,
    backend: str = "inductor",
    mode: str | None = None,
    device: str = "cpu",
) -> float:
    """Seconds of the engine step's first call (compilation included) in this process."""
    torch.manual_seed(0)
    batches = on_device(make_batches(widths, batch), device)
    side = Engine(mlp(widths).to(device), batches, backend, mode)
    sync = synchronizer(device) or (lambda: None)
    sync()
    t0 = time.perf_counter()
    side.step()
    sync()
    return time.perf_counter() - t0


def build(
    size: str, warmup: int, quick: bool, backend: str, mode: str | None, device: str
) -> tuple[dict[str, Hand | Engine], float]:
    widths, batch = QUICK_MID if quick and size == "mid" else SIZES[size][:2]
    torch.manual_seed(0)
    template = mlp(widths).to(device)
    batches = on_device(make_batches(widths, batch), device)
    sides: dict[str, Hand | Engine] = {
        "eager": Hand(template, batches, compiled=False),
        "hand_compiled": Hand(template, batches, compiled=True, backend=backend, mode=mode),
        "engine": Engine(template, batches, backend, mode),
    }
    sync = synchronizer(device) or (lambda: None)
    sync()
    t0 = time.perf_counter()
    sides["engine"].step()
    sync()
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


def time_size(size: str, args: argparse.Namespace) -> dict[str, float]:
    warmup, rounds, steps = QUICK[size] if args.quick else SIZES[size][2:]
    rounds = args.rounds or rounds
    sides, first = build(size, warmup, args.quick, args.backend, args.mode, args.device)
    samples = _harness.interleaved(
        {n: s.step for n, s in sides.items()}, rounds, steps, sync=synchronizer(args.device)
    )
    for name, values in samples.items():
        print(f"  {size:5s} {name:14s} {_harness.summary(values, 1e6)} us/step")
    print(f"  {size:5s} engine first call (compilation included): {first:.1f} s")
    return {n: statistics.median(v) for n, v in samples.items()}


_WARM = """
import sys, time, torch
sys.path.insert(0, {here!r})
torch.set_num_threads(1)
import compile_step
print(compile_step.first_call_seconds({widths!r}, {batch!r}, {backend!r}, {mode!r}, {device!r}))
"""


def warm_compile_seconds(backend: str, mode: str | None, device: str) -> float:
    """The small engine step's first call in a second process on this run's cache."""
    widths, batch = SIZES["small"][:2]
    here = os.path.dirname(os.path.abspath(__file__))
    code = _WARM.format(
        here=here, widths=widths, batch=batch, backend=backend, mode=mode, device=device
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--mode", default=None, help="inductor mode (default: inductor's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default")
    print(
        f"torch {torch.__version__}, 1 thread, {args.backend}, mode {args.mode}, "
        f"device {args.device}, inductor cache {cache}"
    )
    t0 = time.perf_counter()
    widths, batch = SIZES["small"][:2]
    # this process's first compilation
    cold = first_call_seconds(widths, batch, args.backend, args.mode, args.device)
    print(f"cold compile (small engine step, empty cache): {cold:.1f} s")
    small = time_size("small", args)
    mid = time_size("mid", args)
    warm = warm_compile_seconds(args.backend, args.mode, args.device)
    print(f"warm compile (second process, on-disk cache): {warm:.1f} s")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    vs_compiled = mid["engine"] / mid["hand_compiled"]
    print(
        f"ratio_small={small['engine'] / small['eager']:.3f} "
        f"ratio_small_vs_compiled={small['engine'] / small['hand_compiled']:.3f} "
        f"ratio_mid={mid['engine'] / mid['eager']:.3f} "
        f"compile_s={cold:.2f} warm_compile_s={warm:.2f} "
        f"ratio_mid_vs_compiled={vs_compiled:.3f} ratio_vs_raw_compiled={vs_compiled:.3f}"
    )


if __name__ == "__main__":
    main()
