"""The loops' own part of the training state: ``TrainState.loop``, a ``LoopState``.

Everything a loop decision depends on lives here or in ``Progress``, so a run resumed from a
checkpoint takes the same decisions as one never interrupted: whether a stop was requested,
the values callbacks see (Lightning's ``callback_metrics``), the training epoch's metric
accumulators and how each name is reported, the per-dataloader counters of evaluation step
logging, and when the data was last reloaded. Wall-clock time is deliberately not here (it
is no function of the computation); the driver keeps it in checkpoint metadata.

Read and replace it like ``progress``:
``state.replace(loop=state.loop.replace(should_stop=True))``. A state straight from
``engine.init`` has none yet (the engine runs no loop): every loop entry point (``FitLoop``,
``run_evaluation``, the ``Driver``, the Trainer's restore) passes the state through
``ready`` once, which also moves the loop state of a checkpoint written before the field
existed (kept in ``extra["loop"]``) to its place.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from purestep.engine.state import TrainState
from purestep.engine.tree import field, struct

from .aggregate import MetricSpec

__all__ = ["LEGACY_KEY", "LoopState", "get", "put", "ready"]

#: Where checkpoints written before ``TrainState.loop`` existed keep the loop state.
LEGACY_KEY = "loop"


@struct
class LoopState:
    should_stop: bool = False
    callback_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    train_epoch: dict[str, Any] = field(default_factory=dict)
    train_specs: dict[str, MetricSpec] = field(default_factory=dict)
    eval_steps: dict[str, int] = field(default_factory=dict)
    last_train_reload: int | None = None
    last_val_reload: int | None = None


def ready(state: TrainState) -> TrainState:
    """``state`` with its ``loop`` filled in: as it is when it has one; else the loop state
    an older checkpoint kept in ``extra["loop"]`` (moved out of ``extra``), or a fresh one."""
    if state.loop is not None:
        return state
    legacy = state.extra.get(LEGACY_KEY)
    if isinstance(legacy, LoopState):
        extra = {k: v for k, v in state.extra.items() if k != LEGACY_KEY}
        return state.replace(loop=legacy, extra=extra)
    return state.replace(loop=LoopState())


def get(state: TrainState) -> LoopState:
    """Deprecated: read ``ready(state).loop`` (or ``state.loop`` inside a loop)."""
    warnings.warn(
        "loops.loop_state.get(state) is deprecated: the loop state is the field state.loop",
        DeprecationWarning,
        stacklevel=2,
    )
    return ready(state).loop


def put(state: TrainState, loop: LoopState) -> TrainState:
    """Deprecated: ``state.replace(loop=loop)``."""
    warnings.warn(
        "loops.loop_state.put(state, loop) is deprecated: use state.replace(loop=loop)",
        DeprecationWarning,
        stacklevel=2,
    )
    return state.replace(loop=loop)
