"""Gradient clipping by global L2 norm and by value.

Both agree bitwise with ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` with
``foreach=True`` over the same tensors in the same order: per-tensor norms from
``torch._foreach_norm``, their norm over ``torch.stack``, a coefficient
``max_norm / (norm + 1e-6)`` clamped to 1 that always multiplies (no data-dependent branch,
so no device sync), and ``clamp_min`` then ``clamp_max`` for values. ``global_norm`` is
``engine.tree.global_norm`` (one implementation for the whole project).

Both write only into the incoming updates, so under ``owning_updates()`` (what the train step
uses) they work in place, like torch's in-place clipping.
"""

from __future__ import annotations

from typing import Any

import torch

from purestep.engine.tree import global_norm

from . import _util
from .base import EmptyState, GradientTransformation, Params, Updates, owns_updates

__all__ = ["clip_by_global_norm", "clip_by_value", "global_norm"]

Tensor = torch.Tensor


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale updates by ``min(1, max_norm / (global_norm + 1e-6))``."""
    max_norm = _util.check("max_norm", max_norm, low=0.0)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: Any, params: Params | None = None) -> tuple:
        if not updates:
            return {}, state
        norm = global_norm(updates)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        names = list(updates)
        u = list(updates.values())
        idx = _util.groups(u)
        if idx is None:
            out = _mul(u, coef)
        else:
            # In-place like torch: the product keeps each tensor's dtype even where the
            # (promoted) coefficient and a 0-d tensor would promote.
            out = [None] * len(u)
            for ix in idx:
                sub = [u[i] for i in ix]
                if not owns_updates():
                    sub = [t.clone() for t in sub]
                torch._foreach_mul_(sub, coef.to(sub[0].device))
                for j, i in enumerate(ix):
                    out[i] = sub[j]
        return dict(zip(names, out)), state

    return GradientTransformation(init, update)


def _mul(tensors: list[Tensor], coef: Tensor) -> list[Tensor]:
    if owns_updates():
        torch._foreach_mul_(tensors, coef)
        return tensors
    return torch._foreach_mul(tensors, coef)


def clip_by_value(clip_value: float) -> GradientTransformation:
    """Clamp every update element to ``[-clip_value, clip_value]``."""
    clip_value = _util.check("clip_value", clip_value, low=0.0)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: Any, params: Params | None = None) -> tuple:
        if not updates:
            return {}, state
        u = list(updates.values())
        if owns_updates():
            torch._foreach_clamp_min_(u, -clip_value)
        else:
            u = torch._foreach_clamp_min(u, -clip_value)
        torch._foreach_clamp_max_(u, clip_value)
        return dict(zip(updates, u)), state

    return GradientTransformation(init, update)
