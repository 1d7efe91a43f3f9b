"""Pure callbacks: state in ``TrainState.callbacks``, effects requested through ``Requests``.

``Callback`` and ``init_states`` are the contract (``base``); the built-in callbacks are
``EarlyStopping``, ``ModelCheckpoint``, ``LearningRateMonitor``, ``Timer``, ``ModelSummary`` and
``LambdaCallback``. ``ProgressBar`` (tqdm) and ``RichProgressBar`` (rich, an optional extra)
draw, so they are event observers (``ProgressBarBase``), not callbacks; the Trainer takes
one in ``callbacks=[...]`` all the same.
"""

from .base import Callback, init_states
from .checkpoint import ModelCheckpoint
from .early_stopping import EarlyStopping, StoppingReason
from .lambda_callback import LambdaCallback
from .lr_monitor import Injected, LearningRateMonitor, find_hyperparams, should_log_step
from .model_summary import LayerSummary, ModelSummary, Totals, layer_summaries, summarize, totals
from .progress_bar import ProgressBar, ProgressBarBase
from .rich_progress import RichProgressBar
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
    "ProgressBarBase",
    "RichProgressBar",
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
