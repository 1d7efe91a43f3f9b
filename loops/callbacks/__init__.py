"""Pure callbacks: state in ``TrainState.callbacks``, effects requested through ``Requests``.

``Callback`` and ``init_states`` are the contract (``base``); the built-in callbacks are
``EarlyStopping``, ``ModelCheckpoint``, ``LearningRateMonitor``, ``Timer``, ``ModelSummary`` and
``LambdaCallback``. ``ProgressBar`` (tqdm) and ``RichProgressBar`` (rich, an optional extra)
draw, so they are event observers (``ProgressBarBase``), not callbacks; the Trainer takes
one in ``callbacks=[...]`` all the same. ``StochasticWeightAveraging`` and ``EMA`` keep
their averages in their state (checkpointed with the run).
``ThroughputMonitor`` and ``DeviceStatsMonitor``
read clocks and devices, so they are observers too (``loops.profiling.Monitor``) that log
their measurements through the loggers; the Trainer takes them in ``callbacks=[...]``.

Every name is imported on first use (as in ``purestep.loops``): ``from
purestep.loops.callbacks import EarlyStopping`` loads ``early_stopping`` (and what it
needs), not the averaging, profiling and prediction-writing callbacks as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from purestep.engine.lazy import exports

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from .base import Callback, init_states
    from .checkpoint import ModelCheckpoint
    from .device_stats import DeviceStatsMonitor
    from .early_stopping import EarlyStopping, StoppingReason
    from .ema import EMA
    from .lambda_callback import LambdaCallback
    from .lr_monitor import Injected, LearningRateMonitor, find_hyperparams, should_log_step
    from .model_summary import (
        LayerSummary,
        ModelSummary,
        Totals,
        layer_summaries,
        summarize,
        totals,
    )
    from .prediction_writer import PredictionWriter, merge_predictions
    from .progress_bar import ProgressBar, ProgressBarBase
    from .rich_progress import RichProgressBar
    from .swa import StochasticWeightAveraging
    from .throughput import Throughput, ThroughputMonitor
    from .timer import Timer, parse_duration

#: The module of each name (imported when the name is first looked up).
_LAZY: dict[str, str] = {
    "Callback": ".base",
    "init_states": ".base",
    "ModelCheckpoint": ".checkpoint",
    "DeviceStatsMonitor": ".device_stats",
    "EarlyStopping": ".early_stopping",
    "StoppingReason": ".early_stopping",
    "EMA": ".ema",
    "LambdaCallback": ".lambda_callback",
    "Injected": ".lr_monitor",
    "LearningRateMonitor": ".lr_monitor",
    "find_hyperparams": ".lr_monitor",
    "should_log_step": ".lr_monitor",
    "LayerSummary": ".model_summary",
    "ModelSummary": ".model_summary",
    "Totals": ".model_summary",
    "layer_summaries": ".model_summary",
    "summarize": ".model_summary",
    "totals": ".model_summary",
    "PredictionWriter": ".prediction_writer",
    "merge_predictions": ".prediction_writer",
    "ProgressBar": ".progress_bar",
    "ProgressBarBase": ".progress_bar",
    "RichProgressBar": ".rich_progress",
    "StochasticWeightAveraging": ".swa",
    "Throughput": ".throughput",
    "ThroughputMonitor": ".throughput",
    "Timer": ".timer",
    "parse_duration": ".timer",
}

__all__ = [
    "Callback",
    "DeviceStatsMonitor",
    "EMA",
    "EarlyStopping",
    "Injected",
    "LambdaCallback",
    "LayerSummary",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "PredictionWriter",
    "ProgressBar",
    "ProgressBarBase",
    "RichProgressBar",
    "StochasticWeightAveraging",
    "StoppingReason",
    "Throughput",
    "ThroughputMonitor",
    "Timer",
    "Totals",
    "find_hyperparams",
    "init_states",
    "layer_summaries",
    "merge_predictions",
    "parse_duration",
    "should_log_step",
    "summarize",
    "totals",
]


__getattr__, __dir__ = exports(__name__, _LAZY, globals())
