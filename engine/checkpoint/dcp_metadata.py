"""Read ``torch.distributed.checkpoint`` metadata without letting it run code.

DCP's ``.metadata`` file is a pickle, and ``FileSystemReader.read_metadata`` unpickles it
with ``pickle.load``: a crafted file would run any code on load. ``SafeReader`` is a
``FileSystemReader`` whose ``read_metadata`` uses ``MetadataUnpickler``, which resolves only
the classes DCP's metadata is made of (its dataclasses, ``torch.Size``, dtypes, layouts,
``pathlib`` paths) and refuses every other global, and then checks what it read: tensor
entries only (a bytes entry would be read back with an unrestricted ``torch.load``), data
files named as DCP names them and lying in the checkpoint's folder, extents inside those
files, no stream transforms. The tensor data itself is read by DCP with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pathlib
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from .codec import CheckpointError

__all__ = ["MAX_METADATA_BYTES", "MetadataUnpickler", "SafeReader", "read_metadata"]

#: The largest ``.metadata`` file read (far above a model's thousands of entries).
MAX_METADATA_BYTES = 256 * 1024 * 1024

_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")

_ALLOWED: dict[str, dict[str, Any]] = {
    "torch.distributed.checkpoint.metadata": {
        name: getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo": dcp_filesystem._StorageInfo},
    "torch": {"Size": torch.Size},
    "pathlib": {"PosixPath": pathlib.PosixPath, "PurePosixPath": pathlib.PurePosixPath},
}


def _layout(name: str) -> torch.layout:
    short = name.removeprefix("torch.") if isinstance(name, str) else None
    value = getattr(torch, short, None) if short else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"not a torch layout: {name!r}")
    return value


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP metadata objects and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return _layout
        allowed = _ALLOWED.get(module, {})
        if name in allowed:
            return allowed[name]
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of torch.distributed.checkpoint's metadata"
        )


def read_metadata(path: str) -> dcp_metadata.Metadata:
    """The checked metadata of the DCP checkpoint in folder ``path``."""
    file = os.path.join(path, ".metadata")
    try:
        size = os.lstat(file).st_size
    except OSError as err:
        raise CheckpointError(f"{path}: no readable .metadata ({err})") from None
    if not os.path.isfile(file) or os.path.islink(file):
        raise CheckpointError(f"{path}: .metadata is not a regular file")
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{path}: .metadata is {size} bytes, more than a checkpoint needs")
    with open(file, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    try:
        meta = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # UnpicklingError, or any malformed input
        raise CheckpointError(f"{path}: refused to read .metadata: {err}") from None
    _check(meta, path)
    return meta


def _fields(obj: Any, cls: type, what: str, path: str) -> None:
    """``obj`` is exactly a ``cls`` (a dataclass) with no attributes but its fields: the
    pickle's BUILD opcode sets any attribute on the objects it makes."""
    if type(obj) is not cls:
        raise CheckpointError(f"{path}: malformed .metadata: {what} is {type(obj).__name__}")
    extra = set(vars(obj)) - {f.name for f in dataclasses.fields(cls)}
    if extra:
        raise CheckpointError(f"{path}: malformed .metadata: {what} has {sorted(extra)}")


def _shape(value: Any) -> bool:
    return type(value) is torch.Size and all(type(d) is int and d >= 0 for d in value)


def _check_entry(key: Any, entry: Any, path: str) -> int:
    """Check one tensor entry; return its bytes."""
    if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
        raise CheckpointError(
            f"{path}: entry {key!r} is {type(entry).__name__}; a purestep checkpoint holds "
            "tensors only"
        )
    _fields(entry, dcp_metadata.TensorStorageMetadata, f"entry {key!r}", path)
    props = entry.properties
    _fields(props, dcp_metadata.TensorProperties, f"entry {key!r}'s properties", path)
    if not (
        isinstance(props.dtype, torch.dtype)
        and props.layout is torch.strided
        and type(props.requires_grad) is bool
        and type(props.pin_memory) is bool
        and isinstance(props.memory_format, torch.memory_format)
        and _shape(entry.size)
        and type(entry.chunks) is list
    ):
        raise CheckpointError(f"{path}: malformed .metadata: entry {key!r} is not a tensor's")
    for chunk in entry.chunks:
        _fields(chunk, dcp_metadata.ChunkStorageMetadata, f"a chunk of {key!r}", path)
        if not (
            _shape(chunk.offsets)
            and _shape(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
            and all(o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size))
        ):
            raise CheckpointError(f"{path}: a chunk of entry {key!r} lies outside its tensor")
    return math.prod(entry.size) * props.dtype.itemsize


def _check(meta: Any, path: str) -> None:
    if not isinstance(meta, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: .metadata holds {type(meta).__name__}, not DCP Metadata")
    _fields(meta, dcp_metadata.Metadata, "the metadata", path)
    entries = meta.state_dict_metadata
    if type(entries) is not dict or not all(type(k) is str for k in entries):
        raise CheckpointError(f"{path}: malformed .metadata (no entry table)")
    needed = {key: _check_entry(key, entry, path) for key, entry in entries.items()}
    planner = meta.planner_data
    if planner is not None and not (
        type(planner) is dict
        and all(
            type(k) is str and type(v) is tuple and all(type(x) in (str, int) for x in v)
            for k, v in planner.items()
        )
    ):
        raise CheckpointError(f"{path}: malformed .metadata (planner data)")
    if meta.storage_meta is not None:
        _fields(meta.storage_meta, dcp_metadata.StorageMeta, "its storage_meta", path)
    storage = meta.storage_data
    if type(storage) is not dict:
        raise CheckpointError(f"{path}: malformed .metadata (no storage table)")
    sizes: dict[str, int] = {}
    stored: dict[str, int] = dict.fromkeys(entries, 0)
    for index, info in storage.items():
        if type(index) is not dcp_metadata.MetadataIndex or index.fqn not in entries:
            raise CheckpointError(f"{path}: malformed storage key {index!r}")
        if type(info) is not dcp_filesystem._StorageInfo:
            raise CheckpointError(f"{path}: malformed storage entry for {index!r}")
        _fields(info, dcp_filesystem._StorageInfo, f"storage entry {index!r}", path)
        name = info.relative_path
        if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
            raise CheckpointError(
                f"{path}: storage entry {index!r} names the file {name!r}, not a data file of "
                "this checkpoint's folder"
            )
        if info.transform_descriptors:
            raise CheckpointError(f"{path}: storage entry {index!r} asks for stream transforms")
        if name not in sizes:
            file = os.path.join(path, name)
            if not os.path.isfile(file) or os.path.islink(file):
                raise CheckpointError(f"{path}: data file {name} is missing or not a regular file")
            sizes[name] = os.path.getsize(file)
        offset, length = info.offset, info.length
        if (
            not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0)
            or offset + length > sizes[name]
        ):
            raise CheckpointError(
                f"{path}: storage entry {index!r} lies outside its data file {name}"
            )
        stored[index.fqn] += length
    for key, size in needed.items():
        # every stored format holds at least the tensor's bytes: a larger tensor would be
        # allocated for nothing (a crafted size of terabytes)
        if size > stored[key]:
            raise CheckpointError(
                f"{path}: entry {key!r} is {size} bytes but its data files hold "
                f"{stored[key]} for it"
            )


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with ``read_metadata`` through ``MetadataUnpickler``."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._folder = os.fspath(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported")
        meta = read_metadata(self._folder)
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta
