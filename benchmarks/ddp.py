"""Data-parallel throughput: 2 ranks against 1, and the share of a step spent in all-reduce.

Run from the repository root::

    .venv/bin/python benchmarks/ddp.py           # about 30 s
    .venv/bin/python benchmarks/ddp.py --quick   # smoke run, about 10 s

Both sides run through ``hardware.launch`` on CPU (gloo), one intra-op thread per rank, with
the same model (an MLP 64-512-512-10, 0.3 M parameters, 1.2 MB of float32 gradients), Adam,
and ``engine.train_step(..., strategy=hardware.ddp())`` with ``B`` samples per rank per
step: one rank processes ``B`` samples per step, two ranks ``2 * B`` (weak scaling, the
usual way data parallelism is used). Each rank takes warm-up steps, waits at a barrier, then
times every step on its own; the step time of the run is the median over steps of the
slowest rank's time (the ranks wait for each other inside the all-reduce anyway). The
all-reduce time is measured around ``strategy.all_reduce`` (flattening, the gloo collective,
the division and the split, and any wait for the slower rank), averaged over the ranks; one
rank runs no all-reduce at all (the step skips it for a world of one). The 1-rank and
2-rank runs alternate for ``--rounds`` rounds and the medians over rounds are reported, so
background load falls on both.

Throughput is samples per second over all ranks. ``speedup`` is 2-rank throughput over
1-rank throughput (2.0 would be perfect scaling); ``allreduce_share`` is the median
all-reduce time over the median step time on 2 ranks. On a machine with 2 cores shared
with other jobs, two ranks compete with everything else for those cores, so expect little
speedup here; on one core per rank with nothing else running, the all-reduce share is the
overhead that remains.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from purestep import engine, hardware
from purestep.engine import optim


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _rank(rank: int, batch: int, warmup: int, steps: int) -> dict:
    """One rank's timings: per-step seconds and per-step all-reduce seconds."""
    strategy = hardware.ddp(device="cpu")
    reduce_times: list[float] = []
    inner = strategy.all_reduce

    def timed_all_reduce(tree, op="mean"):
        t0 = time.perf_counter()
        out = inner(tree, op)
        reduce_times.append(time.perf_counter() - t0)
        return out

    strategy.all_reduce = timed_all_reduce
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    opt = optim.adam(1e-3)
    state = engine.init(net, opt, seed=0, strategy=strategy)
    step = engine.train_step(net, _loss, opt, strategy=strategy)
    g = torch.Generator().manual_seed(rank)
    data = [
        (torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(8)
    ]
    for i in range(warmup):
        state, _ = step(state, data[i % len(data)])
    strategy.barrier()
    reduce_times.clear()
    step_times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, out = step(state, data[i % len(data)])
        step_times.append(time.perf_counter() - t0)
    float(out.loss)
    return {
        "step": step_times,
        "reduce": reduce_times,
        "params": sum(p.numel() for p in state.params.values()),
    }


def _run(nprocs: int, batch: int, warmup: int, steps: int) -> dict:
    ranks = hardware.launch(_rank, nprocs, batch, warmup, steps, threads=1, max_seconds=300)
    # Per step, the slowest rank sets the pace.
    slowest = [max(r["step"][i] for r in ranks) for i in range(steps)]
    # Time inside all_reduce, averaged over the ranks (it includes waiting for the slower one).
    reduce = [0.0]
    if nprocs > 1:
        reduce = [statistics.fmean(r["reduce"][i] for r in ranks) for i in range(steps)]
    step_s = statistics.median(slowest)
    return {
        "step_s": step_s,
        "p10": sorted(slowest)[steps // 10],
        "p90": sorted(slowest)[(9 * steps) // 10],
        "reduce_s": statistics.median(reduce),
        "throughput": nprocs * batch / step_s,
        "params": ranks[0]["params"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 40, 5, 1
    results: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(args.rounds):
        for nprocs in (1, 2) if r % 2 == 0 else (2, 1):
            res = _run(nprocs, args.batch, args.warmup, args.steps)
            results[nprocs].append(res)
            print(
                f"round {r + 1} ranks={nprocs}: step {res['step_s'] * 1e3:7.3f} ms "
                f"(p10 {res['p10'] * 1e3:.3f}, p90 {res['p90'] * 1e3:.3f}), all-reduce "
                f"{res['reduce_s'] * 1e3:6.3f} ms, {res['throughput']:8.0f} samples/s",
                flush=True,
            )
    summary = {}
    for nprocs, runs in results.items():
        summary[nprocs] = {
            k: statistics.median(run[k] for run in runs)
            for k in ("step_s", "reduce_s", "throughput")
        }
        s = summary[nprocs]
        print(
            f"ranks={nprocs}: {results[nprocs][0]['params']} params, batch {args.batch}/rank, "
            f"step {s['step_s'] * 1e3:.3f} ms, all-reduce {s['reduce_s'] * 1e3:.3f} ms, "
            f"{s['throughput']:.0f} samples/s"
        )
    speedup = summary[2]["throughput"] / summary[1]["throughput"]
    share = summary[2]["reduce_s"] / summary[2]["step_s"]
    print(f"speedup={speedup:.3f} allreduce_share={share:.3f}")


if __name__ == "__main__":
    main()
