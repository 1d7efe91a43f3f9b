"""How a step is compiled: ``CompileOptions``, and ``compile_options`` reading the ``compile=``
argument of the step builders and the Trainer.

What a caller asks for, kept apart from the compiled steps that act on it
(``engine.compile``), where its names are importable too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CompileError", "CompileOptions", "GUARD_MODES", "compile_options"]

#: the values of ``CompileOptions.guards`` (see ``engine.compile_guards``)
GUARD_MODES = ("engine", "dynamo")


class CompileError(RuntimeError):
    """A step function could not be traced as one graph (``fullgraph=True``)."""


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How a step is compiled (``compile=CompileOptions(...)``; ``compile=True`` is the default).

    ``backend``: a ``torch.compile`` backend name (``"inductor"``, ``"aot_eager"``,
    ``"eager"``) or callable. ``mode``: inductor's mode (``"default"``, ``"reduce-overhead"``,
    ``"max-autotune"``, ...; inductor only). ``dynamic``: as ``torch.compile`` (None: static
    first, then generic in a shape that changes; True: generic from the start; False: one
    graph per shape). ``fullgraph``: refuse graph breaks (a clear ``CompileError``).
    ``options``: inductor config patches (``torch._inductor.config`` names). ``guards``:
    ``"engine"`` checks on each call what can change between calls (the inputs, the ambient
    state, the values the step reads) and not the identity of the step's own functions and
    modules (``engine.compile_guards``); ``"dynamo"`` keeps every guard of torch.compile.
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = True
    options: Mapping[str, Any] | None = None
    guards: str = "engine"

    def __post_init__(self) -> None:
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(f"backend must be a name or a callable, got {self.backend!r}")
        if self.mode is not None and not isinstance(self.mode, str):
            raise TypeError(f"mode must be a string or None, got {self.mode!r}")
        if self.mode is not None and self.backend != "inductor":
            raise ValueError(f"mode={self.mode!r} applies to the inductor backend only")
        if self.mode is not None:  # an unknown mode fails here, not at the first step
            import torch._inductor

            try:
                torch._inductor.list_mode_options(self.mode, self.dynamic)
            except RuntimeError as exc:
                raise ValueError(f"unknown inductor mode {self.mode!r}: {exc}") from None
        if self.dynamic not in (None, True, False):
            raise TypeError(f"dynamic must be None, True or False, got {self.dynamic!r}")
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"fullgraph must be a bool, got {self.fullgraph!r}")
        if self.options is not None and not isinstance(self.options, Mapping):
            raise TypeError(f"options must be a mapping, got {type(self.options).__name__}")
        if self.guards not in GUARD_MODES:
            raise ValueError(f"guards must be 'engine' or 'dynamo', got {self.guards!r}")


def compile_options(value: Any) -> CompileOptions | None:
    """``compile=`` as given to a step builder: None/False (eager), True, a ``CompileOptions``
    or a dict of its fields."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if isinstance(value, CompileOptions):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(CompileOptions)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"unknown compile options {unknown}; known: {sorted(known)}")
        return CompileOptions(**value)
    raise TypeError(
        f"compile must be a bool, a CompileOptions or a dict of its fields, got "
        f"{type(value).__name__}"
    )
