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
Every name is imported on first use (``import purestep.loops`` loads nothing else), among
them ``testing`` (hypothesis strategies; needs the ``test`` extra) and ``cli`` (the
config-file command line, in ``loops.command_line``; needs the ``cli`` extra).

Note: the names ``fit``, ``evaluate`` and ``predict`` are the functions; the modules of the
same names stay importable (``from purestep.loops.fit import FitLoop``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from purestep.engine.lazy import exports

#: Where each name lives: ``name -> (module, attribute)``, the module itself when the
#: attribute is None. Everything is imported on first use, so ``import
#: purestep.loops.command_line`` (``python -m purestep fit --help``) loads only what the
#: command line needs, not the loggers, the callbacks and the tuner as well.
_LAZY: dict[str, tuple[str, str | None]] = {
    **{
        name: (f".{name}", None)
        for name in (
            "callbacks",
            "data",
            "lightning",
            "loggers",
            "profiling",
            "schedule",
            "testing",  # needs hypothesis (the test extra)
            "tuning",
        )
    },
    "log": (".aggregate", "log"),
    "FLAG_NAMES": (".config", "FLAG_NAMES"),
    "LoopConfig": (".config", "LoopConfig"),
    **{n: (".data", n) for n in ("Batches", "as_list", "batches", "combine", "keyed", "source")},
    "Driver": (".driver", "Driver"),
    **{n: (".evaluate", n) for n in ("evaluate", "run_evaluation", "test", "validate")},
    **{
        n: (".events", n)
        for n in (
            "EVENTS",
            "FIT_EVENTS",
            "PREDICT_EVENTS",
            "TEST_EVENTS",
            "VALIDATE_EVENTS",
            "Context",
            "Requests",
            "Stage",
            "dispatch",
        )
    },
    **{n: (".fit", n) for n in ("FitLoop", "NonFiniteLossError", "fit")},
    "LoopState": (".loop_state", "LoopState"),
    **{n: (".multi_optim", n) for n in ("MultiStep", "OptimizerHandle")},
    **{n: (".predict", n) for n in ("predict", "run_prediction")},
    **{n: (".seeding", n) for n in ("reset_seed", "seed_everything")},
    **{n: (".task", n) for n in ("DataModule", "Task", "task_callback")},
    **{n: (".trainer", n) for n in ("Trainer", "TrainerStatus")},
    "Tuner": (".tuning", "Tuner"),
    # the command line: jsonargparse (the cli extra) loads when it is called
    "cli": (".command_line", "cli"),
}

#: Functions named like the module that holds them (``loops.fit`` is the function): when
#: the module is first imported, by anyone, the import system binds it on this package;
#: the function is bound instead, as the eager ``from .fit import fit`` did.
_SHADOWED = frozenset({"fit", "evaluate", "predict"})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

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
    "lightning",
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


__getattr__, __dir__ = exports(__name__, _LAZY, globals())
