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

import importlib as _importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
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
    from .loops import DataModule, Task, Trainer, Tuner, callbacks, data, loggers
    from .loops.command_line import cli
    from .loops.lightning import LightningModule
    from .loops.seeding import seed_everything

# Where each entry point lives. They are imported on first use, so ``import purestep.engine``
# (a DataLoader worker, a DDP rank) does not pay for the loops' loggers and progress bars.
_ENTRY_POINTS = {
    "engine": ("purestep.engine", None),
    "hardware": ("purestep.hardware", None),
    "loops": ("purestep.loops", None),
    **{
        name: ("purestep.engine", name)
        for name in (
            "TrainState",
            "checkpoint",
            "eval_step",
            "init",
            "metrics",
            "optim",
            "predict_step",
            "rng",
            "to_module",
            "train_step",
        )
    },
    **{
        name: ("purestep.loops", name)
        for name in ("DataModule", "Task", "Trainer", "Tuner", "callbacks", "data", "loggers")
    },
    "seed_everything": ("purestep.loops.seeding", "seed_everything"),
    "LightningModule": ("purestep.loops.lightning", "LightningModule"),
    # jsonargparse (the cli extra) loads when it is called
    "cli": ("purestep.loops.command_line", "cli"),
}


def _version() -> str:
    """The installed distribution's version (importlib.metadata, read on first use: it
    costs an import and a scan of the installed packages that most runs never need)."""
    from importlib import metadata

    try:
        return metadata.version("purestep")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        version = globals()["__version__"] = _version()
        return version
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module 'purestep' has no attribute {name!r}")
    module_name, attribute = _ENTRY_POINTS[name]
    module = _importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ENTRY_POINTS, "__version__"})


__all__ = [
    "DataModule",
    "LightningModule",
    "Task",
    "TrainState",
    "Trainer",
    "Tuner",
    "__version__",
    "callbacks",
    "checkpoint",
    "cli",
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
    "seed_everything",
    "to_module",
    "train_step",
]
