"""The logger contract: where the loop drivers send metrics, hyper-parameters and text.

Loggers are effects at the edge of the engine: only the loop drivers call them (callbacks
ask for logging through ``Requests.log``). A run's life with one logger:

1. ``log_hyperparams(params)`` once at the start, then ``save()``;
2. ``log_metrics(values, step)`` as training goes (the driver ``save()``s after each call);
3. ``finalize(status)`` at the end: ``"success"``, ``"failed"`` or ``"interrupted"``.

Resuming. A checkpoint stores ``logger.state()`` (plain ints and strings). A resumed run
builds the same logger and calls ``logger.restore(state)`` before logging anything: the
logger continues in the checkpoint's run folder and forgets what was logged after the
checkpoint, so the logs end up as if the run had never been interrupted.
``truncate_after(step)`` does the forgetting by step for callers that only know a step.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

from .folders import RunFolder
from .run_files import RunFiles

__all__ = [
    "STATUSES",
    "FolderLogger",
    "Logger",
    "check_status",
    "check_step",
    "flatten",
    "params_dict",
    "prepare_metrics",
    "to_number",
]

STATUSES = ("success", "failed", "interrupted")
PREFIX_JOIN = "-"


def check_status(status: Any) -> str:
    """``status`` if it is one of ``STATUSES``; a clear error otherwise."""
    if status not in STATUSES:
        raise ValueError(f"finalize status must be one of {STATUSES}, got {status!r}")
    return status


def check_step(step: Any) -> int:
    """``step`` if it is an int >= 0 (the x-axis of every logged value)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return int(step)


def to_number(key: str, value: Any) -> float | int:
    """A logged value as a Python number: one-element tensors and numpy scalars via ``item()``.

    Floating values stay floats, ints stay ints (``epoch`` is written as ``3``), bools
    become 0/1.
    """
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        numel = value.numel() if hasattr(value, "numel") else getattr(value, "size", 1)
        if numel != 1:
            raise ValueError(
                f"metric {key!r} must hold a single value, got a tensor of shape "
                f"{tuple(value.shape)}"
            )
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number or a one-element tensor, got {value!r}")


def prepare_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float | int]:
    """Validate ``metrics``, convert the values to numbers and put ``prefix-`` before names."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of name -> value, got {metrics!r}")
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be str, got {key!r}")
        name = f"{prefix}{PREFIX_JOIN}{key}" if prefix else key
        out[name] = to_number(key, value)
    return out


def params_dict(params: Any) -> dict[str, Any]:
    """Hyper-parameters as a dict: from a mapping, an ``argparse.Namespace`` or a dataclass."""
    if isinstance(params, argparse.Namespace):
        return dict(vars(params))
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if isinstance(params, Mapping):
        return dict(params)
    raise TypeError(
        f"hyper-parameters must be a mapping, an argparse.Namespace or a dataclass, got "
        f"{type(params).__name__}"
    )


def flatten(params: Mapping[str, Any], sep: str = "/", parent: str = "") -> dict[str, Any]:
    """Nested mappings as one level: ``{"opt": {"lr": 1}}`` -> ``{"opt/lr": 1}``."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}{sep}{key}" if parent else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, sep, name))
        else:
            out[name] = value
    return out


class Logger(abc.ABC):
    """Base class of loggers. Subclasses implement ``log_metrics`` and ``log_hyperparams``.

    The other methods default to doing nothing: a logger without a text channel ignores
    ``log_text``; one that keeps no history has nothing to ``truncate_after`` or ``restore``.
    """

    @property
    def name(self) -> str | None:
        """The experiment name (a folder level for loggers that write files)."""
        return None

    @property
    def version(self) -> int | str | None:
        """The run's version within the experiment."""
        return None

    @property
    def save_dir(self) -> str | None:
        """The folder (path or fsspec URL) the logger was given."""
        return None

    @property
    def root_dir(self) -> str | None:
        """The folder holding the experiment's versions, ``save_dir/name``."""
        return None

    @property
    def log_dir(self) -> str | None:
        """This run's folder (path or fsspec URL); ``None`` for loggers without files."""
        return None

    @abc.abstractmethod
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (numbers or one-element tensors) at ``step``."""

    @abc.abstractmethod
    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Record the run's hyper-parameters (and metrics to compare runs by)."""

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Record a piece of text under ``tag`` at ``step`` (ignored by default)."""
        check_step(step)

    def save(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Make everything logged so far reach its destination."""

    def finalize(self, status: str) -> None:
        """End the run with ``status`` (one of ``STATUSES``): save and release resources."""
        check_status(status)
        self.save()

    def state(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this logger (plain ints and strings)."""
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue the run ``state`` (from ``state()``) describes; call before logging."""
        if not isinstance(state, Mapping):
            raise TypeError(f"logger state must be a mapping from state(), got {state!r}")

    def truncate_after(self, step: int) -> None:
        """Forget what was logged at steps after ``step`` (resuming from that step)."""
        check_step(step)


class FolderLogger(Logger):
    """A logger writing into a versioned run folder, ``save_dir/name/version_N[/sub_dir]``.

    The version is read on first use and claimed at the first write (see
    ``folders.RunFolder``); ``restore`` adopts the version recorded in its state, so a
    resumed run keeps writing into the same folder.
    """

    def __init__(
        self,
        save_dir: Any,
        name: str | None,
        version: int | str | None,
        sub_dir: str | None = None,
        prefix: str = "",
    ) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        self._folder = RunFolder(save_dir, name, version, sub_dir)
        self._prefix = prefix
        self._started = False  # set once anything has been written for this run

    @property
    def name(self) -> str | None:
        return self._folder.name

    @property
    def version(self) -> int | str:
        return self._folder.version

    @property
    def save_dir(self) -> str:
        return self._folder.save_dir

    @property
    def root_dir(self) -> str:
        return self._folder.root_dir

    @property
    def log_dir(self) -> str:
        return self._folder.log_dir

    @property
    def picked(self) -> bool:
        """Whether this logger's run folder is settled (a given, adopted or claimed
        version, or the one the run's main process claimed); a version only read is not."""
        return self._folder.picked

    def claim(self) -> None:
        """Make the run folder this run's before anything is written (``RunFolder.claim``:
        a version only read is created exclusively now, or moves on if another run has
        it). The Trainer's main process calls it when a run starts; the first write calls
        it too, so a logger used alone claims its folder."""
        self._folder.claim()

    def take_version(self, version: int | str) -> None:
        """Write (if ever) into ``version``, the one the run's main process claimed (the
        other ranks of a distributed run take rank 0's; nothing is created)."""
        self._folder.take(version)

    def _files(self) -> RunFiles:
        """The files of the run folder, written without following links planted below
        ``root_dir`` (the version folder, ``sub_dir`` and the files themselves)."""
        return RunFiles(self.root_dir, self.log_dir)

    def _write_files(self) -> RunFiles:
        """``_files()`` for a write: the run folder is claimed first (``claim``)."""
        self.claim()
        return self._files()

    def _adopt(self, state: Mapping[str, Any]) -> None:
        """Take over the version in ``state``; only allowed before anything was written."""
        Logger.restore(self, state)
        if self._started:
            raise RuntimeError(
                f"{type(self).__name__}.restore() must be called before anything is logged"
            )
        if "version" in state:
            self._folder.adopt(state["version"])
