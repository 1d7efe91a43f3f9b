"""The loops' own part of the training state, kept in ``TrainState.extra["loop"]``.

Everything a loop decision depends on lives here or in ``Progress``, so a run resumed from a
checkpoint takes the same decisions as one never interrupted: whether a stop was requested,
the values callbacks see (Lightning's ``callback_metrics``), the training epoch's metric
accumulators and how each name is reported, the per-dataloader counters of evaluation step
logging, and when the data was last reloaded. Wall-clock time is deliberately not here (it
is no function of the computation); the driver keeps it in checkpoint metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from purestep.engine.state import TrainState
from purestep.engine.tree import field, struct

from .aggregate import MetricSpec

__all__ = ["LoopState", "get", "put"]

KEY = "loop"


@struct
class LoopState:
    should_stop: bool = False
    callback_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    train_epoch: dict[str, Any] = field(default_factory=dict)
    train_specs: dict[str, MetricSpec] = field(default_factory=dict)
    eval_steps: dict[str, int] = field(default_factory=dict)
    last_train_reload: int | None = None
    last_val_reload: int | None = None


def get(state: TrainState) -> LoopState:
    """The loop state inside ``state`` (a fresh one if the state has none yet)."""
    loop = state.extra.get(KEY)
    return loop if loop is not None else LoopState()


def put(state: TrainState, loop: LoopState) -> TrainState:
    """``state`` with ``loop`` as its loop state."""
    return state.replace(extra={**state.extra, KEY: loop})
