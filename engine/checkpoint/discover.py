"""Find the checkpoint to resume from: the newest one in a folder that actually loads.

Auto-resume must never pick a partial file, and must survive a corrupt one: candidates are
the committed checkpoint files (temporary files of a killed writer are hidden and skipped),
newest first by modification time; the first that reads is returned, and each one that does
not is reported with a warning naming it and the reason. ``read_latest`` returns the payload
it read along with the URL, so a resume reads the file once (``files.load_payload``).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from . import storage
from .codec import CheckpointError
from .files import read

__all__ = ["candidates", "find_latest", "modified_time", "read_latest"]


def candidates(
    folder: str,
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Committed checkpoint files in ``folder`` matching ``pattern``, newest first."""
    found = _dated_candidates(folder, pattern, commit, storage_options)
    return [url for _, url in found]


def _dated_candidates(
    folder: str, pattern: str, commit: str, storage_options: dict[str, Any] | None
) -> list[tuple[float, str]]:
    """``(modification time, url)`` of ``candidates(folder)``, newest first."""
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
    return [(mtime, url) for mtime, _, url in found]


def read_latest(
    folders: str | Sequence[str],
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
    accept: Callable[[dict[str, Any]], bool] | None = None,
) -> tuple[str, dict[str, Any]] | None:
    """``(url, payload)`` of the newest checkpoint across ``folders`` that reads, or None.

    Each broken candidate is skipped with a warning naming it; ``accept(payload)`` may
    skip more (e.g. weights-only files when resuming). The payload is what ``read``
    returns; restore from it with ``load_payload`` instead of reading the file again. Equal
    modification times keep the order of ``folders``.
    """
    if isinstance(folders, str):
        folders = [folders]
    dated: list[tuple[float, str]] = []
    for folder in folders:
        dated += _dated_candidates(folder, pattern, commit, storage_options)
    dated.sort(key=lambda item: item[0], reverse=True)  # stable: ties keep folder order
    for _, url in dated:
        try:
            payload = read(url, commit=commit, storage_options=storage_options)
        except (CheckpointError, OSError) as err:
            warnings.warn(f"skipping checkpoint {url}: {err}", stacklevel=2)
            continue
        if accept is not None and not accept(payload):
            continue
        return url, payload
    return None


def find_latest(
    folder: str | Sequence[str],
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """The newest checkpoint in ``folder`` that reads, or None; warns about broken ones.

    To restore from it, ``read_latest`` saves reading the file a second time."""
    found = read_latest(folder, pattern, commit=commit, storage_options=storage_options)
    return None if found is None else found[0]


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
