"""Trainer flags from the environment and from the command line.

``PURESTEP_TRAINER_<FLAG>`` environment variables supply defaults for flags not passed
explicitly (explicit arguments win; values are read with ``ast.literal_eval``, so ``3``,
``0.5``, ``None``, ``False`` and ``{0: 2}`` work, and anything literal_eval cannot read
stays a string: ``cpu``, ``bf16-mixed``, ``00:01:00:00``; an empty value is ignored).
``add_argparse_args(parser)`` adds one ``--<flag>`` option per Trainer flag, parsed the same
way, and ``from_argparse_args(cls, args, **overrides)`` builds a Trainer from the result.
An unknown flag name is a ``TypeError`` that suggests the closest known one.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ENV_PREFIX",
    "add_argparse_args",
    "check_flag_names",
    "defaults_from_env",
    "flag_names",
    "from_argparse_args",
    "parse_value",
]

ENV_PREFIX = "PURESTEP_TRAINER_"
# Flags that take Python objects only: no command-line option for them.
_NOT_FROM_COMMAND_LINE = frozenset({"callbacks"})


def parse_value(text: str) -> Any:
    """A flag value from text: a Python literal when it is one, else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def flag_names(init: Callable[..., Any]) -> list[str]:
    """The keyword flags of a Trainer ``__init__`` (everything but ``self``)."""
    params = inspect.signature(init).parameters.values()
    return [
        p.name
        for p in params
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def check_flag_names(given: Any, known: list[str], owner: str = "Trainer") -> None:
    """Refuse names that are not flags, suggesting the closest known flag for each."""
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), known, n=1)
        parts.append(f"`{name}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
    raise TypeError(f"{owner} got unknown flag(s): {', '.join(parts)}")


def defaults_from_env(init: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``__init__`` so unset flags take ``PURESTEP_TRAINER_<FLAG>`` values."""
    signature = inspect.signature(init)
    names = flag_names(init)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        check_flag_names(kwargs, names, type(self).__name__)
        bound = signature.bind_partial(self, *args, **kwargs)
        for name in names:
            if name in bound.arguments:
                continue
            text = os.environ.get(ENV_PREFIX + name.upper())
            if text:
                kwargs[name] = parse_value(text)
        init(self, *args, **kwargs)

    return wrapper


def add_argparse_args(
    init: Callable[..., Any], parser: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """Add ``--<flag>`` for every flag of ``init`` that can be given as text."""
    group = parser.add_argument_group("Trainer")
    for name in flag_names(init):
        if name in _NOT_FROM_COMMAND_LINE:
            continue
        default = inspect.signature(init).parameters[name].default
        group.add_argument(
            f"--{name}",
            dest=name,
            type=parse_value,
            default=argparse.SUPPRESS,
            help=f"Trainer flag {name} (default: {default!r})",
        )
    return parser


def from_argparse_args(
    cls: type, args: argparse.Namespace | Mapping[str, Any], **overrides: Any
) -> Any:
    """A ``cls`` built from parsed arguments (keys that are not flags are ignored, so the
    namespace may hold the script's own options; ``overrides`` win and must be flags)."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    names = flag_names(cls.__init__)
    check_flag_names(overrides, names, cls.__name__)
    flags = {k: v for k, v in given.items() if k in names}
    flags.update(overrides)
    return cls(**flags)
