"""Train the digits MLP with DP-SGD: per-example clipping and Gaussian noise.

The model, data split and loss are those of ``examples/digits.py`` (scikit-learn's 8x8
digits, MLP 64-128-10). The step is ``engine.per_sample_step``: every example's gradient is
clipped to ``--max-grad-norm``, the clipped gradients are summed, Gaussian noise of standard
deviation ``--noise-multiplier * --max-grad-norm`` is added (drawn from a key of the state,
so the run is reproducible) and the sum is divided by the batch size before the optimizer
step. Prints the validation accuracy per epoch and, last, ``test_acc=<x>``.

The batches are a shuffled pass over the data per epoch, not the Poisson sampling that the
usual privacy accounting assumes, and no ``(epsilon, delta)`` is computed here: this shows
the mechanics, it is not a privacy audit.
"""

from __future__ import annotations

import argparse
import time

import torch
from digits import load, loss_fn  # examples/digits.py: the same data split and loss
from torch import nn

from purestep import engine, seed_everything
from purestep.engine import metrics, optim, rng


def evaluate(step, state, data, batch_size=256) -> float:
    x, y = data
    total = None
    for i in range(0, len(x), batch_size):
        out = step(state, (x[i : i + batch_size], y[i : i + batch_size]), index=i)
        total = metrics.merge(total, {"acc": out["acc"]})
    return float(metrics.compute(total)["acc"])


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    seed_everything(args.seed)  # nothing here draws from the global generators; a habit
    train, val, test = load(args.seed)
    with torch.device("meta"):  # a template only: engine.init initialises it from the seed
        net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = optim.sgd(args.lr, momentum=args.momentum)
    state = engine.init(net, opt, seed=args.seed)
    step = engine.per_sample_step(
        net,
        loss_fn,
        opt,
        max_grad_norm=args.max_grad_norm,
        noise_multiplier=args.noise_multiplier,
    )
    eval_step = engine.eval_step(net, loss_fn)
    print(
        f"DP-SGD: clip each example to {args.max_grad_norm}, noise std "
        f"{args.noise_multiplier * args.max_grad_norm:g} on the sum of a batch of "
        f"{args.batch_size}, SGD lr {args.lr} momentum {args.momentum}"
    )

    x, y = train
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=rng.generator(rng.fold_in(state.rng, epoch)))
        for i in range(0, len(x), args.batch_size):
            idx = order[i : i + args.batch_size]
            state, out = step(state, (x[idx], y[idx]))
        state = state.replace(progress=state.progress.replace(epoch=epoch + 1, batch_in_epoch=0))
        print(
            f"epoch {epoch + 1:3d}  loss {float(out.loss):.4f}  "
            f"val_acc {evaluate(eval_step, state, val):.4f}"
        )
    test_acc = evaluate(eval_step, state, test)
    print(f"{state.progress.step} steps in {time.perf_counter() - t0:.1f} s")
    print(f"test_acc={test_acc:.4f}")
    return test_acc


if __name__ == "__main__":
    main()
