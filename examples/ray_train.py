"""Train data-parallel under Ray Train: the same script on a laptop and on a Ray cluster.

On a laptop it starts a local Ray cluster; given a cluster's address it joins that one::

    python examples/ray_train.py                          # local cluster, 2 workers
    python examples/ray_train.py --num-workers 4 --epochs 10
    python examples/ray_train.py --address auto --num-workers 8 \\
        --storage-path /shared/ray_results                # on a node of a running cluster
    ray job submit --address http://HEAD_IP:8265 --working-dir . -- \\
        python examples/ray_train.py --num-workers 8 --storage-path /shared/ray_results

Each Ray worker runs ``train_fn``: a ``Trainer(strategy="ddp")`` that joins the process
group Ray formed, reports every epoch to Ray with rank 0's purestep checkpoint
(``ray_train_report``), and resumes from Ray's latest checkpoint when Ray restarts the
worker group (``ray_ckpt_path``; ``--max-failures``): the run then ends bitwise equal to
one never interrupted. The data is a synthetic classification problem made from the seed,
so nothing is downloaded. The last line printed is ``val_loss=<x>``.
"""

from __future__ import annotations

import argparse
import os
import sys

import ray
import torch
import torch.nn.functional as F
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.loops import Trainer
from purestep.loops.integrations.ray_train import ray_ckpt_path, ray_train_report
from purestep.loops.loggers import CSVLogger


def dataset(n: int, seed: int) -> TensorDataset:
    """Points labelled by the nearest of 4 fixed centres (a problem a small MLP learns)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 16, generator=torch.Generator().manual_seed(1234)) * 2
    x = torch.randn(n, 16, generator=g) + centres[torch.randint(0, 4, (n,), generator=g)]
    return TensorDataset(x, torch.cdist(x, centres).argmin(-1))


def loss_fn(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def train_fn(config: dict) -> None:
    """One Ray worker's part of the run (every worker runs it; Ray sets the ranks)."""
    torch.manual_seed(config["seed"])  # every rank builds the same template (checked)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    trainer = Trainer(
        strategy="ddp",
        max_epochs=config["epochs"],
        default_root_dir=config["root"],
        callbacks=ray_train_report(["val_loss", "val_acc"]),
        logger=CSVLogger(config["root"]),  # written by rank 0
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,  # Ray keeps the reported checkpoints
        num_sanity_val_steps=0,
    )
    # the batch size is per worker: the global batch is num_workers times larger
    train = DataLoader(dataset(config["samples"], config["seed"]), batch_size=32, shuffle=True)
    val = DataLoader(dataset(512, config["seed"] + 1), batch_size=128)
    trainer.fit(
        model,
        loss_fn,
        optim.adamw(3e-3),
        train,
        val,
        seed=config["seed"],
        ckpt_path=ray_ckpt_path(),  # None on the first attempt, Ray's latest after a restart
    )


def connect(address: str | None, num_workers: int) -> None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``); else start a local one with a
    CPU per worker."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(address="local", num_cpus=num_workers)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a Ray cluster to join (default: RAY_ADDRESS)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024, help="training samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument("--storage-path", default=os.path.abspath("ray_results"))
    parser.add_argument("--root", default=os.path.abspath("ray_train_runs"))
    parser.add_argument("--name", default="purestep_ray_train")
    args = parser.parse_args(argv)
    connect(args.address, args.num_workers)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={
            "epochs": args.epochs,
            "samples": args.samples,
            "seed": args.seed,
            "root": args.root,
        },
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.gpu),
        run_config=RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()
    print(f"checkpoint: {result.checkpoint.path}", file=sys.stderr)
    val_loss = float(result.metrics["val_loss"])
    print(f"val_acc={result.metrics['val_acc']:.4f}")
    print(f"val_loss={val_loss:.4f}")
    return val_loss


if __name__ == "__main__":
    main()
