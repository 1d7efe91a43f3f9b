"""Train an MLP on scikit-learn's bundled 8x8 digits with the Trainer.

A 60 / 20 / 20 % train / validation / test split, a progress bar, TensorBoard logs and
checkpoints under ``runs/digits/tensorboard/version_N``, CSV logs under
``runs/digits/csv/version_N``; the run is a pure function of ``--seed``. The last
line printed is ``test_acc=<x>``. ``--resume`` continues from the furthest checkpoint of the
latest run.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import metrics, optim, rng
from purestep.loops import Trainer, seed_everything
from purestep.loops.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from purestep.loops.loggers import CSVLogger, TensorBoardLogger


def load(seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``(x, y)`` tensors for train / val / test (60 / 20 / 20 %), pixels scaled to [0, 1]."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=rng.generator(rng.key(seed)))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return (x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:])


def splits(seed: int = 0) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """The same split as ``load`` as datasets."""
    return tuple(TensorDataset(x, y) for x, y in load(seed))


def loss_fn(apply, batch):
    """Cross-entropy, with the accuracy merged exactly over each epoch."""
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": metrics.Accuracy.of(logits, y)}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="runs/digits")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)

    seed_everything(args.seed)  # the template's initial weights below
    train, val, test = splits(args.seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
    steps = args.epochs * -(-len(train) // args.batch_size)
    schedule = optim.schedules.warmup_cosine(args.lr, steps // 20, steps, end_value=args.lr / 20)
    opt = optim.inject_hyperparams(optim.adamw)(lr=schedule, weight_decay=1e-4)

    trainer = Trainer(
        max_epochs=args.epochs,
        default_root_dir=args.root,
        logger=[TensorBoardLogger(args.root, name="tensorboard"), CSVLogger(args.root, name="csv")],
        callbacks=[
            ModelCheckpoint(monitor="val_acc", mode="max", save_last=True),
            EarlyStopping("val_loss", patience=8),
            LearningRateMonitor(),
        ],
        log_every_n_steps=10,
        enable_progress_bar=not args.no_progress_bar,
    )
    state = trainer.fit(
        net,
        loss_fn,
        opt,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=256),
        seed=args.seed,
        ckpt_path="last" if args.resume else None,
    )
    (result,) = trainer.test(state, DataLoader(test, batch_size=256), verbose=False)
    print(f"logs and checkpoints in {trainer.log_dir}")
    print(f"test_acc={result['test_acc']:.4f}")
    return result["test_acc"]


if __name__ == "__main__":
    main()
