"""Find the checkpoint to resume from: the furthest one in some folders that actually loads.

Auto-resume must never pick a partial file, never block and must survive a broken one.
Candidates are the committed checkpoint files (temporary files of a killed writer are hidden
and skipped). They are ranked by the progress each one records (``files.read_record``: the
optimizer step, then the training batches seen, then the epoch), reading only the zip
directory and a small record of each, never a whole file: modification times can be
coarse (one second on some object stores) and must not pick an older step. The
modification time breaks exact ties (and equal times keep the order of the folders, then
names in reverse order). Files without a recorded progress (written before records
existed, or states that are not a ``TrainState``) rank after all that have one, newest first
by modification time. Across several folders, the most recently written folder (by its
newest file) comes first: a fresh run in a new version folder resumes itself, not an older
run that got further.

The ranked files are then loaded in turn: the first that reads and decodes (and that
``accept`` takes) is returned. Each one that does not (a FIFO, device or directory, a zip
this library never writes, a corrupt file, one that reads but does not decode) is skipped
with a warning naming it and the reason. ``load_latest`` returns the decoded state and
metadata, ``read_latest`` the payload (``files.load_payload`` restores from it), so a resume
reads the chosen file once.

Sharded checkpoints (``sharded``: a folder per checkpoint, on local disks) take part too: a
folder matching the pattern is a candidate once committed (one without its commit marker
is skipped with a warning, like a corrupt file), ranked by the progress record its
manifest holds, and checked with ``sharded.peek`` (manifest, DCP index, data files, the
state's decoding; no tensor data read). ``load_latest`` then loads the chosen folder's full
tensors (``tensors=False``: the peeked state, its tensors ``meta`` placeholders, for a caller
that loads it laid out like its own sharded state); ``read_latest`` returns files only (a
folder has no payload).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import sharded, storage
from .codec import CheckpointError
from .files import load_payload, matches_record, payload_record, read, read_record

__all__ = ["candidates", "find_latest", "load_latest", "modified_time", "ranked", "read_latest"]

# A check that takes or skips a loaded checkpoint; raising CheckpointError skips it with a
# warning (silently returning False is for files that are fine but not wanted).
Accept = Callable[..., bool]


def candidates(
    folder: str,
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Committed entries in ``folder`` matching ``pattern``, newest first by modification
    time (a listing: nothing is opened; ``ranked`` orders them for resuming)."""
    found = _dated_candidates(folder, pattern, commit, storage_options)
    return [url for _, url in found if _folder(url) is None or sharded.is_committed(_folder(url))]


def _dated_candidates(
    folder: str, pattern: str, commit: str, storage_options: dict[str, Any] | None
) -> list[tuple[float, str]]:
    """``(modification time, url)`` of ``candidates(folder)``, newest first. Entries of any
    kind are listed (a symlink shows as neither file nor directory here); reading them
    refuses what is not a regular file."""
    fs, path = storage.filesystem(folder, storage_options)
    if not fs.exists(path):
        return []
    found = []
    for info in fs.ls(path, detail=True):
        name = info["name"].rsplit("/", 1)[-1]
        if name.startswith(".") or not fnmatch.fnmatch(name, pattern):
            continue
        url = _join(folder, name)
        if storage.is_committed(url, commit=commit, storage_options=storage_options):
            found.append((modified_time(info), name, url))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [(mtime, url) for mtime, _, url in found]


def ranked(
    folders: str | Sequence[str],
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """The committed checkpoints across ``folders``; files refused before loading are
    skipped with a warning.

    Within a folder the furthest progress comes first (modification time breaks exact ties;
    files without a progress record come after those with one, newest first). Folders are
    taken most recently written first (by their newest file), so a fresh run in a new
    version folder resumes itself rather than an older run that got further.
    """
    if isinstance(folders, str):
        folders = [folders]
    groups = []
    for order, folder in enumerate(folders):
        scored = []
        for mtime, url in _dated_candidates(folder, pattern, commit, storage_options):
            try:
                local = _folder(url)
                if local is not None:
                    record = sharded.read_record(local)  # refuses an uncommitted folder
                else:
                    record = read_record(url, commit=commit, storage_options=storage_options)
            except (CheckpointError, OSError) as err:
                _skip(url, err)
                continue
            progress = (record or {}).get("progress")
            if progress is None:
                scored.append(((False, (), mtime), url))
            else:
                counters = (progress["step"], progress["total_batches"], progress["epoch"])
                scored.append(((True, counters, mtime), url))
        if scored:
            scored.sort(key=lambda item: item[0], reverse=True)  # stable: listing order
            newest = max(score[2] for score, _ in scored)
            groups.append(((newest, scored[0][0], -order), [url for _, url in scored]))
    groups.sort(key=lambda item: item[0], reverse=True)
    return [url for _, urls in groups for url in urls]


def _folder(url: str) -> str | None:
    """The local path of ``url`` if it is a sharded checkpoint folder, else None."""
    if not storage.is_local_url(url):
        return None
    local = storage.filesystem(url)[1]
    return local if sharded.is_sharded_checkpoint(local) else None


def _loadable(
    folders: str | Sequence[str],
    pattern: str,
    commit: str,
    storage_options: dict[str, Any] | None,
) -> Iterator[tuple[str, dict[str, Any] | None, Any, dict[str, Any]]]:
    """``(url, payload, state, metadata)`` of each ranked checkpoint that reads and decodes
    (a sharded folder: payload None, its state peeked)."""
    for url in ranked(folders, pattern, commit=commit, storage_options=storage_options):
        try:
            local = _folder(url)
            if local is not None:
                state, metadata = sharded.peek(local)
                record = sharded.read_record(local)
            else:
                payload = read(url, commit=commit, storage_options=storage_options)
                state, metadata = load_payload(payload, url=url)
                record = payload_record(payload, url)
            if not matches_record(state, record):
                raise CheckpointError(
                    f"{url}: its record states a progress its state does not have (ranked by "
                    "a record that is not its own)"
                )
        except (CheckpointError, OSError) as err:
            _skip(url, err)
            continue
        yield url, (None if local is not None else payload), state, metadata


def _accepted(url: str, accept: Accept | None, *args: Any) -> bool:
    if accept is None:
        return True
    try:
        return bool(accept(*args))
    except CheckpointError as err:
        _skip(url, err)
        return False


def load_latest(
    folders: str | Sequence[str],
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
    accept: Accept | None = None,
    tensors: bool = True,
) -> tuple[str, Any, dict[str, Any]] | None:
    """``(url, state, metadata)`` of the furthest checkpoint across ``folders`` that loads,
    or None. ``accept(state, metadata)`` may skip more: False silently (e.g. weights-only
    files when resuming), a ``CheckpointError`` with a warning. A sharded folder chosen is
    loaded in full (plain CPU tensors); ``tensors=False`` returns its peeked state instead
    (``meta`` placeholders: for a caller that loads it laid out like its own state)."""
    for url, payload, state, metadata in _loadable(folders, pattern, commit, storage_options):
        if _accepted(url, accept, state, metadata):
            local = _folder(url) if payload is None else None
            if local is not None and tensors:
                try:
                    state, metadata = sharded.load(local)
                except CheckpointError as err:
                    _skip(url, err)
                    continue
            return url, state, metadata
    return None


def read_latest(
    folders: str | Sequence[str],
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
    accept: Accept | None = None,
) -> tuple[str, dict[str, Any]] | None:
    """``(url, payload)`` of the furthest checkpoint across ``folders`` that loads, or None.

    Like ``load_latest``, but returns the payload ``read`` returned (restore from it with
    ``load_payload`` instead of reading the file again) and calls ``accept(payload)``;
    files only (sharded folders have no payload: ``load_latest`` takes them)."""
    for url, payload, _, _ in _loadable(folders, pattern, commit, storage_options):
        if payload is not None and _accepted(url, accept, payload):
            return url, payload
    return None


def find_latest(
    folder: str | Sequence[str],
    pattern: str = "*.ckpt",
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """The furthest checkpoint in ``folder`` that loads, or None; warns about broken ones.

    To restore from it, ``load_latest`` saves reading the file a second time."""
    found = load_latest(folder, pattern, commit=commit, storage_options=storage_options)
    return None if found is None else found[0]


def _skip(url: str, err: BaseException) -> None:
    warnings.warn(f"skipping checkpoint {url}: {err}", stacklevel=4)


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
