"""Gradient accumulation: average ``k`` micro-batch gradients, then step the inner transform.

Until a window of ``k`` calls closes, ``update`` returns zero updates and ``apply`` returns
the params untouched (the same tensor objects); the inner transform sees one update per
window, on the mean gradient ``(g_1 + ... + g_k) / k`` (summed in call order, then
divided). ``k`` may be a schedule of the inner step count (completed windows), read when a
window starts, so ramping it never splits a window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from purestep.engine.tree import struct

from . import _util
from .base import GradientTransformation, Params, Updates, is_donating, step

__all__ = ["AccumulateState", "accumulate"]

Tensor = torch.Tensor


@struct
class AccumulateState:
    """``mini_step``: calls so far in the open window; ``count``: completed windows (inner
    steps); ``acc``: the window's running gradient sum; ``inner_state``."""

    mini_step: int
    count: int
    acc: dict[str, Tensor]
    inner_state: Any


def accumulate(
    inner: GradientTransformation, k: int | Callable[[int], int]
) -> GradientTransformation:
    """Step ``inner`` once every ``k`` calls, on the average of those calls' gradients."""
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"accumulate() needs a GradientTransformation, got {type(inner).__name__}")
    if callable(k):
        k_fn = k
    else:
        _window(k)
        k_fn = None

    def k_at(count: int) -> int:
        return _window(k_fn(count)) if k_fn is not None else k

    def init(params: Params) -> AccumulateState:
        return AccumulateState(
            mini_step=0, count=0, acc=_util.zeros(params), inner_state=inner.init(params)
        )

    def gather(grads: Updates, state: AccumulateState) -> tuple:
        """``(mean or None, state)``: add ``grads`` to the window; the mean when it closes."""
        k_now = k_at(state.count)
        mini = state.mini_step + 1
        if k_now == 1 and state.mini_step == 0:
            return grads, state  # g / 1 == g: no need to touch the accumulator
        names = list(grads)
        if not names:
            done = mini >= k_now
            return ({} if done else None), state.replace(mini_step=0 if done else mini)
        g = list(grads.values())
        acc = _util.take(state.acc, names, "acc")
        donate = is_donating()
        if donate:
            torch._foreach_add_(acc, g)
        else:
            acc = torch._foreach_add(acc, g)
        if mini < k_now:
            return None, state.replace(mini_step=mini, acc=_util.merged(state.acc, names, acc))
        torch._foreach_div_(acc, float(k_now))  # ``acc`` is ours here (new or donated)
        if donate:
            torch._foreach_zero_(g)  # the donated grads become the next window's accumulator
            fresh = g
        else:
            fresh = [torch.zeros_like(t) for t in g]
        return dict(zip(names, acc)), state.replace(
            mini_step=0, acc=_util.merged(state.acc, names, fresh)
        )

    def update(updates: Updates, state: AccumulateState, params: Params | None = None):
        mean, state = gather(updates, state)
        if mean is None:
            return {n: torch.zeros_like(u) for n, u in updates.items()}, state
        out, inner_state = inner.update(mean, state.inner_state, params)
        return out, state.replace(count=state.count + 1, inner_state=inner_state)

    def apply(grads: Updates, state: AccumulateState, params: Params) -> tuple:
        mean, state = gather(grads, state)
        if mean is None:
            return dict(params), state
        new_params, inner_state = step(inner, mean, state.inner_state, params)
        return new_params, state.replace(count=state.count + 1, inner_state=inner_state)

    return GradientTransformation(init, update, apply)


def _window(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"accumulation steps k must be an int >= 1, got {k!r}")
    return k
