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
state's decoding; no tensor data read). Where a save (or cleanup) of a name was cut short
between committing its new version and moving it into place, the newest committed state
of that name is a hidden folder beside it (``sharded.newest_in``): that folder is the
name's candidate, in place of the older version or of no entry at all, so a kill at any
point of the commit leaves a run that resumes from its newest committed state. The name's
own entry stays its fallback: taken where the hidden folder fails (the older version), or
where it is gone by the time it is read (its writer placed it at the name meanwhile: the
name is looked up again, never dropped from the listing).
``load_latest`` then loads the chosen folder's full tensors (``tensors=False``: the peeked
state, its tensors ``meta`` placeholders, for a caller that loads it laid out like its own
sharded state); ``read_latest`` returns files only (a folder has no payload).
"""

from __future__ import annotations

import fnmatch
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import sharded, storage
from .codec import CheckpointError
from .files import load_payload, matches_record, payload_record, read, read_record
from .storage import modified_time  # re-exported: its home is the storage layer

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
    folders = [(url, _folder(url)) for _, url, _ in found]
    return [url for url, local in folders if local is None or sharded.is_committed(local)]


def _dated_candidates(
    folder: str, pattern: str, commit: str, storage_options: dict[str, Any] | None
) -> list[tuple[float, str, str | None]]:
    """``(modification time, url, fallback)`` of ``candidates(folder)``, newest first.
    Entries of any kind are listed (a symlink shows as neither file nor directory here);
    reading them refuses what is not a regular file. ``fallback`` is set for a hidden
    folder holding a name's newest committed state: the name's own entry, to take where
    the hidden folder fails (its older version) or is gone (its writer placed it)."""
    fs, path = storage.filesystem(folder, storage_options)
    if not fs.exists(path):
        return []
    # names whose newest committed state is a hidden sharded folder (a commit cut short)
    hidden = sharded.newest_in(path) if storage._is_local(fs) else {}
    found = []
    for info in fs.ls(path, detail=True):
        name = info["name"].rsplit("/", 1)[-1]
        if name.startswith(".") or name in hidden or not fnmatch.fnmatch(name, pattern):
            continue
        url = _join(folder, name)
        if storage.is_committed(url, commit=commit, storage_options=storage_options):
            found.append((modified_time(info), name, url, None))
    for name, local in hidden.items():
        if fnmatch.fnmatch(name, pattern):
            entry = _hidden_candidate(fs, folder, os.path.join(path, name), local)
            if entry is not None:
                found.append((entry[0], name, *entry[1:]))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [(mtime, url, fallback) for mtime, _, url, fallback in found]


def _hidden_candidate(
    fs: Any, folder: str, named: str, local: str
) -> tuple[float, str, str | None] | None:
    """``(modification time, url, fallback)`` for the name ``named`` (a local path) whose
    newest committed state was the hidden folder ``local`` when ``folder`` was listed.
    Where that folder is gone meanwhile (its writer placed it, or cleaned it up), the
    name's newest state is looked up again, so the name is never dropped."""
    for _ in range(2):
        try:
            mtime = modified_time(fs.info(local))
        except OSError:  # moved meanwhile: where is the newest state now?
            local = sharded.newest(named)
            if local is None:
                return None
            continue
        url = _join(folder, os.path.basename(local))
        if os.path.abspath(local) == os.path.abspath(named):
            return mtime, url, None
        return mtime, url, _join(folder, os.path.basename(named))
    return None


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
    return [url for url, _ in _ranked(folders, pattern, commit, storage_options)]


def _ranked(
    folders: str | Sequence[str],
    pattern: str,
    commit: str,
    storage_options: dict[str, Any] | None,
) -> list[tuple[str, str | None]]:
    """``ranked`` with each candidate's fallback (see ``_dated_candidates``): a hidden
    folder whose record cannot be read is ranked by its fallback's record instead."""
    if isinstance(folders, str):
        folders = [folders]
    groups = []
    for order, folder in enumerate(folders):
        scored = []
        for mtime, url, fallback in _dated_candidates(folder, pattern, commit, storage_options):
            score = _score(url, mtime, commit, storage_options, quiet=fallback is not None)
            if score is None and fallback is not None:
                url, fallback = fallback, None
                score = _score(url, _mtime(url, storage_options), commit, storage_options)
            if score is not None:
                scored.append((score, url, fallback))
        if scored:
            scored.sort(key=lambda item: item[0], reverse=True)  # stable: listing order
            newest = max(score[2] for score, _, _ in scored)
            groups.append(((newest, scored[0][0], -order), [(u, f) for _, u, f in scored]))
    groups.sort(key=lambda item: item[0], reverse=True)
    return [entry for _, entries in groups for entry in entries]


def _score(
    url: str,
    mtime: float,
    commit: str,
    storage_options: dict[str, Any] | None,
    *,
    quiet: bool = False,
) -> tuple[bool, tuple[int, ...], float] | None:
    """The ranking key of ``url`` from its progress record (None, warned, when the record
    cannot be read; ``quiet``: no warning once ``url`` is gone, a hidden folder its writer
    placed meanwhile)."""
    try:
        local = _folder(url)
        if local is not None:
            record = sharded.read_record(local)  # refuses an uncommitted folder
        else:
            record = read_record(url, commit=commit, storage_options=storage_options)
    except (CheckpointError, OSError) as err:
        if not (quiet and not _still_there(url)):
            _skip(url, err)
        return None
    progress = (record or {}).get("progress")
    if progress is None:
        return (False, (), mtime)
    return (True, (progress["step"], progress["total_batches"], progress["epoch"]), mtime)


def _mtime(url: str, storage_options: dict[str, Any] | None) -> float:
    """The modification time of ``url`` (0 when it cannot be told)."""
    fs, path = storage.filesystem(url, storage_options)
    try:
        return modified_time(fs.info(path))
    except OSError:
        return 0.0


def _still_there(url: str) -> bool:
    """Whether anything is at the local ``url`` (True elsewhere: nothing moves there)."""
    if not storage.is_local_url(url):
        return True
    return os.path.lexists(storage.filesystem(url)[1])


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
    (a sharded folder: payload None, its state peeked). A hidden folder holding a name's
    newest state that fails is followed by the name's own entry (its older version), and
    so is one that is gone by the time the caller passed over it (placed at the name: the
    name's newest state is there now)."""
    for url, fallback in _ranked(folders, pattern, commit, storage_options):
        found = _read_candidate(url, commit, storage_options, quiet=fallback is not None)
        if found is not None:
            yield found
            if fallback is None or _still_there(url):
                continue
        if fallback is not None:
            found = _read_candidate(fallback, commit, storage_options)
            if found is not None:
                yield found


def _read_candidate(
    url: str, commit: str, storage_options: dict[str, Any] | None, *, quiet: bool = False
) -> tuple[str, dict[str, Any] | None, Any, dict[str, Any]] | None:
    """``(url, payload, state, metadata)`` of ``url`` if it reads and decodes, else None
    (warned; ``quiet``: not once ``url`` is gone, see ``_score``)."""
    try:
        local = _folder(url)
        payload = None
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
        if not (quiet and not _still_there(url)):
            _skip(url, err)
        return None
    return url, payload, state, metadata


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
