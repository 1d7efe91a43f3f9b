"""Adagrad with optional learning-rate decay and L2 weight decay.

``step`` (``apply``) is bitwise equal to ``torch.optim.Adagrad(foreach=True)``: the decayed
learning rate ``-lr / (1 + (step - 1) * lr_decay)`` is computed in Python floats from the
integer step, then the same foreach ops run in the same order. ``update`` returns
``(clr * grad) / std``, and since torch's final ``addcdiv`` has ``value=1`` (no fused
scaling), adding it to the params gives the same bits as the fused path.
"""

from __future__ import annotations

from typing import Any

import torch

from purestep.engine.tree import struct

from . import _util
from .base import GradientTransformation, Params, Updates, is_donating, owns_updates

__all__ = ["AdagradState", "adagrad"]

Tensor = torch.Tensor


@struct
class AdagradState:
    """``count``: steps taken; ``sum``: name -> accumulated squared gradients."""

    count: int
    sum: dict[str, Tensor]


@_util.optimizer_name("Adagrad")
@_util.evaluates_schedules("lr")
def adagrad(
    lr: Any = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adagrad as ``torch.optim.Adagrad``; ``lr`` may be a schedule of the step count."""
    lr_at = _util.learning_rate(lr)
    lr_decay = _util.check("lr_decay", lr_decay, low=0.0)
    weight_decay = _util.check("weight_decay", weight_decay, low=0.0)
    initial = _util.check("initial_accumulator_value", initial_accumulator_value, low=0.0)
    eps = _util.check("eps", eps, low=0.0)
    maximize = _util.flag("maximize", maximize)

    def init(params: Params) -> AdagradState:
        return AdagradState(
            count=0,
            sum={
                n: torch.full_like(p, initial, memory_format=torch.preserve_format)
                for n, p in params.items()
            },
        )

    def kernel(g: list, p: list, acc: list, *, clr: float, fused: bool) -> tuple:
        donate = is_donating()
        owned = owns_updates()  # may ``g`` be written in place? (it never becomes state)
        if maximize:
            g = _util.neg(g, owned)
            owned = True
        if weight_decay != 0:
            if owned:
                torch._foreach_add_(g, p, alpha=weight_decay)
            else:
                g = torch._foreach_add(g, p, alpha=weight_decay)
                owned = True
        if donate:
            torch._foreach_addcmul_(acc, g, g, value=1)
        else:
            acc = torch._foreach_addcmul(acc, g, g, value=1)
        std = torch._foreach_sqrt(acc)
        torch._foreach_add_(std, eps)
        if owned:
            torch._foreach_mul_(g, clr)
            numerator = g
        else:
            numerator = torch._foreach_mul(g, clr)
        if not fused:
            torch._foreach_div_(numerator, std)
            return numerator, acc
        if donate:
            torch._foreach_addcdiv_(p, numerator, std)
            return p, acc
        return torch._foreach_addcdiv(p, numerator, std), acc

    def run(grads: Updates, state: AdagradState, params: Params | None, fused: bool) -> tuple:
        names = list(grads)
        count = state.count
        if not names:
            return names, [], state.replace(count=count + 1)
        if params is None and weight_decay != 0:
            raise ValueError("adagrad with weight_decay needs params in update()")
        g = list(grads.values())
        p = _util.take(params, names, "params") if params is not None else []
        acc = _util.take(state.sum, names, "sum")
        t = count + 1
        clr = -lr_at(count) / (1 + (t - 1) * lr_decay)
        out, acc = _util.grouped(kernel, [g, p, acc], clr=clr, fused=fused)
        new_state = AdagradState(count=t, sum=_util.merged(state.sum, names, acc))
        return names, out, new_state

    def update(updates: Updates, state: AdagradState, params: Params | None = None) -> tuple:
        names, out, state = run(updates, state, params, fused=False)
        return dict(zip(names, out)), state

    def apply(grads: Updates, state: AdagradState, params: Params) -> tuple:
        names, out, state = run(grads, state, params, fused=True)
        return _util.merged(params, names, out), state

    return GradientTransformation(init, update, apply)
