"""Pure, optax-style gradient transformations with torch.optim's numerics.

A ``GradientTransformation`` is ``init(params) -> state`` and ``update(updates, state,
params) -> (updates, state)`` over dicts ``name -> tensor``, plus an optional fused
``apply``; ``step(tx, grads, state, params)`` runs one optimizer step. The named optimizers
(``sgd``, ``adam``, ``adamw``, ``rmsprop``, ``adagrad``) take torch's arguments and defaults
and their ``step`` is bitwise equal to ``torch.optim.X(foreach=True)``. Transforms compose
with ``chain`` and the wrappers (``accumulate``, ``skip_nonfinite``, ``inject_hyperparams``,
``masked``, ``partition``). Learning-rate schedules live in ``optim.schedules`` (its
``schedules.step`` is the StepLR-like schedule; ``optim.step`` applies a transform).
``from_torch(torch.optim.NAdam, lr=...)`` runs any ``torch.optim.Optimizer`` subclass as a
pure transform, bitwise equal to driving it by hand; ``as_transformation`` turns what the
Trainer accepts as an optimizer (a transform, a torch optimizer class or a
``functools.partial`` of one) into a transform. ``from_torch_scheduler(sched)`` translates a
``torch.optim.lr_scheduler`` object into a ``TorchSchedule`` (its learning rates, and cycled
momenta, after ``k`` steps, bitwise torch's) or, for ``ReduceLROnPlateau``, the engine's.

States are ``@struct`` pytrees holding tensors and plain int counters. Nothing here modifies
its inputs except under ``donating()``, which lets the built-in transforms reuse the
storage of the updates, their state and the params (the inputs are then consumed), or
``owning_updates()``, which lets them overwrite the incoming updates only. Under
``differentiable()`` they keep the update's autograd graph (``engine.differentiable``).
"""

from . import schedules
from .accumulate import AccumulateState, accumulate
from .adagrad import AdagradState, adagrad
from .adam import AdamState, adam, adamw
from .base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    Updates,
    apply_updates,
    chain,
    differentiable,
    donating,
    identity,
    is_differentiable,
    is_donating,
    owning_updates,
    owns_updates,
    set_to_zero,
    step,
)
from .clipping import clip_by_global_norm, clip_by_value, global_norm
from .coerce import as_transformation
from .from_torch import TorchOptimizerState, from_torch
from .hyperparams import InjectHyperparamsState, inject_hyperparams
from .masking import MaskedState, PartitionState, decay_mask, masked, partition
from .multi import MultiOptState, find_injected, injected_values, set_hyperparams
from .nonfinite import NonFiniteError, SkipNonFiniteState, all_finite, skip_nonfinite
from .plateau import PlateauState, ReduceLROnPlateau
from .rmsprop import RMSpropState, rmsprop
from .scaling import ScaleByScheduleState, scale, scale_by_schedule
from .schedules import Schedule
from .sgd import SGDState, sgd
from .torch_schedules import TorchSchedule, from_torch_scheduler
from .weight_decay import add_decayed_weights

__all__ = [
    "AccumulateState",
    "AdagradState",
    "AdamState",
    "EmptyState",
    "GradientTransformation",
    "InjectHyperparamsState",
    "MaskedState",
    "MultiOptState",
    "NonFiniteError",
    "OptState",
    "Params",
    "PartitionState",
    "PlateauState",
    "RMSpropState",
    "ReduceLROnPlateau",
    "SGDState",
    "ScaleByScheduleState",
    "Schedule",
    "SkipNonFiniteState",
    "TorchOptimizerState",
    "TorchSchedule",
    "Updates",
    "accumulate",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_updates",
    "as_transformation",
    "chain",
    "clip_by_global_norm",
    "clip_by_value",
    "decay_mask",
    "differentiable",
    "donating",
    "find_injected",
    "from_torch",
    "from_torch_scheduler",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "injected_values",
    "is_differentiable",
    "is_donating",
    "owning_updates",
    "owns_updates",
    "masked",
    "partition",
    "rmsprop",
    "scale",
    "scale_by_schedule",
    "schedules",
    "set_hyperparams",
    "set_to_zero",
    "sgd",
    "skip_nonfinite",
    "step",
]
