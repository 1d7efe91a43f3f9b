"""Our DDP and FSDP against torch's own, side by side: step time, peak memory, collectives.

Run from the repository root::

    .venv/bin/python benchmarks/dist_peer.py           # about 2 minutes
    .venv/bin/python benchmarks/dist_peer.py --quick   # smoke run (a 4-layer model)

One ``hardware.launch`` of 2 CPU ranks (gloo, one intra-op thread each) holds all four
sides, on the same model (an MLP 256 -> 12 x Linear(512) -> 10, 3.3 M parameters), Adam
and 8 samples per rank per step:

* ``ddp``: ``engine.train_step(..., strategy=hardware.ddp(), donate=True)``, the step as
  the Trainer runs it; ``torch_ddp``: ``nn.parallel.DistributedDataParallel`` (default
  ``bucket_cap_mb``) with ``torch.optim.Adam``, a hand loop (``zero_grad``, backward,
  ``step``).
* ``fsdp``: ``hardware.fsdp(auto_wrap_policy={nn.Linear})``, donating; ``torch_fsdp``:
  FSDP2 ``fully_shard`` on every Linear and then on the root, ``torch.optim.Adam`` over the
  DTensor parameters, the same hand loop.

Time: the sides run interleaved in the same processes (``_harness.interleaved``: blocks of
steps, order rotating by round, identical on both ranks); the slower rank's sample of a
block counts (the ranks wait for each other in the collectives) and the median over rounds
is reported. Memory: ``_harness.allocator_peak_bytes`` per rank over one step, from the
storages each side keeps between steps (the state; torch's module parameters, their
gradients and the optimizer state, plus, for torch DDP, its reducer's bucket buffers, one
element per gradient element, which it allocates once and keeps) plus what the CPU allocator
hands out during the step. Collectives: the ``c10d`` collective operations the profiler
records during one step (an all-gather, a reduce-scatter and an all-reduce each count once,
whichever API issued them).

The last line: ``ddp_vs_torch`` and ``fsdp_vs_torch`` are step-time ratios (ours over
torch's), ``*_mem_vs_torch`` per-rank peak-memory ratios (the larger rank of each side),
``fsdp_colls`` / ``torch_fsdp_colls`` the collectives of one step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness

from purestep import engine, hardware
from purestep.engine import optim

WIDTH, DEPTH, BATCH = 512, 12, 8
QUICK_DEPTH = 4
SIDES = ("ddp", "torch_ddp", "fsdp", "torch_fsdp")

#: The profiler's names of collective operations (``torch.distributed`` calls and
#: DTensor's functional collectives); waits, barriers and sends are not counted.
COLLECTIVES = {
    "c10d::allreduce_",
    "c10d::allreduce_coalesced_",
    "c10d::allgather_",
    "c10d::_allgather_base_",
    "c10d::allgather_coalesced_",
    "c10d::allgather_into_tensor_coalesced_",
    "c10d::reduce_scatter_",
    "c10d::_reduce_scatter_base_",
    "c10d::reduce_scatter_tensor_coalesced_",
    "c10d::broadcast_",
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::broadcast",
}


def _model(depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, WIDTH), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, 10))
    return nn.Sequential(*layers)


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _ours(strategy, depth: int, batch):
    """A donating engine step and its state; ``(run, roots)``."""
    from purestep.engine.tree import leaves

    opt = optim.adam(1e-3)
    box = [engine.init(_model(depth), opt, seed=0, strategy=strategy)]
    step = engine.train_step(
        _model(depth), _loss, opt, strategy=strategy, donate=True, grad_norm=False
    )

    def run():
        box[0], _ = step(box[0], batch)

    def roots():
        state = box[0]
        tensors = leaves((state.params, state.buffers, state.opt_state))
        return [_local(t) for t in tensors if isinstance(t, torch.Tensor)]

    return run, roots


def _torch(kind: str, depth: int, batch):
    """Torch's DDP or FSDP2 with ``torch.optim.Adam``, a hand loop; ``(run, roots)``."""
    net = _model(depth)
    extra: list[torch.Tensor] = []
    if kind == "torch_ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
        # the reducer's bucket buffers: allocated at construction, one slot per gradient
        extra = [torch.empty(sum(p.numel() for p in net.parameters()))]
    else:
        from torch.distributed.fsdp import fully_shard

        for m in net.modules():
            if isinstance(m, nn.Linear):
                fully_shard(m)
        model = fully_shard(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run():
        opt.zero_grad(set_to_none=True)
        _loss(model, batch).backward()
        opt.step()

    def roots():
        tensors = [_local(p) for p in model.parameters()]
        tensors += [_local(p.grad) for p in model.parameters() if p.grad is not None]
        for s in opt.state.values():
            tensors += [_local(v) for v in s.values() if isinstance(v, torch.Tensor)]
        return tensors + extra

    return run, roots


def _collectives(run) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if e.name in COLLECTIVES)


def _rank(rank: int, rounds: int, steps: int, depth: int) -> dict:
    strategies = {
        "ddp": hardware.ddp(device="cpu"),
        "fsdp": hardware.fsdp(auto_wrap_policy={nn.Linear}),
    }
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(BATCH, 256, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
    sides = {}
    for name in SIDES:
        if name.startswith("torch_"):
            sides[name] = _torch(name, depth, batch)
        else:
            sides[name] = _ours(strategies[name], depth, batch)
        for _ in range(3):  # warm up (torch DDP rebuilds its buckets after the first step)
            sides[name][0]()
    counts = {name: _collectives(run) for name, (run, _) in sides.items()}
    memory = {
        name: _harness.allocator_peak_bytes(run, run, roots) for name, (run, roots) in sides.items()
    }
    dist.barrier()
    times = _harness.interleaved({n: run for n, (run, _) in sides.items()}, rounds, steps)
    return {
        "memory": memory,
        "times": times,
        "collectives": counts,
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
    ranks = hardware.launch(_rank, 2, args.rounds, args.steps, depth, threads=1, max_seconds=900)
    print(
        f"model: {ranks[0]['params'] / 1e6:.2f} M parameters, Adam, batch {BATCH} per rank, "
        "2 ranks, donating engine steps vs torch hand loops"
    )
    mem, step = {}, {}
    for n in SIDES:
        mem[n] = max(r["memory"][n] for r in ranks)
        slowest = [max(r["times"][n][i] for r in ranks) for i in range(args.rounds)]
        step[n] = statistics.median(slowest)
        print(
            f"{n:10s}: step {_harness.summary(slowest, 1e3, 2)} ms; peak per rank "
            f"{mem[n] / 2**20:7.2f} MiB; collectives per step {ranks[0]['collectives'][n]}"
        )
    colls = ranks[0]["collectives"]
    print(
        f"ddp_vs_torch={step['ddp'] / step['torch_ddp']:.3f} "
        f"ddp_mem_vs_torch={mem['ddp'] / mem['torch_ddp']:.3f} "
        f"fsdp_vs_torch={step['fsdp'] / step['torch_fsdp']:.3f} "
        f"fsdp_mem_vs_torch={mem['fsdp'] / mem['torch_fsdp']:.3f} "
        f"fsdp_colls={colls['fsdp']} torch_fsdp_colls={colls['torch_fsdp']}"
    )


if __name__ == "__main__":
    main()
