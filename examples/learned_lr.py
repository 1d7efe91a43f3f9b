"""Learn the learning rate by hypergradient descent through unrolled training steps.

A small MLP fits a fixed regression data set with momentum SGD for ``--unroll`` steps. The
learning rate lives in the optimizer state (``optim.inject_hyperparams``) as
``exp(log_lr)``; the training loss after the unrolled steps, differentiated through them
(``engine.train_step(..., differentiable=True)``), gives the hypergradient
``d loss / d log_lr``, and Adam on ``log_lr`` follows it (``--outer-steps`` times), each
outer step restarting from the same initial weights. Then the starting rate and the
learned one each train for ``--unroll`` steps the ordinary way.

Prints the rate and the unrolled loss per outer step and, last,
``learned_lr=<x> start_loss=<loss with the starting rate> learned_loss=<loss with the
learned rate>``. Quick by default (seconds).
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


def make_data(seed: int, batches: int, size: int = 64) -> list[tuple[Tensor, Tensor]]:
    """``batches`` fixed batches of ``y = sin(3 x1) + x2^2`` with a little noise."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        x = 2 * torch.rand(size, 2, generator=gen) - 1
        y = torch.sin(3 * x[:, :1]) + x[:, 1:] ** 2 + 0.05 * torch.randn(size, 1, generator=gen)
        out.append((x, y))
    return out


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))


def loss_fn(apply: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return ((apply(x) - y) ** 2).mean()


def mean_loss(model: nn.Module, params: dict[str, Tensor], data: list) -> float:
    with torch.no_grad():
        return sum(
            float(loss_fn(lambda x: torch.func.functional_call(model, params, (x,)), b))
            for b in data
        ) / len(data)


def train_loss(model: nn.Module, lr: float, momentum: float, data: list, seed: int) -> float:
    """The mean training loss after one ordinary pass over ``data`` at rate ``lr``."""
    opt = optim.sgd(lr, momentum=momentum)
    step = engine.train_step(model, loss_fn, opt)
    state = engine.init(model, opt, seed=seed)
    for batch in data:
        state, _ = step(state, batch)
    return mean_loss(model, state.params, data)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lr", type=float, default=0.001, help="the starting learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--unroll", type=int, default=20, help="steps differentiated through")
    parser.add_argument("--outer-steps", type=int, default=40)
    parser.add_argument("--outer-lr", type=float, default=0.1, help="Adam's rate on log(lr)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a tiny model: more threads only wait for each other
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model = make_model()
    data = make_data(args.seed, args.unroll)
    opt = optim.inject_hyperparams(optim.sgd)(lr=args.lr, momentum=args.momentum)
    step = engine.train_step(model, loss_fn, opt, differentiable=True)
    start = engine.init(model, opt, seed=args.seed)

    log_lr = torch.tensor(math.log(args.lr), dtype=torch.float64)
    outer = optim.adam(args.outer_lr)
    outer_state = outer.init({"log_lr": log_lr})
    for i in range(1, args.outer_steps + 1):
        log_lr.requires_grad_()
        state = differentiable.with_hyperparams(start, lr=log_lr.exp())
        state, _ = differentiable.unroll(step, state, data)
        objective = sum(differentiable.loss_of(step, state, b) for b in data) / len(data)
        (grad,) = torch.autograd.grad(objective, [log_lr])
        new, outer_state = optim.step(outer, {"log_lr": grad}, outer_state, {"log_lr": log_lr})
        log_lr = new["log_lr"].detach()
        print(f"outer step {i}: lr {math.exp(float(log_lr)):.4f}, unrolled loss {objective:.4f}")

    learned = math.exp(float(log_lr))
    before = train_loss(model, args.lr, args.momentum, data, args.seed)
    after = train_loss(model, learned, args.momentum, data, args.seed)
    print(f"({time.perf_counter() - t0:.1f} s)")
    print(f"learned_lr={learned:.4f} start_loss={before:.4f} learned_loss={after:.4f}")
    return {"learned_lr": learned, "start_loss": before, "learned_loss": after}


if __name__ == "__main__":
    main()
