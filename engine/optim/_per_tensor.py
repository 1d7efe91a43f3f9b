"""``torch._foreach_*`` ops as per-tensor ops, for the differentiable mode.

Autograd's foreach nodes save more than their per-tensor ops do: ``_foreach_add(a, b,
alpha=)`` keeps ``b`` alive where ``torch.add`` keeps only its dtype, ``_foreach_mul(a, s)``
keeps ``a`` where ``torch.mul`` keeps nothing, so an unrolled optimizer written with foreach
ops holds a few extra parameter-sized tensors per step in its graph (measured: +18% peak
memory over five SGD steps of an MLP). Some of their backward formulas also fail
(``_foreach_addcdiv``'s with respect to its tensors, for a ``(1, n)`` tensor after the
first: "select(): index out of range"). ``ops(differentiable)`` is what the named
optimizers' kernels call their foreach ops on: ``torch`` itself normally, and in the
differentiable mode ``PER_TENSOR``, whose ``_foreach_*`` attributes run the per-tensor op
on each tensor (the ops the table below lacks are torch's own). On CPU the foreach ops run
exactly those per-tensor kernels, so the values are bitwise the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PER_TENSOR", "ops"]

Tensor = torch.Tensor


def _lists(args: tuple, kwargs: dict) -> tuple[int, list[tuple], dict[str, Any]]:
    """``(n, per-index positional args, kwargs)``: tensor lists and scalar lists indexed."""
    n = len(args[0])

    def at(value: Any, i: int) -> Any:
        if isinstance(value, (list, tuple)) and len(value) == n:
            return value[i]
        return value

    return n, [tuple(at(a, i) for a in args) for i in range(n)], kwargs


def _binary(op: Callable[..., Tensor]) -> Callable[..., list]:
    """A foreach op ``f(list, list | scalar | scalars, *, alpha=)`` from ``op``."""

    def run(*args: Any, **kwargs: Any) -> list:
        _, rows, kw = _lists(args, kwargs)
        return [op(*row, **kw) for row in rows]

    return run


def _ternary(op: Callable[..., Tensor]) -> Callable[..., list]:
    """``addcmul`` / ``addcdiv``: the foreach form takes ``value`` positionally."""

    def run(a: Any, b: Any, c: Any, value: Any = 1, **kwargs: Any) -> list:
        _, rows, _ = _lists((a, b, c, value), {})
        return [op(x, y, z, value=v) for x, y, z, v in rows]

    return run


def _in_place(method: str, positional_value: bool = False) -> Callable[..., list]:
    """An in-place foreach op from the tensor method ``method``; returns None like torch."""

    def run(*args: Any, **kwargs: Any) -> None:
        if positional_value and len(args) == 4:
            *args, value = args
            kwargs = {**kwargs, "value": value}
        _, rows, kw = _lists(tuple(args), kwargs)
        for first, *rest in rows:
            getattr(first, method)(*rest, **kw)

    return run


_TABLE: dict[Any, Callable[..., Any]] = {
    torch._foreach_add: _binary(torch.add),
    torch._foreach_sub: _binary(torch.sub),
    torch._foreach_mul: _binary(torch.mul),
    torch._foreach_div: _binary(torch.div),
    torch._foreach_lerp: _binary(torch.lerp),
    torch._foreach_maximum: _binary(torch.maximum),
    torch._foreach_sqrt: _binary(torch.sqrt),
    torch._foreach_neg: _binary(torch.neg),
    torch._foreach_addcmul: _ternary(torch.addcmul),
    torch._foreach_addcdiv: _ternary(torch.addcdiv),
    torch._foreach_add_: _in_place("add_"),
    torch._foreach_sub_: _in_place("sub_"),
    torch._foreach_mul_: _in_place("mul_"),
    torch._foreach_div_: _in_place("div_"),
    torch._foreach_lerp_: _in_place("lerp_"),
    torch._foreach_sqrt_: _in_place("sqrt_"),
    torch._foreach_neg_: _in_place("neg_"),
    torch._foreach_copy_: _in_place("copy_"),
    torch._foreach_addcmul_: _in_place("addcmul_", positional_value=True),
    torch._foreach_addcdiv_: _in_place("addcdiv_", positional_value=True),
}


class _PerTensor:
    """``torch``'s ``_foreach_*`` functions, those of ``_TABLE`` run per tensor."""

    def __init__(self) -> None:
        for func, per_tensor in _TABLE.items():
            setattr(self, func.__name__, per_tensor)

    def __getattr__(self, name: str) -> Any:  # the others: torch's own
        return getattr(torch, name)


PER_TENSOR: Any = _PerTensor()


def ops(differentiable: bool) -> Any:
    """Where a kernel finds its foreach ops: ``torch``, or ``PER_TENSOR`` when
    ``differentiable``."""
    return PER_TENSOR if differentiable else torch
