"""Clearer errors from the user's step functions.

Two helpers used wherever the engine calls a loss, eval or predict function:

* ``check_signature(fn, what)`` runs when a step is built. It refuses a function written
  PyTorch Lightning's way, ``fn(batch, batch_idx)``, with a ``TypeError`` that says what the
  engine calls instead, ``fn(apply, batch)``; left alone, such a function fails on its first
  call with an unrelated message (``'Flatten' object has no attribute 'flatten'``).
* ``check_call(fn, args, ...)`` runs when a run starts, for the hooks the loops will call
  later (a Task's ``on_*`` hooks, a callback's handlers): a hook that cannot take the
  arguments it will get, or that has a Lightning callback's ``(trainer, pl_module)``, is a
  ``TypeError`` naming it, the signature found and the one expected, instead of failing
  an epoch later with ``takes 1 positional argument but 3 were given``.
* ``annotate(exc, fn, stage, batch)`` runs only when the user's function raised: it adds a
  note (PEP 678) naming the function, the step and the batch's structure, then the caller
  re-raises the same exception. The call sites wrap the user call in ``try`` / ``except``,
  which costs nothing on Python 3.11+ while nothing raises; the summary is computed only
  on failure. The note is added once, however many steps the exception passes through.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["annotate", "check_call", "check_signature", "describe_function", "summarize"]

#: Every note this module adds starts with this (it also marks an exception as annotated).
NOTE_PREFIX = "purestep:"

#: Second parameters that show a Lightning-style step, ``(batch, batch_idx)``.
_INDEX_NAMES = frozenset({"batch_idx", "batch_nb", "batch_index", "dataloader_idx"})

#: What each step calls its user function, for the note.
_ROLES = {
    "train_step": "loss function",
    "per_sample_step": "loss function",
    "eval_step": "eval function",
    "predict_step": "predict function",
}

_MAX_ITEMS = 6  # container entries shown before "... (n more)"
_MAX_DEPTH = 3  # nesting shown before "..."
_MAX_CHARS = 400  # the summary's length bound


# --------------------------------------------------------------------------- naming


def describe_function(fn: Any) -> str:
    """A readable qualified name for ``fn``: a function, bound method, partial or object."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({describe_function(fn.func)})"
    name = getattr(fn, "__qualname__", None)
    if isinstance(name, str):
        return name
    return f"{type(fn).__qualname__}.__call__"


# --------------------------------------------------------------------------- the signature


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def check_signature(fn: Any, what: str, *, method: bool = False) -> None:
    """Raise ``TypeError`` if ``fn`` looks like a Lightning step: its first parameter is named
    ``batch``, or its second ``batch_idx`` (or ``batch_nb``, ``batch_index``,
    ``dataloader_idx``). ``what`` names the argument in the message (``"loss_fn"``,
    ``"eval_step fn"``), or with ``method=True`` the method of a class body whose function
    ``fn`` is (``self`` is then skipped).

    Anything else passes, including ``*args``, ``functools.partial``, callable objects and
    builtins whose signature cannot be read.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    names = [p.name for p in signature.parameters.values() if p.kind in _POSITIONAL]
    if method:
        names = names[1:]
    lightning = len(names) > 1 and names[1] in _INDEX_NAMES
    # ``(batch)`` alone is Lightning's shape too; ``(batch, model)`` has them swapped.
    swapped = names[:1] == ["batch"] and not lightning
    if not (lightning or swapped):
        return
    short = what.rsplit(" ", 1)[-1]
    body = (
        "return apply(batch)"
        if "predict" in what
        else "x, y = batch; return F.mse_loss(apply(x), y)"
    )
    if method:
        subject = f"{describe_function(fn)}(self, {', '.join(names)})"
        expects = f"{short}(self, apply, batch)"
        example = f"def {short}(self, apply, batch): {body}"
    else:
        name = describe_function(fn)
        subject = f"{name if name == short else f'{what} {name}'}({', '.join(names)})"
        expects = f"{short}(apply, batch)"
        example = f"def {short}(apply, batch): {body}"
    shape = (
        "has PyTorch Lightning's step signature (batch, batch_idx)"
        if lightning or len(names) == 1
        else "takes the batch first: its parameters look swapped"
    )
    raise TypeError(
        f"{subject} {shape}; purestep "
        f"calls {expects}, where apply is the model bound to the state's tensors (call it "
        f"like the module: apply(x)) and no batch index is passed. For example: {example}"
    )


# --------------------------------------------------------------------------- hooks

#: The first parameters of a PyTorch Lightning callback hook.
_LIGHTNING_HOOK = ["trainer", "pl_module"]


def _shown_signature(fn: Any, signature: inspect.Signature) -> str:
    """``fn``'s signature as written, ``self`` included for a bound method."""
    if inspect.ismethod(fn):
        try:
            return str(inspect.signature(fn.__func__))
        except (TypeError, ValueError):
            pass
    return str(signature)


def check_call(fn: Any, args: tuple[str, ...], name: str, expected: str, explain: str) -> None:
    """Raise ``TypeError`` if ``fn`` cannot be called with the positional arguments named
    ``args`` (the way the loops will call it), or if it takes Lightning's callback
    arguments ``(trainer, pl_module, ...)``. ``name`` names it (``"MyCallback.on_fit_end"``),
    ``expected`` is the signature the loops call (``"on_fit_end(self, state, ctx)"``) and
    ``explain`` says what the arguments are and what it returns. Anything whose signature
    cannot be read passes."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    names = [p.name for p in signature.parameters.values() if p.kind in _POSITIONAL]
    lightning = names[:2] == _LIGHTNING_HOOK
    try:
        signature.bind(*args)
    except TypeError as err:
        problem = f"does not take the arguments the loops pass ({err})"
    else:
        if not lightning:
            return
        problem = "has a PyTorch Lightning callback's signature (trainer, pl_module, ...)"
    raise TypeError(
        f"{name}{_shown_signature(fn, signature)} {problem}; purestep calls {expected}: {explain}"
    )


# --------------------------------------------------------------------------- the batch


def summarize(batch: Any, limit: int = _MAX_CHARS) -> str:
    """The structure of ``batch`` in one bounded line: container types, dict keys, tensor
    shapes and dtypes, e.g. ``dict{'x': Tensor[32, 64] float32, 'y': Tensor[32] int64}``."""
    try:
        text = _describe(batch, 0)
    except Exception as exc:  # a summary must never hide the user's error
        return f"<{type(batch).__qualname__}: not summarised ({type(exc).__name__})>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _entries(items: list[str], total: int) -> str:
    if total > len(items):
        items = [*items, f"... ({total - len(items)} more)"]
    return ", ".join(items)


def _short_repr(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "..."


def _describe(x: Any, depth: int) -> str:
    name = type(x).__qualname__
    if isinstance(x, torch.Tensor):
        shape = ", ".join(str(s) for s in x.shape)
        dtype = str(x.dtype).removeprefix("torch.")
        device = "" if x.device.type == "cpu" else f" {x.device}"
        kind = "Tensor" if type(x) in (torch.Tensor, torch.nn.Parameter) else name
        return f"{kind}[{shape}] {dtype}{device}"
    if x is None or isinstance(x, (bool, int, float, complex)):
        return name if x is not None else "None"
    if isinstance(x, (str, bytes)):
        return f"{name}[{len(x)}]"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:  # numpy and friends
        return f"{name}[{', '.join(str(s) for s in shape)}] {dtype}"
    if depth >= _MAX_DEPTH:
        return f"{name}{{...}}" if isinstance(x, Mapping) else f"{name}(...)"
    if isinstance(x, Mapping):
        shown = list(x.items())[:_MAX_ITEMS]
        body = [f"{_short_repr(k)}: {_describe(v, depth + 1)}" for k, v in shown]
        return f"{name}{{{_entries(body, len(x))}}}"
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):  # a namedtuple
        shown = list(zip(type(x)._fields, x))[:_MAX_ITEMS]
        body = [f"{k}={_describe(v, depth + 1)}" for k, v in shown]
        return f"{name}({_entries(body, len(x))})"
    if isinstance(x, (tuple, list)):
        body = [_describe(v, depth + 1) for v in x[:_MAX_ITEMS]]
        open_, close = ("(", ")") if isinstance(x, tuple) else ("[", "]")
        return f"{name}{open_}{_entries(body, len(x))}{close}"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = dataclasses.fields(x)
        body = [f"{f.name}={_describe(getattr(x, f.name), depth + 1)}" for f in fields[:_MAX_ITEMS]]
        return f"{name}({_entries(body, len(fields))})"
    return name


# --------------------------------------------------------------------------- the note


def _dict_hint(exc: BaseException, batch: Any) -> str | None:
    """A hint for the commonest dict-batch mistake, ``x, y = batch`` (which gives the keys)."""
    if not isinstance(batch, Mapping) or not isinstance(
        exc, (AttributeError, TypeError, ValueError)
    ):
        return None
    keys = [k for k in list(batch)[:2] if isinstance(k, str)]
    if not keys:
        return None
    unpacked = ", ".join(f"{k!r}" for k in keys)
    return (
        f"hint: unpacking a dict batch (x, y = batch) gives its keys ({unpacked}), "
        f"not its values; index it: batch[{keys[0]!r}]"
    )


def annotate(exc: BaseException, fn: Any, stage: str, batch: Any) -> None:
    """Add a note to ``exc`` naming ``fn``, the step ``stage`` (``"train_step"``,
    ``"eval_step"``, ``"predict_step"``, ``"per_sample_step"``, optionally with a detail in
    parentheses) and the structure of the ``batch`` it was called with. Once per exception:
    an exception that already carries a purestep note is left as it is. The exception's type
    and message are unchanged; on Python 3.10 (no ``add_note``) the note goes into
    ``__notes__``, which 3.10's traceback does not print. Never raises."""
    try:
        notes = getattr(exc, "__notes__", None) or ()
        if any(isinstance(n, str) and n.startswith(NOTE_PREFIX) for n in notes):
            return
        role = _ROLES.get(stage.split(" ", 1)[0], "function")
        lines = [
            f"{NOTE_PREFIX} raised in the {role} {describe_function(fn)}, called as "
            f"fn(apply, batch) by {stage}",
            f"batch: {summarize(batch)}",
        ]
        hint = _dict_hint(exc, batch)
        if hint is not None:
            lines.append(hint)
        note = "\n".join(lines)
        add_note = getattr(exc, "add_note", None)
        if add_note is not None:
            add_note(note)
        else:
            exc.__notes__ = [*notes, note]
    except Exception:
        pass
