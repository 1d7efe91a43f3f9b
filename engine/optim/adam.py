"""Adam and AdamW (decoupled weight decay), optionally AMSGrad and maximizing.

``step`` (``apply``) is bitwise equal to ``torch.optim.Adam`` / ``AdamW`` with
``foreach=True``: the moments use the same ``lerp`` / ``mul`` / ``addcmul`` ops, the bias
corrections are computed in Python floats from the integer step count exactly as torch
computes them from ``step.item()``, and the params get one fused ``addcdiv``. ``update``
returns ``step_size * exp_avg / denom`` (plus ``param * (1 - lr * wd) - param`` for AdamW);
adding it to the params rounds differently from the fused op, so that path agrees with
torch to about one ulp per step, not bitwise.

Under ``donating()`` the moments and params are updated in place; the only extra memory is
the denominator temporary, as in torch. Under ``differentiable()`` nothing is written in
place and ``lr``, ``betas``, ``eps`` and ``weight_decay`` given as tensors that require grad
get their gradient (``_util.with_tangent``), the values unchanged.
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

__all__ = ["AdamState", "adam", "adamw"]

Tensor = torch.Tensor


@struct
class AdamState:
    """``count``: steps taken; first and second moments (and their running max for AMSGrad,
    empty otherwise), name -> tensor, named as in ``torch.optim.Adam``'s state."""

    count: int
    exp_avg: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    max_exp_avg_sq: dict[str, Tensor]


#: Mean elements per tensor from which the eager update's square root writes straight into the
#: gradients' storage (``torch.sqrt(out=)`` per tensor) rather than copying and then rooting.
_OUT_SQRT = 1 << 16


@_util.optimizer_name("Adam")
@_util.evaluates_schedules("lr")
def adam(
    lr: Any = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adam as ``torch.optim.Adam`` (L2 weight decay added to the gradient)."""
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=False)


@_util.optimizer_name("AdamW")
@_util.evaluates_schedules("lr")
def adamw(
    lr: Any = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """AdamW as ``torch.optim.AdamW``: params shrink by ``lr * weight_decay`` each step."""
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=True)


def _adam(
    lr: Any,
    betas: Any,
    eps: Any,
    weight_decay: Any,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
) -> GradientTransformation:
    lr_at = _util.learning_rate(lr)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of floats, got {betas!r}")
    hyper = _util.hyper_tensors(
        lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay
    )
    beta1 = _util.check("beta1 (betas[0])", betas[0], low=0.0, high=1.0, high_open=True)
    beta2 = _util.check("beta2 (betas[1])", betas[1], low=0.0, high=1.0, high_open=True)
    eps = _util.check("eps", eps, low=0.0)
    weight_decay = _util.check("weight_decay", weight_decay, low=0.0)
    amsgrad = _util.flag("amsgrad", amsgrad)
    maximize = _util.flag("maximize", maximize)

    def init(params: Params) -> AdamState:
        return AdamState(
            count=0,
            exp_avg=_util.zeros(params),
            exp_avg_sq=_util.zeros(params),
            max_exp_avg_sq=_util.zeros(params) if amsgrad else {},
        )

    def kernel(
        g: list, p: list, m: list, v: list, vmax: list, *, lr: float, t: int, fused: bool
    ) -> tuple:
        donate = is_donating()
        owned = owns_updates()
        diff = is_differentiable()
        ops = _per_tensor.ops(diff)  # ``torch``, or per-tensor ops keeping a lean graph
        live = _util.live(hyper, diff)  # hyper-parameters to differentiate (usually none)
        p_in, m_in, v_in = p, m, v
        if maximize:
            g = _util.neg(g, owned)
            owned = True
        if weight_decay != 0:
            if decoupled:
                if fused:
                    if donate:
                        ops._foreach_mul_(p, 1 - lr * weight_decay)
                    else:
                        p = ops._foreach_mul(p, 1 - lr * weight_decay)
            elif owned:
                ops._foreach_add_(g, p, alpha=weight_decay)
            else:
                g = ops._foreach_add(g, p, alpha=weight_decay)
                owned = True
        if live:
            lr_x, wd_x = live.get("lr", lr), live.get("weight_decay", weight_decay)
            shrink = None  # the tangent of AdamW's factor ``1 - lr * weight_decay``
            if decoupled and (weight_decay != 0 or "weight_decay" in live):
                shrink = _util.tangent(1 - lr_x * wd_x)
                if fused:
                    p = _util.with_tangent(p, shrink, p_in)
            elif not decoupled:
                g = _util.with_tangent(g, _util.tangent(live.get("weight_decay")), p)
        if donate:
            ops._foreach_lerp_(m, g, 1 - beta1)
            ops._foreach_mul_(v, beta2)
        else:
            m = ops._foreach_lerp(m, g, 1 - beta1)
            v = ops._foreach_mul(v, beta2)
        ops._foreach_addcmul_(v, g, g, 1 - beta2)
        if live:
            b1 = live.get("beta1")
            if b1 is not None:
                m = _util.with_tangent(m, _util.tangent(1 - b1), ops._foreach_sub(g, m_in))
            if "beta2" in live:
                spread = ops._foreach_sub(v_in, ops._foreach_mul(g, g))
                v = _util.with_tangent(v, _util.tangent(live["beta2"]), spread)
        if torch.compiler.is_compiling():
            # Traced, the count is symbolic: as Python numbers (or as 0-d tensors computed
            # from it) inductor inlines these powers of it into every elementwise loop and
            # evaluates them once per vector. Concatenated they become one small buffer that
            # is computed once per call and loaded by the loops (the update runs 7-12x
            # faster on 1M parameters).
            count = torch.full((1,), t, dtype=torch.float64, device=m[0].device)
            bias_correction1 = 1 - beta1**count
            scalars = torch.cat([(1 - beta2**count) ** 0.5, (lr / bias_correction1) * -1])
            bias_correction2_sqrt, step_size = scalars.float().unbind()
        else:
            bias_correction1 = 1 - beta1**t
            bias_correction2 = 1 - beta2**t
            step_size = (lr / bias_correction1) * -1
            bias_correction2_sqrt = bias_correction2**0.5
        if amsgrad:
            if donate:
                ops._foreach_maximum_(vmax, v)
            else:
                vmax = ops._foreach_maximum(vmax, v)
        source = vmax if amsgrad else v
        if owned and not diff:
            # The gradients are ours: reuse them for the denominator (no new allocation).
            # Large tensors take ``sqrt(out=)``, one pass instead of a copy and an in-place
            # sqrt; small ones the two foreach calls (one kernel launch each for the lot).
            if not torch.compiler.is_compiling() and sum(x.numel() for x in g) >= _OUT_SQRT * len(
                g
            ):
                for x, y in zip(source, g):
                    torch.sqrt(x, out=y)
            else:
                ops._foreach_copy_(g, source)
                ops._foreach_sqrt_(g)
            denom = g
        else:
            denom = ops._foreach_sqrt(source)
        del g
        if diff:  # out of place: sqrt's backward reads its result
            root = denom
            denom = ops._foreach_div(denom, bias_correction2_sqrt)
            if "beta2" in live:
                inverse = 1 / (1 - live["beta2"] ** t) ** 0.5
                denom = _util.with_tangent(denom, _util.tangent(inverse), root)
            denom = ops._foreach_add(denom, eps)
            denom = _util.with_tangent(denom, _util.tangent(live.get("eps")), None)
        else:
            ops._foreach_div_(denom, bias_correction2_sqrt)
            ops._foreach_add_(denom, eps)
        step_tangent = None
        if live and ("lr" in live or "beta1" in live):
            lr_x, b1_x = live.get("lr", lr), live.get("beta1", beta1)
            step_tangent = _util.tangent(-(lr_x / (1 - b1_x**t)))
        if fused and isinstance(step_size, Tensor):  # traced: addcdiv takes no tensor value
            ratio = ops._foreach_div(m, denom)
            ops._foreach_mul_(ratio, step_size)
            if donate or (decoupled and weight_decay != 0):
                ops._foreach_add_(p, ratio)
                out = p
            else:
                out = ops._foreach_add(p, ratio)
        elif fused:
            if donate or (decoupled and weight_decay != 0 and not diff):
                ops._foreach_addcdiv_(p, m, denom, step_size)
                out = p
            else:
                out = ops._foreach_addcdiv(p, m, denom, step_size)
            if step_tangent is not None:
                out = _util.with_tangent(out, step_tangent, ops._foreach_div(m, denom))
        else:
            out = ops._foreach_div(m, denom)
            del denom
            if diff:
                ratio = out
                out = _util.with_tangent(ops._foreach_mul(out, step_size), step_tangent, ratio)
            else:
                ops._foreach_mul_(out, step_size)
            if decoupled and weight_decay != 0:
                # ``p * (1 - lr * wd) - p`` is exact, so the decay matches torch's rounded
                # factor (adding ``-lr * wd * p`` instead drifts by ~1e-8 relative per step).
                decay = ops._foreach_mul(p, 1 - lr * weight_decay)
                ops._foreach_sub_(decay, p)
                ops._foreach_add_(out, decay)
            if live and shrink is not None:
                out = _util.with_tangent(out, shrink, p)
        return out, m, v, vmax

    def run(grads: Updates, state: AdamState, params: Params | None, fused: bool) -> tuple:
        names = list(grads)
        count = state.count
        if not names:
            return names, [], state.replace(count=count + 1)
        if params is None and weight_decay != 0:
            raise ValueError("adam/adamw with weight_decay needs params in update()")
        g = list(grads.values())
        p = _util.take(params, names, "params") if params is not None else []
        m = _util.take(state.exp_avg, names, "exp_avg")
        v = _util.take(state.exp_avg_sq, names, "exp_avg_sq")
        vmax = _util.take(state.max_exp_avg_sq, names, "max_exp_avg_sq") if amsgrad else []
        out, m, v, vmax = _util.grouped(
            kernel, [g, p, m, v, vmax], lr=lr_at(count), t=count + 1, fused=fused
        )
        new_state = AdamState(
            count=count + 1,
            exp_avg=_util.merged(state.exp_avg, names, m),
            exp_avg_sq=_util.merged(state.exp_avg_sq, names, v),
            max_exp_avg_sq=_util.merged(state.max_exp_avg_sq, names, vmax) if amsgrad else {},
        )
        return names, out, new_state

    def update(updates: Updates, state: AdamState, params: Params | None = None) -> tuple:
        names, out, state = run(updates, state, params, fused=False)
        return dict(zip(names, out)), state

    def apply(grads: Updates, state: AdamState, params: Params) -> tuple:
        names, out, state = run(grads, state, params, fused=True)
        return _util.merged(params, names, out), state

    return GradientTransformation(init, update, apply)
