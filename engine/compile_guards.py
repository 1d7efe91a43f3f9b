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
- dropped: guards on the *identity* of the step's own code and objects (that a function, a
  module, a class or a builtin is the same object, that a module has no hooks, that an
  instance attribute does not shadow a method, that two of the step's objects alias).

A changed input or value fails its guard and goes through dynamo's normal path: the
recompilation, as before. What the floor assumes is the contract a step already has: do not
swap the model's modules, register hooks on it or monkeypatch the functions it calls after
the step is built (build a new step instead). ``guards="dynamo"`` keeps every guard.

On top of that, a compiled call skips torch.compile's per-call entry when it can: the
engine checks the (filtered) guards of the graphs compiled so far itself, in dynamo's order,
and runs the chosen graph's code directly; when none passes, the call goes through
torch.compile, which recompiles. It needs ``fullgraph=True`` (no resume functions to trace)
and dynamo's cache entries readable; where either is missing the call goes through
torch.compile every time, with the same filtered guards.
"""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["DROPPED_GUARDS", "GUARD_MODES", "guard_filter", "supports_guard_filter"]

#: the values of ``CompileOptions.guards``
GUARD_MODES = ("engine", "dynamo")

#: dynamo's guard kinds that check the identity of an object rather than a value; dropped
#: when the object is not one of the step's inputs
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
            out.append(on_input or entry.guard_type not in DROPPED_GUARDS)
        return out

    return keep


class DirectCalls:
    """The graphs dynamo compiled for one function, called without torch.compile's entry.

    ``run(args)`` checks each cache entry's guards (as filtered when it was compiled) in
    dynamo's order and runs the first passing entry's code as a plain function; it returns
    ``MISS`` when none passes or the entries are unknown, and the caller goes through
    torch.compile (then ``refresh()``)."""

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

    def run(self, args: tuple[Any, ...]) -> Any:
        entries = self._entries
        if not entries or not _default_stance():
            return self.MISS
        frame = dict(self._frame)
        frame.update(zip(self._inputs, args))
        for check, run in entries:
            if check(frame):
                return run(*args)
        return self.MISS


def _default_stance() -> bool:
    """False under ``torch.compiler.set_stance`` other than the default (force_eager, ...):
    those go through torch.compile, which applies them."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return stance is None or (stance.stance == "default" and not stance.skip_guard_eval_unsafe)
