"""Stochastic gradient descent with optional momentum, dampening, Nesterov and L2 decay.

``step`` (``apply``) is bitwise equal to ``torch.optim.SGD(foreach=True)``: the same foreach
ops in the same order with the same Python-float scalars, the momentum buffer starting as
a copy of the first (decayed) gradient. ``update`` returns ``-lr * direction``; adding it to
the params rounds differently from torch's fused ``add(alpha=-lr)``, so that path agrees
with torch to about one ulp per step, not bitwise.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.tree import struct

from . import _util
from .base import GradientTransformation, Params, Updates, is_donating

__all__ = ["SGDState", "sgd"]

Tensor = torch.Tensor


@struct
class SGDState:
    """``count``: steps taken; ``momentum_buffer``: name -> buffer (empty without momentum)."""

    count: int
    momentum_buffer: dict[str, Tensor]


def sgd(
    lr: Any,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> GradientTransformation:
    """SGD as ``torch.optim.SGD``; ``lr`` may be a schedule of the step count."""
    lr_at = _util.learning_rate(lr)
    momentum = _util.check("momentum", momentum, low=0.0)
    dampening = _util.scalar("dampening", dampening)
    weight_decay = _util.check("weight_decay", weight_decay, low=0.0)
    nesterov = _util.flag("nesterov", nesterov)
    maximize = _util.flag("maximize", maximize)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum requires momentum > 0 and dampening == 0")

    def init(params: Params) -> SGDState:
        return SGDState(count=0, momentum_buffer=_util.zeros(params) if momentum != 0 else {})

    def kernel(g: list, p: list, buf: list, *, lr: float, first: bool, fused: bool) -> tuple:
        donate = is_donating()
        owned = donate  # may ``g`` be written in place?
        if maximize:
            g = _util.neg(g, owned)
            owned = True
        if weight_decay != 0:
            if owned:
                torch._foreach_add_(g, p, alpha=weight_decay)
            else:
                g = torch._foreach_add(g, p, alpha=weight_decay)
                owned = True
        d_is_state = False
        if momentum != 0:
            if first:
                # torch: the first buffer is a copy of the gradient (no dampening)
                buf = g if owned and not nesterov else [t.clone() for t in g]
            elif donate:
                torch._foreach_mul_(buf, momentum)
                torch._foreach_add_(buf, g, alpha=1 - dampening)
            else:
                buf = torch._foreach_mul(buf, momentum)
                torch._foreach_add_(buf, g, alpha=1 - dampening)
            if nesterov:
                if owned:
                    torch._foreach_add_(g, buf, alpha=momentum)
                else:
                    g = torch._foreach_add(g, buf, alpha=momentum)
                    owned = True
            else:
                g = buf
                d_is_state = True
        if fused:
            if donate:
                torch._foreach_add_(p, g, alpha=-lr)
                return p, buf
            return torch._foreach_add(p, g, alpha=-lr), buf
        if owned and not d_is_state:
            torch._foreach_mul_(g, -lr)
            return g, buf
        return torch._foreach_mul(g, -lr), buf

    def run(grads: Updates, state: SGDState, params: Params | None, fused: bool) -> tuple:
        names = list(grads)
        count = state.count
        if not names:
            return names, [], state.replace(count=count + 1)
        if params is None and (fused or weight_decay != 0):
            raise ValueError("sgd with weight_decay needs params in update()")
        g = list(grads.values())
        p = _util.take(params, names, "params") if params is not None else []
        buf = _util.take(state.momentum_buffer, names, "momentum_buffer") if momentum else []
        out, buf = _util.grouped(
            kernel, [g, p, buf], lr=lr_at(count), first=count == 0, fused=fused
        )
        new_buf = _util.merged(state.momentum_buffer, names, buf) if momentum else {}
        return names, out, SGDState(count=count + 1, momentum_buffer=new_buf)

    def update(updates: Updates, state: SGDState, params: Params | None = None) -> tuple:
        names, out, state = run(updates, state, params, fused=False)
        return dict(zip(names, out)), state

    def apply(grads: Updates, state: SGDState, params: Params) -> tuple:
        names, out, state = run(grads, state, params, fused=True)
        return _util.merged(params, names, out), state

    return GradientTransformation(init, update, apply)
