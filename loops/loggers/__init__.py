"""Loggers: where the loop drivers send metrics, hyper-parameters and text.

``CSVLogger`` (``metrics.csv`` + ``hparams.yaml``), ``TensorBoardLogger`` (tensorboardX event
files) and ``MemoryLogger`` (Python lists, for tests) share the ``Logger`` contract;
``LoggerCollection`` fans calls out to several; ``create_loggers`` reads the Trainer's
``logger`` flag. File loggers write into versioned run folders (``folders``) on any fsspec
path, and resume a killed run through ``state()`` / ``restore(state)``; they claim a new
version folder atomically and never write through a symbolic link planted in a run folder
(``run_files``: ``LinkRefusedError``). ``MLFlowLogger`` and ``WandbLogger`` log to those
services (the extras ``purestep[mlflow]`` and ``purestep[wandb]``); their modules import
``mlflow`` / ``wandb`` only when a logger first talks to its backend, so importing purestep
never imports them.

Every name is imported on first use (as in ``purestep.loops``): ``from
purestep.loops.loggers import Logger`` or ``CSVLogger`` does not import tensorboardX
(``TensorBoardLogger`` and ``LoggerCollection``, which builds the default one, do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from purestep.engine.lazy import exports

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from .base import STATUSES, FolderLogger, Logger
    from .collection import LoggerCollection, create_loggers
    from .csv import CSVLogger
    from .folders import RunFolder, next_version, run_dir
    from .hparams_yaml import dump_yaml, load_yaml
    from .memory import MemoryLogger
    from .mlflow import MLFlowLogger
    from .run_files import LinkRefusedError
    from .tensorboard import TensorBoardLogger
    from .wandb import WandbLogger

#: The module of each name (imported when the name is first looked up).
_LAZY: dict[str, str] = {
    "STATUSES": ".base",
    "FolderLogger": ".base",
    "Logger": ".base",
    "LoggerCollection": ".collection",
    "create_loggers": ".collection",
    "CSVLogger": ".csv",
    "LinkRefusedError": ".run_files",
    "RunFolder": ".folders",
    "next_version": ".folders",
    "run_dir": ".folders",
    "dump_yaml": ".hparams_yaml",
    "load_yaml": ".hparams_yaml",
    "MemoryLogger": ".memory",
    "MLFlowLogger": ".mlflow",
    "TensorBoardLogger": ".tensorboard",
    "WandbLogger": ".wandb",
}

__all__ = [
    "STATUSES",
    "CSVLogger",
    "FolderLogger",
    "LinkRefusedError",
    "Logger",
    "LoggerCollection",
    "MLFlowLogger",
    "MemoryLogger",
    "RunFolder",
    "TensorBoardLogger",
    "WandbLogger",
    "create_loggers",
    "dump_yaml",
    "load_yaml",
    "next_version",
    "run_dir",
]


__getattr__, __dir__ = exports(__name__, _LAZY, globals())
