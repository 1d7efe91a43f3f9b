"""What the loops wrap when a profiler measures: the train step's two halves, timed.

Installed once per run, and only with a profiler, so an unprofiled run calls its step
directly and pays nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .base import Profiler

__all__ = ["ProfiledTrainStep", "section"]

_NULL = contextlib.nullcontext()


def section(profiler: Profiler | None, action: str) -> contextlib.AbstractContextManager[Any]:
    """``profiler.profile(action)``; one shared null context when ``profiler`` is None."""
    return _NULL if profiler is None else profiler.profile(action)


class ProfiledTrainStep:
    """A train step whose ``backward`` (forward and backward pass) is timed as
    ``training_step`` and whose ``apply`` (the optimizer update) as ``optimizer_step``;
    a several-optimizer step's ``run`` (each optimizer's forward, backward and update, for
    one batch) is timed as ``training_step``. Everything else is the wrapped step's."""

    def __init__(self, step: Any, profiler: Profiler) -> None:
        self._step = step
        self._profiler = profiler

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        prof = self._profiler
        prof.start("training_step")
        try:
            return self._step.backward(*args, **kwargs)
        finally:
            prof.stop("training_step")

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        prof = self._profiler
        prof.start("optimizer_step")
        try:
            return self._step.apply(*args, **kwargs)
        finally:
            prof.stop("optimizer_step")

    def run(self, *args: Any, **kwargs: Any) -> Any:
        prof = self._profiler
        prof.start("training_step")
        try:
            return self._step.run(*args, **kwargs)
        finally:
            prof.stop("training_step")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)
