"""Private helpers shared by the transforms: hyper-parameter checks, dict <-> list plumbing
and grouping of tensor lists by device and dtype.

Transforms work on lists of tensors taken from name-keyed dicts in the order of the incoming
updates, so every ``torch._foreach_*`` call sees one list per role (params, grads, moments).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from purestep.engine.tree import device_dtype_groups

Tensor = torch.Tensor
Schedule = Callable[[int], float]


# --------------------------------------------------------------------------- hyper-parameters


def scalar(name: str, value: Any) -> float:
    """``value`` as a Python float: a real number or a one-element tensor (not a bool)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got the bool {value!r}")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}"
            )
        return float(value.detach())  # the value only (no warning for one requiring grad)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{name} must be a number, got {type(value).__name__}")


def check(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    high_open: bool = False,
    low_open: bool = False,
) -> float:
    """``scalar(name, value)`` checked against a range; NaN is always rejected."""
    x = scalar(name, value)
    bad = math.isnan(x)
    if low is not None:
        bad |= x <= low if low_open else x < low
    if high is not None:
        bad |= x >= high if high_open else x > high
    if bad:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        if low is not None and high is not None:
            rng = f"in {lo}, {hi}"
        elif low is not None:
            rng = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            rng = f"< {high:g}" if high_open else f"<= {high:g}"
        raise ValueError(f"invalid {name}: {x!r} (must be {rng})")
    return x


def flag(name: str, value: Any) -> bool:
    """A boolean option; anything else is a TypeError (catches swapped positional args)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def evaluates_schedules(*names: str) -> Callable[[Any], Any]:
    """Mark a transform factory whose arguments ``names`` may be schedules that its transform
    evaluates at its own update count (``factory.schedule_args``).

    ``inject_hyperparams`` then hands such a schedule on as it is instead of rebuilding the
    transform every step; the count must be the number of ``update``/``apply`` calls so far,
    which is the wrapper's count too.
    """

    def mark(factory: Any) -> Any:
        factory.schedule_args = frozenset(names)
        return factory

    return mark


def optimizer_name(name: str) -> Callable[[Any], Any]:
    """Mark a transform factory as the optimizer torch calls ``name`` (``factory.optimizer_name``,
    e.g. ``"AdamW"``); ``inject_hyperparams`` records it in its state for the LR monitor."""

    def mark(factory: Any) -> Any:
        factory.optimizer_name = name
        return factory

    return mark


def learning_rate(lr: Any) -> Schedule:
    """``lr`` (a non-negative number, a one-element tensor or a schedule) as ``count -> float``.

    Constants are checked here; a schedule's values are converted with ``float`` when used.
    """
    if callable(lr) and not isinstance(lr, Tensor):
        return lambda count: float(lr(count))
    value = check("learning rate", lr, low=0.0)
    return lambda count: value


# --------------------------------------------------------------------------- tangents
#
# In differentiable mode (``base.differentiable()``) a hyper-parameter given as a tensor that
# requires grad must get a gradient, while the update's values stay bitwise those computed
# with the Python float (torch's fused ``add(alpha=)`` / ``addcdiv(value=)`` take Python
# numbers only, and ``p + lr * g`` rounds differently from them). So the kernels compute the
# values as always, with floats, and add ``t * partial`` where ``t = h - h.detach()`` is an
# exact zero whose gradient is one: the sum has the values of the float computation and the
# derivative ``partial`` with respect to ``h``. (``x + 0`` is ``x``, but for ``-0.0``, which
# becomes ``+0.0``: equal under ``torch.equal``; an infinite partial makes the sum NaN.)


def hyper_tensors(**values: Any) -> dict[str, Tensor]:
    """The arguments given as tensors, by name: the candidates for hypergradients."""
    return {n: v for n, v in values.items() if isinstance(v, Tensor)}


def live(hyper: Mapping[str, Tensor], differentiable: bool) -> dict[str, Tensor]:
    """The hyper-parameter tensors to differentiate: in differentiable mode, those that
    require grad (empty otherwise, and then the kernels run exactly as they always do)."""
    if not hyper or not differentiable:
        return {}
    return {n: t for n, t in hyper.items() if t.requires_grad}


def tangent(expr: Any) -> Tensor | None:
    """``expr - expr.detach()``: zero, with the gradient of ``expr`` (None for a float)."""
    return expr - expr.detach() if isinstance(expr, Tensor) else None


def with_tangent(values: list[Tensor], t: Tensor | None, partials: list[Tensor] | None) -> list:
    """``values + t * partials`` (``values + t`` when ``partials`` is None): ``values``'
    numbers, with ``partials`` as their derivative with respect to what ``t`` tracks."""
    if t is None:
        return values
    if partials is None:
        return [v + t for v in values]
    return [torch.addcmul(v, d, t) for v, d in zip(values, partials)]  # one op, not two


# --------------------------------------------------------------------------- dicts and lists


def take(d: Mapping[str, Tensor], names: Sequence[str], what: str) -> list[Tensor]:
    """``[d[n] for n in names]`` with a clear error naming the first missing key."""
    try:
        return [d[n] for n in names]
    except KeyError as e:
        raise KeyError(
            f"{what} has no entry for {e.args[0]!r}: it must cover every name of the updates "
            "(was the state initialised from params with other names?)"
        ) from None


def merged(old: Mapping[str, Tensor], names: Sequence[str], values: Sequence[Tensor]) -> dict:
    """``old`` with ``names`` set to ``values``: a new dict, ``old`` untouched.

    ``names`` were all looked up in ``old``, so equal lengths mean equal key sets (the usual
    case, built directly in ``names``' order); otherwise a copy of ``old`` keeps the others.
    """
    if len(names) == len(old):
        return dict(zip(names, values))
    new = dict(old)
    new.update(zip(names, values))
    return new


def zeros(d: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Zeros shaped like each tensor of ``d`` (same dtype, device and memory format)."""
    return {n: torch.zeros_like(t, memory_format=torch.preserve_format) for n, t in d.items()}


def neg(tensors: list[Tensor], in_place: bool) -> list[Tensor]:
    """``-tensors``, written into ``tensors`` when ``in_place`` (they are the caller's own)."""
    if in_place:
        torch._foreach_neg_(tensors)
        return tensors
    return torch._foreach_neg(tensors)


# --------------------------------------------------------------------------- grouping


def groups(tensors: Sequence[Tensor]) -> list[list[int]] | None:
    """Index groups of ``tensors`` by (device, dtype); ``None`` when they all agree (common)."""
    first = tensors[0]
    dtype, device = first.dtype, first.device
    for t in tensors:
        if t.dtype != dtype or t.device != device:
            return device_dtype_groups(tensors)
    return None


def grouped(kernel: Callable[..., tuple], lists: Sequence[list], **kwargs: Any) -> tuple:
    """Run ``kernel(*lists, **kwargs) -> tuple of lists`` once per (device, dtype) group.

    ``foreach`` kernels are fastest on lists of one device and dtype (torch groups the same
    way); the arithmetic is elementwise, so grouping never changes a result. ``lists[0]``
    decides the groups; empty lists (unused roles) stay empty. Outputs are scattered back to
    the original positions.
    """
    idx = groups(lists[0])
    if idx is None:
        return kernel(*lists, **kwargs)
    n = len(lists[0])
    outs: list[list | None] | None = None
    for ix in idx:
        sub = [[lst[i] for i in ix] if lst else lst for lst in lists]
        res = kernel(*sub, **kwargs)
        if outs is None:
            outs = [[None] * n if r else r for r in res]
        for out, r in zip(outs, res):
            if r:
                for j, i in enumerate(ix):
                    out[i] = r[j]
    assert outs is not None
    return tuple(outs)
