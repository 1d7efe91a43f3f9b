"""The functional core of purestep: state pytrees, keys, optimizers and pure step functions."""

from . import checkpoint, compile, metrics, optim, per_sample, rng, tree
from .bind import Binder, canonical_names
from .export import to_module
from .loss_scale import DynamicLossScale, LossScaleState
from .per_sample import PerSampleStep, per_sample_step
from .state import Progress, TrainState, init, materialize, trainable_names
from .step import (
    EvalStep,
    Gradients,
    PredictStep,
    StepOutput,
    TrainStep,
    batch_size,
    eval_step,
    owned_gradients,
    predict_step,
    train_step,
)
from .strategy import Local, Precision, Strategy
from .tree import field, struct

__all__ = [
    "Binder",
    "DynamicLossScale",
    "EvalStep",
    "Gradients",
    "Local",
    "LossScaleState",
    "PerSampleStep",
    "Precision",
    "PredictStep",
    "Progress",
    "StepOutput",
    "Strategy",
    "TrainState",
    "TrainStep",
    "batch_size",
    "canonical_names",
    "checkpoint",
    "compile",
    "eval_step",
    "field",
    "init",
    "materialize",
    "metrics",
    "optim",
    "owned_gradients",
    "per_sample",
    "per_sample_step",
    "predict_step",
    "rng",
    "struct",
    "to_module",
    "train_step",
    "trainable_names",
    "tree",
]
