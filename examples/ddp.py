"""Train the digits MLP data-parallel: every rank takes its shard, gradients are averaged.

Run it either way (the global batch is split evenly across the ranks)::

    torchrun --nproc_per_node=2 examples/ddp.py
    python examples/ddp.py --spawn 2          # hardware.launch: no torchrun needed

Each rank builds the same state (``hardware.ddp()`` broadcasts rank 0's initial parameters
and checks the seed), iterates its own shard of every epoch (``loops.data.source`` with the
strategy's rank and world size: DistributedSampler semantics, deterministic in (seed,
epoch)), and ``engine.train_step`` averages the gradients across ranks once per step.
Accuracies are computed on each rank's shard and merged with ``sync_metrics`` (as with
DistributedSampler, a set whose size is not a multiple of the world size is padded by
repeating its first samples). Rank 0 prints; the last line is ``test_acc=<x>``.
"""

from __future__ import annotations

import argparse
import os

from digits import load, loss_fn  # examples/digits.py: the same data split and loss
from torch import nn

from purestep import engine, hardware, loops, seed_everything
from purestep.engine import metrics, optim, rng


def evaluate(strategy, step, state, data, batch_size: int = 128) -> float:
    """Accuracy over ``data``: each rank scores its shard, the counts are summed."""
    shard = loops.data.source(data, batch_size=batch_size, **strategy.data_options())
    total = None
    for i, batch in enumerate(shard.iterate(0)):
        total = metrics.merge(total, {"acc": step(state, batch, index=i)["acc"]})
    return float(metrics.compute(strategy.sync_metrics(total))["acc"])


def train(rank: int | None, args: argparse.Namespace) -> float:
    """One rank's run (``rank`` is given by hardware.launch; torchrun sets it in the env)."""
    strategy = hardware.ddp(device=args.device)
    if args.batch_size % strategy.world_size:
        raise ValueError(
            f"--batch-size {args.batch_size} is not divisible by {strategy.world_size} ranks"
        )
    say = print if strategy.is_primary else (lambda *a, **k: None)
    train_set, val_set, test_set = load(args.seed)
    seed_everything(args.seed)  # every rank builds the same template (rank 0's is broadcast)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
    opt = optim.adamw(args.lr, weight_decay=1e-4)
    state = engine.init(net, opt, seed=args.seed, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy)
    eval_step = engine.eval_step(net, loss_fn, strategy=strategy)
    batches = loops.data.source(
        train_set,
        batch_size=args.batch_size // strategy.world_size,  # the global batch, split
        shuffle=True,
        seed=rng.fold_in(state.rng, rng.Purpose.DATA),
        **strategy.data_options(),
    )
    per_rank = args.batch_size // strategy.world_size
    say(f"{strategy!r}: {len(batches)} batches of {per_rank} per epoch")
    for epoch in range(args.epochs):
        losses = None
        for batch in batches.iterate(epoch):
            state, out = step(state, batch)
            losses = metrics.merge(losses, {"loss": metrics.Mean.of(out.loss)})
        state = state.replace(progress=state.progress.replace(epoch=epoch + 1, batch_in_epoch=0))
        loss = float(metrics.compute(strategy.sync_metrics(losses))["loss"])
        val_acc = evaluate(strategy, eval_step, state, val_set)
        say(f"epoch {epoch + 1:3d}  loss {loss:.4f}  val_acc {val_acc:.4f}", flush=True)
    if not strategy.in_sync(state):
        raise RuntimeError("the ranks' states drifted apart")
    test_acc = evaluate(strategy, eval_step, state, test_set)
    strategy.close()
    return test_acc


def main(argv: list[str] | None = None) -> float | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (all ranks)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if any, else cpu")
    parser.add_argument("--spawn", type=int, default=0, metavar="N", help="start N local ranks")
    args = parser.parse_args(argv)
    if args.spawn:
        test_acc = hardware.launch(train, args.spawn, args)[0]
    else:  # started by torchrun: this process is one rank
        test_acc = train(None, args)
        if os.environ.get("RANK", "0") != "0":
            return None
    print(f"test_acc={test_acc:.4f}", flush=True)
    return test_acc


if __name__ == "__main__":
    main()
