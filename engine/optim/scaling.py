"""Multiply updates by a constant or by a schedule of the step count.

``scale(-lr)`` after a direction-producing transform turns it into a descent step;
``scale_by_schedule`` does the same with a changing factor, counting its own updates.
Under ``owning_updates()`` both multiply the incoming updates in place.
"""

from __future__ import annotations

from typing import Any

import torch

from purestep.engine.tree import struct

from . import _util
from .base import EmptyState, GradientTransformation, Params, Updates, owns_updates

__all__ = ["ScaleByScheduleState", "scale", "scale_by_schedule"]

Tensor = torch.Tensor


@struct
class ScaleByScheduleState:
    """``count``: updates so far (the schedule's argument)."""

    count: int


def _scaled(updates: Updates, factor: float) -> Updates:
    if not updates:
        return {}
    u = list(updates.values())
    if owns_updates():  # the updates are ours to overwrite
        torch._foreach_mul_(u, factor)
    else:
        u = torch._foreach_mul(u, factor)
    return dict(zip(updates, u))


def scale(factor: float) -> GradientTransformation:
    """Multiply updates by ``factor`` (a number or one-element tensor)."""
    factor = _util.scalar("factor", factor)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: Any, params: Params | None = None) -> tuple:
        return _scaled(updates, factor), state

    return GradientTransformation(init, update)


@_util.evaluates_schedules("schedule")
def scale_by_schedule(schedule: _util.Schedule) -> GradientTransformation:
    """Multiply updates by ``schedule(count)``, ``count`` being this transform's update count."""
    if not callable(schedule):
        raise TypeError(
            f"schedule must be callable (count -> float), got {type(schedule).__name__}"
        )

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=0)

    def update(updates: Updates, state: ScaleByScheduleState, params: Params | None = None):
        factor = float(schedule(state.count))
        return _scaled(updates, factor), ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init, update)
