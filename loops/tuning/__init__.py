"""Tuning before a run: the learning-rate finder and the batch-size scaler (Lightning's
``Tuner``). Both search on a private trainer from the state the next ``fit`` starts from,
and keep nothing from it, so nothing needs restoring afterwards."""

from .attrs import find_attr, get_attr, has_attr, set_attr
from .batch_size import is_oom_error, scale_batch_size
from .flags import check_auto_flags, tune
from .lr_finder import LRFinder, LRSweepCallback, lr_find, sweep_lrs
from .tuner import Tuner

__all__ = [
    "LRFinder",
    "LRSweepCallback",
    "Tuner",
    "find_attr",
    "check_auto_flags",
    "get_attr",
    "has_attr",
    "is_oom_error",
    "lr_find",
    "scale_batch_size",
    "set_attr",
    "sweep_lrs",
    "tune",
]
