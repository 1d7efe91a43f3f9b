"""Atomic writes and safe reads of checkpoint files on any fsspec filesystem.

A reader never sees a partial checkpoint. Where the filesystem can rename (local disks,
``memory://``), the file is written under a hidden temporary name in the same folder and
renamed into place. Where it cannot (object stores), the file is written in place and a
commit marker ``<name>.complete`` is written after it; a file without its marker is not a
checkpoint. Temporary files left by a killed writer are hidden (``.<name>.tmp-*``), ignored
by discovery and removed by ``remove_partial``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import IO, Any

import fsspec

__all__ = [
    "MARKER_SUFFIX",
    "exists",
    "filesystem",
    "is_committed",
    "is_local_url",
    "open_read",
    "remove",
    "remove_partial",
    "uses_marker",
    "write_atomic",
]

MARKER_SUFFIX = ".complete"
_RENAMING = ("file", "local", "memory")


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """``(fs, path)`` for ``url``."""
    return fsspec.core.url_to_fs(os.fspath(url), **(storage_options or {}))


def uses_marker(fs: Any, commit: str = "auto") -> bool:
    """Whether files on ``fs`` are committed with a marker instead of a rename.

    ``commit``: ``"auto"`` (a marker only where the filesystem cannot rename), ``"rename"``
    or ``"marker"``; readers must use the same setting as the writer.
    """
    if commit not in ("auto", "rename", "marker"):
        raise ValueError(f"commit must be 'auto', 'rename' or 'marker', got {commit!r}")
    if commit != "auto":
        return commit == "marker"
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return not any(p in _RENAMING for p in protocols)


def is_local_url(url: str) -> bool:
    """Whether ``url`` names a file on the local disk."""
    fs, _ = filesystem(url)
    return _is_local(fs)


def _is_local(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("file", "local") for p in protocols)


def write_atomic(
    url: str,
    write: Callable[[IO[bytes]], None],
    *,
    commit: str = "auto",
    fsync: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Write a file with ``write(file)`` so that it appears whole or not at all.

    ``commit``: ``"auto"`` (rename where possible, else a marker), ``"rename"`` or
    ``"marker"``. ``fsync``: also flush the data to the device before committing (local
    files), for power-loss durability; a killed process needs only the rename.
    """
    fs, path = filesystem(url, storage_options)
    use_marker = uses_marker(fs, commit)
    parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if use_marker:
        marker = path + MARKER_SUFFIX
        if fs.exists(marker):
            fs.rm(marker)
        with fs.open(path, "wb") as f:
            write(f)
        with fs.open(marker, "wb") as f:
            f.write(b"ok")
        return
    tmp = (
        f"{parent}/.{name}.tmp-{uuid.uuid4().hex}" if parent else f".{name}.tmp-{uuid.uuid4().hex}"
    )
    try:
        if _is_local(fs):
            with open(tmp, "wb") as f:
                write(f)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if fsync and parent:
                _fsync_dir(parent)
        else:
            with fs.open(tmp, "wb") as f:
                write(f)
            fs.mv(tmp, path)
    except BaseException:
        try:
            if fs.exists(tmp):
                fs.rm(tmp)
        finally:
            raise


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_committed(
    url: str, *, commit: str = "auto", storage_options: dict[str, Any] | None = None
) -> bool:
    """Whether ``url`` is a complete checkpoint file (its marker exists where one is used)."""
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        return False
    return fs.exists(path + MARKER_SUFFIX) if uses_marker(fs, commit) else True


def exists(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


def open_read(
    url: str, *, commit: str = "auto", storage_options: dict[str, Any] | None = None
) -> IO[bytes]:
    """Open a checkpoint for reading; a missing or uncommitted file is a clear error."""
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        raise FileNotFoundError(f"no checkpoint at {url}")
    if uses_marker(fs, commit) and not fs.exists(path + MARKER_SUFFIX):
        raise FileNotFoundError(
            f"{url} has no commit marker ({MARKER_SUFFIX}): it was not completely written"
        )
    return fs.open(path, "rb")


def remove(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete a checkpoint and its marker (missing files are fine)."""
    fs, path = filesystem(url, storage_options)
    for p in (path + MARKER_SUFFIX, path):
        if fs.exists(p):
            fs.rm(p)


def remove_partial(folder: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Delete temporary files a killed writer left in ``folder``; return their paths.

    Call it only when no live writer uses ``folder`` (a live write's temporary file would be
    deleted under it): the Trainer does, on the primary process, before it writes there."""
    fs, path = filesystem(folder, storage_options)
    if not fs.exists(path):
        return []
    removed = []
    for entry in fs.ls(path, detail=False):
        name = entry.rsplit("/", 1)[-1]
        if name.startswith(".") and ".tmp-" in name:
            try:
                fs.rm(entry)
            except FileNotFoundError:  # its writer finished (renamed it) or removed it
                continue
            removed.append(entry)
    return removed
