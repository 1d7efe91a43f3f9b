"""Settling what killed writers of sharded checkpoints left, and deleting checkpoints.

Only the writer (``fit``) cleans up; readers never change a folder. ``recover(folder)``
first finishes each commit a gone writer cut short (the hidden folder holding the newest
committed state of a name is placed at the name: ``commit._place``), then deletes the gone
writers' hidden folders that hold no newest committed state (uncommitted ones, and versions
a newer one replaced), marker first. A live writer's folders are never touched
(``storage.writer_alive``; one whose writer cannot be checked only once untouched for
``STALE_AFTER_S``), nor a folder holding the newest committed state of a name. ``remove``
deletes an evicted checkpoint with its hidden versions, so none of them comes back as the
name's newest state.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

from ..codec import CheckpointError
from ..storage import STALE_AFTER_S, writer_alive
from . import commit
from .folder import COMMIT_FILE, is_sharded_checkpoint, read_manifest
from .versions import _hidden_entries, _hidden_version, _hidden_versions, _newest, newest


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What ``recover`` did: the hidden folders it placed at their checkpoint's path
    (``(folder, path)``: commits it finished) and the entries it deleted."""

    completed: list[tuple[str, str]]
    removed: list[str]


def _gone(path: str, stale_after: float) -> bool:
    """Whether the writer named in the hidden folder ``path`` is gone (or, when that cannot
    be told, the folder has been untouched for ``stale_after`` seconds)."""
    alive = writer_alive(os.path.basename(path))
    if alive is None:
        try:
            alive = time.time() - os.lstat(path).st_mtime < stale_after
        except OSError:
            return False
    return not alive


def recover(folder: str | os.PathLike, *, stale_after: float = STALE_AFTER_S) -> Recovery:
    """Settle what killed writers of sharded checkpoints left in ``folder`` (see the module
    docstring); the paths reported are absolute. A newest state that cannot be placed stays
    hidden, where discovery uses it and a later cleanup tries again."""
    folder = os.path.abspath(os.fspath(folder))
    completed: list[tuple[str, str]] = []
    removed: list[str] = []
    for name, versions in _hidden_versions(folder).items():
        best = _newest(folder, name, versions)
        if best is None or not best.hidden or not _gone(best.path, stale_after):
            continue
        target = os.path.join(folder, name)
        try:
            removed += commit._place(best.path, target)
        except OSError:
            continue
        completed.append((best.path, target))
    for entry in _hidden_entries(folder):
        full = os.path.join(folder, entry)
        if not os.path.lexists(full) or not _gone(full, stale_after) or _holds_newest(full):
            continue
        version = _hidden_version(full)
        commit._discard(full, full if version is None else os.path.join(folder, version.name))
        if not os.path.lexists(full):
            removed.append(full)
    return Recovery(completed, removed)


def _holds_newest(full: str) -> bool:
    """Whether the hidden folder ``full`` (absolute) holds the newest committed state of
    its name."""
    version = _hidden_version(full)
    return version is not None and newest(os.path.join(os.path.dirname(full), version.name)) == full


def remove_partial(folder: str | os.PathLike, *, stale_after: float = STALE_AFTER_S) -> list[str]:
    """``recover(folder)`` (commits cut short are finished first), returning the paths it
    deleted: the temporary folders that killed writers of sharded checkpoints left (as
    ``storage.remove_partial`` treats temporary files) and replaced versions. A live
    writer's folder, or one holding the newest committed state of a name, is never
    deleted."""
    return recover(folder, stale_after=stale_after).removed


def remove(path: str | os.PathLike) -> None:
    """Delete the committed purestep sharded checkpoint folder ``path`` (anything else is a
    ``CheckpointError``): its commit marker first, so a deletion cut short leaves a folder
    no reader takes for a checkpoint; then its hidden versions (``remove_hidden``)."""
    path = os.fspath(path)
    if not is_sharded_checkpoint(path) or os.path.islink(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint folder")
    read_manifest(path)  # committed, and purestep's: never another program's folder
    marker = os.path.join(path, COMMIT_FILE)
    if os.path.lexists(marker):
        os.remove(marker)
    shutil.rmtree(path)
    remove_hidden(path)


def remove_hidden(path: str | os.PathLike) -> list[str]:
    """Delete the committed hidden versions of the checkpoint ``path`` that saves or
    cleanups cut short left beside it (marker first), except a provably live writer's
    (``storage.writer_alive``: it finishes or deletes its own): what evicting a name needs,
    so that no older version of it becomes its newest state. Returns what was deleted."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    removed = []
    for version in _hidden_versions(folder).get(name, []):
        if writer_alive(os.path.basename(version.path)) is not True:
            commit._discard(version.path, path)
            if not os.path.lexists(version.path):
                removed.append(version.path)
    return removed
