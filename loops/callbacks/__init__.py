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
"""

from .base import Callback, init_states
from .checkpoint import ModelCheckpoint
from .device_stats import DeviceStatsMonitor
from .early_stopping import EarlyStopping, StoppingReason
from .ema import EMA
from .lambda_callback import LambdaCallback
from .lr_monitor import Injected, LearningRateMonitor, find_hyperparams, should_log_step
from .model_summary import LayerSummary, ModelSummary, Totals, layer_summaries, summarize, totals
from .prediction_writer import PredictionWriter, merge_predictions
from .progress_bar import ProgressBar, ProgressBarBase
from .rich_progress import RichProgressBar
from .swa import StochasticWeightAveraging
from .throughput import Throughput, ThroughputMonitor
from .timer import Timer, parse_duration

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
