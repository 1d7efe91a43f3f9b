"""A k-step unroll and its meta-backward: purestep's differentiable step against autograd by hand.

Run from the repository root::

    .venv/bin/python benchmarks/unroll.py           # full run, about a minute
    .venv/bin/python benchmarks/unroll.py --quick   # smoke run, a few seconds

Both sides run in this one process on the same batches from the same initial weights: an MLP
64-256-256-10 (tanh), cross-entropy, batch 128, ``K = 5`` inner steps, then the loss on a
held-out batch differentiated with respect to what the run learns:

* **meta** (MAML's second-order meta-gradient): plain SGD (lr 0.1); the gradient of the
  held-out loss with respect to the initial parameters. purestep:
  ``engine.train_step(..., differentiable=True, grad_norm=False)`` (no gradient norms, as by
  hand), ``differentiable.unroll`` and
  ``differentiable.loss_of``; by hand: ``torch.func.functional_call``,
  ``torch.autograd.grad(..., create_graph=True)`` and ``torch.add(p, g, alpha=-lr)`` per
  step (the same arithmetic: the two meta-gradients are compared bitwise before timing).
* **hyper** (a hypergradient): momentum SGD (lr 0.1, momentum 0.9) with the learning rate a
  tensor that requires grad; the gradient with respect to the learning rate and the initial
  parameters. purestep: ``optim.inject_hyperparams(optim.sgd)`` and
  ``differentiable.with_hyperparams``; by hand: ``buf = momentum * buf + g`` and
  ``p - lr * buf`` with the tensor ``lr``, as one writes it (purestep keeps torch's fused
  ``add(alpha=)`` values and adds an exact-zero term for the rate's gradient, so the
  hypergradients agree to rounding, checked to ``rtol=1e-4``: float32, different rounding of
  the update).

Memory: ``_harness.peak_live_bytes`` of one unroll and meta-backward, the roots being the
initial parameters and the batches (the graph of the k steps is what it measures). Time:
``_harness.interleaved`` (sides alternate in rounds, median of rounds). Threads: one
(``torch.set_num_threads(1)``). The last line is ``meta_time_ratio=... meta_mem_ratio=...
hyper_time_ratio=... hyper_mem_ratio=...``, purestep over by hand (target <= 1.1 each).
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch import nn

from purestep import engine
from purestep.engine import differentiable, optim

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.unroll``
    from benchmarks import _harness

WIDTHS = (64, 256, 256, 10)
BATCH = 128
K = 5
LR = 0.1
MOMENTUM = 0.9
FULL = (3, 30, 5)  # warm-up calls, rounds, calls per round
QUICK = (1, 2, 1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(WIDTHS)):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(WIDTHS) - 2 else [])
    return nn.Sequential(*layers)


loss_fn = _harness.cross_entropy_loss


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _harness.classification_batches(n, BATCH, WIDTHS[0], WIDTHS[-1])


class Purestep:
    """The unroll with purestep's differentiable step."""

    def __init__(self, model, batches, hyper: bool) -> None:
        self.batches, self.val, self.hyper = batches[:K], batches[K], hyper
        opt = (
            optim.inject_hyperparams(optim.sgd)(lr=LR, momentum=MOMENTUM)
            if hyper
            else optim.sgd(LR)
        )
        # no gradient norms: the hand loop computes none (the default step reports them)
        self.step = engine.train_step(model, loss_fn, opt, differentiable=True, grad_norm=False)
        self.start = engine.init(model, opt)

    def roots(self):
        return [*self.start.params.values(), *(t for b in self.batches for t in b), *self.val]

    def __call__(self):
        state = differentiable.leaf_params(self.start)
        wrt = list(state.params.values())
        if self.hyper:
            lr = torch.tensor(LR, dtype=torch.float64, requires_grad=True)
            state = differentiable.with_hyperparams(state, lr=lr)
            wrt = [lr, *wrt]
        state, _ = differentiable.unroll(self.step, state, self.batches)
        return torch.autograd.grad(differentiable.loss_of(self.step, state, self.val), wrt)


class ByHand:
    """The same unroll with ``torch.autograd`` alone."""

    def __init__(self, model, batches, hyper: bool) -> None:
        self.model, self.batches, self.val, self.hyper = model, batches[:K], batches[K], hyper
        self.start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def roots(self):
        return [*self.start.values(), *(t for b in self.batches for t in b), *self.val]

    def loss(self, params, batch):
        return loss_fn(lambda x: torch.func.functional_call(self.model, params, (x,)), batch)

    def __call__(self):
        params = {n: p.detach().requires_grad_() for n, p in self.start.items()}
        names = list(params)
        wrt = list(params.values())
        lr = torch.tensor(LR, dtype=torch.float64, requires_grad=True) if self.hyper else LR
        if self.hyper:
            wrt = [lr, *wrt]
        bufs = None
        for batch in self.batches:
            grads = torch.autograd.grad(
                self.loss(params, batch), [params[n] for n in names], create_graph=True
            )
            if self.hyper:
                bufs = (
                    list(grads) if bufs is None else [MOMENTUM * b + g for b, g in zip(bufs, grads)]
                )
                params = {n: params[n] - lr * b for n, b in zip(names, bufs)}
            else:
                params = {n: torch.add(params[n], g, alpha=-LR) for n, g in zip(names, grads)}
        return torch.autograd.grad(self.loss(params, self.val), wrt)


def check_agreement(ours, theirs, hyper: bool) -> str:
    a, b = ours(), theirs()
    if hyper:
        ok = all(torch.allclose(x.double(), y.double(), rtol=1e-4, atol=1e-7) for x, y in zip(a, b))
        if not ok:
            raise AssertionError("the hypergradients disagree beyond rtol=1e-4")
        return "agree to rtol=1e-4"
    if not all(torch.equal(x, y) for x, y in zip(a, b)):
        raise AssertionError("the meta-gradients are not bitwise equal")
    return "bitwise equal"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warmup, rounds, calls = QUICK if args.quick else FULL
    _harness.self_check()
    model = make_model()
    batches = make_batches(K + 1)
    ratios = {}
    for case, hyper in (("meta", False), ("hyper", True)):
        sides = {
            "purestep": Purestep(model, batches, hyper),
            "by_hand": ByHand(model, batches, hyper),
        }
        agreement = check_agreement(sides["purestep"], sides["by_hand"], hyper)
        for side in sides.values():
            for _ in range(warmup):
                side()
        times = _harness.interleaved(sides, rounds, calls)
        mem = {n: _harness.peak_live_bytes(s, s.roots).peak for n, s in sides.items()}
        print(f"{case}: K={K} steps, gradients {agreement}")
        for n in sides:
            print(
                f"  {n:9s} {_harness.summary(times[n], 1e3, 2)} ms per unroll + meta-backward, "
                f"peak live {mem[n] / 2**20:.2f} MiB"
            )
        median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        ratios[f"{case}_time_ratio"] = median["purestep"] / median["by_hand"]
        ratios[f"{case}_mem_ratio"] = mem["purestep"] / mem["by_hand"]
    print(" ".join(f"{k}={v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
