"""RMSprop, optionally centered and with momentum.

``step`` (``apply``) is bitwise equal to ``torch.optim.RMSprop(foreach=True)`` (same foreach
ops, order and scalars). ``update`` returns ``-lr * grad / avg`` (or ``-lr * buffer``);
adding it to the params rounds differently from torch's fused ``addcdiv`` /
``add(alpha=)``, so that path agrees with torch to about one ulp per step, not bitwise.
"""

from __future__ import annotations

from typing import Any

import torch

from purestep.engine.tree import struct

from . import _util
from .base import GradientTransformation, Params, Updates, is_donating, owns_updates

__all__ = ["RMSpropState", "rmsprop"]

Tensor = torch.Tensor


@struct
class RMSpropState:
    """``count``: steps taken; ``square_avg``; ``momentum_buffer`` (empty without momentum);
    ``grad_avg`` (empty unless centered); name -> tensor as in ``torch.optim.RMSprop``."""

    count: int
    square_avg: dict[str, Tensor]
    momentum_buffer: dict[str, Tensor]
    grad_avg: dict[str, Tensor]


@_util.optimizer_name("RMSprop")
@_util.evaluates_schedules("lr")
def rmsprop(
    lr: Any = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """RMSprop as ``torch.optim.RMSprop``; ``lr`` may be a schedule of the step count."""
    lr_at = _util.learning_rate(lr)
    alpha = _util.check("alpha", alpha, low=0.0, high=1.0)
    eps = _util.check("eps", eps, low=0.0)
    weight_decay = _util.check("weight_decay", weight_decay, low=0.0)
    momentum = _util.check("momentum", momentum, low=0.0)
    centered = _util.flag("centered", centered)
    maximize = _util.flag("maximize", maximize)

    def init(params: Params) -> RMSpropState:
        return RMSpropState(
            count=0,
            square_avg=_util.zeros(params),
            momentum_buffer=_util.zeros(params) if momentum > 0 else {},
            grad_avg=_util.zeros(params) if centered else {},
        )

    def kernel(g: list, p: list, sq: list, buf: list, ga: list, *, lr: float, fused: bool) -> tuple:
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
            torch._foreach_mul_(sq, alpha)
        else:
            sq = torch._foreach_mul(sq, alpha)
        torch._foreach_addcmul_(sq, g, g, value=1 - alpha)
        if centered:
            if donate:
                torch._foreach_lerp_(ga, g, 1 - alpha)
            else:
                ga = torch._foreach_lerp(ga, g, 1 - alpha)
            avg = torch._foreach_addcmul(sq, ga, ga, value=-1)
            torch._foreach_sqrt_(avg)
        else:
            avg = torch._foreach_sqrt(sq)
        torch._foreach_add_(avg, eps)
        if momentum > 0:
            if donate:
                torch._foreach_mul_(buf, momentum)
            else:
                buf = torch._foreach_mul(buf, momentum)
            torch._foreach_addcdiv_(buf, g, avg)
            del avg
            if not fused:
                out = torch._foreach_mul(buf, -lr)
            elif donate:
                torch._foreach_add_(p, buf, alpha=-lr)
                out = p
            else:
                out = torch._foreach_add(p, buf, alpha=-lr)
        elif not fused:
            if owned:
                torch._foreach_div_(g, avg)
                out = g
            else:
                out = torch._foreach_div(g, avg)
            torch._foreach_mul_(out, -lr)
        elif donate:
            torch._foreach_addcdiv_(p, g, avg, value=-lr)
            out = p
        else:
            out = torch._foreach_addcdiv(p, g, avg, value=-lr)
        return out, sq, buf, ga

    def run(grads: Updates, state: RMSpropState, params: Params | None, fused: bool) -> tuple:
        names = list(grads)
        count = state.count
        if not names:
            return names, [], state.replace(count=count + 1)
        if params is None and weight_decay != 0:
            raise ValueError("rmsprop with weight_decay needs params in update()")
        g = list(grads.values())
        p = _util.take(params, names, "params") if params is not None else []
        sq = _util.take(state.square_avg, names, "square_avg")
        buf = _util.take(state.momentum_buffer, names, "momentum_buffer") if momentum > 0 else []
        ga = _util.take(state.grad_avg, names, "grad_avg") if centered else []
        out, sq, buf, ga = _util.grouped(kernel, [g, p, sq, buf, ga], lr=lr_at(count), fused=fused)
        new_state = RMSpropState(
            count=count + 1,
            square_avg=_util.merged(state.square_avg, names, sq),
            momentum_buffer=(
                _util.merged(state.momentum_buffer, names, buf) if momentum > 0 else {}
            ),
            grad_avg=_util.merged(state.grad_avg, names, ga) if centered else {},
        )
        return names, out, new_state

    def update(updates: Updates, state: RMSpropState, params: Params | None = None) -> tuple:
        names, out, state = run(updates, state, params, fused=False)
        return dict(zip(names, out)), state

    def apply(grads: Updates, state: RMSpropState, params: Params) -> tuple:
        names, out, state = run(grads, state, params, fused=True)
        return _util.merged(params, names, out), state

    return GradientTransformation(init, update, apply)
