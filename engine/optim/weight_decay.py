"""Coupled (L2) weight decay as a transform: ``updates + weight_decay * params``.

Placed before an adaptive transform this is torch's ``weight_decay`` of SGD/Adam (the same
``add(alpha=)`` op, so the sums are bitwise equal). For decoupled decay use ``adamw`` or
put it after the direction and before ``scale(-lr)``. ``mask`` restricts it to some params
(e.g. ``decay_mask``: not biases and norms).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import _util
from .base import EmptyState, GradientTransformation, Params, Updates, owns_updates
from .masking import masked

__all__ = ["add_decayed_weights"]

Tensor = torch.Tensor


def add_decayed_weights(
    weight_decay: float,
    mask: Mapping[str, bool] | Callable[[str, Tensor], bool] | None = None,
) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update (only where ``mask`` is true, if given)."""
    weight_decay = _util.check("weight_decay", weight_decay, low=0.0)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: Any, params: Params | None = None) -> tuple:
        if not updates:
            return {}, state
        if params is None:
            raise ValueError("add_decayed_weights needs params in update()")
        names = list(updates)
        u = list(updates.values())
        p = _util.take(params, names, "params")
        if owns_updates():  # only the updates are written, never the params
            torch._foreach_add_(u, p, alpha=weight_decay)
        else:
            u = torch._foreach_add(u, p, alpha=weight_decay)
        return dict(zip(names, u)), state

    tx = GradientTransformation(init, update)
    return tx if mask is None else masked(tx, mask)
