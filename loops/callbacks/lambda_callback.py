"""A stateless callback made of plain functions: ``LambdaCallback(on_train_epoch_end=fn)``.

Each keyword names a loop event and gives ``fn(ctx) -> Requests | None``. The functions
must be pure like any handler (no printing: return ``Requests(messages=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..events import EVENTS, NOTHING, Context, Requests
from .base import Callback

__all__ = ["LambdaCallback"]

Handler = Callable[[Context], "Requests | None"]
_CLASSES: dict[tuple[type, frozenset[str]], type] = {}


def _handler(event: str) -> Callable[[Any, Any, Context], tuple[Any, Requests]]:
    def handle(self: LambdaCallback, state: Any, ctx: Context) -> tuple[Any, Requests]:
        result = self.handlers[event](ctx)
        if result is None:
            return state, NOTHING
        if not isinstance(result, Requests):
            raise TypeError(
                f"LambdaCallback's {event} function must return Requests or None, "
                f"got {type(result).__name__}"
            )
        return state, result

    handle.__name__ = event
    return handle


def _class_for(base: type, events: frozenset[str]) -> type:
    """A subclass of ``base`` overriding exactly ``events``, so the loops call only those."""
    cls = _CLASSES.get((base, events))
    if cls is None:
        body = {e: _handler(e) for e in sorted(events)}
        body.update(_lambda_base=base, __qualname__=base.__qualname__)
        cls = type(base.__name__, (base,), body)
        _CLASSES[(base, events)] = cls
    return cls


class LambdaCallback(Callback):
    """A callback from functions: each keyword is an event of ``loops.events.EVENTS``.

    ``name``: the key of its (empty) state; give one when using several LambdaCallbacks.
    """

    def __init__(self, name: str | None = None, **handlers: Handler) -> None:
        unknown = sorted(set(handlers) - set(EVENTS))
        if unknown:
            raise ValueError(
                f"LambdaCallback got unknown event(s) {unknown}; valid events are: "
                + ", ".join(EVENTS)
            )
        for event, fn in handlers.items():
            if not callable(fn):
                raise TypeError(
                    f"LambdaCallback({event}=...) must be a function ctx -> Requests | None, "
                    f"got {type(fn).__name__}"
                )
        self.handlers: dict[str, Handler] = dict(handlers)
        if name is not None:
            self.name = name
        base = type(self).__dict__.get("_lambda_base", type(self))
        self.__class__ = _class_for(base, frozenset(handlers))
