"""``seed_everything``: one seed for what the engine's keys do not reach.

Inside a run every random draw comes from the state's key (``engine.rng``): dropout, data
order, DataLoader workers, per-sample augmentations. What happens *before* the run is the
user's code and draws from torch's, numpy's and Python's global generators: building the
model (``nn.Linear`` initialises its weights from torch's generator), making a synthetic
data set, a random split. ``seed_everything(seed)`` seeds those three generators, as
Lightning's function of the same name does, and records the seed in the environment
(``PURESTEP_GLOBAL_SEED``), where spawned ranks and worker processes read it and where
``Trainer.fit`` takes it as its default ``seed``, so one number fixes the whole run.

This module changes global state (that is its purpose), so it lives in ``loops`` with the
other effects, not in the engine.
"""

from __future__ import annotations

import operator
import os
import random
import warnings
from typing import Any

import torch

__all__ = [
    "MAX_SEED",
    "SEED_ENV",
    "SEED_WORKERS_ENV",
    "global_seed",
    "reset_seed",
    "resolve_seed",
    "seed_everything",
]

#: Where the seed is recorded for this process, the ranks and workers it starts.
SEED_ENV = "PURESTEP_GLOBAL_SEED"
#: "1" when ``seed_everything(..., workers=True)`` asked for seeded workers.
SEED_WORKERS_ENV = "PURESTEP_SEED_WORKERS"
#: Lightning's variable, read (never written) when ours is not set, so a process started by
#: Lightning's tooling with a seed keeps it.
LIGHTNING_SEED_ENV = "PL_GLOBAL_SEED"
#: numpy's legacy seeding takes 32-bit seeds; Lightning's bounds.
MAX_SEED = 2**32 - 1


def _checked(seed: Any, where: str) -> int:
    """``seed`` as an int in numpy's range (an int, a numpy integer, or the text of one)."""
    if isinstance(seed, str):
        try:
            seed = int(seed.strip())
        except ValueError:
            raise ValueError(f"{where}: {seed!r} is not an integer seed") from None
    elif isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise TypeError(f"{where}: a seed is an int, got {seed!r}")
    seed = operator.index(seed)
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{where}: seed {seed} is out of bounds (0 to {MAX_SEED}, numpy's range)")
    return seed


def global_seed() -> int | None:
    """The seed ``seed_everything`` recorded for this process (``PURESTEP_GLOBAL_SEED``, or
    Lightning's ``PL_GLOBAL_SEED``), or None when neither is set. A malformed value is a
    ``ValueError`` naming the variable."""
    for name in (SEED_ENV, LIGHTNING_SEED_ENV):
        value = os.environ.get(name)
        if value is not None:
            return _checked(value, f"environment variable {name}")
    return None


def resolve_seed(seed: int | None) -> int:
    """``seed`` itself, or (None) the recorded global seed, or 0: what ``Trainer.fit`` and
    the tuner build their state with."""
    if seed is not None:
        return _checked(seed, "seed")
    found = global_seed()
    return 0 if found is None else found


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed torch (CPU and every CUDA device), numpy and ``random`` with ``seed`` and record
    it in ``PURESTEP_GLOBAL_SEED``; return it. Call it before building the model and the
    data, as in Lightning.

    ``seed=None`` takes the recorded seed (``PURESTEP_GLOBAL_SEED``, then Lightning's
    ``PL_GLOBAL_SEED``: a spawned rank seeds itself as its parent did), else 0 with a
    warning. A seed outside 0..2**32-1, or one that is not an integer, is an error.

    ``workers`` is Lightning's flag and is recorded (``PURESTEP_SEED_WORKERS``), but the
    Trainer seeds DataLoader workers and per-sample augmentations from the run's key
    whether or not it is set: they are deterministic in any case.
    """
    if seed is None:
        found = global_seed()
        if found is None:
            found = 0
            if verbose:
                warnings.warn(
                    "seed_everything(): no seed given or recorded, seed set to 0", stacklevel=2
                )
        seed = found
    else:
        seed = _checked(seed, "seed_everything()")
    os.environ[SEED_ENV] = str(seed)
    os.environ[SEED_WORKERS_ENV] = str(int(bool(workers)))
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device's generator
    return seed


def reset_seed() -> int | None:
    """Seed the generators again with the recorded seed (None and nothing done when none is
    recorded), as Lightning's ``reset_seed``: e.g. at the start of a spawned rank."""
    seed = global_seed()
    if seed is None:
        return None
    workers = os.environ.get(SEED_WORKERS_ENV, "0") == "1"
    return seed_everything(seed, workers=workers, verbose=False)
