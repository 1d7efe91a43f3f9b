"""Read ``torch.distributed.checkpoint`` metadata without letting it run code.

DCP's ``.metadata`` file is a pickle, and ``FileSystemReader.read_metadata`` unpickles it
with ``pickle.load``: a crafted file would run any code on load. ``SafeReader`` is a
``FileSystemReader`` whose ``read_metadata`` uses ``MetadataUnpickler``, which resolves only
the classes DCP's metadata is made of (its dataclasses, ``torch.Size``, dtypes, layouts,
``pathlib`` paths) and refuses every other global. The tensor data itself is read by DCP
with ``torch.load(weights_only=True)``. Around the unpickling:

* **before it**, the pickle is scanned for what it would expand to (``dcp_expansion``:
  at most ``MAX_METADATA_VALUES`` values, so no few kilobytes unpickle to an exponentially
  shared structure);
* **after it**, the index is checked (``dcp_index``): tensor entries only (a bytes entry
  would be read back with an unrestricted ``torch.load``), chunks covering each tensor
  exactly, data files named as DCP names them and lying in the checkpoint's folder,
  extents inside those files and apart, each of its chunk's bytes plus at most
  ``MAX_SLICE_OVERHEAD``, no stream transforms: what the data may decode to is bounded by
  what the index declares;
* **before DCP reads any slice** of a load, ``SafeReader.read_data`` checks each one
  (``dcp_slices.check_slice``: an uncompressed ``torch.save`` archive of at most its
  chunk's bytes, read about a kilobyte of it).

Every name of those modules that this one used to hold is importable from here.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from concurrent.futures import Future
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from .codec import CheckpointError
from .dcp_expansion import MAX_METADATA_VALUES, check_expansion
from .dcp_expansion import _expanded as _expanded  # private names kept importable from here
from .dcp_expansion import _TooLarge as _TooLarge
from .dcp_index import MAX_IRREGULAR_PAIRS, MAX_TENSOR_DIMS, check_index, slice_limits
from .dcp_index import _Box as _Box
from .dcp_index import _overlap as _overlap
from .dcp_index import _TooIrregular as _TooIrregular
from .dcp_slices import MAX_SLICE_OVERHEAD, check_slice

__all__ = [
    "MAX_IRREGULAR_PAIRS",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_VALUES",
    "MAX_SLICE_OVERHEAD",
    "MAX_TENSOR_DIMS",
    "MetadataUnpickler",
    "SafeReader",
    "check_expansion",
    "read_metadata",
]

#: The largest ``.metadata`` file read (far above a model's thousands of entries).
MAX_METADATA_BYTES = 256 * 1024 * 1024

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
    check_expansion(data, path)
    try:
        meta = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # UnpicklingError, or any malformed input
        raise CheckpointError(f"{path}: refused to read .metadata: {err}") from None
    check_index(meta, path)
    return meta


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with ``read_metadata`` through ``MetadataUnpickler``, and
    every data slice a read asks for checked (``check_slice``) before DCP reads any."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._folder = os.fspath(path)
        self._limits: dict[tuple[str, int, int], tuple[str, int]] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported")
        meta = read_metadata(self._folder)
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta

    def set_up_storage_reader(
        self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """DCP's set-up, plus what each slice of ``metadata`` may decode to (on every rank:
        a rank that did not read the metadata gets it from the coordinator)."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._limits = slice_limits(metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's ``read_data``, once every slice that ``plan`` reads is checked. Checked in
        this public method, which every read of a plan goes through, rather than in a
        private hook of DCP's that a torch release could stop calling (which would lose
        the checks silently). Tensor data is still read once, by DCP."""
        self._check_slices(plan)
        return super().read_data(plan, planner)

    def _check_slices(self, plan: LoadPlan) -> None:
        """``check_slice`` on each distinct slice the items of ``plan`` name, one data file
        open at a time (DCP may read a slice for several items)."""
        per_file: dict[str, set[tuple[int, int]]] = {}
        for item in plan.items:
            sinfo = self.storage_data[item.storage_index]
            per_file.setdefault(sinfo.relative_path, set()).add((sinfo.offset, sinfo.length))
        for name, spans in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for offset, length in sorted(spans):
                    self._check_one(stream, name, offset, length)

    def _check_one(self, stream: IO[bytes], name: str, offset: int, length: int) -> None:
        """``check_slice`` on bytes ``offset`` to ``offset + length`` of the data file
        ``name`` (open as ``stream``), bounded by its checked storage entry."""
        if (name, offset, length) not in self._limits:
            raise CheckpointError(
                f"{self._folder}: DCP asked for bytes {offset} to {offset + length} of {name}, "
                "which no checked storage entry names"
            )
        key, declared = self._limits[(name, offset, length)]
        where = f"the data of tensor {key!r} (bytes {offset} to {offset + length} of {name})"
        try:
            check_slice(stream, offset, length, declared, where)
        except CheckpointError as err:
            raise CheckpointError(
                f"reading the sharded checkpoint {self._folder} failed: {err}"
            ) from None
