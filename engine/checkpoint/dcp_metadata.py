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

**Before it is unpickled**, the ``.metadata`` pickle is scanned opcode by opcode
(``check_expansion``: nothing built, nothing called) for what it would expand to, every
reference to a memoized container counted once per use as if the structure were a tree:
at most ``MAX_METADATA_VALUES`` values, or one per byte of the file where that is more.
Otherwise a few kilobytes could describe a tuple nested 30 deep with each level holding
the one below twice: unpickling it as a dict key hashes it ``2**30`` times, and the checks
below (or an error message's ``repr``) would walk it as often.

**What the data may decode to is bounded by what the index declares**, so a small folder
cannot make a reader allocate gigabytes (with or without a target state):

* every tensor has at most ``MAX_TENSOR_DIMS`` dimensions and its chunks cover it
  exactly (their elements add up to the tensor's, and no two share an element: checked
  in O(n log n) per dimension for grids, pair by pair within ``MAX_IRREGULAR_PAIRS``
  steps otherwise), and each chunk has one storage entry;
* each storage entry holds its chunk's bytes plus at most ``MAX_SLICE_OVERHEAD`` (DCP
  stores a chunk as one uncompressed ``torch.save`` archive: about a kilobyte beyond the
  tensor's bytes), lies inside its data file, and shares no byte with another entry. So
  the tensors declared never exceed the distinct bytes stored ("stored" meaning the data
  files' sizes, which are what a reader reads: a sparse file's holes read back as zeros,
  and allocated blocks are not a measure filesystems agree on);
* before DCP reads any slice of a load, ``SafeReader.read_data`` checks each one
  (``check_slice``, reading about a kilobyte of it): its zip end records
  and directory lie exactly where ``torch.save`` writes them (``zip_layout``: so torch's
  reader uses the directory checked here), stored entries only (a compressed entry
  could inflate a thousandfold), tensor records of at most the chunk's bytes, control
  entries of at most ``MAX_SLICE_OVERHEAD``, and a ``data.pkl`` that matches its checksum
  and passes ``safe_load.scan_pickle`` (nothing built beyond what the slice holds).
  Nothing is decompressed and the checks read no tensor data (DCP's ``torch.load``
  reads it once).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import os
import pathlib
import pickle
import re
from concurrent.futures import Future
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from . import zip_layout
from .codec import CheckpointError
from .safe_load import check_archive, read_entry, scan_pickle

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
#: The most values the ``.metadata`` pickle may expand to (``check_expansion``), every
#: reference to a memoized container counted once per use, unless the file has more bytes
#: than this: a pickle that shares no container expands to at most one value per byte (each
#: value takes an opcode), so the bound never refuses one, and it keeps hashing and walking
#: the metadata linear in its size. DCP writes about 70 values per tensor chunk: 4 million
#: values is about 57,000 chunks, past which the file's size is the bound.
MAX_METADATA_VALUES = 4_000_000
#: The bytes a data slice may hold beyond its chunk's tensor bytes: ``torch.save``'s zip
#: headers, alignment padding and control entries (about 1 KiB for one tensor). Also the
#: largest zip directory, and the most control entries, a slice may hold.
MAX_SLICE_OVERHEAD = 64 * 1024
#: The steps (pairs of chunks compared, times their dimensions) spent, over a whole index,
#: where a tensor's chunks do not form a grid (sharding along one dimension, or a grid of
#: several, is checked in O(n log n) per dimension without this budget: that is what
#: FSDP, tensor and 2-D parallelism write).
MAX_IRREGULAR_PAIRS = 1_000_000
#: The most dimensions a tensor entry may declare (models use a handful).
MAX_TENSOR_DIMS = 64

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # a chunk's (offsets, sizes)

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


class _Garbled(Exception):
    """Raised by ``_expanded`` where the bytes are not a pickle it can follow."""


def _codes(spec: str) -> dict[int, int]:
    """``{opcode: width}`` of the space-separated ``NAME:width`` (or ``NAME``, width 0)."""
    pairs = (item.partition(":") for item in spec.split())
    return {getattr(pickle, name)[0]: int(width or 0) for name, _, width in pairs}


# Opcodes that push one value holding no other (a number, a string, a global, a buffer),
# by how their argument is read: a fixed number of bytes; a length of that many bytes,
# then as many bytes; or a line (text protocol 0).
_ATOM_FIXED = _codes(
    "BININT:4 BININT1:1 BININT2:2 BINFLOAT:8 NONE NEWTRUE NEWFALSE EXT1:1 EXT2:2 EXT4:4 NEXT_BUFFER"
)
_ATOM_SIZED = _codes(
    "LONG1:1 SHORT_BINSTRING:1 SHORT_BINBYTES:1 SHORT_BINUNICODE:1 LONG4:4 BINSTRING:4 "
    "BINBYTES:4 BINUNICODE:4 BINBYTES8:8 BYTEARRAY8:8 BINUNICODE8:8"
)
_ATOM_LINE = set(_codes("INT LONG STRING UNICODE FLOAT PERSID"))
# Opcodes that make a new container of the values above the topmost mark (OBJ: a call).
_FROM_MARK = set(_codes("TUPLE LIST DICT FROZENSET OBJ"))
# Opcodes that add the values above the topmost mark to the container below it.
_ADD_FROM_MARK = set(_codes("APPENDS SETITEMS ADDITEMS"))
_MEMOIZE = pickle.MEMOIZE[0]
_BINGET, _LONG_BINGET, _GET = pickle.BINGET[0], pickle.LONG_BINGET[0], pickle.GET[0]
_BINPUT, _LONG_BINPUT, _PUT = pickle.BINPUT[0], pickle.LONG_BINPUT[0], pickle.PUT[0]
_EMPTY = set(_codes("EMPTY_TUPLE EMPTY_LIST EMPTY_DICT EMPTY_SET"))
_TUPLE1, _TUPLE2, _TUPLE3 = pickle.TUPLE1[0], pickle.TUPLE2[0], pickle.TUPLE3[0]
_MARK, _POP, _POP_MARK, _DUP = pickle.MARK[0], pickle.POP[0], pickle.POP_MARK[0], pickle.DUP[0]
_CALL = set(_codes("NEWOBJ REDUCE"))
_NEWOBJ, _OBJ, _EMPTY_TUPLE = pickle.NEWOBJ[0], pickle.OBJ[0], pickle.EMPTY_TUPLE[0]
_NEWOBJ_EX, _BUILD = pickle.NEWOBJ_EX[0], pickle.BUILD[0]
_APPEND, _SETITEM = pickle.APPEND[0], pickle.SETITEM[0]
_GLOBAL, _STACK_GLOBAL, _INST = pickle.GLOBAL[0], pickle.STACK_GLOBAL[0], pickle.INST[0]
_BINPERSID, _READONLY_BUFFER = pickle.BINPERSID[0], pickle.READONLY_BUFFER[0]
_FRAME, _PROTO, _STOP = pickle.FRAME[0], pickle.PROTO[0], pickle.STOP[0]


def check_expansion(data: bytes, path: str) -> None:
    """Refuse (``CheckpointError`` naming the folder ``path``) the ``.metadata`` pickle
    ``data`` if it expands to more than ``MAX_METADATA_VALUES`` values (or one per byte of
    ``data``, where that is more), every reference to a memoized container counted once
    per use; or if it cannot be followed (truncated, garbled, or built as no pickler
    writes DCP's metadata: see ``_expanded``). Reads the opcodes only and keeps one number
    per value on the unpickler's stack and memo: linear in ``len(data)``, whatever the
    pickle would expand to."""
    limit = max(MAX_METADATA_VALUES, len(data))
    try:
        _expanded(data, limit)
    except _TooLarge:
        raise CheckpointError(
            f"{path}: refused to read .metadata: its pickle expands to more than {limit:,} "
            "values (each reference to a shared container counted once per use: a few "
            "kilobytes can describe an exponentially large structure, which unpickling, "
            "hashing or walking would not finish); DCP writes no such metadata"
        ) from None
    except _Garbled as err:
        raise CheckpointError(f"{path}: refused to read .metadata: {err}") from None
    except IndexError:
        raise CheckpointError(
            f"{path}: refused to read .metadata: its pickle is truncated or garbled (it "
            "reads past its end or its stack)"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(
            f"{path}: refused to read .metadata: not a pickle that can be read "
            f"({type(err).__name__} following its opcodes)"
        ) from None


class _TooLarge(Exception):
    """Raised by ``_expanded`` when a value expands past the limit."""


def _placed(values: list[Any], limit: int) -> int:
    """The expanded size of ``values`` (``_expanded``'s stack values), now placed in a
    container: each open container among them is marked placed (it may no longer grow).
    ``_TooLarge`` past ``limit``: so no size grows much past it (no huge ints)."""
    total = 0
    for value in values:
        if value.__class__ is int:
            total += value
        else:
            value[1] = True
            total += value[0]
    if total > limit:
        raise _TooLarge
    return total


def _grow(node: Any, by: int, limit: int) -> None:
    """Add ``by`` values to the open container ``node`` (``_expanded``)."""
    if node.__class__ is int or node[1]:
        raise _Garbled(
            "its pickle adds to a value that is not an open container (a built value, or "
            "one already placed in another: a cycle or out-of-order pickle, which DCP's "
            "metadata never is)"
        )
    node[0] += by
    if node[0] > limit:
        raise _TooLarge


def _expanded(data: bytes, limit: int) -> int:
    """The number of values the pickle ``data`` expands to, every reference to a memoized
    container counted once per use (``_TooLarge`` past ``limit``). Follows the unpickler's
    stack, marks and memo, keeping for each value its expanded size: an int for a value
    that no longer changes (a number, string, global, tuple, a call's result), a list
    ``[size, placed]`` for a container the pickle may still fill (a list, dict or set, an
    object made by NEWOBJ, which BUILD gives its state). Counting sizes as they are built
    holds because a pickler writes each container whole before placing it in another:
    ``_Garbled`` where a pickle fills a container already placed (only a cycle does that,
    and DCP's metadata has none), BUILDs other than a new object (it would set attributes
    on a class or a shared value), or fails on its stack or bytes. Flat loop, branches
    ordered by how often DCP's metadata holds each opcode (it runs once per opcode)."""
    stack: list[Any] = []
    push = stack.append
    marks: list[int] = []
    memo: dict[int, Any] = {}
    at = 0
    while True:  # past the end (no STOP, or an argument cut short): an IndexError here
        op = data[at]
        at += 1
        if op == _MEMOIZE:
            memo[len(memo)] = stack[-1]
        elif op == _BINGET:
            push(memo[data[at]])
            at += 1
        elif op == _LONG_BINGET:
            push(memo[int.from_bytes(data[at : at + 4], "little")])
            at += 4
        elif op == _TUPLE1:  # inlined ``_placed`` (adding 1 cannot pass the limit fast)
            value = stack[-1]
            if value.__class__ is not int:
                value[1] = True
                value = value[0]
            stack[-1] = value + 1
        elif op == _MARK:
            marks.append(len(stack))
        elif op in _ATOM_FIXED:
            at += _ATOM_FIXED[op]
            push(1)
        elif op in _EMPTY:
            push(1 if op == _EMPTY_TUPLE else [1, False])
        elif op in _CALL:
            args = stack.pop()
            func = stack[-1]
            if args.__class__ is int and func.__class__ is int and args + func < limit:
                size = 1 + args + func  # the common case, inlined
            else:
                size = 1 + _placed([func, args], limit)
            stack[-1] = [size, False] if op == _NEWOBJ else size
        elif op == _BUILD:
            state = stack.pop()
            _grow(stack[-1], _placed([state], limit), limit)
        elif op in _ADD_FROM_MARK:
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            _grow(stack[-1], _placed(items, limit), limit)
        elif op in _ATOM_SIZED:
            width = _ATOM_SIZED[op]
            at += width + int.from_bytes(data[at : at + width], "little")
            push(1)
        elif op == _STACK_GLOBAL:
            del stack[-2:]
            push(1)
        elif op in _FROM_MARK:
            start = marks.pop()
            size = 1 + _placed(stack[start:], limit)
            del stack[start:]
            push([size, False] if op == _OBJ else size)
        elif op in (_TUPLE2, _TUPLE3):
            width = 2 if op == _TUPLE2 else 3
            if len(stack) < width:
                raise _Garbled("a tuple of more values than the stack holds")
            stack[-width:] = [1 + _placed(stack[-width:], limit)]
        elif op == _APPEND:
            value = stack.pop()
            _grow(stack[-1], _placed([value], limit), limit)
        elif op == _SETITEM:
            items = stack[-2:]
            del stack[-2:]
            _grow(stack[-1], _placed(items, limit), limit)
        elif op == _BINPUT:
            memo[data[at]] = stack[-1]
            at += 1
        elif op == _LONG_BINPUT:
            memo[int.from_bytes(data[at : at + 4], "little")] = stack[-1]
            at += 4
        elif op in _ATOM_LINE:
            at = data.index(b"\n", at) + 1
            push(1)
        elif op in (_PUT, _GET):
            line = data.index(b"\n", at)
            index = int(data[at:line])
            at = line + 1
            if op == _PUT:
                memo[index] = stack[-1]
            else:
                push(memo[index])
        elif op == _GLOBAL:
            at = data.index(b"\n", data.index(b"\n", at) + 1) + 1
            push(1)
        elif op == _INST:
            at = data.index(b"\n", data.index(b"\n", at) + 1) + 1
            start = marks.pop()
            size = 2 + _placed(stack[start:], limit)
            del stack[start:]
            push([size, False])
        elif op == _NEWOBJ_EX:
            size = 1 + _placed(stack[-3:], limit)
            del stack[-2:]
            stack[-1] = [size, False]
        elif op == _DUP:
            push(stack[-1])
        elif op == _POP:
            if stack and (not marks or len(stack) > marks[-1]):
                stack.pop()
            else:
                marks.pop()
        elif op == _POP_MARK:
            del stack[marks.pop() :]
        elif op == _BINPERSID:
            stack[-1] = 1
        elif op == _READONLY_BUFFER:
            if stack[-1].__class__ is not int:
                raise _Garbled("a buffer opcode on a container")
        elif op == _FRAME:
            at += 8
        elif op == _PROTO:
            at += 1
        elif op == _STOP:
            if len(stack) != 1 or marks:
                raise _Garbled("the pickle stops with a stack of other than one value")
            return _placed(stack, limit)
        else:
            raise _Garbled(f"unknown pickle opcode {op:#04x} at byte {at - 1}")


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


def _check(meta: Any, path: str) -> None:
    """Check the unpickled ``meta`` of the folder ``path`` (see the module docstring)."""
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


def _slice_limits(meta: dcp_metadata.Metadata) -> dict[tuple[str, int, int], tuple[str, int]]:
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


class _Window(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of the open binary ``file``, seekable as a
    file of their own: what ``zipfile`` needs to read one data slice's directory. (DCP's
    own view of a slice reports positions of the whole file.)"""

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the slice")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        if count == 0:
            return 0
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer).cast("B")[:count]) or 0
        self._pos += got
        return got


def check_slice(file: IO[bytes], offset: int, length: int, declared: int, where: str) -> None:
    """Refuse the data slice ``file[offset : offset + length]`` unless it is an archive as
    ``torch.save`` writes it that decodes to at most ``declared`` bytes of tensor records
    (its chunk's) and ``MAX_SLICE_OVERHEAD`` of control entries:

    * its zip directory lies where ``torch.save`` writes it (``zip_layout``: otherwise
      torch's reader could use another directory than the one checked here) and is at
      most ``MAX_SLICE_OVERHEAD`` bytes;
    * its entries are stored (uncompressed) inside the slice (``safe_load.check_archive``);
    * its ``data.pkl`` matches its checksum and builds nothing larger than the slice
      (``safe_load.scan_pickle``: no ``bytearray(n)``, no exponentially shared structure,
      no view past its storage; torch checks each storage against its record).

    Reads the end records, the directory (twice: here and by ``zipfile``) and
    ``data.pkl`` only: about a kilobyte for a slice ``torch.save`` wrote, a few times
    ``MAX_SLICE_OVERHEAD`` at most, and no tensor record. So a bomb is refused before
    anything inflates. ``where`` names the slice in errors."""
    window = _Window(file, offset, length)
    directory = zip_layout.find_directory(window, length, where)
    if directory.size > MAX_SLICE_OVERHEAD:
        raise CheckpointError(
            f"refusing to load {where}: its zip directory is {directory.size} bytes; "
            f"torch.save writes about a kilobyte for a tensor (at most {MAX_SLICE_OVERHEAD})"
        )
    zip_layout.check_entries(window, directory, where)
    infos = check_archive(window, where, verify=False).infolist()
    pickled = next(i for i in infos if i.filename.rsplit("/", 1)[-1] == "data.pkl")
    records = pickled.filename[: -len("data.pkl")] + "data/"
    data = sum(i.file_size for i in infos if i.filename.startswith(records))
    control = sum(i.file_size for i in infos if not i.filename.startswith(records))
    if data > declared:
        raise CheckpointError(
            f"refusing to load {where}: it holds {data} bytes of tensor data but its chunk "
            f"declares {declared}"
        )
    if control > MAX_SLICE_OVERHEAD:
        raise CheckpointError(
            f"refusing to load {where}: its control entries hold {control} bytes, more than "
            f"torch.save writes (at most {MAX_SLICE_OVERHEAD})"
        )
    scan_pickle(read_entry(window, pickled, where), where)


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
        self._limits = _slice_limits(metadata)

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
