"""Read a file with ``torch.load(weights_only=True)``, turning every failure into a clear error.

Checkpoints and weight files are both read here, so they refuse the same things with the
same messages. Before ``torch.load`` sees a file, its zip directory is checked
(``check_archive``) for what ``torch.save`` never writes: a compressed entry (it could
inflate far beyond the file, e.g. 1 MB into 1 GiB), an entry that declares more bytes than
the file holds, entries whose sizes add up to more than the file; the small control entries
(``data.pkl``, ``version``, ...) must match their checksums. So nothing is allocated beyond
the file's size. A file that needs the unpickler to build arbitrary objects is refused
(nothing from it runs); anything else that does not read is "corrupt or truncated, or not a
checkpoint", naming the file. A missing or uncommitted file stays a ``FileNotFoundError``,
and a FIFO, device or directory is refused unopened (see ``storage.open_read``).

Then its pickle is scanned (``scan_pickle``: its opcodes are read, nothing is built) for
what would cost more than the file's size once unpickled, and refused before anything is:
shared references that expand past ``MAX_PICKLE_VALUES`` values (a few kilobytes can
describe an exponentially large structure, and merely hashing a dict key made of shared
tuples would not finish), and tensors whose storage is smaller than their shape and
strides need (``codec.layout_problem``: a stride-0 ``expand``-ed view, overlapping or
negative strides, an extent past the storage), which a quantized tensor allocates in full
and anything copying them expands; and calls that allocate a size the file states
(``torch.FloatTensor(n)``, ``bytearray(n)``). Each refusal names the tensor's place
(``state.params['w']``, ``metadata['hparams']['x']``, ``['state_dict']['w']``).
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import os
import pickle
import struct
import zipfile
import zlib
from collections import deque
from collections.abc import Iterator
from typing import IO, Any

import torch

from . import storage, zip_layout
from .codec import MAX_NODES, CheckpointError, layout_problem
from .codec import _label as _codec_label
from .zip_layout import corrupt  # re-exported: its home is the layout check

__all__ = [
    "MAX_PICKLE_VALUES",
    "check_archive",
    "open_archive",
    "read_entry",
    "scan_pickle",
    "torch_load",
]

#: The most values (containers and leaves, each reference to a shared one counted again, a
#: tensor's pickled parts included) that a file's pickle may expand to. The encoding of a
#: state within ``codec.MAX_NODES`` stays inside it (it pickles a few values per decoded
#: one); hashing or walking this many takes a second or so.
MAX_PICKLE_VALUES = 16 * MAX_NODES

# What torch.load raises for a damaged file: a bad zip directory, a short read, a missing
# archive member, an I/O failure half way through, a garbled pickle stream.
_CORRUPT = (
    RuntimeError,
    EOFError,
    zipfile.BadZipFile,
    ValueError,
    OSError,
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    struct.error,
    OverflowError,
)
# What the weights-only unpickler says when it refuses a global or an object (anything
# else it raises means the pickle stream itself is garbled).
_REFUSALS = (
    "GLOBAL ",
    "Trying to call reduce",
    "Can only create new object",
    "Can only build",
    "must be imported to load",
)
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


def check_archive(f: IO[bytes], url: str, *, verify: bool = True) -> zipfile.ZipFile:
    """The zip directory of the open file ``f``, refused unless it is one ``torch.save``
    could have written: stored (uncompressed) entries inside the file, a ``data.pkl``, and
    (``verify``) control entries that match their checksums. Reads the directory and, to
    verify, the control entries (``data.pkl`` grows with the state; tensors are not read)."""
    return _checked_archive(f, url, verify=verify)[0]


def _checked_archive(
    f: IO[bytes], url: str, *, verify: bool
) -> tuple[zipfile.ZipFile, bytes | None]:
    """``check_archive``'s work: the zip directory and (``verify``) ``data.pkl``'s bytes."""
    size = f.seek(0, os.SEEK_END)
    # one directory only, where torch.save puts it: zipfile and torch's reader agree on it
    zip_layout.check_layout(f, size, url)
    f.seek(0)
    try:
        archive = zipfile.ZipFile(f)
        infos = archive.infolist()
    except Exception as err:  # whatever zipfile makes of garbage
        detail = f"not a zip archive as torch.save writes ({_first_line(err)})"
        raise corrupt(url, detail + "; torch's legacy pre-1.6 format is not read") from None
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"refusing to load {url}: its entry {info.filename!r} is compressed (zip method "
                f"{info.compress_type}); torch.save stores entries uncompressed, so this file "
                "is corrupt or not a checkpoint (a compressed entry can inflate far beyond the "
                "file's size)"
            )
        total += info.file_size
        if info.file_size != info.compress_size:
            raise corrupt(
                url,
                f"its entry {info.filename!r} declares {info.file_size} bytes but stores "
                f"{info.compress_size}",
            )
        if info.header_offset < 0 or info.header_offset + info.file_size > size:
            raise CheckpointError(
                f"refusing to load {url}: its entry {info.filename!r} declares "
                f"{info.file_size} bytes at offset {info.header_offset}, more than the file "
                f"({size} bytes) holds; it is corrupt or not a checkpoint"
            )
    if total > size:
        raise CheckpointError(
            f"refusing to load {url}: its entries declare {total} bytes in all, more than the "
            f"file ({size} bytes) holds; it is corrupt or not a checkpoint"
        )
    pickles = [i for i in infos if i.filename.rsplit("/", 1)[-1] == "data.pkl"]
    if len(pickles) != 1:
        raise corrupt(url, "a zip archive, but not one torch.save wrote (no single data.pkl)")
    prefix = pickles[0].filename[: -len("data.pkl")]
    pickled = None
    for info in infos if verify else ():
        if not info.filename.startswith(prefix + "data/"):
            data = read_entry(f, info, url)
            if info is pickles[0]:
                pickled = data
    return archive, pickled


def read_entry(f: IO[bytes], info: zipfile.ZipInfo, url: str) -> bytes:
    """The bytes of the stored entry ``info`` of ``f`` (checked by ``check_archive``),
    verified against its checksum (unless the writer left it 0: torch can skip it)."""
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise corrupt(url, f"entry {info.filename!r} has no valid zip header")
    _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    f.seek(info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)
    data = f.read(info.file_size)
    if len(data) != info.file_size:
        raise corrupt(url, f"entry {info.filename!r} is cut short")
    if info.CRC and zlib.crc32(data) != info.CRC:
        raise corrupt(url, f"entry {info.filename!r} does not match its checksum")
    return data


@contextlib.contextmanager
def open_archive(
    url: str,
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
) -> Iterator[tuple[IO[bytes], zipfile.ZipFile]]:
    """``(file, zip directory)`` of ``url``, opened with ``storage.open_read`` and checked
    with ``check_archive``; the file is closed on exit."""
    with storage.open_read(url, commit=commit, storage_options=storage_options) as f:
        yield f, check_archive(f, url, verify=verify)


def torch_load(
    url: str,
    *,
    map_location: Any = "cpu",
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
    advice: str = "",
) -> Any:
    """The object ``torch.save`` wrote to ``url``, read without running code from it.

    ``advice`` is added to the refusal of a file that holds arbitrary Python objects (e.g.
    how to extract the weights from a trusted file).
    """
    with storage.open_read(url, commit=commit, storage_options=storage_options) as f:
        _, pickled = _checked_archive(f, url, verify=True)
        scan_pickle(pickled or b"", url)
        local = getattr(f, "name", None) if storage.is_local_url(url) else None
        source = local if isinstance(local, str) else f
        f.seek(0)
        try:
            return torch.load(source, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            if not any(refusal in str(err) for refusal in _REFUSALS):
                raise corrupt(url, _unpickler_detail(err)) from None
            raise CheckpointError(
                f"refusing to load {url}: it holds Python objects other than tensors and "
                f"plain containers (a pickle payload?); nothing from it was run. {advice}"
                f"Detail: {_unpickler_detail(err)}"
            ) from None
        except _CORRUPT as err:
            raise corrupt(url, _first_line(err)) from None


def _unpickler_detail(err: Exception) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if "Unsupported" in ln or "error" in ln]
    return (lines[-1] if lines else (str(err).splitlines() or [""])[0])[:300]


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0][:300] or type(err).__name__


# ------------------------------------------------------------------ scanning the pickle

# Callables the weights-only unpickler allows that allocate a size read from the file
# (``torch.FloatTensor(2**40)``, ``torch.UntypedStorage(2**40)``): torch.save never calls them.
_CONSTRUCTORS = frozenset(
    f"{cls.__module__}.{cls.__name__}"
    for cls in (torch.Tensor, *torch._tensor_classes, *torch._storage_classes)
)
# Tensor rebuilds that take (storage, offset, size, stride, ...): the index of their dtype
# argument, None where the tensor takes its storage's dtype.
_REBUILDS = {
    "torch._utils._rebuild_tensor": None,
    "torch._utils._rebuild_tensor_v2": None,
    "torch._utils._rebuild_qtensor": None,
    "torch._utils._rebuild_tensor_v3": 6,
}
_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"  # (rebuild, type, its args, state)
_NESTED = "torch._utils._rebuild_nested_tensor"
_BYTEARRAY = "builtins.bytearray"
# The opcodes the weights-only unpickler reads (its whole set), as the byte values.
_APPEND = pickle.APPEND[0]
_APPENDS = pickle.APPENDS[0]
_BINFLOAT = pickle.BINFLOAT[0]
_BINGET = pickle.BINGET[0]
_BININT = pickle.BININT[0]
_BININT1 = pickle.BININT1[0]
_BININT2 = pickle.BININT2[0]
_BINPERSID = pickle.BINPERSID[0]
_BINPUT = pickle.BINPUT[0]
_BINUNICODE = pickle.BINUNICODE[0]
_BUILD = pickle.BUILD[0]
_EMPTY_DICT = pickle.EMPTY_DICT[0]
_EMPTY_LIST = pickle.EMPTY_LIST[0]
_EMPTY_SET = pickle.EMPTY_SET[0]
_EMPTY_TUPLE = pickle.EMPTY_TUPLE[0]
_GLOBAL = pickle.GLOBAL[0]
_LONG1 = pickle.LONG1[0]
_LONG_BINGET = pickle.LONG_BINGET[0]
_LONG_BINPUT = pickle.LONG_BINPUT[0]
_MARK = pickle.MARK[0]
_NEWFALSE = pickle.NEWFALSE[0]
_NEWOBJ = pickle.NEWOBJ[0]
_NEWTRUE = pickle.NEWTRUE[0]
_NONE = pickle.NONE[0]
_PROTO = pickle.PROTO[0]
_REDUCE = pickle.REDUCE[0]
_SETITEM = pickle.SETITEM[0]
_SETITEMS = pickle.SETITEMS[0]
_SHORT_BINSTRING = pickle.SHORT_BINSTRING[0]
_STOP = pickle.STOP[0]
_TUPLE = pickle.TUPLE[0]
_TUPLE1 = pickle.TUPLE1[0]
_TUPLE2 = pickle.TUPLE2[0]
_TUPLE3 = pickle.TUPLE3[0]
_U32 = struct.Struct("<I")
_SIZES = {_BININT: (4, "<i"), _BININT2: (2, "<H"), _BINFLOAT: (8, ">d")}
_ATOMS = {_NONE: None, _NEWTRUE: True, _NEWFALSE: False}
_EMPTY = {_EMPTY_DICT: "dict", _EMPTY_LIST: "list", _EMPTY_SET: "set", _EMPTY_TUPLE: "tuple"}
_TUPLES = {_TUPLE1: 1, _TUPLE2: 2, _TUPLE3: 3}


class _Box:
    """A container, call result, class or storage of the pickle being scanned: what it holds
    (``items``: elements, ``key, value, ...`` for a dict, ``[callable, args, state...]`` for
    a call) and, for a class or a call, the dotted name of what it names or calls."""

    __slots__ = ("items", "kind", "name")

    def __init__(self, kind: str, items: list[Any], name: str | None = None) -> None:
        self.kind = kind
        self.items = items
        self.name = name


def scan_pickle(data: bytes, url: str) -> None:
    """Refuse (``CheckpointError`` naming ``url`` and, for a tensor, its place) the pickle
    ``data`` of a file if unpickling it with ``torch.load(weights_only=True)`` would build
    more than the file holds (see the module doc). Only opcodes are read; a pickle the scan
    cannot follow (garbled, or opcodes the weights-only unpickler refuses) is left for
    ``torch.load`` to refuse with its own message."""
    scan = _Scan(url)
    root = scan.run(data)
    if scan.problem is not None:
        box, detail = scan.problem
        where = _path_to(root, box) if root is not None else None
        place = f"the tensor at {where}" if where else "a tensor in it"
        raise CheckpointError(
            f"refusing to load {url}: {place} {detail}; nothing from it was loaded"
        )
    if root is not None and scan.shared and not _within(root, MAX_PICKLE_VALUES):
        raise CheckpointError(
            f"refusing to load {url}: its pickle expands to more than {MAX_PICKLE_VALUES:,} "
            "values (each reference to shared data counted once per use: a few kilobytes "
            "can describe an exponentially large structure, which building, hashing or "
            "walking would not finish); nothing from it was loaded"
        )


class _Scan:
    """One pass over a pickle's opcodes, keeping the weights-only unpickler's stack, marks
    and memo as ``_Box`` skeletons and plain values (no object is built, nothing is
    called), and the first problem found: ``(box, what is wrong)``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.problem: tuple[_Box, str] | None = None
        # Whether a container is referenced again from the memo: only then can the pickle
        # expand (torch.save refers again to classes and strings, not to a state's containers).
        self.shared = False

    def run(self, data: bytes) -> Any:
        """The skeleton of the pickled object, or None where the scan cannot follow."""
        try:
            return self._run(data)
        except (ValueError, IndexError, KeyError, AttributeError, TypeError, RecursionError):
            return None  # garbled: torch.load says how

    def _run(self, data: bytes) -> Any:
        """The opcode loop (its branches ordered by how often a large state's pickle holds
        each opcode: it runs once per opcode of the file, so it is kept flat)."""
        stack: list[Any] = []
        marks: list[list[Any]] = []
        memo: dict[int, Any] = {}
        end = len(data)
        at = 0
        while at < end:
            op = data[at]
            at += 1
            if op == _BINPUT:
                memo[data[at]] = stack[-1]
                at += 1
            elif op == _LONG_BINPUT:
                memo[_U32.unpack_from(data, at)[0]] = stack[-1]
                at += 4
            elif op == _LONG_BINGET:
                value = memo[_U32.unpack_from(data, at)[0]]
                stack.append(value)
                if type(value) is _Box and value.kind != "global":
                    self.shared = True
                at += 4
            elif op == _BINGET:
                value = memo[data[at]]
                at += 1
                stack.append(value)
                if type(value) is _Box and value.kind != "global":
                    self.shared = True  # a container met again: it may expand
            elif op == _BINUNICODE:
                (size,) = _U32.unpack_from(data, at)
                at += 4 + size
                if at > end:
                    return None
                stack.append(str(data[at - size : at], "utf-8", "surrogatepass"))
            elif op == _MARK:
                marks.append(stack)
                stack = []
            elif op in _EMPTY:
                stack.append(_Box(_EMPTY[op], []))
            elif op in (_SETITEMS, _APPENDS):
                items, stack = stack, marks.pop()
                stack[-1].items.extend(items)
            elif op == _BININT1:
                stack.append(data[at])
                at += 1
            elif op in _SIZES:  # the other numbers: their bytes decoded as the unpickler does
                size, layout = _SIZES[op]
                stack.append(struct.unpack_from(layout, data, at)[0])
                at += size
            elif op in _TUPLES:
                count = _TUPLES[op]
                if len(stack) < count:
                    return None
                items = stack[len(stack) - count :]
                del stack[len(stack) - count :]
                stack.append(_Box("tuple", items))
            elif op == _TUPLE:
                items, stack = stack, marks.pop()
                stack.append(_Box("tuple", items))
            elif op in _ATOMS:
                stack.append(_ATOMS[op])
            elif op == _REDUCE:
                args = stack.pop()
                stack[-1] = self._call(stack[-1], args)
            elif op == _BINPERSID:
                stack.append(_Box("storage", [stack.pop()]))
            elif op == _GLOBAL:
                first = data.index(b"\n", at)
                second = data.index(b"\n", first + 1)
                module = data[at:first].decode("utf-8")
                stack.append(_Box("global", [], _global_name(module, data[first + 1 : second])))
                at = second + 1
            elif op in (_APPEND, _SETITEM):
                count = 1 if op == _APPEND else 2
                items = stack[len(stack) - count :]
                del stack[len(stack) - count :]
                stack[-1].items.extend(items)
            elif op == _BUILD:
                state = stack.pop()
                stack[-1].items.append(state)
            elif op == _NEWOBJ:
                args = stack.pop()
                stack.append(self._call(stack.pop(), args))
            elif op in (_SHORT_BINSTRING, _LONG1):
                size = data[at]
                at += 1 + size
                raw = data[at - size : at]
                stack.append(raw if op == _SHORT_BINSTRING else pickle.decode_long(raw))
            elif op == _STOP:
                return stack.pop()
            elif op == _PROTO:
                at += 1
            else:
                return None  # the weights-only unpickler refuses it
        return None

    def _call(self, func: Any, args: Any) -> _Box:
        """The result of calling ``func(*args)``, checked (the first problem is kept)."""
        name = func.name if isinstance(func, _Box) and func.kind == "global" else None
        box = _Box("call", [func, args], name)
        if self.problem is None:
            detail = _call_problem(name, args)
            if detail is not None:
                self.problem = (box, detail)
        return box


def _global_name(module: str, name_bytes: bytes) -> str:
    """The dotted name a GLOBAL opcode's module and name lines resolve to, with the renames
    of Python 2 names that ``torch.load`` applies."""
    name = name_bytes.decode("utf-8")
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _call_problem(name: str | None, args: Any) -> str | None:
    """What is wrong with calling ``name(*args)`` while unpickling, or None."""
    while name == _FROM_TYPE:  # a tensor subclass: the rebuild it wraps is checked
        inner = _tuple_items(args)
        if inner is None or len(inner) < 3 or not isinstance(inner[0], _Box):
            return None
        name, args = inner[0].name, inner[2]
    if name in _CONSTRUCTORS:
        return (
            f"is made by calling {name}(...), which allocates whatever size the file "
            "states; torch.save never writes that"
        )
    if name == _BYTEARRAY and any(isinstance(a, int) for a in _tuple_items(args) or ()):
        return "is made by calling bytearray(n), which allocates n bytes the file does not hold"
    if name == _NESTED:
        return (
            "is a nested tensor: those are not read from checkpoints (their sizes and "
            "strides are tensors that can describe more data than the file holds)"
        )
    if name in _REBUILDS:
        return _tensor_problem(args, _REBUILDS[name])
    return None


def _tuple_items(value: Any) -> list[Any] | None:
    return value.items if isinstance(value, _Box) and value.kind == "tuple" else None


def _ints(value: Any) -> list[int] | None:
    """``value`` as the list of ints a size or stride is (a tuple, list or ``torch.Size``
    of ints in the pickle), or None."""
    if isinstance(value, _Box) and value.kind == "call" and value.name == "torch.Size":
        inner = _tuple_items(value.items[1])
        value = inner[0] if inner and len(inner) == 1 else None
    if not isinstance(value, _Box) or value.kind not in ("tuple", "list"):
        return None
    items = value.items
    return items if all(isinstance(n, int) for n in items) else None


def _tensor_problem(args: Any, dtype_at: int | None) -> str | None:
    """What is wrong with a tensor rebuilt from ``(storage, offset, size, stride, ...)``."""
    items = _tuple_items(args)
    if items is None or len(items) < 4:
        return "is malformed (its rebuild takes no storage, offset, size and stride)"
    offset, size, stride = items[1], _ints(items[2]), _ints(items[3])
    dtype = items[dtype_at] if dtype_at is not None and len(items) > dtype_at else None
    elements = _storage_elements(items[0], dtype)
    if elements is None or not isinstance(offset, int) or size is None or stride is None:
        return "is malformed (its storage, offset, size or stride is not one torch.save writes)"
    detail = layout_problem(size, stride, offset, elements)
    if detail is None:
        return None
    return f"(size {tuple(size)}, strides {tuple(stride)}, offset {offset}) is refused: {detail}"


def _storage_elements(storage: Any, dtype: Any) -> int | None:
    """How many elements of the tensor's dtype the storage named by the persistent id
    ``('storage', type, key, location, numel)`` holds (``torch.load`` checks ``numel``
    against the archive entry), or None if it is not such a storage."""
    if not isinstance(storage, _Box) or storage.kind != "storage":
        return None
    pid = _tuple_items(storage.items[0])
    if pid is None or len(pid) != 5:
        return None
    kind, numel = pid[1], pid[4]
    if not isinstance(kind, _Box) or kind.name is None or not isinstance(numel, int):
        return None
    stored = _itemsize(kind.name)
    wanted = stored if dtype is None else _itemsize(getattr(dtype, "name", None))
    if not stored or not wanted:
        return None
    return numel * stored // wanted


def _itemsize(name: str | None) -> int | None:
    """Bytes per element of the storage class or dtype named ``name`` (``torch.FloatStorage``,
    ``torch.UntypedStorage``, ``torch.float16``), or None if it names neither."""
    if not name or not name.startswith("torch."):
        return None
    short = name.rsplit(".", 1)[-1]
    if short == "UntypedStorage":
        return 1
    dtype = getattr(torch, short, None)
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    try:
        return torch.serialization.StorageType(short).dtype.itemsize
    except Exception:  # not a storage class torch knows
        return None


def _within(root: _Box, limit: int) -> bool:
    """Whether the skeleton ``root`` expands to at most ``limit`` values, every reference
    to a shared box counted again; computed once per box (a reference back to a box being
    counted, a cycle, counts one), so it costs the pickle's size, not the expansion's."""
    done: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[_Box, bool]] = [(root, False)]
    while stack:
        box, leaving = stack.pop()
        key = id(box)
        if leaving:
            total = 1 + sum(
                done.get(id(item), 1) if isinstance(item, _Box) else 1 for item in box.items
            )
            if total > limit:
                return False
            done[key] = total
            active.discard(key)
        elif key not in done and key not in active:
            active.add(key)
            stack.append((box, True))
            stack.extend(
                (item, False)
                for item in box.items
                if isinstance(item, _Box) and id(item) not in done and id(item) not in active
            )
    return True


def _path_to(root: Any, target: _Box) -> str | None:
    """Where ``target`` sits under ``root``, written as a path into the decoded data
    (``state.params['w']``; raw containers as ``['key'][0]``), or None if unreachable."""
    if not isinstance(root, _Box):
        return None
    parents: dict[int, tuple[_Box, int] | None] = {id(root): None}
    queue = deque([root])
    while queue and id(target) not in parents:
        box = queue.popleft()
        for index, item in enumerate(box.items):
            if isinstance(item, _Box) and id(item) not in parents:
                parents[id(item)] = (box, index)
                queue.append(item)
    if id(target) not in parents:
        return None
    steps: list[tuple[_Box, int]] = []
    step = parents[id(target)]
    while step is not None:
        steps.append(step)
        step = parents[id(step[0])]
    return _render(steps[::-1]) or "the root"


def _render(steps: list[tuple[_Box, int]]) -> str:
    """The path of ``steps`` (``(box, index of the next one in its items)`` from the root):
    purestep's encoded nodes are read through (``{"__kind__": "dict", "items": [[k, v]]}``
    is ``[k]``, a struct's field is ``.field``), a call (a tensor's rebuild) adds nothing."""
    out: list[str] = []
    k = 0
    while k < len(steps):
        box, i = steps[k]
        kind = _encoded_kind(box)
        if kind is not None and k + 1 < len(steps):
            inner, j = steps[k + 1]
            if kind == "dict" and k + 2 < len(steps):
                entry = steps[k + 2][0]
                out.append(f"[{_label(entry.items[0] if entry.items else None)}]")
                k += 3
                continue
            if kind in ("list", "tuple"):
                out.append(f"[{j}]")
                k += 2
                continue
            if kind == "struct" and j % 2 == 1:
                out.append(f".{inner.items[j - 1]}")
                k += 2
                continue
        if box.kind == "call":
            k += 2  # the call and its argument tuple
            continue
        if box.kind == "dict":
            out.append(f"[{_label(box.items[i - 1]) if i % 2 else '?'}]")
        elif box.kind in ("list", "tuple", "set"):
            out.append(f"[{i}]")
        k += 1
    if out and out[0] in ("['state']", "['metadata']"):  # a purestep checkpoint's entries
        out[0] = out[0][2:-2]
    return "".join(out)


def _encoded_kind(box: _Box) -> str | None:
    """The ``__kind__`` of an encoded node (a dict box holding one), else None."""
    if box.kind != "dict":
        return None
    items = box.items
    for at in range(0, len(items) - 1, 2):
        if items[at] == "__kind__" and isinstance(items[at + 1], str):
            return items[at + 1]
    return None


def _label(key: Any) -> str:
    """A dict key as a path shows it (as ``codec`` writes paths; a container key as ``?``)."""
    return "?" if isinstance(key, _Box) else _codec_label(key)
