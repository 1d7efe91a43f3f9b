"""What ``from_torch`` keeps of a torch optimizer's values: hyper-parameter specs and plain data.

Hyper-parameters: the float entries of a param group (floats, one-element tensors, tuples of
them such as ``betas``, or schedules of the step count) live in the state as 0-d float64
tensors; ``_Hyper`` turns the state's value (or a schedule's) into what torch's group gets.
Plain data: what a checkpoint can hold (tensors, numbers, strings, ``None``, lists / tuples
/ dicts of them), copied, zeroed as placeholders and compared structurally here.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

Tensor = torch.Tensor

# Injected even when given as ints (torch's defaults are ``0``): the names the LR monitor logs.
_MONITORED = ("lr", "momentum", "weight_decay")


# --------------------------------------------------------------------------- hyper-parameters


def _is_schedule(value: Any) -> bool:
    return callable(value) and not isinstance(value, (Tensor, type))


def _is_scalar(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral))


def _injectable(key: str, value: Any) -> bool:
    """Whether a group entry lives in ``hyperparams``: floats, one-element tensors,
    schedules and non-empty tuples / lists of those; ``lr``, ``momentum`` and
    ``weight_decay`` also when ints (handed back to torch as floats)."""
    if key in _MONITORED and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return True
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_is_scalar(v) or _is_schedule(v) for v in value)
    return _is_scalar(value) or _is_schedule(value)


def _has_schedule(spec: Any) -> bool:
    if isinstance(spec, (tuple, list)):
        return any(_is_schedule(s) for s in spec)
    return _is_schedule(spec)


def _at(spec: Any, count: int) -> Any:
    """``spec`` (a value, a schedule or a tuple / list of them) with schedules evaluated."""
    if _is_schedule(spec):
        return float(spec(count))
    if isinstance(spec, (tuple, list)):
        return type(spec)(_at(s, count) for s in spec)
    return spec


def _f64(x: Any) -> Tensor:
    return torch.tensor(float(x), dtype=torch.float64)


def _stored(value: Any) -> Any:
    """A torch group value as the state holds it: a 0-d float64 tensor, or a tuple of them."""
    if isinstance(value, (tuple, list)):
        return tuple(_f64(v) for v in value)
    return _f64(value)


def _as_given(spec: Any, x: float) -> Any:
    """``x`` in the form the user gave it: a tensor like a tensor spec, else a float."""
    if isinstance(spec, Tensor):
        if float(spec) == x:
            return spec
        return torch.tensor(x, dtype=spec.dtype, device=spec.device)
    return x


class _Hyper:
    """One injected group entry: its spec (as given, schedules included) and a one-entry
    cache ``stored value -> torch value``, so an unchanged state costs no ``float()``."""

    __slots__ = ("cache", "key", "scheduled", "spec")

    def __init__(self, key: str, spec: Any) -> None:
        self.key, self.spec = key, spec
        self.scheduled = _has_schedule(spec)
        self.cache: tuple[Any, Any] = (None, None)

    def value(self, count: int, current: Any) -> tuple[Any, Any]:
        """``(value for torch's group, value to store)`` for the step at ``count``."""
        spec = self.spec
        if not self.scheduled:
            cached, value = self.cache
            if cached is not current:
                value = self._torch(current)
                self.cache = (current, value)
            return value, current
        if isinstance(spec, (tuple, list)):
            self._check_tuple(current)
            xs = [float(s(count)) if _is_schedule(s) else float(c) for s, c in zip(spec, current)]
            stored = tuple(_f64(x) if _is_schedule(s) else c for s, x, c in zip(spec, xs, current))
            return type(spec)(_as_given(s, x) for s, x in zip(spec, xs)), stored
        x = float(spec(count))
        return x, _f64(x)

    def _torch(self, current: Any) -> Any:
        spec = self.spec
        try:
            if isinstance(spec, (tuple, list)):
                self._check_tuple(current)
                return type(spec)(_as_given(s, float(c)) for s, c in zip(spec, current))
            return _as_given(spec, float(current))
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"from_torch: the state's hyper-parameter {self.key!r} must be a number or a "
                f"one-element tensor{' per entry' if isinstance(spec, (tuple, list)) else ''}, "
                f"got {current!r:.80}"
            ) from e

    def _check_tuple(self, current: Any) -> None:
        if not isinstance(current, (tuple, list)) or len(current) != len(self.spec):
            raise TypeError(
                f"from_torch: the state's hyper-parameter {self.key!r} must be a tuple of "
                f"{len(self.spec)} values, got {current!r:.80}"
            )


# --------------------------------------------------------------------------- plain values

_IMMUTABLE = (bool, int, float, str, type(None))


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Refuse values a checkpoint cannot hold (see the module doc)."""
    if isinstance(value, Tensor) or type(value) in _IMMUTABLE:
        return
    if depth < 20 and isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]", depth + 1)
        return
    if depth < 20 and type(value) is dict:
        for k, v in value.items():
            if type(k) not in (int, float, str):
                raise TypeError(f"{where} has the key {k!r}; state keys must be str or int")
            _check_plain(v, f"{where}[{k!r}]", depth + 1)
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}: from_torch keeps the optimizer's state in the "
        "TrainState, whose checkpoints hold only tensors, numbers, strings, None and "
        "lists / tuples / dicts of them"
    )


def _copy(value: Any) -> Any:
    """A copy of a plain value that the optimizer may write into (tensors cloned)."""
    if isinstance(value, Tensor):
        return value.clone()
    if type(value) in _IMMUTABLE:
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _placeholder(value: Any) -> Any:
    """A zero value of ``value``'s structure, shape and type (an entry not created yet)."""
    if isinstance(value, Tensor):
        return torch.zeros_like(value)
    if type(value) in _IMMUTABLE:
        return type(value)() if value is not None else None
    if isinstance(value, (tuple, list)):
        return type(value)(_placeholder(v) for v in value)
    if isinstance(value, dict):
        return {k: _placeholder(v) for k, v in value.items()}
    return value


def _compatible(old: Any, new: Any) -> bool:
    """Whether ``new`` can replace ``old`` in a state of fixed structure (as checkpoints
    match it: the same nesting, tensors of the same shape and dtype, numbers for numbers)."""
    if isinstance(new, Tensor):
        return isinstance(old, Tensor) and old.shape == new.shape and old.dtype == new.dtype
    if isinstance(old, Tensor):
        return False
    if isinstance(new, (tuple, list)):
        return (
            isinstance(old, (tuple, list))
            and len(old) == len(new)
            and all(_compatible(a, b) for a, b in zip(old, new))
        )
    if isinstance(new, dict):
        return (
            isinstance(old, dict)
            and old.keys() == new.keys()
            and all(_compatible(old[k], new[k]) for k in new)
        )
    if new is None or old is None:
        return new is old
    if isinstance(new, (int, float)) and isinstance(old, (int, float)):
        return isinstance(new, bool) == isinstance(old, bool)
    return type(new) is type(old)


def _unalias(value: Any, storages: set[int]) -> Any:
    """``value`` with every tensor that shares one of ``storages`` cloned."""
    if isinstance(value, Tensor):
        return value.clone() if value.untyped_storage().data_ptr() in storages else value
    if isinstance(value, (tuple, list)):
        return type(value)(_unalias(v, storages) for v in value)
    if isinstance(value, dict):
        return {k: _unalias(v, storages) for k, v in value.items()}
    return value
