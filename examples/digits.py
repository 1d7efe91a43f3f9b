"""Train an MLP on scikit-learn's bundled 8x8 digits with the engine's pure steps.

The whole run is a ``TrainState`` threaded through ``train_step``; the data order of every
epoch is a pure function of (seed, epoch). Prints the validation accuracy per epoch and, as
its last line, ``test_acc=<x>``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import engine
from engine import metrics, optim, rng


def load(seed: int = 0):
    """Train / val / test tensors (60 / 20 / 20 %), pixels scaled to [0, 1]."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=rng.generator(rng.key(seed)))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return (x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:])


def loss_fn(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": metrics.Accuracy.of(logits, y)}


def evaluate(step, state, data, batch_size=256):
    x, y = data
    total = None
    for i in range(0, len(x), batch_size):
        out = step(state, (x[i : i + batch_size], y[i : i + batch_size]), index=i)
        total = metrics.merge(total, {"acc": out["acc"]})
    return float(metrics.compute(total)["acc"])


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    train, val, test = load(args.seed)
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
    opt = optim.adamw(args.lr, weight_decay=1e-4)
    state = engine.init(net, opt, seed=args.seed)
    step = engine.train_step(net, loss_fn, opt)
    eval_step = engine.eval_step(net, loss_fn)

    x, y = train
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=rng.generator(rng.fold_in(state.rng, epoch)))
        for i in range(0, len(x), args.batch_size):
            idx = order[i : i + args.batch_size]
            state, out = step(state, (x[idx], y[idx]))
        state = state.replace(progress=state.progress.replace(epoch=epoch + 1, batch_in_epoch=0))
        print(f"epoch {epoch + 1:3d}  loss {float(out.loss):.4f}  "
              f"val_acc {evaluate(eval_step, state, val):.4f}")
    test_acc = evaluate(eval_step, state, test)
    print(f"test_acc={test_acc:.4f}")
    return test_acc


if __name__ == "__main__":
    main()
