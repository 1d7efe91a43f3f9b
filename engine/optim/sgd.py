"""Stochastic gradient descent with optional momentum, dampening, Nesterov and L2 decay.

``step`` (``apply``) is bitwise equal to ``torch.optim.SGD(foreach=True)``: the same foreach
ops in the same order with the same Python-float scalars, the momentum buffer starting as
a copy of the first (decayed) gradient. ``update`` returns ``-lr * direction``; adding it to
the params rounds differently from torch's fused ``add(alpha=-lr)``, so that path agrees
with torch to about one ulp per step, not bitwise.

The signature is torch's: ``sgd(lr=1e-3, momentum=0, dampening=0, weight_decay=0,
nesterov=False, *, maximize=False)``. Under ``owning_updates()`` the maximize and
weight-decay steps write into the gradients instead of new temporaries; an owned gradient
never becomes the momentum buffer (only a donated one does). Under ``differentiable()``
nothing is written in place and tensor hyper-parameters that require grad get their
gradient (``_util.with_tangent``), the values unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from purestep.engine.tree import struct

from . import _per_tensor, _util
from .base import (
    GradientTransformation,
    Params,
    Updates,
    is_differentiable,
    is_donating,
    owns_updates,
)

__all__ = ["SGDState", "sgd"]

Tensor = torch.Tensor


@struct
class SGDState:
    """``count``: steps taken; ``momentum_buffer``: name -> buffer (empty without momentum)."""

    count: int
    momentum_buffer: dict[str, Tensor]


@_util.optimizer_name("SGD")
@_util.evaluates_schedules("lr")
def sgd(
    lr: Any = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """SGD as ``torch.optim.SGD`` (same argument order and defaults); ``lr`` may be a
    schedule of the step count. In differentiable mode (``optim.differentiable()``) ``lr``,
    ``momentum``, ``dampening`` and ``weight_decay`` given as tensors that require grad get
    their gradient; the values stay bitwise those of the floats."""
    hyper = _util.hyper_tensors(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay
    )
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
        owned = owns_updates()  # may ``g`` be written in place?
        ours = donate  # may ``g`` become state (the momentum buffer)? Only our own temporaries
        diff = is_differentiable()
        ops = _per_tensor.ops(diff)  # ``torch``, or per-tensor ops keeping a lean graph
        live = _util.live(hyper, diff)  # hyper-parameters to differentiate (usually none)
        if live and "momentum" in live and momentum == 0:
            raise ValueError(
                "sgd with momentum=0 keeps no momentum buffer, so momentum has no gradient: "
                "start it from a value > 0 to differentiate with respect to it"
            )
        if maximize:
            if owned:
                ops._foreach_neg_(g)
            else:
                g = ops._foreach_neg(g)
                owned = ours = True
        if weight_decay != 0:
            if owned:
                ops._foreach_add_(g, p, alpha=weight_decay)
            else:
                g = ops._foreach_add(g, p, alpha=weight_decay)
                owned = ours = True
        if live:
            g = _util.with_tangent(g, _util.tangent(live.get("weight_decay")), p)
        d_is_state = False
        if momentum != 0:
            old_buf = buf
            if first:
                # torch: the first buffer is a copy of the gradient (no dampening)
                buf = g if ours and not nesterov else [t.clone() for t in g]
            elif donate:
                ops._foreach_mul_(buf, momentum)
                ops._foreach_add_(buf, g, alpha=1 - dampening)
            else:
                buf = ops._foreach_mul(buf, momentum)
                ops._foreach_add_(buf, g, alpha=1 - dampening)
            if live and not first:
                buf = _util.with_tangent(buf, _util.tangent(live.get("momentum")), old_buf)
                damp = live.get("dampening")
                buf = _util.with_tangent(buf, None if damp is None else _util.tangent(1 - damp), g)
            if nesterov:
                if owned and not diff:
                    ops._foreach_add_(g, buf, alpha=momentum)
                else:
                    g = ops._foreach_add(g, buf, alpha=momentum)
                    owned = True
                    if live:
                        g = _util.with_tangent(g, _util.tangent(live.get("momentum")), buf)
            else:
                g = buf
                d_is_state = True
        lr_tangent = _util.tangent(-live["lr"]) if "lr" in live else None
        if fused:
            if donate:
                ops._foreach_add_(p, g, alpha=-lr)
                return p, buf
            return _util.with_tangent(ops._foreach_add(p, g, alpha=-lr), lr_tangent, g), buf
        if owned and not d_is_state and not diff:
            ops._foreach_mul_(g, -lr)
            return g, buf
        return _util.with_tangent(ops._foreach_mul(g, -lr), lr_tangent, g), buf

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
