"""What the Trainer and a Task's ``configure_optimizers`` accept as one optimizer.

``as_transformation(value)`` returns a ``GradientTransformation`` for:

* an ``engine.optim`` transform (returned as it is; anything with ``init`` and ``update``
  counts, as before);
* a ``torch.optim.Optimizer`` subclass, with torch's defaults: ``torch.optim.NAdam``;
* such a class with keyword arguments, ``functools.partial(torch.optim.NAdam, lr=1e-3)``,
  run through ``optim.from_torch`` (which is the explicit spelling of the same).

A pair ``(cls, kwargs)`` is not one of them: in ``configure_optimizers`` a tuple is
Lightning's list of optimizers.

An already-built torch optimizer (bound to some module's parameters, Lightning's
``torch.optim.Adam(self.parameters(), lr=...)``) is refused with the ``from_torch`` call
that replaces it (its constructor arguments only: never what an LR scheduler wrote into
its param groups), and anything else with the list of accepted forms. Returned from
``configure_optimizers`` together with the torch LR scheduler built on it, an instance is
taken (``loops.optimizers``: ``torch_instances.from_instance`` names its params through
the module).
"""

from __future__ import annotations

import functools
from typing import Any

from torch.optim import Optimizer

from ._torch_setup import _instance_message
from .base import GradientTransformation
from .from_torch import from_torch

__all__ = ["as_transformation"]

_ACCEPTED = (
    "an engine.optim transform (e.g. optim.adamw(1e-3)), or a torch.optim.Optimizer class "
    "with its arguments: optim.from_torch(torch.optim.NAdam, lr=1e-3), "
    "functools.partial(torch.optim.NAdam, lr=1e-3) or the bare class torch.optim.NAdam"
)


def _is_optimizer_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, Optimizer)


def as_transformation(value: Any, what: str = "optimizer") -> GradientTransformation:
    """``value`` as a ``GradientTransformation`` (see the module doc); ``what`` names it in
    error messages (``"configure_optimizers() returned"``-style context)."""
    if isinstance(value, GradientTransformation):
        return value
    if isinstance(value, Optimizer):
        raise TypeError(_instance_message(value, what))
    if _is_optimizer_class(value):
        return from_torch(value)
    if isinstance(value, functools.partial) and _is_optimizer_class(value.func):
        if value.args:
            raise TypeError(
                f"{what}: functools.partial({value.func.__qualname__}, ...) must give keyword "
                f"arguments only (the params come from the TrainState), got the positional "
                f"arguments {value.args!r:.80}"
            )
        return from_torch(value.func, **value.keywords)
    if hasattr(value, "init") and hasattr(value, "update") and not isinstance(value, type):
        return value  # a transform-like object of the user's own
    raise TypeError(f"{what} must be {_ACCEPTED}; got {_describe(value)}")


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    return f"a {type(value).__name__}"
