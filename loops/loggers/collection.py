"""Several loggers as one, and the Trainer's ``logger`` flag turned into loggers.

``LoggerCollection`` forwards every call to each of its loggers in order. Every logger gets
the call even when an earlier one raises; the first error is raised afterwards, so one
failing destination never silently starves the others (and ``finalize`` always reaches all).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

from .base import FolderLogger, Logger, check_status
from .folders import share_version
from .tensorboard import TensorBoardLogger

__all__ = ["LoggerCollection", "create_loggers"]


def _check_logger(logger: Any, where: str) -> Logger:
    if not isinstance(logger, Logger):
        raise TypeError(f"{where} must be a loops.loggers.Logger, got {type(logger).__name__}")
    return logger


class LoggerCollection(Logger, Sequence[Logger]):
    """Fan each call out to ``loggers`` (a ``Sequence``: index, iterate, ``len``).

    ``name``, ``version``, ``save_dir``, ``root_dir`` and ``log_dir`` are the first
    logger's (``None`` when empty), as the loops use the first logger's folder.
    ``state()`` is the list of the loggers' states; ``restore`` takes that list back.
    The file loggers among them share one version (see ``create_loggers``).
    """

    def __init__(self, loggers: Iterable[Logger] = ()) -> None:
        self._loggers = [_check_logger(lg, "each item of LoggerCollection") for lg in loggers]
        _share_version(self._loggers)

    @overload
    def __getitem__(self, index: int) -> Logger: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Logger]: ...
    def __getitem__(self, index):
        return self._loggers[index]

    def __len__(self) -> int:
        return len(self._loggers)

    def __iter__(self) -> Iterator[Logger]:
        return iter(self._loggers)

    def __repr__(self) -> str:
        return f"LoggerCollection({self._loggers!r})"

    def _first(self, attribute: str) -> Any:
        return getattr(self._loggers[0], attribute) if self._loggers else None

    @property
    def name(self) -> str | None:
        return self._first("name")

    @property
    def version(self) -> int | str | None:
        return self._first("version")

    @property
    def save_dir(self) -> str | None:
        return self._first("save_dir")

    @property
    def root_dir(self) -> str | None:
        return self._first("root_dir")

    @property
    def log_dir(self) -> str | None:
        return self._first("log_dir")

    def _each(self, call: Callable[[Logger, Any], Any], args: Sequence[Any] | None = None) -> None:
        """Run ``call(logger, arg)`` for every logger; re-raise the first error at the end."""
        first_error: BaseException | None = None
        for i, logger in enumerate(self._loggers):
            try:
                call(logger, None if args is None else args[i])
            except Exception as error:
                if first_error is None:
                    first_error = error
        if first_error is not None:
            raise first_error

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self._each(lambda lg, _: lg.log_metrics(metrics, step))

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        self._each(lambda lg, _: lg.log_hyperparams(params, metrics))

    def log_text(self, tag: str, text: str, step: int) -> None:
        self._each(lambda lg, _: lg.log_text(tag, text, step))

    def save(self) -> None:
        self._each(lambda lg, _: lg.save())

    def finalize(self, status: str) -> None:
        check_status(status)
        self._each(lambda lg, _: lg.finalize(status))

    def state(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [logger.state() for logger in self._loggers]

    def restore(self, state: Sequence[Mapping[str, Any]]) -> None:  # type: ignore[override]
        if isinstance(state, Mapping) or not isinstance(state, Sequence):
            raise TypeError(f"LoggerCollection state must be a list of states, got {state!r}")
        if len(state) != len(self._loggers):
            raise ValueError(
                f"the state holds {len(state)} logger states but there are "
                f"{len(self._loggers)} loggers; resume with the same loggers as the checkpoint"
            )
        self._each(lambda lg, s: lg.restore(s), state)

    def truncate_after(self, step: int) -> None:
        self._each(lambda lg, _: lg.truncate_after(step))


def create_loggers(logger_flag: Any, default_root_dir: str | os.PathLike[str]) -> list[Logger]:
    """The loggers the Trainer's ``logger`` flag asks for.

    ``True``: one ``TensorBoardLogger(save_dir=default_root_dir)``; ``False``/``None``: none;
    a ``Logger`` or an iterable of ``Logger``s: those, as given. Anything else: ``TypeError``.

    Several file loggers share one run version, as in Lightning: those without an explicit
    (or already picked) version all take the first ``version_N`` free under each of their
    folders, so ``[CSVLogger(root), TensorBoardLogger(root)]`` write into one ``version_N``.
    """
    if logger_flag is True:
        return [TensorBoardLogger(save_dir=default_root_dir)]
    if logger_flag is False or logger_flag is None:
        return []
    if isinstance(logger_flag, LoggerCollection):
        loggers = list(logger_flag)
    elif isinstance(logger_flag, Logger):
        loggers = [logger_flag]
        _tell_checkpoint_dir(loggers, default_root_dir)
        return loggers
    elif isinstance(logger_flag, Iterable) and not isinstance(logger_flag, (str, bytes, Mapping)):
        loggers = [_check_logger(lg, "each item of the logger flag") for lg in logger_flag]
    else:
        raise TypeError(
            "logger must be True, False, None, a Logger or a list of Loggers, got "
            f"{type(logger_flag).__name__} {logger_flag!r}"
        )
    _share_version(loggers)
    _tell_checkpoint_dir(loggers, default_root_dir)
    return loggers


def _tell_checkpoint_dir(loggers: Sequence[Logger], default_root_dir: Any) -> None:
    """Tell loggers the Trainer's ``default_root_dir`` (``use_root_dir``: MLFlowLogger's run
    folders without a local store) and loggers that upload checkpoints
    (``MLFlowLogger(log_model=...)``) where the Trainer's default ``ModelCheckpoint``
    writes: ``<first logger's log_dir, else default_root_dir>/checkpoints``, asked when
    they upload."""
    first = loggers[0] if loggers else None

    def folder() -> str:
        root = first.log_dir if first is not None and first.log_dir is not None else None
        return (root or os.fspath(default_root_dir)).rstrip("/") + "/checkpoints"

    for logger in loggers:
        hook = getattr(logger, "use_root_dir", None)  # MLFlowLogger's run folders
        if callable(hook):
            hook(default_root_dir)
        hook = getattr(logger, "use_checkpoint_dir", None)
        if callable(hook):
            hook(folder)


def _share_version(loggers: Sequence[Logger]) -> None:
    share_version([lg._folder for lg in loggers if isinstance(lg, FolderLogger)])
