"""Measuring a run: profilers of the loops' actions, and the base class of monitors.

``Trainer(profiler="simple" | "advanced" | "pytorch")`` or a ``Profiler`` object
(``SimpleProfiler``, ``AdvancedProfiler``, ``PyTorchProfiler``, or your own subclass of
``Profiler``); ``resolve`` turns the flag into a profiler. Without one the loops run their
unprofiled code paths (``PassThroughProfiler`` is what ``trainer.profiler`` is then). The
actions the loops time are listed in ``ACTIONS``. ``Monitor`` is the base class of the
observers that log measurements (``ThroughputMonitor``, ``DeviceStatsMonitor``).
"""

from __future__ import annotations

from typing import Any

from .advanced import AdvancedProfiler
from .base import PassThroughProfiler, Profiler
from .monitor import Monitor
from .pytorch import STEP_ACTIONS, PyTorchProfiler
from .simple import SimpleProfiler, parse_report
from .wrappers import ProfiledTrainStep, section

__all__ = [
    "ACTIONS",
    "PROFILERS",
    "STEP_ACTIONS",
    "AdvancedProfiler",
    "Monitor",
    "PassThroughProfiler",
    "ProfiledTrainStep",
    "Profiler",
    "PyTorchProfiler",
    "SimpleProfiler",
    "active",
    "parse_report",
    "resolve",
    "section",
]

#: ``Trainer(profiler=<name>)`` -> the profiler class.
PROFILERS = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}

#: The actions the loops time (``{stage}`` and ``{key}.{event}`` filled in).
ACTIONS = (
    "run_training_epoch",
    "run_training_batch",
    "[FitLoop].train_dataloader_next",
    "training_step",  # forward and backward
    "optimizer_step",
    "run_sanity_check",
    "run_validation",
    "run_test",
    "run_predict",
    "[EvaluationLoop].val_next",
    "[EvaluationLoop].test_next",
    "[PredictionLoop].predict_next",
    "validation_step",
    "test_step",
    "predict_step",
    "[Callback]{key}.{event}",
    "[Observer]{name}.{event}",
    "[Logger]{name}.log_metrics",
    "save_checkpoint",
)


def resolve(profiler: Any) -> Profiler:
    """The profiler a ``Trainer(profiler=...)`` flag names: None -> ``PassThroughProfiler``,
    ``"simple"`` / ``"advanced"`` / ``"pytorch"`` (any case) -> a new one, a ``Profiler``
    as it is."""
    if profiler is None:
        return PassThroughProfiler()
    if isinstance(profiler, Profiler):
        return profiler
    if isinstance(profiler, str):
        cls = PROFILERS.get(profiler.lower())
        if cls is not None:
            return cls()
    hint = ""
    if isinstance(profiler, type) and issubclass(profiler, Profiler):
        hint = f" (a class: pass an instance, {profiler.__name__}())"
    raise ValueError(
        f"profiler must be None, one of {', '.join(map(repr, PROFILERS))} or a "
        f"loops.profiling.Profiler, got {profiler!r}{hint}"
    )


def active(profiler: Profiler | None) -> Profiler | None:
    """``profiler`` if it measures anything, else None (the loops' one check per run)."""
    if profiler is None or isinstance(profiler, PassThroughProfiler):
        return None
    return profiler
