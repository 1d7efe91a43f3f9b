"""Hyper-parameters that live in the optimizer state.

``inject_hyperparams(adam)(lr=1e-3, betas=(0.9, 0.999))`` keeps each float
hyper-parameter as a 0-d float64 tensor in ``state.hyperparams``, so it can be logged,
changed between steps (``state.replace(hyperparams={**state.hyperparams, "lr": t})``) or
batched. A hyper-parameter given as a schedule is evaluated at the wrapper's update count
at every step (a value written into the state for it is overwritten); the state holds the
value the latest step used (at ``init``: the one the first step will use). Each step
rebuilds the inner transform from the current values (cached while they do not change) and
runs its ``update`` or fused ``apply``, so ``inject_hyperparams(adam)`` keeps Adam's
bitwise parity with torch.

Injected: floats, one-element tensors, schedules (callables) and tuples / lists of these.
Ints, bools, strings, None, transforms and names listed in ``static_args`` are passed to
the factory unchanged.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from engine.tree import struct

from .base import GradientTransformation, Params, Updates, step

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]

Tensor = torch.Tensor


@struct
class InjectHyperparamsState:
    """``count``: updates so far; ``hyperparams``: name -> 0-d float64 tensor (or a tuple of
    them); ``inner_state``: the wrapped transform's state."""

    count: int
    hyperparams: dict[str, Any]
    inner_state: Any


def _is_scalar(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral))


def _is_schedule(value: Any) -> bool:
    return callable(value) and not isinstance(value, (Tensor, GradientTransformation, type))


def _injectable(value: Any) -> bool:
    if isinstance(value, GradientTransformation):
        return False
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_is_scalar(v) or _is_schedule(v) for v in value)
    return _is_scalar(value) or _is_schedule(value)


def _as_tensor(x: float) -> Tensor:
    return torch.tensor(x, dtype=torch.float64)


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: Iterable[str] = ()
) -> Callable[..., GradientTransformation]:
    """Wrap ``factory`` so that its float / schedule arguments live in the state."""
    sig = inspect.signature(factory)
    static = frozenset(static_args)
    unknown = sorted(static - set(sig.parameters))
    if unknown:
        raise TypeError(f"static_args {unknown} are not parameters of {factory!r}")

    @functools.wraps(factory)
    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = sig.bind(*args, **kwargs)
        specs: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = sig.parameters[name].kind
            if (
                name not in static
                and kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                and _injectable(value)
            ):
                specs[name] = value
        cache: list[Any] = [None, None]

        def evaluate(count: int, current: dict[str, Any] | None) -> tuple:
            """``(values, hyperparams)``: floats for the factory and the tensors to store."""
            values: dict[str, Any] = {}
            stored: dict[str, Any] = {}
            for name, spec in specs.items():
                if isinstance(spec, (tuple, list)):
                    cur = current[name] if current is not None else (None,) * len(spec)
                    pairs = [_one(s, count, c) for s, c in zip(spec, cur)]
                    values[name] = tuple(v for v, _ in pairs)
                    stored[name] = tuple(t for _, t in pairs)
                else:
                    cur = current[name] if current is not None else None
                    values[name], stored[name] = _one(spec, count, cur)
            return values, stored

        def build(values: dict[str, Any]) -> GradientTransformation:
            key = tuple(values.items())
            if cache[0] != key:
                call = inspect.BoundArguments(sig, {**bound.arguments, **values})
                cache[0], cache[1] = key, factory(*call.args, **call.kwargs)
            return cache[1]

        build(evaluate(0, None)[0])  # validate the arguments now

        def init(params: Params) -> InjectHyperparamsState:
            values, stored = evaluate(0, None)
            return InjectHyperparamsState(0, stored, build(values).init(params))

        def update(updates: Updates, state: InjectHyperparamsState, params: Params | None = None):
            values, stored = evaluate(state.count, state.hyperparams)
            out, inner = build(values).update(updates, state.inner_state, params)
            return out, InjectHyperparamsState(state.count + 1, stored, inner)

        def apply(grads: Updates, state: InjectHyperparamsState, params: Params) -> tuple:
            values, stored = evaluate(state.count, state.hyperparams)
            new_params, inner = step(build(values), grads, state.inner_state, params)
            return new_params, InjectHyperparamsState(state.count + 1, stored, inner)

        return GradientTransformation(init, update, apply)

    return wrapped


def _one(spec: Any, count: int, current: Any) -> tuple[float, Any]:
    """The value of one hyper-parameter at ``count`` and the tensor to store for it."""
    if _is_schedule(spec):
        value = float(spec(count))
        return value, _as_tensor(value)
    if current is None:
        value = float(spec)
        return value, _as_tensor(value)
    return float(current), current
