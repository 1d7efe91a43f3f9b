"""FSDP against DDP at 2 ranks: per-rank peak memory of a training step, and step time.

Run from the repository root::

    .venv/bin/python benchmarks/fsdp.py           # about 60 s
    .venv/bin/python benchmarks/fsdp.py --quick   # smoke run (a 4-layer model), about 15 s

One ``hardware.launch`` of 2 CPU ranks (gloo, one intra-op thread each) holds both sides:
the same model (an MLP 256 -> 12 x Linear(512, 512) -> 10, 3.3 M parameters), Adam, and 8
samples per rank per step, under ``hardware.ddp()`` (every rank holds the whole state) and
``hardware.fsdp(auto_wrap_policy={nn.Linear})`` (each Linear gathers its parameters on its
own, resharded after the forward pass). The batch is small so that the step's memory is
mostly parameters, gradients and optimizer state, the part sharding divides.

Memory: ``_harness.allocator_peak_bytes`` per rank over one step (the CPU allocator's own
records through ``torch.profiler``; the live-storage meter's dispatch mode does not see
through DTensor's wrapper tensors), starting from the state's own storages (the roots:
parameters, buffers, optimizer state; a DTensor counts its local shard). So the peak
covers the state, the gradients, the gathered parameters and reduce-scatter buffers in
flight, and the (small) activations. ``mem_ratio`` is FSDP's per-rank peak over DDP's (the
larger of the two ranks' for each).

Time: both sides run interleaved in the same processes (``_harness.interleaved``: blocks of
steps, order rotating by round, identical on both ranks), one sample per block per rank;
the slower rank's sample counts (they wait for each other in the collectives), and the
median over rounds is reported. ``time_ratio`` is FSDP's step time over DDP's. On 2 shared
cores the collectives cost relatively more than on one accelerator per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness

from purestep import engine, hardware
from purestep.engine import optim

WIDTH, DEPTH, BATCH = 512, 12, 8
QUICK_DEPTH = 4  # --quick: a smaller model of the same shape


def _model(depth: int = DEPTH) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, WIDTH), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, 10))
    return nn.Sequential(*layers)


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _storages(state) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from purestep.engine.tree import leaves

    out = []
    for t in leaves((state.params, state.buffers, state.opt_state)):
        if isinstance(t, DTensor):
            out.append(t.to_local())
        elif isinstance(t, torch.Tensor):
            out.append(t)
    return out


def _rank(rank: int, rounds: int, steps: int, depth: int) -> dict:
    sides = {"ddp": hardware.ddp(device="cpu"), "fsdp": hardware.fsdp(auto_wrap_policy={nn.Linear})}
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(BATCH, 256, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
    states, steppers = {}, {}
    for name, strategy in sides.items():
        opt = optim.adam(1e-3)
        states[name] = engine.init(_model(depth), opt, seed=0, strategy=strategy)
        steppers[name] = engine.train_step(_model(depth), _loss, opt, strategy=strategy)
        for _ in range(2):  # warm up
            states[name], _ = steppers[name](states[name], batch)
    memory = {}
    for name in sides:

        def one(name=name):
            states[name], _ = steppers[name](states[name], batch)

        memory[name] = _harness.allocator_peak_bytes(
            one, one, lambda name=name: _storages(states[name])
        )
    sides["ddp"].barrier()

    def runner(name):
        def run():
            states[name], _ = steppers[name](states[name], batch)

        return run

    times = _harness.interleaved({n: runner(n) for n in sides}, rounds, steps)
    return {
        "memory": memory,
        "times": times,
        "params": sum(p.numel() for p in _model(depth).parameters()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 1
    depth = QUICK_DEPTH if args.quick else DEPTH
    ranks = hardware.launch(_rank, 2, args.rounds, args.steps, depth, threads=1, max_seconds=600)
    print(
        f"model: {ranks[0]['params'] / 1e6:.2f} M parameters, Adam, batch {BATCH} per rank, 2 ranks"
    )
    mem = {n: max(r["memory"][n] for r in ranks) for n in ("ddp", "fsdp")}
    step = {}
    for n in ("ddp", "fsdp"):
        slowest = [max(r["times"][n][i] for r in ranks) for i in range(args.rounds)]
        step[n] = statistics.median(slowest)
        print(
            f"{n:5s}: peak per rank {mem[n] / 2**20:7.2f} MiB "
            f"(ranks {ranks[0]['memory'][n] / 2**20:.2f}, {ranks[1]['memory'][n] / 2**20:.2f}); "
            f"step {_harness.summary(slowest, 1e3, 2)} ms"
        )
    print(f"mem_ratio={mem['fsdp'] / mem['ddp']:.3f} time_ratio={step['fsdp'] / step['ddp']:.3f}")


if __name__ == "__main__":
    main()
