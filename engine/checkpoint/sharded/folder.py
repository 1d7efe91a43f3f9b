"""What a sharded checkpoint folder is: its files, its format, and whether it is committed.

A folder holds each rank's ``*.distcp`` data file and DCP's ``.metadata`` index,
``purestep.json`` (the manifest: format, versions, the state's structure, the metadata) and
``COMMITTED`` (written last: the checkpoint is complete). Only a committed folder with a
manifest of this format is read. The small files are written and flushed here
(``_write_file``, ``_fsync_dir``).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from .. import storage
from ..codec import CheckpointError

SHARDED_FORMAT = "purestep-sharded"
SHARDED_VERSION = 1
MANIFEST = "purestep.json"
COMMIT_FILE = "COMMITTED"
#: The largest ``purestep.json`` read.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: The largest ``COMMITTED`` record read (a few dozen bytes are written).
MAX_MARKER_BYTES = 4096


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a sharded checkpoint (committed or not)."""
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def is_committed(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint folder whose writer finished (its commit
    marker is a regular file in it)."""
    path = os.fspath(path)
    marker = os.path.join(path, COMMIT_FILE)
    return is_sharded_checkpoint(path) and os.path.isfile(marker) and not os.path.islink(marker)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The checked ``purestep.json`` of a committed sharded checkpoint."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint folder")
    if not is_committed(path):
        raise CheckpointError(f"{path} is not committed (its writer did not finish): refusing it")
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file) or os.path.islink(file):
        raise CheckpointError(f"{path} has no {MANIFEST}")
    if os.path.getsize(file) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: {MANIFEST} is larger than a checkpoint needs")
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{path} is not a purestep sharded checkpoint")
    if "state" not in manifest or not isinstance(manifest.get("metadata", {}), dict):
        raise CheckpointError(f"{path}: malformed {MANIFEST} (no state)")
    if manifest.get("version") != SHARDED_VERSION:
        raise CheckpointError(
            f"{path} has sharded format version {manifest.get('version')!r}; this purestep "
            f"reads version {SHARDED_VERSION}"
        )
    return manifest


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """The progress record of the committed sharded checkpoint at ``path`` (``{"progress":
    {"epoch", "step", "batch_in_epoch", "total_batches"} or None}``, like
    ``files.read_record``), read from its manifest alone."""
    from ..files import _PROGRESS_FIELDS

    record = read_manifest(path).get("record")
    progress = record.get("progress") if isinstance(record, dict) else None
    if progress is None:
        return {"progress": None}
    if not isinstance(progress, dict) or not all(
        type(progress.get(f)) is int for f in _PROGRESS_FIELDS
    ):
        raise CheckpointError(f"{os.fspath(path)}: malformed progress record in {MANIFEST}")
    return {"progress": {f: progress[f] for f in _PROGRESS_FIELDS}}


def _write_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to the device (a manifest or a marker)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    """Flush the folder ``path``'s entries (renames, new files) to the device, where the
    platform can; a folder that cannot be opened or flushed is left as it is."""
    with contextlib.suppress(OSError):
        storage._fsync_dir(path)
