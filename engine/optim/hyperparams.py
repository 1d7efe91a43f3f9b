"""Hyper-parameters that live in the optimizer state.

``inject_hyperparams(adam)(lr=1e-3, betas=(0.9, 0.999))`` keeps each float
hyper-parameter as a 0-d float64 tensor in ``state.hyperparams``, so it can be logged,
changed between steps (``state.replace(hyperparams={**state.hyperparams, "lr": t})``) or
batched. A hyper-parameter given as a schedule is evaluated at the wrapper's update count
at every step (a value written into the state for it is overwritten); the state holds the
value the latest step used (at ``init``: the one the first step will use). The inner
transform is built from the current values and rebuilt only when one of them changes; a
schedule the factory can evaluate itself (its ``schedule_args``: the named optimizers'
``lr``, ``scale_by_schedule``'s ``schedule``) is handed to it as it is, at the same count,
so a learning-rate schedule costs no rebuild per step (as with ``adam(lr=schedule)``, the
schedule's values are then not range-checked). ``update`` or the fused ``apply`` of the inner
transform runs, so ``inject_hyperparams(adam)`` keeps Adam's bitwise parity with torch.

Injected: floats, one-element tensors, schedules (callables) and tuples / lists of these.
Ints, bools, strings, None, transforms and names listed in ``static_args`` are passed to
the factory unchanged.

**Differentiable mode.** Under ``optim.differentiable()`` a stored hyper-parameter that is a
tensor requiring grad is handed to the factory as that tensor (not its float), so
``sgd``/``adam``/``adamw`` differentiate the update with respect to it, and the next state
stores it with its graph; the transform is then built anew for each step.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from purestep.engine.tree import field, struct

from .base import GradientTransformation, Params, Updates, is_differentiable, step

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]

Tensor = torch.Tensor


@struct
class InjectHyperparamsState:
    """``count``: updates so far; ``hyperparams``: name -> 0-d float64 tensor (or a tuple of
    them); ``inner_state``: the wrapped transform's state; ``name``: the optimizer's torch
    class name when the factory declares one (``"AdamW"`` for ``adamw``), else ``""``."""

    count: int
    hyperparams: dict[str, Any]
    inner_state: Any
    name: str = field(static=True, default="")


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
    own_schedules = frozenset(getattr(factory, "schedule_args", ()))
    torch_name = getattr(factory, "optimizer_name", "")
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
        # Schedules the factory evaluates itself (at its own count, which is ours): they stay
        # in the factory's arguments and out of the cache key.
        handed_on = frozenset(n for n, s in specs.items() if n in own_schedules and _is_schedule(s))
        cache: list[Any] = [(None, None)]

        def evaluate(count: int, current: dict[str, Any] | None) -> tuple:
            """``(values, hyperparams)``: floats for the factory and the tensors to store."""
            values: dict[str, Any] = {}
            stored: dict[str, Any] = {}
            for name, spec in specs.items():
                if name in handed_on:
                    stored[name] = _as_tensor(float(spec(count)))  # for logging only
                elif isinstance(spec, (tuple, list)):
                    cur = current[name] if current is not None else (None,) * len(spec)
                    pairs = [_one(s, count, c) for s, c in zip(spec, cur)]
                    values[name] = tuple(v for v, _ in pairs)
                    stored[name] = tuple(t for _, t in pairs)
                else:
                    cur = current[name] if current is not None else None
                    values[name], stored[name] = _one(spec, count, cur)
            return values, stored

        def build(values: dict[str, Any]) -> GradientTransformation:
            if is_differentiable() and any(_holds_tensor(v) for v in values.values()):
                # Tensors that require grad (see ``_one``): each step builds its own
                # transform around this step's tensors, never a cached one around others.
                call = inspect.BoundArguments(sig, {**bound.arguments, **values})
                return factory(*call.args, **call.kwargs)
            key = tuple(values.items())
            cached_key, tx = cache[0]
            if cached_key != key:
                call = inspect.BoundArguments(sig, {**bound.arguments, **values})
                tx = factory(*call.args, **call.kwargs)
                cache[0] = (key, tx)
            return tx

        build(evaluate(0, None)[0])  # validate the arguments now

        def init(params: Params) -> InjectHyperparamsState:
            values, stored = evaluate(0, None)
            return InjectHyperparamsState(0, stored, build(values).init(params), torch_name)

        def update(updates: Updates, state: InjectHyperparamsState, params: Params | None = None):
            values, stored = evaluate(state.count, state.hyperparams)
            out, inner = build(values).update(updates, state.inner_state, params)
            return out, InjectHyperparamsState(state.count + 1, stored, inner, torch_name)

        def apply(grads: Updates, state: InjectHyperparamsState, params: Params) -> tuple:
            values, stored = evaluate(state.count, state.hyperparams)
            new_params, inner = step(build(values), grads, state.inner_state, params)
            return new_params, InjectHyperparamsState(state.count + 1, stored, inner, torch_name)

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
    if isinstance(current, Tensor) and current.requires_grad and is_differentiable():
        return current, current  # the factory gets the tensor, to differentiate it
    return float(current), current


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, Tensor) for v in value)
    return isinstance(value, Tensor)
