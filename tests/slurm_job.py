"""One task of a simulated two-node SLURM job (run as a script; tests/test_slurm_requeue.py).

The test starts two of these with the variables ``srun`` would set (``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_NODELIST`` ...) and none of torchrun's; ``Trainer(strategy="ddp")``
must find its rank and rank 0's address from them. ``--signal-rank R --signal-batch N``:
rank R sends itself SIGUSR1 at its N-th train batch (SLURM's ``--signal=USR1@90``).
``--resume``: ``ckpt_path="last"``. ``--explicit``: pass the cluster environment as
Lightning does, ``plugins=[SLURMEnvironment()]``. Rank 0 saves the final parameters to
``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from purestep.engine import optim
from purestep.hardware.cluster import SLURMEnvironment
from purestep.loops import Trainer
from purestep.loops.callbacks import LambdaCallback


def loss_fn(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--signal-rank", type=int, default=None)
    parser.add_argument("--signal-batch", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--explicit", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seen = {"batches": 0}

    def maybe_signal(ctx):
        seen["batches"] += 1
        if ctx.rank == args.signal_rank and seen["batches"] == args.signal_batch:
            os.kill(os.getpid(), signal.SIGUSR1)
        return None

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    plugins = {"plugins": [SLURMEnvironment()]} if args.explicit else {}
    trainer = Trainer(
        max_epochs=2,
        strategy="ddp",
        default_root_dir="run",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[LambdaCallback(on_train_batch_end=maybe_signal)],
        **plugins,
    )
    cluster = trainer.strategy.cluster
    print(f"rank={trainer.strategy.rank} cluster={type(cluster).__name__}", flush=True)
    try:
        state = trainer.fit(
            net,
            loss_fn,
            optim.adam(1e-2),
            DataLoader(data, batch_size=4, shuffle=True),
            seed=5,
            ckpt_path="last" if args.resume else None,
        )
    finally:
        print(f"ran_batches={seen['batches']}", flush=True)
    if trainer.strategy.is_primary:
        torch.save(dict(state.params), args.out)
    print(f"finished step={state.progress.step}", flush=True)


if __name__ == "__main__":
    main()
