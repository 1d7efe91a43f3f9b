"""The guard floor of a compiled step: what is checked on every call, and how cheaply.

torch.compile guards every graph with hundreds of checks, re-evaluated on every call:
that each function, module, class and global the step touched is still the same object,
that no hook was added to a module, that the inputs have the shapes they had... For a step
most of them are constants: a step's loss function, model and optimizer are fixed when the
step is built. ``guards="engine"`` (the default of ``CompileOptions``) keeps the checks that
can change from one call to the next and drops the others when a graph is compiled:

- kept: every guard on the step's inputs (the state's and the batch's tree structure, each
  tensor's shape, strides, dtype, device, requires_grad and aliasing, the values of their
  Python leaves), the ambient state (grad mode, autocast, deterministic algorithms,
  torch-function modes, the default device), the symbolic guards on the counters traced
  as dynamic (an lr schedule's phase), and every guard on a *value* read from elsewhere (a
  Python number or flag an outside object holds, such as a LightningModule's
  ``current_epoch``; a container's length or keys);
- dropped: guards on the *identity* of the step's own code (that a function, a module, a
  class, an ``nn.Module`` or a builtin is the same object, that a module has no hooks, that
  an instance attribute does not shadow a method, that two of the step's objects alias).
  Identity guards on data stay: an enum member, a key added to a plain dict, an instance
  attribute shadowing a class-level number.

A changed input or value fails its guard and goes through dynamo's normal path: the
recompilation, as before. What the floor assumes is the contract a step already has: do not
swap the model's modules, register hooks on it or monkeypatch the functions it calls after
the step is built, of any kind (build a new step instead). ``guards="dynamo"`` keeps every
guard. ``torch._dynamo.reset()`` empties the engine's entries with dynamo's.

On top of that, a compiled call skips torch.compile's per-call entry when it can: the
engine checks the (filtered) guards of the graphs compiled so far itself, most recently hit
first (as dynamo orders them), and runs the chosen graph's code directly; when none
passes, the call goes through torch.compile, which recompiles. It needs ``fullgraph=True``
(no resume functions to trace) and dynamo's cache entries readable; where either is missing
the call goes through torch.compile every time, with the same filtered guards.
"""

from __future__ import annotations

import enum
import functools
import inspect
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .compile_options import GUARD_MODES

__all__ = ["DROPPED_GUARDS", "GUARD_MODES", "guard_filter", "supports_guard_filter"]

#: dynamo's guard kinds that check the identity of an object rather than a value; dropped
#: when the object is not one of the step's inputs and is code (a function, a module, a
#: class, an ``nn.Module``, ...), not data (an enum member, a number, a tensor)
DROPPED_GUARDS = frozenset(
    {
        "BUILTIN_MATCH",
        "CLASS_MATCH",
        "CLOSURE_MATCH",
        "DICT_NOT_CONTAINS",
        "DUPLICATE_INPUT",
        "EMPTY_NN_MODULE_HOOKS_DICT",
        "FUNCTION_MATCH",
        "ID_MATCH",
        "MODULE_MATCH",
        "NN_MODULE",
        "NOT_PRESENT_IN_GENERIC_DICT",
    }
)

#: kinds dropped whatever their value (the step's own aliasing and hooks)
_ALWAYS_DROPPED = frozenset({"DUPLICATE_INPUT", "EMPTY_NN_MODULE_HOOKS_DICT"})

_CODE_TYPES = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    types.CodeType,
    functools.partial,
    type,
    torch.nn.Module,
)


def _is_code(value: Any) -> bool:
    return isinstance(value, _CODE_TYPES) and not isinstance(value, enum.Enum)


def _identity_of_code(entry: Any) -> bool:
    """Whether a guard of a ``DROPPED_GUARDS`` kind checks code (droppable) rather than
    data: an enum member compared by identity, a key added to a plain dict, an instance
    attribute shadowing a class-level number are data and stay guarded."""
    kind = entry.guard_type
    if kind in _ALWAYS_DROPPED:
        return True
    if kind == "DICT_NOT_CONTAINS":  # a class's or an object's ``__dict__``: a shadowed method
        return "__dict__" in entry.name or entry.name.startswith("dict(")
    if not getattr(entry, "has_value", False):
        return kind in ("MODULE_MATCH", "BUILTIN_MATCH", "CLASS_MATCH", "CLOSURE_MATCH")
    value = entry.value
    if kind == "NOT_PRESENT_IN_GENERIC_DICT":  # ``value`` has no instance attribute ``attr``
        create = getattr(entry.orig_guard, "create_fn", None)
        attr = getattr(create, "keywords", {}).get("attr") if create is not None else None
        if attr is None:
            return False
        default = inspect.getattr_static(type(value), attr, None)
        return callable(default) or hasattr(default, "__get__")  # a method or descriptor
    return _is_code(value)


_ROOT = re.compile(r"[.\[]")


def supports_guard_filter() -> bool:
    """Whether this torch's ``torch.compile`` takes a ``guard_filter_fn`` (torch 2.8 on)."""
    try:
        from torch._dynamo import eval_frame

        return "guard_filter_fn" in inspect.signature(eval_frame._optimize).parameters
    except (ImportError, AttributeError, TypeError, ValueError):  # pragma: no cover - old torch
        return False


def guard_filter(inputs: Sequence[str]) -> Callable[[Sequence[Any]], list[bool]]:
    """The ``guard_filter_fn`` of a graph whose function takes ``inputs``: True for each
    guard kept (see the module doc)."""
    names = frozenset(inputs)

    def keep(entries: Sequence[Any]) -> list[bool]:
        out = []
        for entry in entries:
            on_input = not entry.is_global and _ROOT.split(entry.name, 1)[0] in names
            dropped = entry.guard_type in DROPPED_GUARDS and _identity_of_code(entry)
            out.append(on_input or not dropped)
        return out

    return keep


class DirectCalls:
    """The graphs dynamo compiled for one function, called without torch.compile's entry.

    ``run(args)`` checks each cache entry's guards (as filtered when it was compiled), most
    recently hit first as dynamo does, and runs the first passing entry's code as a plain
    function; it returns ``MISS`` when none passes or the entries are unknown, and the
    caller goes through torch.compile (then ``refresh()``)."""

    MISS = object()

    def __init__(self, fn: types.FunctionType) -> None:
        code = fn.__code__
        self._fn = fn
        self._inputs = code.co_varnames[: code.co_argcount]
        cells = fn.__closure__ or ()
        self._frame = {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}
        self._entries: list[tuple[Callable[[dict], bool], Callable[..., Any]]] = []

    def refresh(self) -> None:
        """Read dynamo's cache entries of the function again (after a compiled call)."""
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            found = _debug_get_cache_entry_list(self._fn.__code__)
        except (ImportError, AttributeError, TypeError):  # pragma: no cover - other torch
            self._entries = []
            return
        fn, entries = self._fn, []
        for entry in found:
            code = entry.code
            if code.co_freevars != fn.__code__.co_freevars:  # pragma: no cover - defensive
                self._entries = []
                return
            run = types.FunctionType(code, fn.__globals__, fn.__name__, None, fn.__closure__)
            entries.append((entry.guard_manager.check, run))
        self._entries = entries

    def forget(self) -> None:
        """Drop the entries read (``torch._dynamo.reset()`` emptied dynamo's caches: the
        next call goes through torch.compile and compiles anew)."""
        self._entries = []

    def run(self, args: tuple[Any, ...]) -> Any:
        entries = self._entries
        if not entries or not _default_stance():
            return self.MISS
        frame = dict(self._frame)
        frame.update(zip(self._inputs, args))
        for i, entry in enumerate(entries):
            if entry[0](frame):
                if i:  # dynamo moves a hit to the front of its list: so does this
                    entries.insert(0, entries.pop(i))
                return entry[1](*args)
        return self.MISS


def _default_stance() -> bool:
    """False under a ``torch.compiler.set_stance`` other than the default (force_eager,
    force_backend, ...): those calls go through torch.compile, which applies the stance."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return stance is None or (
        stance.stance == "default"
        and not stance.skip_guard_eval_unsafe
        and getattr(stance, "backend", None) is None
    )
