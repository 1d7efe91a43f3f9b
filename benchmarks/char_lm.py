"""Per-step time of the char-level transformer (``examples/char_lm.py``): the engine step
eager and compiled against hand-written eager and compiled loops.

Run from the repository root::

    .venv/bin/python benchmarks/char_lm.py           # full run, a few minutes
    .venv/bin/python benchmarks/char_lm.py --quick   # smoke run: 1 block, width 16, context 8
    .venv/bin/python benchmarks/char_lm.py --quick --backend aot_eager  # the tests' run
    .venv/bin/python benchmarks/char_lm.py --device cuda --mode reduce-overhead

The example's model (2 pre-norm transformer blocks of width 128, 4 heads, context 64, byte
vocabulary, dropout 0.1), batch 32 windows of its corpus (the standard library's sources),
AdamW (lr 3e-3, weight decay 0.01), four sides in this one process from the same initial
weights, on the same batches:

* hand: ``torch.optim.AdamW`` and ``zero_grad()`` / forward / ``F.cross_entropy`` /
  ``backward()`` / ``step()`` (``compile_step.Hand``, with the example's loss);
* hand_compiled: the same loop with ``torch.compile(model)`` and a compiled optimizer
  step (``torch.compile(opt.step)``), the strongest form a PyTorch user writes by hand;
* eager: ``engine.train_step(model, loss_fn, optim.adamw(...), donate=True,
  grad_norm=False)``;
* compiled: the same with ``compile=True`` (forward, backward and AdamW as one inductor
  graph; its compile time is printed and not timed).

The sides train with dropout, each drawing its own masks (the hand loops from torch's
global generators, the engine steps from their state's key), so their parameters part after
the first step: the sides do the same work, not the same arithmetic, and no parity is
claimed between them (``benchmarks/compile_step.py`` checks it on a model without dropout).

Threads: ``torch.set_num_threads(1)`` for every side (see ``benchmarks/step_overhead.py``).
Timing: ``_harness.interleaved``; medians of the per-block time per step. The last line is
``ratio_eager=<eager / hand> ratio_compiled=<compiled / hand>
ratio_vs_raw_compiled=<compiled / hand_compiled>``. ``--backend`` (default ``inductor``) is
the ``torch.compile`` backend of both compiled sides; the test suite's smoke run uses
``aot_eager`` (the same traced graphs on torch's kernels: no code generation), the inductor
path being tested in ``tests/test_compile.py`` and ``tests/test_examples.py``. ``--mode``
(default none: inductor's default) is inductor's mode for both compiled sides, e.g.
``reduce-overhead`` (CUDA graphs). ``--device cuda`` puts the model and batches on the GPU
and waits for it at both ends of every timed block. ``--rounds N`` replaces the number of
timed rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from purestep import engine, optim

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.char_lm``
    from benchmarks import _harness

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)
import char_lm  # the example's model, corpus and loss
from compile_step import Hand, on_device, synchronizer  # the hand-written loops

BATCH = 32
N_BATCHES = 4
FULL = (3, 21, 5)  # warm-up steps, rounds, steps per block
QUICK = (1, 2, 1)
CONTEXT = 64
#: --quick's stand-in model: (context, width, layers)
QUICK_MODEL = (8, 16, 1)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, 3e-3, weight_decay=0.01)


def hand(template: torch.nn.Module, batches: list, compiled: bool, args: Any) -> Hand:
    """The hand-written loop on the example's loss (``compiled``: with ``args``' backend and
    mode)."""
    how = {"backend": args.backend, "mode": args.mode} if compiled else {}
    return Hand(template, batches, compiled, **how, make_opt=adamw, loss=char_lm.loss_fn)


class Engine:
    def __init__(self, template: torch.nn.Module, batches: list, compile: Any) -> None:
        tx = optim.adamw(3e-3, weight_decay=0.01)
        self.state = engine.init(template, tx, seed=0)
        self.fn = engine.train_step(
            template, char_lm.loss_fn, tx, donate=True, grad_norm=False, compile=compile
        )
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        batch = self.batches[self.i % N_BATCHES]
        self.i += 1
        self.state, _ = self.fn(self.state, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--mode", default=None, help="inductor mode (default: inductor's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warmup, rounds, steps = QUICK if args.quick else FULL
    rounds = args.rounds or rounds
    context = QUICK_MODEL[0] if args.quick else CONTEXT
    train, _ = char_lm.windows(char_lm.corpus(200_000), context)
    rows = train.tensors[0]
    batches = on_device(
        [(rows[i * BATCH : (i + 1) * BATCH],) for i in range(N_BATCHES)], args.device
    )
    torch.manual_seed(0)
    # --quick: a tiny stand-in (compiling the real model takes long)
    if args.quick:
        context, width, layers = QUICK_MODEL
        template = char_lm.CharLM(context=context, width=width, layers=layers)
    else:
        template = char_lm.CharLM()
    template = template.to(args.device)
    compile = {"backend": args.backend, "mode": args.mode}
    sides = {
        "hand": hand(template, batches, False, args),
        "hand_compiled": hand(template, batches, True, args),
        "eager": Engine(template, batches, compile=False),
        "compiled": Engine(template, batches, compile=compile),
    }
    sync = synchronizer(args.device) or (lambda: None)
    for name in ("hand_compiled", "compiled"):
        sync()
        t0 = time.perf_counter()
        sides[name].step()
        sync()
        print(f"{name} step's first call (compilation included): {time.perf_counter() - t0:.1f} s")
    for side in sides.values():
        for _ in range(warmup):
            side.step()
    samples = _harness.interleaved(
        {n: s.step for n, s in sides.items()}, rounds, steps, sync=synchronizer(args.device)
    )
    tokens = BATCH * context
    for name, v in samples.items():
        med = statistics.median(v)
        print(f"  {name:13s} {_harness.summary(v, 1e3)} ms/step  {tokens / med:,.0f} tokens/s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    median = {n: statistics.median(v) for n, v in samples.items()}
    print(
        f"ratio_eager={median['eager'] / median['hand']:.3f} "
        f"ratio_compiled={median['compiled'] / median['hand']:.3f} "
        f"ratio_vs_raw_compiled={median['compiled'] / median['hand_compiled']:.3f}"
    )


if __name__ == "__main__":
    main()
