"""Pure callbacks: state in ``TrainState.callbacks``, effects requested through ``Requests``.

``Callback`` and ``init_states`` are the contract (``base``); the built-in callbacks are
``EarlyStopping``, ``ModelCheckpoint``, ``LearningRateMonitor``, ``Timer``, ``ModelSummary`` and
``LambdaCallback``. ``ProgressBar`` draws, so it is an event observer, not a callback.
"""

from .base import Callback, init_states
from .checkpoint import ModelCheckpoint
from .early_stopping import EarlyStopping, StoppingReason
from .lambda_callback import LambdaCallback
from .lr_monitor import Injected, LearningRateMonitor, find_hyperparams, should_log_step
from .model_summary import LayerSummary, ModelSummary, Totals, layer_summaries, summarize, totals
from .progress_bar import ProgressBar
from .timer import Timer, parse_duration

__all__ = [
    "Callback",
    "EarlyStopping",
    "Injected",
    "LambdaCallback",
    "LayerSummary",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "StoppingReason",
    "Timer",
    "Totals",
    "find_hyperparams",
    "init_states",
    "layer_summaries",
    "parse_duration",
    "should_log_step",
    "summarize",
    "totals",
]
