"""The functional core of purestep: state pytrees, keys, optimizers and pure step functions."""

from . import checkpoint, metrics, optim, per_sample, rng, tree
from .bind import Binder
from .loss_scale import DynamicLossScale, LossScaleState
from .per_sample import PerSampleStep, per_sample_step
from .state import Progress, TrainState, init, trainable_names
from .step import StepOutput, eval_step, predict_step, train_step
from .strategy import Local, Precision, Strategy
from .tree import field, struct

__all__ = [
    "Binder",
    "DynamicLossScale",
    "Local",
    "LossScaleState",
    "Precision",
    "Progress",
    "StepOutput",
    "Strategy",
    "TrainState",
    "checkpoint",
    "eval_step",
    "field",
    "init",
    "metrics",
    "optim",
    "predict_step",
    "rng",
    "struct",
    "train_step",
    "trainable_names",
    "tree",
    "PerSampleStep",
    "per_sample",
    "per_sample_step",
]
