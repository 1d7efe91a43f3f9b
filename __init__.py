"""purestep: a functional, stateless training engine for PyTorch.

The whole training state is an immutable pytree passed through pure step functions. The
three subpackages are ``purestep.engine`` (state, keys, optimizers, pure steps, checkpoints),
``purestep.loops`` (data order, loop decisions, callbacks, loggers, the ``Trainer``) and
``purestep.hardware`` (strategies: precision, DDP, ensembles, launch). This module offers the
everyday entry points, so a script needs only ``import purestep``.

This file is the package root: ``pyproject.toml`` maps the repository root to ``purestep``,
so the folders ``engine/``, ``loops/`` and ``hardware/`` install as its subpackages.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from . import engine, hardware, loops
from .engine import (
    TrainState,
    checkpoint,
    eval_step,
    init,
    metrics,
    optim,
    predict_step,
    rng,
    to_module,
    train_step,
)
from .loops import DataModule, Task, Trainer, callbacks, data, loggers

try:
    __version__ = _metadata.version("purestep")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "DataModule",
    "Task",
    "TrainState",
    "Trainer",
    "__version__",
    "callbacks",
    "checkpoint",
    "data",
    "engine",
    "eval_step",
    "hardware",
    "init",
    "loggers",
    "loops",
    "metrics",
    "optim",
    "predict_step",
    "rng",
    "to_module",
    "train_step",
]
