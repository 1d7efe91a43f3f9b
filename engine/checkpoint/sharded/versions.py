"""Ordering the versions of a checkpoint name, to find the newest committed state (read-only).

A version of ``run.ckpt`` is the entry at ``run.ckpt`` itself (a committed sharded folder,
or a plain checkpoint file) or a committed hidden folder beside it, named
``.run.ckpt.tmp-<writer>-<random>`` (``storage._temp_name``), whose ``COMMITTED`` record
``{"name": "run.ckpt", "sequence": n, "time_ns": t}`` claims the name. A claim is believed
only when the hidden name was made from exactly that name (``_owner``): a crafted marker
cannot make a folder a version of another checkpoint.

Two sharded versions are ordered by ``(sequence, the modification time of COMMITTED)``; a
plain file against a sharded folder by its modification time against that of the folder's
``COMMITTED``: times of one clock, the file server's (the record's ``time_ns``, rank 0's
clock, orders nothing). A marker without a record (an empty file, written before records
existed) counts as sequence 0. The entry at the name itself wins a tie.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from .. import storage
from ..storage import _TMP
from .folder import COMMIT_FILE, MAX_MARKER_BYTES, is_committed, is_sharded_checkpoint


@dataclasses.dataclass(frozen=True)
class _Version:
    """One entry holding a version of the checkpoint ``name``: ``order`` is ``(sequence,
    stamp_ns)`` for a committed sharded folder, None for another kind of entry (a plain
    checkpoint file). ``stamp_ns`` is a time of the file server's clock: the modification
    time of a folder's ``COMMITTED``, or of the plain file."""

    path: str
    name: str
    order: tuple[int, int] | None
    stamp_ns: int
    hidden: bool


def _later(a: _Version, b: _Version) -> bool:
    """Whether ``a`` is a later version than ``b`` (see the module docstring)."""
    if a.order is not None and b.order is not None:
        return a.order > b.order
    return a.stamp_ns > b.stamp_ns


def _plain_name(name: Any) -> bool:
    """Whether ``name`` is a file name of the folder itself: no separator, not hidden."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode()) <= 255
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
    )


def _commit_record(folder: str) -> tuple[str | None, int, int] | None:
    """``(name, sequence, stamp_ns)`` of the committed sharded checkpoint ``folder`` (its
    record's name and sequence, its marker's modification time); None when it is not
    committed. A marker without a valid record (written before records existed: empty)
    gives ``(None, 0, stamp_ns)``."""
    if not is_committed(folder):
        return None
    marker = os.path.join(folder, COMMIT_FILE)
    try:
        stamp = os.lstat(marker).st_mtime_ns
        with open(marker, "rb") as f:
            raw = f.read(MAX_MARKER_BYTES + 1)
    except OSError:
        return None
    try:
        record = json.loads(raw) if raw.strip() and len(raw) <= MAX_MARKER_BYTES else None
    except (ValueError, RecursionError):
        record = None
    if (
        isinstance(record, dict)
        and _plain_name(record.get("name"))
        and type(record.get("sequence")) is int
        and record["sequence"] >= 0
        and type(record.get("time_ns")) is int
    ):
        return record["name"], record["sequence"], stamp
    return None, 0, stamp


def _owner(entry: str, recorded: str | None) -> str | None:
    """The checkpoint name the hidden folder ``entry`` is a version of: the name its marker
    records if ``_temp_name`` makes exactly this entry's stem from it (the whole name, or
    its prefix where the name was cut to fit), else None; with no record, the stem itself,
    unless it may have been cut (then the name is unknown)."""
    if not entry.startswith(".") or _TMP not in entry:
        return None
    cut = entry.rindex(_TMP)
    stem, tail = entry[1:cut], entry[cut:]
    if not stem:
        return None
    if recorded is not None:
        believed = _plain_name(recorded) and storage._temp_stem(recorded, tail) == stem
        return recorded if believed else None
    if len(entry.encode()) > storage._NAME_MAX - 4:  # a character of up to 4 bytes may be cut
        return None
    return stem if _plain_name(stem) else None


def _hidden_entries(folder: str) -> list[str]:
    """The hidden temporary folders (not symlinks) in ``folder``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [
        n
        for n in names
        if n.startswith(".")
        and _TMP in n
        and not os.path.islink(os.path.join(folder, n))
        and os.path.isdir(os.path.join(folder, n))
    ]


def _hidden_version(full: str) -> _Version | None:
    """The version the hidden folder ``full`` holds; None when it holds none (uncommitted,
    or its claim is not believed)."""
    record = _commit_record(full)
    name = None if record is None else _owner(os.path.basename(full), record[0])
    if record is None or name is None:
        return None
    return _Version(full, name, (record[1], record[2]), record[2], True)


def _hidden_versions(folder: str) -> dict[str, list[_Version]]:
    """The committed hidden folders in ``folder`` (made absolute), by the checkpoint name
    they are a version of."""
    folder = os.path.abspath(folder)
    found: dict[str, list[_Version]] = {}
    for entry in _hidden_entries(folder):
        version = _hidden_version(os.path.join(folder, entry))
        if version is not None:
            found.setdefault(version.name, []).append(version)
    return found


def _visible_version(folder: str, name: str) -> _Version | None:
    """The version of ``name`` at its own path in ``folder``: a committed sharded folder,
    or another entry (a plain checkpoint file); None when nothing is there or only an
    uncommitted sharded folder (no committed state)."""
    path = os.path.join(os.path.abspath(folder), name)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    record = _commit_record(path)
    if record is not None:
        return _Version(path, name, (record[1], record[2]), record[2], False)
    if is_sharded_checkpoint(path):
        return None
    return _Version(path, name, None, st.st_mtime_ns, False)


def _newest(folder: str, name: str, hidden: list[_Version]) -> _Version | None:
    """The newest committed version of ``name`` in ``folder`` (its own path wins a tie)."""
    best = max(hidden, key=lambda v: v.order or (0, v.stamp_ns), default=None)
    visible = _visible_version(folder, name)
    if best is None or (visible is not None and not _later(best, visible)):
        return visible
    return best


def newest(path: str | os.PathLike) -> str | None:
    """The entry holding the newest committed state of the checkpoint ``path`` names
    (absolute): ``path`` itself, or a hidden folder beside it whose commit was cut short
    (see the package docstring); ``path`` when it exists and nothing newer does; None when
    neither exists."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    found = _newest(folder, name, _hidden_versions(folder).get(name, []))
    if found is not None:
        return found.path
    return path if os.path.lexists(path) else None


def newest_in(folder: str | os.PathLike) -> dict[str, str]:
    """Checkpoint name -> hidden folder (absolute), for each name in ``folder`` whose newest
    committed state is a hidden folder (a commit cut short between its steps ``committed``
    and ``placed``): discovery takes it in place of the name."""
    folder = os.path.abspath(os.fspath(folder))
    found = {}
    for name, versions in _hidden_versions(folder).items():
        best = _newest(folder, name, versions)
        if best is not None and best.hidden:
            found[name] = best.path
    return found
