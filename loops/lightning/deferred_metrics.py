"""torchmetrics objects that load their states at their first use in a hook.

``metric_states.in_hook`` gives every registered metric its kept states for the length of a
hook, but copying them costs: so it sets each metric's class to a ``deferred`` subclass
whose states, update flags and methods load the metric when first read or written (and give
it its class back). A hook that never uses a metric costs no copy of its kept states.
``PENDING`` holds the metrics not loaded yet, with the hook view that loads them (its
``_load_metric(path)``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PENDING", "deferred", "load_pending"]

#: The metrics an ``in_hook`` has not loaded yet, by ``id``: (the hook's view, path).
PENDING: dict[int, tuple[Any, str]] = {}
#: What ``in_hook`` loads a metric on the first use of, besides its states: the flags
#: ``_load`` sets and the methods that read or reset them.
_LOADING = ("_update_count", "_computed", "_forward_cache", "_to_sync")
_LOADING += ("update", "compute", "forward", "reset")
_DEFERRED: dict[tuple[type, tuple[str, ...]], type] = {}


def load_pending(metric: Any) -> None:
    """Load a metric its ``in_hook`` deferred (its class is the ``deferred`` one)."""
    found = PENDING.pop(id(metric), None)
    if found is None:  # not a pending hook's (it failed to put it back): its class back
        object.__setattr__(metric, "__class__", type(metric).__bases__[0])
        return
    owner, path = found
    owner._load_metric(path)


def deferred(cls: type, names: tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose instances load themselves (their owner's ``_load_metric``)
    when one of their states (``names``), update flags or methods is read or written,
    which gives them their class back. ``in_hook`` sets it as a metric's class for the
    hook's length: a hook that never uses the metric costs no copy of its kept states."""
    key = (cls, names)
    found = _DEFERRED.get(key)
    if found is None:
        namespace: dict[str, Any] = {name: _loading(name) for name in (*names, *_LOADING)}
        namespace.update(
            __module__=cls.__module__,
            __qualname__=cls.__qualname__,
            __hash__=_hash_unloaded,  # named_modules() hashes modules: no load for that
            __getstate__=_loaded_then("__getstate__"),
            __reduce_ex__=_loaded_then("__reduce_ex__"),
        )
        found = _DEFERRED[key] = type(cls)(cls.__name__, (cls,), namespace)
    return found


def _loading(name: str) -> property:
    def get(self: Any) -> Any:
        load_pending(self)
        return getattr(self, name)

    def put(self: Any, value: Any) -> None:
        load_pending(self)
        setattr(self, name, value)

    def delete(self: Any) -> None:
        load_pending(self)
        delattr(self, name)

    return property(get, put, delete)


def _loaded_then(method: str) -> Any:
    def call(self: Any, *args: Any) -> Any:
        load_pending(self)
        return getattr(self, method)(*args)

    return call


def _hash_unloaded(self: Any) -> int:
    """torchmetrics' ``Metric.__hash__`` (class name, id and states), of the states as
    they are, without loading."""
    held = self.__dict__
    return hash((type(self).__name__, id(self), *(held[n] for n in self._defaults)))
