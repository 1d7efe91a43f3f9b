"""Check an unpickled DCP index: what the data may decode to is bounded by what it declares.

So a small folder cannot make a reader allocate gigabytes (with or without a target state):

* every tensor has at most ``MAX_TENSOR_DIMS`` dimensions and its chunks cover it
  exactly (their elements add up to the tensor's, and no two share an element: checked
  in O(n log n) per dimension for grids, pair by pair within ``MAX_IRREGULAR_PAIRS``
  steps otherwise), and each chunk has one storage entry;
* each storage entry holds its chunk's bytes plus at most ``MAX_SLICE_OVERHEAD`` (DCP
  stores a chunk as one uncompressed ``torch.save`` archive: about a kilobyte beyond the
  tensor's bytes), names a data file of the checkpoint's folder, lies inside it, asks for
  no stream transforms, and shares no byte with another entry. So the tensors declared
  never exceed the distinct bytes stored ("stored" meaning the data files' sizes, which are
  what a reader reads: a sparse file's holes read back as zeros, and allocated blocks are
  not a measure filesystems agree on).

``check_index`` runs these checks; ``slice_limits`` gives what each data slice of a checked
index may decode to, for ``dcp_slices.check_slice``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from .codec import CheckpointError
from .dcp_slices import MAX_SLICE_OVERHEAD

__all__ = ["MAX_IRREGULAR_PAIRS", "MAX_TENSOR_DIMS", "check_index", "slice_limits"]

#: The steps (pairs of chunks compared, times their dimensions) spent, over a whole index,
#: where a tensor's chunks do not form a grid (sharding along one dimension, or a grid of
#: several, is checked in O(n log n) per dimension without this budget: that is what
#: FSDP, tensor and 2-D parallelism write).
MAX_IRREGULAR_PAIRS = 1_000_000
#: The most dimensions a tensor entry may declare (models use a handful).
MAX_TENSOR_DIMS = 64

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # a chunk's (offsets, sizes)

_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")


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


class _TooIrregular(Exception):
    """Raised by ``_overlap`` when checking a layout would take more steps than are left."""


def _chunk_bytes(entry: dcp_metadata.TensorStorageMetadata) -> dict[tuple[int, ...], int]:
    """``{offsets: bytes}`` of an entry's chunks: what the storage entry keyed by those
    offsets must hold (a repeated offset keeps the largest chunk: an empty chunk may share
    its offsets with a full one)."""
    itemsize = entry.properties.dtype.itemsize
    table: dict[tuple[int, ...], int] = {}
    for chunk in entry.chunks:
        offsets = tuple(chunk.offsets)
        table[offsets] = max(table.get(offsets, 0), math.prod(chunk.sizes) * itemsize)
    return table


def _runs(boxes: list[_Box], dim: int) -> list[list[_Box]]:
    """``boxes`` sorted along ``dim`` and cut into runs whose intervals chain together:
    boxes of different runs share no index of ``dim``, so no element."""
    runs: list[list[_Box]] = []
    end = 0
    for box in sorted(boxes, key=lambda b: b[0][dim]):
        start, stop = box[0][dim], box[0][dim] + box[1][dim]
        if not runs or start >= end:
            runs.append([box])
            end = stop
        else:
            runs[-1].append(box)
            end = max(end, stop)
    return runs


def _overlap(boxes: list[_Box], dim: int, budget: list[int]) -> bool:
    """Whether two of ``boxes`` (nonempty chunks, equal along every dimension before
    ``dim``) share an element. A run (``_runs``) whose boxes all span one interval, a row
    of a grid, is checked along the next dimension; any other run pair by pair, each pair
    costing ``budget[0]`` one step per dimension (``_TooIrregular`` when it runs out).
    Iterative: the dimensions left to check are a worklist, not a recursion."""
    pending = [(boxes, dim)]
    while pending:
        group, at = pending.pop()
        if len(group) < 2:
            continue
        if at == len(group[0][0]):
            return True  # equal along every dimension: the same box twice
        for run in _runs(group, at):
            if len(run) < 2:
                continue
            if len({(o[at], s[at]) for o, s in run}) == 1:
                pending.append((run, at + 1))
                continue
            budget[0] -= len(run) * (len(run) - 1) // 2 * len(run[0][0])
            if budget[0] < 0:
                raise _TooIrregular
            for (o1, s1), (o2, s2) in itertools.combinations(run, 2):
                if all(a < c + m and c < a + n for a, n, c, m in zip(o1, s1, o2, s2)):
                    return True
    return False


def _check_cover(
    key: str, entry: dcp_metadata.TensorStorageMetadata, path: str, budget: list[int]
) -> None:
    """The chunks of a (checked) entry cover its tensor exactly: their elements add up to
    the tensor's and no two share one. Otherwise part of the tensor would be declared
    twice or never read (left as uninitialized memory)."""
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks if math.prod(c.sizes)]
    held, numel = sum(math.prod(s) for _, s in boxes), math.prod(entry.size)
    if held != numel:
        raise CheckpointError(
            f"{path}: the chunks of entry {key!r} hold {held} elements but the tensor has "
            f"{numel}: they do not cover it"
        )
    try:
        shared = _overlap(boxes, 0, budget)
    except _TooIrregular:
        raise CheckpointError(
            f"{path}: the chunks of entry {key!r} are laid out too irregularly to check "
            f"(more than {MAX_IRREGULAR_PAIRS} steps of comparing chunks): not a layout DCP writes"
        ) from None
    if shared:
        raise CheckpointError(f"{path}: chunks of entry {key!r} overlap (elements declared twice)")


def _check_entry(key: Any, entry: Any, path: str, budget: list[int]) -> dict[tuple[int, ...], int]:
    """Check one tensor entry and its chunks; return ``_chunk_bytes`` of it."""
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
    if len(entry.size) > MAX_TENSOR_DIMS:
        raise CheckpointError(
            f"{path}: entry {key!r} declares a tensor of {len(entry.size)} dimensions, more "
            f"than {MAX_TENSOR_DIMS} (checking its chunks costs a step per dimension)"
        )
    for chunk in entry.chunks:
        _fields(chunk, dcp_metadata.ChunkStorageMetadata, f"a chunk of {key!r}", path)
        if not (
            _shape(chunk.offsets)
            and _shape(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
            and all(o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size))
        ):
            raise CheckpointError(f"{path}: a chunk of entry {key!r} lies outside its tensor")
    _check_cover(key, entry, path, budget)
    return _chunk_bytes(entry)


def check_index(meta: Any, path: str) -> None:
    """Check the unpickled ``meta`` of the folder ``path`` (see the module docstring);
    ``CheckpointError`` naming what is wrong."""
    if not isinstance(meta, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: .metadata holds {type(meta).__name__}, not DCP Metadata")
    _fields(meta, dcp_metadata.Metadata, "the metadata", path)
    entries = meta.state_dict_metadata
    if type(entries) is not dict or not all(type(k) is str for k in entries):
        raise CheckpointError(f"{path}: malformed .metadata (no entry table)")
    budget = [MAX_IRREGULAR_PAIRS]
    chunks = {key: _check_entry(key, entry, path, budget) for key, entry in entries.items()}
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
    extents: dict[str, list[tuple[int, int, Any]]] = {}
    stored = dict.fromkeys(entries, 0)
    for index, info in storage.items():
        name = _check_storage(index, info, entries, sizes, path)
        extents.setdefault(name, []).append((info.offset, info.offset + info.length, index))
        stored[index.fqn] += info.length
    for key, entry in entries.items():
        # every stored format holds at least the tensor's bytes: a larger tensor would be
        # allocated for nothing (a crafted size of terabytes)
        size = math.prod(entry.size) * entry.properties.dtype.itemsize
        if size > stored[key]:
            raise CheckpointError(
                f"{path}: entry {key!r} is {size} bytes but its data files hold "
                f"{stored[key]} for it"
            )
    _check_chunks_stored(chunks, storage, path)
    _check_extents(extents, path)


def _check_storage(
    index: Any, info: Any, entries: dict[str, Any], sizes: dict[str, int], path: str
) -> str:
    """Check one storage entry: the key of a tensor entry, a data file of the folder, an
    extent inside it, no stream transforms. ``sizes`` caches the data files' sizes.
    Returns the data file's name."""
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
        raise CheckpointError(f"{path}: storage entry {index!r} lies outside its data file {name}")
    return name


def _check_chunks_stored(
    chunks: dict[str, dict[tuple[int, ...], int]], storage: dict[Any, Any], path: str
) -> None:
    """Every chunk has one storage entry (checked by ``_check_storage``), every entry is a
    chunk's, and each holds its chunk's bytes and at most ``MAX_SLICE_OVERHEAD`` more: DCP
    stores a chunk uncompressed (transforms are refused), so a shorter extent cannot hold
    it and a much longer one is not what ``torch.save`` writes."""
    stored: set[tuple[str, tuple[int, ...]]] = set()
    for index, info in storage.items():
        table = chunks[index.fqn]
        offsets = tuple(index.offset) if isinstance(index.offset, tuple) else ()
        if not isinstance(index.offset, tuple) or offsets not in table:
            raise CheckpointError(
                f"{path}: storage entry {index!r} is for no chunk of entry {index.fqn!r}"
            )
        declared = table[offsets]
        if not declared <= info.length <= declared + MAX_SLICE_OVERHEAD:
            raise CheckpointError(
                f"{path}: the chunk of entry {index.fqn!r} at {list(offsets)} is {declared} "
                f"bytes but its data files hold {info.length} for it (DCP stores a chunk's "
                f"bytes and at most {MAX_SLICE_OVERHEAD} more)"
            )
        stored.add((index.fqn, offsets))
    for key, table in chunks.items():
        for offsets in table:
            if (key, offsets) not in stored:
                raise CheckpointError(
                    f"{path}: the chunk of entry {key!r} at {list(offsets)} has no storage entry"
                )


def _check_extents(extents: dict[str, list[tuple[int, int, Any]]], path: str) -> None:
    """No two storage entries share a byte of a data file: otherwise one small file could
    back any number of chunks (an 8 GiB tensor declared on 64 MiB, read over and over)."""
    for name, spans in extents.items():
        spans.sort(key=lambda span: span[:2])
        for (_, end, first), (start, _, second) in itertools.pairwise(spans):
            if start < end:
                raise CheckpointError(
                    f"{path}: storage entries {first!r} and {second!r} share bytes {start} to "
                    f"{end} of data file {name}: each stored byte may back one chunk only"
                )


def slice_limits(meta: dcp_metadata.Metadata) -> dict[tuple[str, int, int], tuple[str, int]]:
    """``{(file, offset, length): (tensor key, chunk bytes)}`` of every storage entry of the
    (checked) ``meta``: what each data slice may decode to."""
    tables: dict[str, dict[tuple[int, ...], int]] = {}
    limits = {}
    for index, info in meta.storage_data.items():
        if index.fqn not in tables:
            tables[index.fqn] = _chunk_bytes(meta.state_dict_metadata[index.fqn])
        declared = tables[index.fqn].get(tuple(index.offset), 0)
        limits[(info.relative_path, info.offset, info.length)] = (index.fqn, declared)
    return limits
