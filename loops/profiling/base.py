"""The profiler contract the loops time their actions with, and the one that does nothing.

A profiler measures named *actions* (``"training_step"``, ``"[Callback]EarlyStopping.
on_validation_end"``): ``start(action)`` / ``stop(action)``, or ``with profiler.profile(
action):``. ``summary()`` is the report as text; ``describe()`` shows it (primary process) and
writes it to ``<dirpath>/<stage>-<filename>[-<rank>].txt`` (Lightning's naming: ``dirpath``
defaults to the run folder, ``stage`` is the entry point, ``fit`` / ``validate`` / ``test`` /
``predict``). The loops call ``setup`` when a run starts, ``describe`` and ``teardown`` when
it ends (failed runs included).

Timings are effects, like every clock reading: they are the driver's, never part of the
``TrainState``, so a profiled run computes exactly what an unprofiled one does.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["PassThroughProfiler", "Profiler"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-\[\]{}=,+]")


class _Timed:
    """``with``-block form of one action (cheaper than a generator-based context manager)."""

    __slots__ = ("action", "profiler")

    def __init__(self, profiler: Profiler, action: str) -> None:
        self.profiler = profiler
        self.action = action

    def __enter__(self) -> None:
        self.profiler.start(self.action)

    def __exit__(self, *exc: Any) -> None:
        self.profiler.stop(self.action)


class Profiler:
    """Base class of profilers (Lightning's ``Profiler`` interface).

    Subclasses implement ``start``, ``stop`` and ``summary``. ``dirpath``: the folder of the
    report file (default: the run folder the loops pass to ``setup``); ``filename``: its
    name stem (default ``"profile"``; the stage is prepended, the rank appended when there
    are several processes, ``.txt`` added).
    """

    def __init__(
        self, dirpath: str | os.PathLike[str] | None = None, filename: str | None = None
    ) -> None:
        if filename is not None and (not isinstance(filename, str) or not filename):
            raise ValueError(f"filename must be a non-empty string, got {filename!r}")
        if filename is not None and os.sep in filename:
            raise ValueError(f"filename must not contain a path separator, got {filename!r}")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self._stage: str | None = None
        self._rank: int | None = None
        self._log_dir: str | None = None
        # the folder at or above the run folder the Trainer trusts (its logger's root_dir):
        # links below it are refused when a report is written into the run folder
        self._log_root: str | None = None
        self._primary = True
        self.printer: Callable[[str], None] | None = None
        #: The report file the last ``describe()`` wrote (None before).
        self.report_path: str | None = None

    # ---------------------------------------------------------------- the interface

    def start(self, action: str) -> None:
        """Start timing ``action``."""
        raise NotImplementedError

    def stop(self, action: str) -> None:
        """Stop timing ``action`` (started by ``start``)."""
        raise NotImplementedError

    def summary(self) -> str:
        """The report of what was measured since ``setup``."""
        raise NotImplementedError

    def profile(self, action: str) -> contextlib.AbstractContextManager[None]:
        """``with profiler.profile(action):`` times the block as ``action``."""
        return _Timed(self, action)

    def profile_iterable(
        self, iterable: Any, action: str, limit: int | float | None = None
    ) -> Iterator[Any]:
        """Yield ``iterable``'s items (at most ``limit``), timing each fetch as ``action``.
        Without a finite ``limit`` the fetch that finds the end is timed too (an unsized
        stream has no other way to end)."""
        it = iter(iterable)
        start, stop = self.start, self.stop
        left = -1 if limit is None or limit == float("inf") else int(limit)
        while left != 0:
            left -= 1
            start(action)
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                stop(action)
            yield item

    # ---------------------------------------------------------------- run lifecycle

    def setup(
        self,
        stage: str | None = None,
        local_rank: int | None = None,
        log_dir: str | None = None,
        *,
        primary: bool = True,
        printer: Callable[[str], None] | None = None,
    ) -> None:
        """Called by the loops when a run starts: its stage (``"fit"``, ...), this process's
        rank (None for one process), the run folder, whether this process shows reports,
        and where reports are shown."""
        self._stage = stage
        self._rank = local_rank
        self._log_dir = log_dir
        self._primary = primary
        if printer is not None:
            self.printer = printer

    def uses_run_folder(self, fn: str) -> bool:
        """Whether a run of ``fn`` writes a report into the run folder (no ``dirpath``):
        the Trainer then gives the run a version folder of its own."""
        return self.dirpath is None

    def use_log_root(self, root: str | None) -> None:
        """Where the run folder's trusted part ends (the Trainer passes its logger's
        ``root_dir`` at each run): a report written into the run folder (``dirpath``
        None) is refused if a link was planted between that root and the report."""
        self._log_root = root

    def report_base(self, path: str) -> str:
        """The folder the report ``path`` is written under without following links below
        it (``loggers.run_files``): ``dirpath`` when given (the user chose it), else the
        trusted root of the run folder (``use_log_root``) when the report is under it,
        else the report's own folder."""
        folder = os.path.abspath(os.path.dirname(path) or ".")
        root = self._log_root
        if self.dirpath is None and root is not None:
            root = os.path.abspath(root)
            if os.path.commonpath([root, folder]) == root:
                return root
        return folder

    def teardown(self, stage: str | None = None) -> None:
        """Called by the loops when a run ends (after ``describe``)."""

    def describe(self) -> None:
        """Show the summary (primary process) and write it to the report file."""
        text = self.summary()
        if not text:
            return
        path = self.output_path()
        if path is not None:
            from ..loggers.run_files import write_file  # on use: it imports the loggers

            # its folder made and the file written without following a planted link
            write_file(self.report_base(path), os.path.abspath(path), (text + "\n").encode())
            self.report_path = path
        if self._primary:
            (self.printer or print)(text)

    # ---------------------------------------------------------------- file names

    def prepare_filename(
        self, action: str | None = None, extension: str = ".txt", split_token: str = "-"
    ) -> str:
        """``<stage>-<filename>[-<rank>][-<action>]<extension>`` (Lightning's naming; the
        action name made safe for file systems)."""
        parts = []
        if self._stage is not None:
            parts.append(self._stage)
        parts.append(self.filename or "profile")
        if self._rank is not None:
            parts.append(str(self._rank))
        if action is not None:
            parts.append(_UNSAFE.sub("_", action))
        return split_token.join(parts) + extension

    def output_dir(self) -> str | None:
        """Where reports go: ``dirpath``, else the run folder (None when neither is known)."""
        return self.dirpath if self.dirpath is not None else self._log_dir

    def output_path(self, action: str | None = None, extension: str = ".txt") -> str | None:
        folder = self.output_dir()
        if folder is None:
            return None
        return os.path.join(folder, self.prepare_filename(action, extension))


_NULL = contextlib.nullcontext()


class PassThroughProfiler(Profiler):
    """The profiler of a run without profiling: every method does nothing, and
    ``profile()`` returns one shared null context. The loops do not even call it on the
    hot path (they check for it once per run); it is what ``trainer.profiler`` is then."""

    def uses_run_folder(self, fn: str) -> bool:
        return False  # it writes nothing

    def start(self, action: str) -> None:
        return None

    def stop(self, action: str) -> None:
        return None

    def summary(self) -> str:
        return ""

    def profile(self, action: str) -> contextlib.AbstractContextManager[None]:
        return _NULL

    def profile_iterable(
        self, iterable: Any, action: str, limit: int | float | None = None
    ) -> Iterator[Any]:
        if limit is None or limit == float("inf"):
            return iter(iterable)
        return itertools.islice(iterable, int(limit))

    def describe(self) -> None:
        return None
