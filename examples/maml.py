"""MAML on sinusoid regression: the inner loop is purestep's differentiable train step.

Each task is a sine wave ``y = a * sin(x - phase)`` (amplitude in [0.1, 5], phase in
[0, pi], x in [-5, 5], as in Finn et al., 2017). The meta-parameters are the initial weights
of a small MLP (1-40-40-1); for every task of a meta-batch, ``--inner-steps`` SGD steps on
``--shots`` support points run through ``engine.train_step(..., differentiable=True)``, the
loss on query points of the same task is taken from the adapted state, and the meta-gradient
is the second-order gradient of the mean query loss with respect to the initial weights
(``torch.autograd.grad`` through the unrolled inner steps). Adam (``engine.optim.adam``,
applied the ordinary way) updates the meta-parameters. ``meta_gradient_by_hand`` is the
same computation written with ``torch.autograd`` alone; the tests compare the two.

Prints the mean query loss every ``--log-every`` meta-steps and, last,
``meta_loss=<mean query loss over the last logging window>``. Quick by default (seconds).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from purestep import engine
from purestep.engine import differentiable, optim

Tensor = torch.Tensor


def sample_tasks(gen: torch.Generator, tasks: int, shots: int, queries: int) -> list:
    """``tasks`` sine tasks: ``[((x_support, y_support), (x_query, y_query)), ...]``."""
    out = []
    for _ in range(tasks):
        amplitude = 0.1 + 4.9 * torch.rand((), generator=gen)
        phase = math.pi * torch.rand((), generator=gen)
        x = 10 * torch.rand(shots + queries, 1, generator=gen) - 5
        y = amplitude * torch.sin(x - phase)
        out.append(((x[:shots], y[:shots]), (x[shots:], y[shots:])))
    return out


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def loss_fn(apply: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return ((apply(x) - y) ** 2).mean()


def inner_step(model: nn.Module, inner_lr: float) -> differentiable.DifferentiableTrainStep:
    """The differentiable SGD step of the inner loop."""
    return engine.train_step(model, loss_fn, optim.sgd(inner_lr), differentiable=True)


def meta_gradient(
    step: differentiable.DifferentiableTrainStep,
    state: engine.TrainState,
    tasks: list,
    inner_steps: int,
) -> tuple[dict[str, Tensor], Tensor]:
    """``(meta-gradient, mean query loss)`` at ``state``'s parameters (the meta-parameters)."""
    start = differentiable.leaf_params(state)
    total = None
    for support, query in tasks:
        adapted, _ = differentiable.unroll(step, start, [support] * inner_steps)
        loss = differentiable.loss_of(step, adapted, query)
        total = loss if total is None else total + loss
    meta_loss = total / len(tasks)
    grads = torch.autograd.grad(meta_loss, list(start.params.values()))
    return dict(zip(start.params, grads)), meta_loss.detach()


def functional_loss(model: nn.Module, params: dict[str, Tensor], batch: tuple) -> Tensor:
    """``loss_fn`` of ``model`` run on ``params`` (``torch.func.functional_call``)."""
    return loss_fn(lambda x: torch.func.functional_call(model, params, (x,)), batch)


def meta_gradient_by_hand(
    model: nn.Module, params: dict[str, Tensor], tasks: list, inner_steps: int, inner_lr: float
) -> tuple[dict[str, Tensor], Tensor]:
    """The same meta-gradient with ``torch.autograd`` alone (``torch.add(p, g, alpha=-lr)`` is
    the arithmetic of SGD's update, as in ``torch.optim.SGD``)."""
    start = {n: p.detach().requires_grad_() for n, p in params.items()}
    names = list(start)
    total = None
    for support, query in tasks:
        fast = dict(start)
        for _ in range(inner_steps):
            loss = functional_loss(model, fast, support)
            grads = torch.autograd.grad(loss, [fast[n] for n in names], create_graph=True)
            fast = {n: torch.add(fast[n], g, alpha=-inner_lr) for n, g in zip(names, grads)}
        loss = functional_loss(model, fast, query)
        total = loss if total is None else total + loss
    meta_loss = total / len(tasks)
    grads = torch.autograd.grad(meta_loss, [start[n] for n in names])
    return dict(zip(names, grads)), meta_loss.detach()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--meta-steps", type=int, default=300)
    parser.add_argument("--meta-batch", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--inner-lr", type=float, default=0.01)
    parser.add_argument("--meta-lr", type=float, default=1e-3)
    parser.add_argument("--shots", type=int, default=10)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a tiny model: more threads only wait for each other
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)  # the template's initial weights
    model = make_model()
    meta_opt = optim.adam(args.meta_lr)
    state = engine.init(model, optim.sgd(args.inner_lr), seed=args.seed)
    meta_state = meta_opt.init(state.params)
    step = inner_step(model, args.inner_lr)
    gen = torch.Generator().manual_seed(args.seed)
    window: list[float] = []
    for i in range(1, args.meta_steps + 1):
        tasks = sample_tasks(gen, args.meta_batch, args.shots, args.queries)
        grads, meta_loss = meta_gradient(step, state, tasks, args.inner_steps)
        params, meta_state = optim.step(meta_opt, grads, meta_state, state.params)
        state = state.replace(params=params)
        window.append(float(meta_loss))
        if i % args.log_every == 0 or i == args.meta_steps:
            print(f"meta-step {i}: query loss {sum(window) / len(window):.4f}")
            last, window = sum(window) / len(window), []
    print(f"({time.perf_counter() - t0:.1f} s)")
    print(f"meta_loss={last:.4f}")
    return last


if __name__ == "__main__":
    main()
