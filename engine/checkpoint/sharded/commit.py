"""The commit protocol's filesystem steps: a committed state of a name exists at every instant.

A save writes into a hidden folder of its writer (``_temp_name``), then (rank 0):
``_commit`` writes its ``COMMITTED`` record, ordered after every committed version of the
name; ``_place`` retires the entry at the name to a hidden name of this writer, moves the
new folder in, and discards the retired entry and the name's older hidden versions whose
writers are not provably alive (``_discard``: a folder's marker first, so a deletion cut
short leaves no committed folder behind). ``replace_with_file`` puts a plain checkpoint
file in place of a sharded folder by the same steps. Each step ends in ``_reached``, where
the tests stop a save as a kill would.

The names here that tests replace (``_reached``, ``_temp_name``) are looked up in this
module at call time: other modules call ``commit._reached(...)``, never a copy of it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Callable

from .. import storage
from ..storage import _temp_name  # replaced by the tests: look it up here, at call time
from . import folder as layout
from .folder import COMMIT_FILE, _fsync_dir
from .versions import _hidden_versions, _later, _visible_version

#: The points of a save's commit protocol, in order (see the package docstring).
COMMIT_STEPS = ("written", "described", "committed", "retired", "placed", "unmarked")
#: The points of ``replace_with_file``, in order.
REPLACE_STEPS = ("written", "retired", "placed", "unmarked")

__all__ = ["COMMIT_STEPS", "REPLACE_STEPS", "replace_with_file"]


def _reached(step: str, path: str) -> None:
    """A save (or cleanup) of ``path`` has completed ``step`` of ``COMMIT_STEPS``. Does
    nothing: the tests replace it to stop a save at each step, as a kill would."""


class _Stranded(OSError):
    """Moving a new version into place failed, and so did putting the version before back
    at its name: that version is kept, committed, at the hidden path ``retired`` (the
    newest committed state of the name: discovery finds it, cleanup places it later)."""

    def __init__(self, err: OSError, path: str, retired: str) -> None:
        super().__init__(
            err.errno,
            f"moving the new version to {path} failed ({err.strerror or err}), and so did "
            f"putting the version before back",
        )
        self.retired = retired


def _commit(temp: str, path: str) -> None:
    """Write the commit marker of ``temp``, the new version of ``path``: its record names
    ``path`` and orders it after every committed version of that name beside it."""
    parent, name = os.path.split(path)
    earlier = [v.order[0] for v in _hidden_versions(parent).get(name, []) if v.order]
    visible = _visible_version(parent, name)
    if visible is not None and visible.order is not None:
        earlier.append(visible.order[0])
    record = {"name": name, "sequence": 1 + max(earlier, default=0), "time_ns": time.time_ns()}
    layout._write_file(os.path.join(temp, COMMIT_FILE), json.dumps(record).encode())
    _fsync_dir(temp)
    _fsync_dir(parent)
    _reached("committed", path)


def _retire(path: str) -> str | None:
    """Rename the entry at ``path`` (if any) to a hidden name of this writer; its new path."""
    if not os.path.lexists(path):
        return None
    retired = os.path.join(os.path.dirname(path), _temp_name(os.path.basename(path)))
    os.replace(path, retired)
    _fsync_dir(os.path.dirname(path))
    _reached("retired", path)
    return retired


def _move_in(new: str, path: str, retired: str | None) -> None:
    """Rename ``new`` to ``path``; if that fails, put the ``retired`` entry back (a
    ``_Stranded`` error when that fails too)."""
    try:
        os.replace(new, path)
    except OSError as err:
        if retired is not None:
            try:
                if os.path.lexists(path):
                    raise FileExistsError(errno.EEXIST, f"{path} is taken")
                os.replace(retired, path)
            except OSError:
                raise _Stranded(err, path, retired) from err
        raise
    _fsync_dir(os.path.dirname(path))
    _reached("placed", path)


def _place(new: str, path: str) -> list[str]:
    """Move the committed folder ``new`` to ``path``. An entry already at ``path`` is
    renamed to a hidden name of this writer first and deleted once ``new`` is in place: at
    no instant is there no committed version. If the move fails, the retired entry is put
    back (``_Stranded`` where it cannot be). Then the name's older hidden versions whose
    writers are not provably alive are deleted (``_discard_superseded``). Returns the
    entries deleted."""
    retired = _retire(path)
    _move_in(new, path, retired)
    removed = []
    if retired is not None:
        _discard(retired, path)
        if not os.path.lexists(retired):
            removed.append(retired)
    return removed + _discard_superseded(path)


def _discard_superseded(path: str) -> list[str]:
    """Delete the committed hidden versions of ``path`` older than the one at ``path``
    whose writers are not provably alive (``storage.writer_alive`` is not True): a version
    replaced is never needed again, and a full FSDP checkpoint left for a whole run may
    fill the disk. A live writer's folder stays (it finishes or removes it). Returns what
    was deleted."""
    parent, name = os.path.split(path)
    placed = _visible_version(parent, name)
    removed: list[str] = []
    if placed is None:
        return removed
    for version in _hidden_versions(parent).get(name, []):
        alive = storage.writer_alive(os.path.basename(version.path))
        if alive is not True and not _later(version, placed):
            _discard(version.path, path)
            if not os.path.lexists(version.path):
                removed.append(version.path)
    return removed


def _discard(entry: str, path: str) -> None:
    """Delete ``entry``, a version of ``path`` that a newer one replaced: a folder's commit
    marker first, so a deletion cut short leaves no committed folder behind."""
    if os.path.isdir(entry) and not os.path.islink(entry):
        with contextlib.suppress(OSError):
            marker = os.path.join(entry, COMMIT_FILE)
            if os.path.lexists(marker):
                os.remove(marker)
        _reached("unmarked", path)
        shutil.rmtree(entry, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(entry)


def _abandon(temp: str) -> None:
    """Remove the temporary folder of a failed save (its marker first, if it has one)."""
    if os.path.isdir(temp) and not os.path.islink(temp):
        with contextlib.suppress(OSError):
            marker = os.path.join(temp, COMMIT_FILE)
            if os.path.lexists(marker):
                os.remove(marker)
        shutil.rmtree(temp, ignore_errors=True)


def replace_with_file(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Put a plain checkpoint file in place of the sharded folder at ``path`` (an FSDP
    run's checkpoint, resumed by a DDP or single-device run), so that a committed state
    of ``path`` exists at every instant (``REPLACE_STEPS``): ``write(temp)`` writes the
    file at a hidden temporary name of this writer (which discovery ignores and cleanup
    removes once its writer is gone), the folder is retired to a hidden name (the newest
    state of the name until the file is in), the file is renamed in (newer than the
    folder: its modification time is later than the folder's ``COMMITTED``), then the
    folder is deleted marker first, and so are the name's older hidden versions whose
    writers are not provably alive. A failure before the file is in leaves the folder at
    ``path`` (a full disk is ``storage``'s out-of-space error naming ``path``)."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    temp = os.path.join(parent, _temp_name(name))
    try:
        write(temp)
        _reached("written", path)
        retired = _retire(path)
        _move_in(temp, path, retired)
    except Exception as err:  # a failure, not a kill: the temporary file goes at once
        with contextlib.suppress(OSError):
            if os.path.isfile(temp) and not os.path.islink(temp):
                os.remove(temp)
        if storage._space_error_in_chain(err):  # named after the checkpoint, not temp
            where = f"kept, hidden, at {err.retired}" if isinstance(err, _Stranded) else "intact"
            raise storage._no_space(
                path, f"its temporary file was removed; the checkpoint there before is {where}"
            ) from err
        raise
    if retired is not None:
        _discard(retired, path)
    _discard_superseded(path)
