"""Find the checkpoint to resume from: the newest one in a folder that actually loads.

Auto-resume must never pick a partial file, and must survive a corrupt one: candidates are
the committed checkpoint files (temporary files of a killed writer are hidden and skipped),
newest first by modification time; the first that reads is returned, and each one that does
not is reported with a warning naming it and the reason.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Any

from . import storage
from .codec import CheckpointError
from .files import read

__all__ = ["candidates", "find_latest", "modified_time"]


def candidates(
    folder: str,
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Committed checkpoint files in ``folder`` matching ``pattern``, newest first."""
    fs, path = storage.filesystem(folder, storage_options)
    if not fs.exists(path):
        return []
    found = []
    for info in fs.ls(path, detail=True):
        name = info["name"].rsplit("/", 1)[-1]
        if info.get("type") == "directory" or name.startswith("."):
            continue
        if not fnmatch.fnmatch(name, pattern):
            continue
        url = _join(folder, name)
        if storage.is_committed(url, commit=commit, storage_options=storage_options):
            found.append((modified_time(info), name, url))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [url for _, _, url in found]


def find_latest(
    folder: str,
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """The newest checkpoint in ``folder`` that reads, or None; warns about broken ones."""
    for url in candidates(folder, pattern, commit=commit, storage_options=storage_options):
        try:
            read(url, commit=commit, storage_options=storage_options)
        except (CheckpointError, OSError) as err:
            warnings.warn(f"skipping checkpoint {url}: {err}", stacklevel=2)
            continue
        return url
    return None


def _join(folder: str, name: str) -> str:
    return folder.rstrip("/") + "/" + name


def modified_time(info: dict[str, Any]) -> float:
    """A file's modification time from an fsspec ``info`` dict (0 when it has none)."""
    for key in ("mtime", "created", "LastModified", "last_modified"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return 0.0
