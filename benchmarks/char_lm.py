"""Per-step time of the char-level transformer (``examples/char_lm.py``): the engine step
eager and compiled against a hand-written eager loop.

Run from the repository root::

    .venv/bin/python benchmarks/char_lm.py           # full run, a few minutes
    .venv/bin/python benchmarks/char_lm.py --quick   # smoke run: 1 block, width 16, context 8
    .venv/bin/python benchmarks/char_lm.py --quick --backend aot_eager  # the tests' run

The example's model (2 pre-norm transformer blocks of width 128, 4 heads, context 64, byte
vocabulary, dropout 0.1), batch 32 windows of its corpus (the standard library's sources),
AdamW (lr 3e-3, weight decay 0.01), three sides in this one process from the same initial
weights, on the same batches:

* hand: ``torch.optim.AdamW`` and ``zero_grad()`` / forward / ``F.cross_entropy`` /
  ``backward()`` / ``step()``;
* eager: ``engine.train_step(model, loss_fn, optim.adamw(...), donate=True,
  grad_norm=False)``;
* compiled: the same with ``compile=True`` (forward, backward and AdamW as one inductor
  graph; its compile time is printed and not timed).

Threads: ``torch.set_num_threads(1)`` for every side (see ``benchmarks/step_overhead.py``).
Timing: ``_harness.interleaved``; medians of the per-block time per step. The last line is
``ratio_eager=<eager / hand> ratio_compiled=<compiled / hand>``. ``--backend`` (default
``inductor``) is the compiled side's ``torch.compile`` backend; the test suite's smoke run uses
``aot_eager`` (the same traced graph on torch's kernels: no code generation), the inductor
path being tested in ``tests/test_compile.py`` and ``tests/test_examples.py``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from purestep import engine, optim

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.char_lm``
    from benchmarks import _harness

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)
import char_lm  # the example's model, corpus and loss

BATCH = 32
N_BATCHES = 4
FULL = (3, 21, 5)  # warm-up steps, rounds, steps per block
QUICK = (1, 2, 1)
CONTEXT = 64
#: --quick's stand-in model: (context, width, layers)
QUICK_MODEL = (8, 16, 1)


class Hand:
    def __init__(self, template: torch.nn.Module, batches: list) -> None:
        self.model = copy.deepcopy(template)
        self.opt = torch.optim.AdamW(self.model.parameters(), 3e-3, weight_decay=0.01)
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        (rows,) = self.batches[self.i % N_BATCHES]
        self.i += 1
        self.opt.zero_grad()
        logits = self.model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, char_lm.VOCAB), rows[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    warmup, rounds, steps = QUICK if args.quick else FULL
    context = QUICK_MODEL[0] if args.quick else CONTEXT
    train, _ = char_lm.windows(char_lm.corpus(200_000), context)
    rows = train.tensors[0]
    batches = [(rows[i * BATCH : (i + 1) * BATCH],) for i in range(N_BATCHES)]
    torch.manual_seed(0)
    # --quick: a tiny stand-in (compiling the real model takes long)
    if args.quick:
        context, width, layers = QUICK_MODEL
        template = char_lm.CharLM(context=context, width=width, layers=layers)
    else:
        template = char_lm.CharLM()
    sides = {
        "hand": Hand(template, batches),
        "eager": Engine(template, batches, compile=False),
        "compiled": Engine(template, batches, compile={"backend": args.backend}),
    }
    t0 = time.perf_counter()
    sides["compiled"].step()
    print(f"compiled step's first call (compilation included): {time.perf_counter() - t0:.1f} s")
    for side in sides.values():
        for _ in range(warmup):
            side.step()
    samples = _harness.interleaved({n: s.step for n, s in sides.items()}, rounds, steps)
    tokens = BATCH * context
    for name, v in samples.items():
        med = statistics.median(v)
        print(f"  {name:9s} {_harness.summary(v, 1e3)} ms/step  {tokens / med:,.0f} tokens/s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    hand = statistics.median(samples["hand"])
    print(
        f"ratio_eager={statistics.median(samples['eager']) / hand:.3f} "
        f"ratio_compiled={statistics.median(samples['compiled']) / hand:.3f}"
    )


if __name__ == "__main__":
    main()
