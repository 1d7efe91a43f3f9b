"""K models trained at once (``hardware.ensemble``) against K sequential engine runs.

Run from the repository root::

    .venv/bin/python benchmarks/ensemble.py           # full run, about half a minute
    .venv/bin/python benchmarks/ensemble.py --quick   # smoke run, a few seconds

Both sides run in this one process: K = 16 MLPs 64-128-10 (ReLU), Adam (lr 1e-3), batch
64, on the same batches in the same order, from the same 16 initial states:

* sequential: 16 ordinary ``TrainState``s (``hardware.member(ensemble_state, i)``) and one
  ``engine.train_step(net, loss_fn, adam)`` with its defaults; one round is 16 calls, one
  per member, each on the round's batch;
* ensemble: the stacked state and ``engine.train_step(..., strategy=hardware.ensemble(16))``
  with its defaults (``grad="autograd"``: a vmapped forward pass and one backward pass);
  one round is one call.

Before timing, both sides take the same warm-up steps and every member's parameters are
compared with its sequential twin (the printout says whether they agree bitwise). Informative
extra sides: the ensemble with ``grad="func"`` (``vmap(torch.func.grad)``) and with a 16-way
learning-rate sweep (``hparams={"lr": [...]}``: 16 optimizer calls per step instead of one).

Threads: ``torch.set_num_threads(1)`` (see ``benchmarks/step_overhead.py``: the machine's 2
cores are shared, and one thread keeps the kernels identical and the figures stable).
Timing: ``_harness.interleaved`` (sides alternate in rounds, median per round). The figure
per side is the time of one step of all 16 members; the last line is
``speedup=<sequential / ensemble> speedup_compiled=<sequential / ensemble_compiled>``, the
latter the ensemble step compiled whole (``compile=True``, ``grad_norm=False``: forward,
vmapped backward and the stacked Adam update as one inductor graph; compared with the
sequential runs to ``rtol=1e-4, atol=1e-5``, different kernels; its compile time is part of
the warm-up, not of the figures; ``--backend``, default ``inductor``, its ``torch.compile``
backend: the test suite's smoke run uses ``aot_eager``, no code generation). ``--scaling``
also times the ensemble step alone for K = 1, 4 and 16, which splits its cost into a fixed
part and a per-member part.
``--breakdown`` also times each side's gradient half alone (``TrainStep.backward``: forward,
backward, gradient bookkeeping) next to its whole step, so the optimizer half (norms and
update, ``TrainStep.apply``) is the difference, and prints the speedup a free optimizer half
would give at most.

What limits the speedup (measured on the 2-core development VM, often with another process
busy on the other core; figures move by 20-30% between runs, the last line between about 2.6
and 3.6, and a quiet machine gives the lower figures, since the sequential side gains most):

* The sequential side costs 0.5-0.75 ms per plain step, about half in each half; almost
  all of it is per-op overhead (the member's kernels take about 0.1 ms).
* The optimizer half is where the ensemble wins: one stacked Adam call instead of 16 costs
  0.4-1.0 ms against 4.5-5.4 ms (5-14x). Stacked Adam is memory-bound (eight passes over
  0.5 MB tensors, about 0.35 ms of kernels measured alone).
* The gradient half is where it does not: 2.4-3.0 ms against 4.1-4.4 ms for 16 plain
  forward and backward passes, only 1.5-1.7x. Its kernels take about 1.3 ms (five ``bmm``
  about 0.5 ms; ``log_softmax`` forward and backward about 0.3 ms, since a [1024, 10]
  log-softmax costs as much as sixteen [64, 10] ones; bias adds, ReLU, sums about 0.25 ms;
  the row-major copy of the two weight gradients about 0.15 ms). The rest is per-op cost of
  vmap: one ``F.linear`` becomes 11 physical ops (transposes, expands, views, ``bmm``, a
  ``mul`` by 1 and a broadcast ``add``), ``cross_entropy``'s ``nll_loss`` is decomposed in
  Python into about 20 ops, and the backward graph has 31 nodes where the same computation
  written with ``baddbmm`` has 17. The vmapped forward takes 1.0-1.5 ms where those batched
  kernels called directly take 0.55-0.75 ms.
* So even a free optimizer half would give at most 3.3-3.5x (``--breakdown``; also measured
  by replacing the update with nothing): the goal of 4x is out of reach for a generic
  ``vmap`` step of this model on this machine. ``--scaling`` gives about 1.5-2.4 ms fixed
  plus 0.13-0.2 ms per member; a larger K amortises the fixed part, but the per-member
  part is memory-bound and grows with it (K = 32 and 64, timed twice each with this
  benchmark's sides, gave 3.0-4.3, within the noise of K = 16).

Tried and measured with paired, interleaved A/B runs: calling functorch's C entry points
directly instead of ``torch.func.vmap`` (skipping its pytree handling of the flat inputs and
outputs) changed nothing measurable (0.99-1.01), so the public API stays; skipping the
per-member norms saves about 1%, but both sides report them by default (``grad_norm=True``)
and the sequential side pays for them too; leaving the weight gradients transposed instead
of copying them makes the step slower (every Adam op then reads them strided); running the
optimizer on member chunks small enough for the core's L2 is slower (each optimizer call
costs 0.1-0.15 ms of Python); the 25-100 page faults per step (glibc hands the 0.5 MB
temporaries back to the OS) disappear with a larger ``M_TRIM_THRESHOLD`` but the speedup
moves only within the noise, and a library should not set process-wide allocator options.
Kept: the step skips the search for injected hyper-parameters when its optimizer has none
(about 25 us a step, 1-3% in paired runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from purestep import engine, hardware
from purestep.engine import optim, tree

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.ensemble``
    from benchmarks import _harness

K = 16
WIDTHS = (64, 128, 10)
BATCH = 64
LR = 1e-3
FULL = (5, 15, 10)  # warm-up steps, rounds, steps per round
QUICK = (2, 3, 2)


loss_fn = _harness.cross_entropy_loss


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _harness.classification_batches(n, BATCH, WIDTHS[0], WIDTHS[-1])


class Sequential:
    """K ordinary states, one plain engine step per member."""

    def __init__(self, net, states, batches):
        self.states = states
        self.step_fn = engine.train_step(net, loss_fn, optim.adam(LR))
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.states = [self.step_fn(s, batch)[0] for s in self.states]


class Ensemble:
    """The stacked state, one ensemble step for all members."""

    def __init__(self, net, state, batches, opt=None, **step_kwargs):
        ens = hardware.ensemble(K, hparams=step_kwargs.pop("hparams", None))
        opt = opt if opt is not None else optim.adam(LR)
        self.state = state
        self.step_fn = engine.train_step(net, loss_fn, opt, strategy=ens, **step_kwargs)
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.state, _ = self.step_fn(self.state, batch)


def breakdown(seq: Sequential, ens: Ensemble, rounds: int, steps: int) -> None:
    """Each side's full step and its gradient half alone (``TrainStep.backward``: forward and
    backward), timed together; the optimizer half (norms, update) is the difference."""
    batch = seq.batches[0]

    def seq_grads() -> None:
        for s in seq.states:
            seq.step_fn.backward(s, batch)

    def ens_grads() -> None:
        ens.step_fn.backward(ens.state, batch)

    timed = {"seq": seq.step, "seq_grads": seq_grads, "ens": ens.step, "ens_grads": ens_grads}
    med = {
        n: statistics.median(v) * 1e3 for n, v in _harness.interleaved(timed, rounds, steps).items()
    }
    halves = {
        "gradient half (forward, backward)": (med["seq_grads"], med["ens_grads"]),
        "optimizer half (norms, update)": (
            med["seq"] - med["seq_grads"],
            med["ens"] - med["ens_grads"],
        ),
        "whole step": (med["seq"], med["ens"]),
    }
    print("  breakdown (median ms, sequential vs ensemble):")
    for name, (a, b) in halves.items():
        print(f"    {name:34s} {a:8.3f} {b:8.3f}  speedup {a / b:5.2f}")
    bound = med["seq"] / med["ens_grads"]
    print(f"    with a free optimizer half the speedup would be at most {bound:.2f}")


def scaling(net: nn.Module, batches: list, rounds: int, steps: int) -> None:
    """The ensemble step's time for a few K: a fixed cost plus a cost per member."""
    sides = {}
    for k in (1, 4, 16):
        ens = hardware.ensemble(k)
        state = engine.init(net, optim.adam(LR), seed=0, strategy=ens)
        side = Ensemble(net, state, batches)
        side.step_fn = engine.train_step(net, loss_fn, optim.adam(LR), strategy=ens)
        side.step()
        sides[f"K={k}"] = side.step
    samples = _harness.interleaved(sides, rounds, steps)
    print("  ensemble step alone (median ms):", end="")
    for name, v in samples.items():
        print(f"  {name} {statistics.median(v) * 1e3:.3f}", end="")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps only (smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--scaling", action="store_true", help="also time K = 1, 4, 16")
    parser.add_argument(
        "--breakdown", action="store_true", help="also time the gradient half of each side"
    )
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend of the compiled side"
    )
    args = parser.parse_args()
    warmup, rounds, steps = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    net = nn.Sequential(nn.Linear(WIDTHS[0], WIDTHS[1]), nn.ReLU(), nn.Linear(WIDTHS[1], WIDTHS[2]))
    start = engine.init(net, optim.adam(LR), seed=0, strategy=hardware.ensemble(K))
    batches = make_batches(8)
    sweep_opt = optim.inject_hyperparams(optim.adam)(lr=LR)
    sweep_start = engine.init(net, sweep_opt, seed=0, strategy=hardware.ensemble(K))
    sides = {
        "sequential": Sequential(net, [hardware.member(start, i) for i in range(K)], batches),
        "ensemble": Ensemble(net, start, batches),
        "ensemble_func": Ensemble(net, start, batches, grad="func"),
        # the whole vmapped step (forward, backward, Adam) as one inductor graph
        "ensemble_compiled": Ensemble(
            net, start, batches, compile={"backend": args.backend}, grad_norm=False
        ),
        "ensemble_sweep": Ensemble(
            net,
            sweep_start,
            batches,
            opt=sweep_opt,
            hparams={"lr": [LR * (1 + i / K) for i in range(K)]},
        ),
    }
    for _ in range(warmup):
        for side in sides.values():
            side.step()
    seq = sides["sequential"].states
    worst, bitwise = 0.0, True
    for name in ("ensemble", "ensemble_func"):
        for i in range(K):
            m = hardware.member(sides[name].state, i)
            for n, p in m.params.items():
                worst = max(worst, (p - seq[i].params[n]).abs().max().item())
                bitwise &= torch.equal(p, seq[i].params[n])
            if not tree.trees_equal(m.progress, seq[i].progress):
                raise AssertionError(f"{name}: member {i}'s progress differs")
    if worst > 1e-5:
        raise AssertionError(f"the ensemble diverged from the sequential runs (max {worst:.3g})")
    for i in range(K):  # compiled: different kernels, so a tolerance
        m = hardware.member(sides["ensemble_compiled"].state, i)
        for n, p in m.params.items():
            torch.testing.assert_close(p, seq[i].params[n], rtol=1e-4, atol=1e-5)
    agree = "bitwise" if bitwise else f"to {worst:.1e}"

    samples = _harness.interleaved({n: s.step for n, s in sides.items()}, rounds, steps)
    ms = {n: [x * 1e3 for x in v] for n, v in samples.items()}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); K={K} MLPs "
        f"{'-'.join(map(str, WIDTHS))}, batch {BATCH}, Adam lr {LR}; {rounds} rounds x {steps} "
        f"steps per side; after {warmup} warm-up steps every member agrees with its "
        f"sequential run {agree}"
    )
    seq_ms = statistics.median(ms["sequential"])
    for name, v in ms.items():
        med = statistics.median(v)
        paired = statistics.median(a / b for a, b in zip(ms["sequential"], v))
        print(
            f"  {name:15s} {med:8.3f} ms per step of all {K} members  "
            f"({med / K * 1e3:7.1f} us per member-step; min {min(v):.3f} max {max(v):.3f})  "
            f"speedup {seq_ms / med:5.2f}  paired-median {paired:5.2f}"
        )
    ens_ms = statistics.median(ms["ensemble"])
    if args.breakdown:
        breakdown(sides["sequential"], sides["ensemble"], rounds, steps)
    if args.scaling:
        scaling(net, batches, rounds, steps)
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    speedup = seq_ms / ens_ms
    compiled = seq_ms / statistics.median(ms["ensemble_compiled"])
    print(f"speedup={speedup:.3f} speedup_compiled={compiled:.3f}")


if __name__ == "__main__":
    main()
