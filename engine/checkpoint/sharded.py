"""Sharded checkpoints: every rank writes its own shard through ``torch.distributed.checkpoint``.

A sharded checkpoint is a folder::

    run.ckpt/
      __0_0.distcp  __1_0.distcp ...   each rank's tensors (DCP's FileSystemWriter)
      .metadata                        DCP's index of them (a pickle; read safely, below)
      purestep.json                    format, versions, the state's structure, the metadata
      COMMITTED                        written last: the checkpoint is complete

``save(state, path, metadata=...)`` is called by every rank (a collective when a process
group exists; also works in one process without one). The state is encoded as for an
ordinary checkpoint (``codec.encode``: plain data, ``@struct`` classes by name); its tensors
(DTensor shards and plain tensors alike) go to DCP under the keys ``tensor.<i>`` in tree
order, the rest to ``purestep.json`` as JSON. Atomic: everything is written into a
temporary folder beside ``path``; when every rank's ``dcp.save`` has returned (DCP writes
``.metadata`` after gathering every rank's results), rank 0 writes ``purestep.json``,
renames the folder into place (an older checkpoint at ``path`` is renamed away first and
deleted after the commit) and writes ``COMMITTED`` in it, last: no temporary folder ever
holds a marker. A reader never sees a half-written checkpoint: a folder without
``COMMITTED`` is refused. A rank that dies mid-save leaves the temporary folder
(uncommitted and hidden; the launcher ends the other ranks, which wait in DCP's
collectives); ``remove_partial`` deletes it once its writer is gone.

``load(path, target=None)`` reads it back at any world size. With ``target`` (a state of
the same model and optimizer: say a fresh ``engine.init`` under ``hardware.fsdp()`` on 1, 2
or 4 ranks, or a plain single-device state) the parameters, buffers, optimizer and
loss-scaler state are loaded into tensors laid out like the target's (DCP reshards: a
DTensor target reads its own chunk of the saved shards, a plain target the full tensor),
after checking that their global shapes and dtypes match; everything else (progress, key,
callback and loop state) comes from the checkpoint as it is, like ``conform``. Without a
target, plain full CPU tensors. Every rank calls it when the target is sharded.

**Safety: no code runs from a checkpoint.** ``purestep.json`` is JSON, decoded by
``codec.decode`` (registered ``@struct`` classes only). DCP's ``.metadata`` pickle is read by
``dcp_metadata.SafeReader`` (only DCP's metadata classes are resolved; data files must be
this folder's; tensor entries only); tensor data is read by DCP with
``torch.load(weights_only=True)``. Local filesystems only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .codec import CheckpointError, decode, encode
from .storage import _TMP, STALE_AFTER_S, _temp_name, writer_alive

__all__ = [
    "COMMIT_FILE",
    "MANIFEST",
    "SHARDED_FORMAT",
    "is_committed",
    "is_sharded_checkpoint",
    "load",
    "peek",
    "read_manifest",
    "read_record",
    "remove",
    "remove_partial",
    "save",
]

SHARDED_FORMAT = "purestep-sharded"
SHARDED_VERSION = 1
MANIFEST = "purestep.json"
COMMIT_FILE = "COMMITTED"
#: The largest ``purestep.json`` read.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_TENSOR = "__tensor__"
#: The parts of a state the model and optimizer decide: with a target, their tensors are
#: loaded laid out like the target's (sharded or not); the rest comes from the file as is.
MODEL_SECTIONS = ("params", "buffers", "opt_state", "precision")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process when no group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _split(tree: Any, tensors: dict[str, torch.Tensor], section: str) -> Any:
    """``tree`` (encoded) with every tensor replaced by a reference into ``tensors``, keyed
    ``"<section>.<i>"`` in tree order."""
    if isinstance(tree, torch.Tensor):
        key = f"{section}.{sum(1 for k in tensors if k.rpartition('.')[0] == section)}"
        tensors[key] = tree
        return {_TENSOR: key}
    if isinstance(tree, dict):
        return {k: _split(v, tensors, section) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_split(v, tensors, section) for v in tree]
    return tree


def _split_sections(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``_split`` with one section per top-level field (of a ``@struct`` such as
    ``TrainState``, or of a dict with string keys), so the parts the model and optimizer
    decide can be matched against a target on their own."""
    if isinstance(tree, dict) and tree.get("__kind__") == "struct":
        data = {f: _split(v, tensors, f) for f, v in tree["data"].items()}
        return {**tree, "data": data, "static": _split(tree["static"], tensors, "static")}
    if isinstance(tree, dict) and tree.get("__kind__") == "dict":
        items = [
            [k, _split(v, tensors, k if isinstance(k, str) and k.isidentifier() else "root")]
            for k, v in tree["items"]
        ]
        return {**tree, "items": items}
    return _split(tree, tensors, "root")


def _join(tree: Any, tensors: Mapping[str, torch.Tensor], depth: int = 0) -> Any:
    if depth > 200:
        raise CheckpointError("malformed sharded checkpoint: nested too deeply")
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            key = tree[_TENSOR]
            if not isinstance(key, str) or key not in tensors:
                raise CheckpointError(f"malformed sharded checkpoint: no tensor {key!r}")
            return tensors[key]
        return {k: _join(v, tensors, depth + 1) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_join(v, tensors, depth + 1) for v in tree]
    return tree


def _record(state: Any) -> dict[str, Any]:
    """The progress record of ``state`` (as ``files.read_record`` gives a file's), written
    into the manifest so that resume discovery ranks a folder without reading its tensors."""
    from .files import _PROGRESS_FIELDS

    progress = getattr(state, "progress", None)
    try:
        counters = {f: int(getattr(progress, f)) for f in _PROGRESS_FIELDS}
    except (AttributeError, TypeError, ValueError, RuntimeError):
        counters = None
    return {"progress": counters}


def _tensors_of(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    return _split_sections(encode(value), tensors), tensors


def _agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (identity without a process group)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(state: Any, path: str | os.PathLike, *, metadata: Mapping[str, Any] | None = None) -> None:
    """Write ``state`` as a sharded checkpoint folder at ``path`` (every rank calls this;
    ``metadata`` is taken from rank 0)."""
    from .files import versions

    path = os.path.abspath(os.fspath(path))
    if "://" in os.fspath(path):
        raise CheckpointError(f"sharded checkpoints are written to local folders, not {path}")
    parent = os.path.dirname(path)
    rank = _rank()
    skeleton, tensors = _tensors_of(state)
    # hidden, named with the writer's identity: discovery never lists it, and once its
    # writer is gone ``remove_partial`` deletes it
    temp = _agree(os.path.join(parent, _temp_name(os.path.basename(path))) if rank == 0 else None)
    error = None
    if rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            if os.path.lexists(temp):
                shutil.rmtree(temp)
            os.makedirs(temp)
        except OSError as err:
            error = f"cannot create {temp}: {err}"
    error = _agree(error)
    if error:
        raise CheckpointError(error)
    import torch.distributed.checkpoint as dcp  # about a second to import: only when used

    try:
        with _quiet():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(temp), no_dist=not _distributed())
    except Exception as err:
        raise CheckpointError(f"writing the sharded checkpoint {path} failed: {err}") from err
    old = None
    if rank == 0:
        try:
            meta_skeleton, meta_tensors = _tensors_of(dict(metadata or {}))
            if meta_tensors:
                raise CheckpointError("sharded checkpoint metadata may not hold tensors")
            manifest = {
                "format": SHARDED_FORMAT,
                "version": SHARDED_VERSION,
                "versions": versions(),
                "world_size": dist.get_world_size() if _distributed() else 1,
                "record": _record(state),
                "state": skeleton,
                "metadata": meta_skeleton,
            }
            _write_file(os.path.join(temp, MANIFEST), json.dumps(manifest).encode())
            _fsync_dir(temp)
            if os.path.lexists(path):
                old = os.path.join(parent, _temp_name(os.path.basename(path)))
                os.replace(path, old)
            os.replace(temp, path)
            _fsync_dir(parent)
            # the commit point, last and in place: no other folder ever holds a marker
            _write_file(os.path.join(path, COMMIT_FILE), b"")
            _fsync_dir(path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)
        except (OSError, CheckpointError, TypeError, ValueError) as err:
            error = f"committing the sharded checkpoint {path} failed: {err}"
            _roll_back(path, old)
            shutil.rmtree(temp, ignore_errors=True)
    error = _agree(error)
    if error:
        raise CheckpointError(error)


def remove_partial(folder: str | os.PathLike, *, stale_after: float = STALE_AFTER_S) -> list[str]:
    """Delete the temporary folders in ``folder`` that killed writers of sharded checkpoints
    left (hidden, named with the writer's identity, as ``storage.remove_partial`` treats
    temporary files): one whose writer is gone, or, when that cannot be told, untouched for
    ``stale_after`` seconds. A live writer's folder is never touched. Returns their paths."""
    folder = os.fspath(folder)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        full = os.path.join(folder, name)
        if not name.startswith(".") or _TMP not in name:
            continue
        if os.path.islink(full) or not os.path.isdir(full):
            continue
        alive = writer_alive(name)
        if alive is None:
            try:
                alive = time.time() - os.lstat(full).st_mtime < stale_after
            except OSError:
                continue
        if not alive:
            shutil.rmtree(full, ignore_errors=True)
            if not os.path.lexists(full):
                removed.append(full)
    return removed


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a sharded checkpoint (committed or not)."""
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def _roll_back(path: str, old: str | None) -> None:
    """After a failed commit: the older checkpoint, renamed away, back at ``path`` (the new,
    uncommitted folder removed), so a failed save never loses the one before."""
    if old is None or not os.path.lexists(old) or is_committed(path):
        return
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        os.replace(old, path)


def is_committed(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint folder whose writer finished (its commit
    marker is a regular file in it)."""
    path = os.fspath(path)
    marker = os.path.join(path, COMMIT_FILE)
    return is_sharded_checkpoint(path) and os.path.isfile(marker) and not os.path.islink(marker)


def remove(path: str | os.PathLike) -> None:
    """Delete the committed purestep sharded checkpoint folder ``path`` (anything else is a
    ``CheckpointError``): its commit marker first, so a deletion cut short leaves a folder
    no reader takes for a checkpoint."""
    path = os.fspath(path)
    if not is_sharded_checkpoint(path) or os.path.islink(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint folder")
    read_manifest(path)  # committed, and purestep's: never another program's folder
    marker = os.path.join(path, COMMIT_FILE)
    if os.path.lexists(marker):
        os.remove(marker)
    shutil.rmtree(path)


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
    from .files import _PROGRESS_FIELDS

    record = read_manifest(path).get("record")
    progress = record.get("progress") if isinstance(record, dict) else None
    if progress is None:
        return {"progress": None}
    if not isinstance(progress, dict) or not all(
        type(progress.get(f)) is int for f in _PROGRESS_FIELDS
    ):
        raise CheckpointError(f"{os.fspath(path)}: malformed progress record in {MANIFEST}")
    return {"progress": {f: progress[f] for f in _PROGRESS_FIELDS}}


def peek(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(state, metadata)`` of the committed sharded checkpoint at ``path`` with every tensor
    a ``meta``-device placeholder of its saved shape and dtype: all is checked as ``load``
    checks it (manifest, DCP index, data files and extents, the state's decoding) but no
    tensor data is read. Resume discovery uses it to validate a folder that the restore
    then loads laid out like its own state."""
    from .dcp_metadata import read_metadata

    path = os.path.abspath(os.fspath(path))
    manifest = read_manifest(path)
    saved = read_metadata(path).state_dict_metadata
    dest = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device="meta")
        for key, entry in saved.items()
    }
    return _decoded(manifest, dest, path)


def _decoded(
    manifest: dict[str, Any], tensors: Mapping[str, torch.Tensor], path: str
) -> tuple[Any, dict[str, Any]]:
    state = decode(_join(manifest["state"], tensors), "state")
    meta = decode(_join(manifest.get("metadata", {}), {}), "metadata")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: malformed metadata")
    meta = {**meta, "versions": manifest.get("versions"), "world_size": manifest.get("world_size")}
    return state, meta


def load(path: str | os.PathLike, target: Any = None) -> tuple[Any, dict[str, Any]]:
    """``(state, metadata)`` of the sharded checkpoint at ``path``, laid out like ``target``
    (see the module docstring)."""
    import torch.distributed.checkpoint as dcp

    from .dcp_metadata import SafeReader, read_metadata

    path = os.path.abspath(os.fspath(path))
    manifest = read_manifest(path)
    saved = read_metadata(path).state_dict_metadata
    dest = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in saved.items()
    }
    if target is not None:
        _, wanted = _tensors_of(target)
        # the model's parts the file holds (a weights-only file has no optimizer state)
        present = {k.rpartition(".")[0] for k in saved} & set(MODEL_SECTIONS)
        wanted = {k: t for k, t in wanted.items() if k.rpartition(".")[0] in present}
        _check_layout(saved, wanted, path)
        dest.update({key: torch.empty_like(t) for key, t in wanted.items()})
    try:
        with _quiet():
            dcp.load(dest, storage_reader=SafeReader(path), no_dist=not _distributed())
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"reading the sharded checkpoint {path} failed: {err}") from err
    return _decoded(manifest, dest, path)


def _check_layout(saved: Mapping[str, Any], wanted: Mapping[str, torch.Tensor], path: str) -> None:
    """The target's tensors of ``MODEL_SECTIONS`` against the checkpoint's: same sections,
    counts, global shapes and dtypes."""
    for section in sorted({k.rpartition(".")[0] for k in [*wanted, *saved]} & set(MODEL_SECTIONS)):
        mine = [k for k in wanted if k.rpartition(".")[0] == section]
        theirs = [k for k in saved if k.rpartition(".")[0] == section]
        if len(mine) != len(theirs):
            raise CheckpointError(
                f"{path}: the checkpoint's {section} hold {len(theirs)} tensors but the target "
                f"state's hold {len(mine)}: it was written for a different model or optimizer"
            )
    for key, t in wanted.items():
        entry = saved[key]
        if tuple(entry.size) != tuple(t.shape) or entry.properties.dtype != t.dtype:
            raise CheckpointError(
                f"{path}: tensor {key} is {list(entry.size)} {entry.properties.dtype} in the "
                f"checkpoint but {list(t.shape)} {t.dtype} in the target state: it was "
                "written for a different model or optimizer"
            )
