"""Loop compositions over the engine's pure steps: fit, validate, test, predict, the Trainer.

The pieces, from the bottom up: deterministic data order (``source``, ``batches``,
``combine``, ``as_list``, ``keyed``); the loop flags (``LoopConfig``) and every loop decision
as a pure function (``schedule``); events, the read-only ``Context`` and ``Requests`` that
pure ``callbacks`` return; ``loggers``; the ``Driver`` that carries out effects; the
compositions ``fit`` / ``FitLoop``, ``validate``, ``test``, ``run_evaluation``, ``predict``,
``run_prediction``; ``profiling`` (profilers of the loops' actions, the ``Monitor`` base of
observers that log measurements); and the Lightning-shaped ``Trainer`` with ``Task`` and
``DataModule`` (several optimizers: ``MultiStep``, the manual-optimization
``OptimizerHandle``; ``optimizers`` and ``schedulers`` read ``configure_optimizers``), and
its ``Tuner`` (``tuning``: learning-rate finder, batch-size scaler).
``seed_everything`` seeds the global generators the user's own code draws from (building
the model, making data) and records the seed that ``Trainer.fit`` defaults to.
``log(value, on_step=..., on_epoch=...)`` chooses how a value a step returns is logged.
``testing`` (hypothesis strategies; needs the ``test`` extra) is imported on first use, and
so is ``cli`` (the config-file command line, in ``loops.command_line``; needs the ``cli``
extra).

Note: the names ``fit``, ``evaluate`` and ``predict`` are the functions; the modules of the
same names stay importable (``from purestep.loops.fit import FitLoop``).
"""

from __future__ import annotations

from typing import Any

from . import callbacks, data, loggers, profiling, schedule, tuning
from .aggregate import log
from .config import FLAG_NAMES, LoopConfig
from .data import Batches, as_list, batches, combine, keyed, source
from .driver import Driver
from .evaluate import evaluate, run_evaluation, test, validate
from .events import (
    EVENTS,
    FIT_EVENTS,
    PREDICT_EVENTS,
    TEST_EVENTS,
    VALIDATE_EVENTS,
    Context,
    Requests,
    Stage,
    dispatch,
)
from .fit import FitLoop, NonFiniteLossError, fit
from .loop_state import LoopState
from .multi_optim import MultiStep, OptimizerHandle
from .predict import predict, run_prediction
from .seeding import reset_seed, seed_everything
from .task import DataModule, Task, task_callback
from .trainer import Trainer, TrainerStatus
from .tuning import Tuner

__all__ = [
    "EVENTS",
    "FIT_EVENTS",
    "FLAG_NAMES",
    "PREDICT_EVENTS",
    "TEST_EVENTS",
    "VALIDATE_EVENTS",
    "Batches",
    "Context",
    "DataModule",
    "Driver",
    "FitLoop",
    "LoopConfig",
    "LoopState",
    "MultiStep",
    "NonFiniteLossError",
    "OptimizerHandle",
    "Requests",
    "Stage",
    "Task",
    "Trainer",
    "TrainerStatus",
    "Tuner",
    "as_list",
    "batches",
    "callbacks",
    "cli",
    "combine",
    "data",
    "dispatch",
    "evaluate",
    "fit",
    "keyed",
    "log",
    "loggers",
    "predict",
    "profiling",
    "run_evaluation",
    "run_prediction",
    "reset_seed",
    "schedule",
    "seed_everything",
    "source",
    "task_callback",
    "test",
    "testing",
    "tuning",
    "validate",
]


def __getattr__(name: str) -> Any:
    if name == "testing":  # needs hypothesis, so only imported when asked for
        import importlib

        return importlib.import_module(".testing", __name__)
    if name == "cli":  # the command line (jsonargparse, the cli extra, loads when it is called)
        import importlib

        function = importlib.import_module(".command_line", __name__).cli
        globals()["cli"] = function  # later look-ups skip this function
        return function
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
