"""Small models, data and a state digest shared by the engine tests."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from purestep.engine import tree


def mlp(seed: int = 0, dropout: float = 0.0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers.append(nn.ReLU())
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(16, 3))
    return nn.Sequential(*layers)


def batches(n: int, seed: int = 0, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(n)
    ]


def loss_fn(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def sign_data(n: int = 32, seed: int = 0) -> TensorDataset:
    """``n`` samples of 8 features labelled by the sign of the first: a task the Trainer
    tests learn in a few steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def sign_loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def clone_tree(t):
    return tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, t)


def digest(t) -> str:
    """A hash of every leaf's path, dtype, shape and bytes: equal digests mean equal trees."""
    h = hashlib.sha256()
    for path, leaf in tree.flatten_with_paths(t):
        h.update(path.encode())
        if isinstance(leaf, torch.Tensor):
            x = leaf.detach().contiguous().cpu()
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


ROOT = Path(__file__).resolve().parent.parent


def run_job(job: Path, folder: Path, *args: str) -> subprocess.CompletedProcess:
    """Run a job script of tests/ in ``folder`` (created) with the repository importable;
    the kill-and-resume tests start their runs this way."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(job), *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
