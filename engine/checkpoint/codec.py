"""Encode a state pytree into containers ``torch.load(weights_only=True)`` can read, and back.

A checkpoint must never need the unpickler to build objects: loading a file may not run
code from it. So every node is written as plain data — tensors, numbers, strings, ``None``
and tagged dicts/lists — and rebuilt here. ``@struct`` classes are named by
``"module:qualname"`` and rebuilt only if they are registered ``@struct`` classes: the
registry (``tree.STRUCTS``) as it stands, plus purestep's own modules that define them
(``STRUCT_MODULES``, imported on demand); a checkpoint never makes any other module
import. Anything else is refused with the path of the offending node.

What a file may make us build is bounded, however it is crafted. Nesting is limited to
``MAX_DEPTH`` levels both ways, so it cannot exhaust the interpreter's stack (a state nests
a handful of levels). Decoding builds at most ``MAX_NODES`` values and ``MAX_TEXT_BYTES`` of
strings for one state or metadata (``Budget``), and refuses data it meets twice: pickle
stores a shared container once, so a few kilobytes of shared references would otherwise
decode to an exponentially large tree ("billion laughs"); ``encode`` never shares, and
counts against the same budget, so whatever it writes decodes. Leaves are only what
``encode`` writes (tensors, numbers, strings, ``None``). A tensor whose elements overlap in
memory (an ``expand``-ed view) is written as a compact copy, so no file of ours holds one
(``safe_load`` refuses them).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

import torch

from purestep.engine.tree import STRUCTS

__all__ = [
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_TEXT_BYTES",
    "STRUCT_MODULES",
    "Budget",
    "CheckpointError",
    "decode",
    "encode",
    "layout_problem",
    "overlapping",
]

_KIND = "__kind__"
_OWN_PACKAGE = "purestep"
# Checkpoints written before the package was named purestep name its modules without the prefix.
_LEGACY_PACKAGES = ("engine", "loops", "hardware")
#: How deeply containers and ``@struct`` objects may nest in a checkpoint; far above what a
#: state needs and well inside Python's recursion limit when decoding.
MAX_DEPTH = 100
#: The most values (containers, ``@struct`` objects and leaves, a tensor counting as one)
#: that encoding or decoding one state, or one checkpoint's metadata, may build: some
#: hundred times what a large model's state and optimizer hold, and a few seconds of
#: decoding. It bounds what a crafted file can make the loader (and whatever walks the
#: decoded hyper-parameters after it) build.
MAX_NODES = 4_000_000
#: The most bytes of strings (values and dict keys) that one state or metadata may hold.
MAX_TEXT_BYTES = 256 * 2**20
#: purestep's modules that define ``@struct`` classes a checkpoint may hold: a class named
#: by a checkpoint is looked up in the registry, and only these modules are imported to
#: fill it (a module's import runs its code: no name read from a file chooses another).
#: tests/test_decoding_budget.py checks that the list is complete.
STRUCT_MODULES = frozenset(
    f"{_OWN_PACKAGE}.{name}"
    for name in (
        "engine.loss_scale",
        "engine.metrics",
        "engine.optim.accumulate",
        "engine.optim.adagrad",
        "engine.optim.adam",
        "engine.optim.base",
        "engine.optim.from_torch",
        "engine.optim.hyperparams",
        "engine.optim.masking",
        "engine.optim.multi",
        "engine.optim.nonfinite",
        "engine.optim.plateau",
        "engine.optim.rmsprop",
        "engine.optim.scaling",
        "engine.optim.sgd",
        "engine.state",
        "engine.step",
        "hardware.ensemble",
        "hardware.member_sgd",
        "hardware.members",
        "loops.aggregate",
        "loops.lightning.logging",
        "loops.lightning.metric_states",
        "loops.loop_state",
    )
)
# Paths in messages stop growing here (a crafted file's long keys must not make every
# node's path cost more to build); a dict key shows at most this many characters.
_PATH_CHARS = 240
_KEY_CHARS = 40
_LEAVES = (bool, int, float, str)


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read as asked (the message says why)."""


class Budget:
    """What one ``encode`` or ``decode`` may still build: ``MAX_NODES`` values and
    ``MAX_TEXT_BYTES`` of strings (the limits as they are when it is made). ``spend``
    counts one value and its text, so a structure is refused while it is being built, not
    after it has filled the memory."""

    __slots__ = ("nodes", "text", "verb")

    def __init__(self, verb: str = "decode") -> None:
        self.nodes = MAX_NODES
        self.text = MAX_TEXT_BYTES
        self.verb = verb

    def spend(self, text: int, path: str) -> None:
        """Count one value holding ``text`` bytes of strings; refuse past the budget."""
        self.nodes -= 1
        self.text -= text
        if self.nodes < 0 or self.text < 0:
            what = (
                f"more than {MAX_NODES:,} values"
                if self.nodes < 0
                else f"more than {MAX_TEXT_BYTES:,} bytes of strings"
            )
            if self.verb == "encode":
                raise CheckpointError(
                    f"cannot save {_short(path)}: the data holds {what} (codec.MAX_NODES, "
                    "MAX_TEXT_BYTES: a checkpoint stays inside what loading accepts; shared "
                    "references count once per use)"
                )
            raise CheckpointError(
                f"malformed checkpoint at {_short(path)}: it decodes to {what} (the budget of "
                "one state or metadata: codec.MAX_NODES, MAX_TEXT_BYTES); refusing it"
            )


def overlapping(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a strided layout may address one element twice: a stride of 0 along a
    dimension of more than one element (an ``expand``-ed view), or strides that, sorted,
    do not each step past everything the smaller ones reach. Every view made by slicing,
    transposing, permuting or selecting passes; ``expand``, ``unfold`` and odd
    ``as_strided`` layouts do not."""
    dims = sorted((st, n) for n, st in zip(size, stride) if n > 1)
    reach = 0
    for st, n in dims:
        if st <= reach:
            return True
        reach += st * (n - 1)
    return False


def layout_problem(
    size: Sequence[int], stride: Sequence[int], offset: int, elements: int
) -> str | None:
    """Why a tensor of ``size``/``stride`` at ``offset`` cannot stand on a storage of
    ``elements`` elements (None if it can): negative numbers, an extent beyond the storage,
    or elements that overlap, which would make the tensor larger than the data the file
    holds for it (e.g. ``torch.zeros(1).expand(2**27)``: 4 bytes stored, 512 MiB once
    anything copies it)."""
    if len(size) != len(stride):
        return f"it has {len(size)} sizes but {len(stride)} strides"
    if offset < 0 or any(n < 0 for n in size) or any(st < 0 for st in stride):
        return "it has a negative size, stride or offset"
    if any(n == 0 for n in size):
        return None  # no element is read
    end = offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1
    if end > elements:
        return f"it reaches element {end:,} of a storage of {elements:,} elements"
    if overlapping(size, stride):
        numel = 1
        for n in size:
            numel *= n
        return (
            f"its {numel:,} elements overlap in a storage of {elements:,} (a stride-0 or "
            "overlapping view: its storage is smaller than its shape needs)"
        )
    return None


def _compact(tensor: torch.Tensor, path: str) -> torch.Tensor:
    """``tensor`` detached, as a compact copy if its elements overlap in memory (a file
    must not hold a layout that loading refuses); a nested tensor is refused."""
    if tensor.is_nested:
        raise CheckpointError(f"cannot save {_short(path)}: nested tensors are not saved")
    tensor = tensor.detach()
    if tensor.layout == torch.strided and overlapping(tensor.shape, tensor.stride()):
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def encode(value: Any, path: str = "", *, budget: Budget | None = None) -> Any:
    """``value`` as plain data (tensors kept as they are, detached; overlapping views
    copied). Counts against ``budget`` (a fresh one by default), so data that shares
    references is refused before it is expanded past what decoding accepts."""
    return _encode(value, path, 0, budget or Budget("encode"))


def _encode(value: Any, path: str, depth: int, budget: Budget) -> Any:
    if isinstance(value, torch.Tensor):
        budget.spend(0, path)
        if value.is_meta:
            raise CheckpointError(f"cannot save {path or 'the root'}: it is a meta tensor")
        return _compact(value, path)
    if value is None or type(value) in _LEAVES:
        budget.spend(len(value) if type(value) is str else 0, path)
        return value
    if isinstance(value, bool):
        return _encode(bool(value), path, depth, budget)
    if isinstance(value, int):
        return _encode(int(value), path, depth, budget)
    if isinstance(value, float):
        return _encode(float(value), path, depth, budget)
    if isinstance(value, str):
        return _encode(str(value), path, depth, budget)
    nests = isinstance(value, (dict, list, tuple)) or STRUCTS.get(_name(type(value))) is type(value)
    if nests and depth >= MAX_DEPTH:
        raise CheckpointError(
            f"cannot save {_short(path)}: it is nested deeper than {MAX_DEPTH} levels"
        )
    budget.spend(0, path)
    deeper = depth + 1
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            key = _key(k, path)
            budget.text -= len(key) if type(key) is str else 0
            items.append([key, _encode(v, _at(path, f"[{_label(k)}]"), deeper, budget)])
        return {_KIND: "dict", "items": items}
    if isinstance(value, list):
        items = [_encode(v, _at(path, f"[{i}]"), deeper, budget) for i, v in enumerate(value)]
        return {_KIND: "list", "items": items}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        items = [_encode(v, _at(path, f"[{i}]"), deeper, budget) for i, v in enumerate(value)]
        return {_KIND: "tuple", "items": items}
    if isinstance(value, torch.dtype):
        return {_KIND: "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_KIND: "device", "name": str(value)}
    cls = type(value)
    name = _name(cls)
    if STRUCTS.get(name) is cls:
        d = value.__dict__
        budget.text -= len(name)

        def fields(names: Any) -> dict[str, Any]:
            return {f: _encode(d[f], _at(path, f".{f}"), deeper, budget) for f in names}

        return {
            _KIND: "struct",
            "type": name,
            "data": fields(cls.__struct_data__),
            "static": fields(cls.__struct_static__),
        }
    raise CheckpointError(
        f"cannot save {path or 'the root'}: a {cls.__name__} is not a tensor, a number, a "
        "string, a container or an @struct class"
    )


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _short(path: str) -> str:
    """``path`` for a message: the root named, a very long path cut in the middle."""
    if not path:
        return "the root"
    return path if len(path) <= 120 else f"{path[:60]}...{path[-50:]}"


def _at(path: str, segment: str) -> str:
    """``path`` followed by ``segment``, unless it is already ``_PATH_CHARS`` long (then it
    ends in ``...``): building each node's path costs a bounded amount."""
    if len(path) < _PATH_CHARS:
        return path + segment
    return path if path.endswith("...") else path + "..."


def _label(key: Any) -> str:
    """``repr(key)`` for a path, a long string key cut to ``_KEY_CHARS`` characters."""
    if isinstance(key, str) and len(key) > _KEY_CHARS:
        return repr(key[:_KEY_CHARS]) + "..."
    return repr(key)


def _key(key: Any, path: str) -> Any:
    if key is None or type(key) in _LEAVES:
        return key
    if isinstance(key, (int, float, str)):
        return encode(key, path)
    raise CheckpointError(f"cannot save {path}: dict key {key!r} is not a str or a number")


def _struct_class(name: str) -> type:
    """The registered ``@struct`` class a checkpoint names ``"module:qualname"``: looked up
    in the registry; on a miss, the module is imported only if it is one of purestep's
    ``STRUCT_MODULES`` (a name from a file never makes any other module run)."""
    cls = STRUCTS.get(name)  # as written: a user's own module may be named ``engine``
    if cls is None and name.split(".")[0].split(":")[0] in _LEGACY_PACKAGES:
        name = f"{_OWN_PACKAGE}.{name}"
        cls = STRUCTS.get(name)
    module = name.partition(":")[0]
    if cls is None and module in STRUCT_MODULES:
        importlib.import_module(module)
        cls = STRUCTS.get(name)
    if cls is None:
        raise CheckpointError(
            f"the checkpoint holds a {name[:200]} but no such @struct class is loaded; "
            "loading imports no module a file names, so import the module that defines it "
            "before loading (or the checkpoint comes from a newer version)"
        )
    return cls


_NO_DEFAULT = object()


def _field_default(cls: type, name: str) -> Any:
    """The default a struct field declares (a later version's new field), or ``_NO_DEFAULT``."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return _NO_DEFAULT


def decode(data: Any, path: str = "", *, budget: Budget | None = None) -> Any:
    """The value ``encode`` turned into ``data``; a malformed node (nesting deeper than
    ``MAX_DEPTH``, data met twice, a leaf ``encode`` never writes, more than ``budget``
    allows: a fresh ``Budget`` by default) is a ``CheckpointError`` naming its path."""
    decoder = _Decoder(budget or Budget())
    try:
        return decoder.value(data, path, 0)
    except RecursionError:  # called with little stack left: still a clear error
        raise CheckpointError(
            f"malformed checkpoint at {_short(path)}: nested too deeply to decode"
        ) from None


class _Decoder:
    """One ``decode``: its budget, and the containers of the encoded data already met (each
    may be decoded once: pickle keeps one copy of a shared container, so meeting one again
    means a crafted file whose references would expand exponentially, or a cycle)."""

    __slots__ = ("budget", "seen")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.seen: set[int] = set()

    def claim(self, container: Any, path: str) -> Any:
        """``container``, refused if this decode met it before."""
        key = id(container)
        if key in self.seen:
            raise CheckpointError(
                f"malformed checkpoint at {_short(path)}: it refers again to data already "
                "decoded elsewhere (purestep never writes shared or recursive references; "
                "expanding them could turn a small file into an exponentially large state)"
            )
        self.seen.add(key)
        return container

    def value(self, data: Any, path: str, depth: int) -> Any:
        if not isinstance(data, dict):
            if isinstance(data, (list, tuple)):
                raise CheckpointError(f"malformed checkpoint at {_short(path)}: bare sequence")
            if data is None or type(data) in _LEAVES or isinstance(data, torch.Tensor):
                self.budget.spend(len(data) if type(data) is str else 0, path)
                return data
            raise CheckpointError(
                f"malformed checkpoint at {_short(path)}: a {type(data).__name__} is not "
                "data purestep writes (tensors, numbers, strings, None and tagged nodes)"
            )
        if depth >= MAX_DEPTH:
            raise CheckpointError(
                f"malformed checkpoint at {_short(path)}: nested deeper than {MAX_DEPTH} levels"
            )
        self.claim(data, path)
        self.budget.spend(0, path)
        try:
            return self.node(data, path, depth + 1)
        except RecursionError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
            detail = f"{type(err).__name__}: {err}"
            raise CheckpointError(
                f"malformed checkpoint at {_short(path)}: {detail[:200]}"
            ) from None

    def items(self, data: dict[str, Any], path: str) -> list[Any]:
        items = data["items"]
        if type(items) is not list:
            raise TypeError(f"its items are a {type(items).__name__}, not a list")
        return self.claim(items, path)

    def node(self, data: dict[str, Any], path: str, depth: int) -> Any:
        kind = data.get(_KIND)
        if kind == "dict":
            out = {}
            for entry in self.items(data, path):
                if type(entry) is not list or len(entry) != 2:
                    raise TypeError("a dict entry is not a [key, value] pair")
                k, v = self.claim(entry, path)
                if not (k is None or type(k) in _LEAVES):
                    raise TypeError(f"a dict key is a {type(k).__name__}, not a str or a number")
                self.budget.text -= len(k) if type(k) is str else 0
                out[k] = self.value(v, _at(path, f"[{_label(k)}]"), depth)
            return out
        if kind in ("list", "tuple"):
            items = self.items(data, path)
            out = [self.value(v, _at(path, f"[{i}]"), depth) for i, v in enumerate(items)]
            return out if kind == "list" else tuple(out)
        if kind == "dtype":
            dtype = getattr(torch, str(data["name"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown dtype {data['name']!r} at {_short(path)}")
            return dtype
        if kind == "device":
            return torch.device(data["name"])
        if kind == "struct":
            return self.struct(data, path, depth)
        raise CheckpointError(
            f"malformed checkpoint at {_short(path)}: unknown node {str(kind)[:100]!r}"
        )

    def struct(self, data: dict[str, Any], path: str, depth: int) -> Any:
        if type(data["type"]) is not str:
            raise TypeError("its struct type is not a string")
        self.budget.text -= len(data["type"])
        cls = _struct_class(data["type"])
        fields = dict(self.claim(data["data"], path))
        fields.update(self.claim(data["static"], path))
        expected = cls.__struct_fields__
        for name in expected - set(fields):  # added since the file was written: its default
            default = _field_default(cls, name)
            if default is not _NO_DEFAULT:
                fields[name] = encode(default)
        if set(fields) != expected:
            raise CheckpointError(
                f"{data['type']} at {_short(path)} has fields {sorted(map(str, fields))[:50]} "
                f"in the checkpoint but {sorted(expected)} in this version"
            )
        obj = object.__new__(cls)
        obj.__dict__.update(
            {f: self.value(v, _at(path, f".{f}"), depth) for f, v in fields.items()}
        )
        return obj
