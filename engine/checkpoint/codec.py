"""Encode a state pytree into containers ``torch.load(weights_only=True)`` can read, and back.

A checkpoint must never need the unpickler to build objects: loading a file may not run
code from it. So every node is written as plain data — tensors, numbers, strings, ``None``
and tagged dicts/lists — and rebuilt here. ``@struct`` classes are named by
``"module:qualname"`` and rebuilt only if they are registered ``@struct`` classes (imported
from purestep's own packages when needed); anything else is refused with the path of the
offending node. Nesting is limited to ``MAX_DEPTH`` levels both ways, so a crafted file
cannot exhaust the interpreter's stack (a state nests a handful of levels).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any

import torch

from purestep.engine.tree import STRUCTS

__all__ = ["MAX_DEPTH", "CheckpointError", "decode", "encode"]

_KIND = "__kind__"
_OWN_PACKAGE = "purestep"
# Checkpoints written before the package was named purestep name its modules without the prefix.
_LEGACY_PACKAGES = ("engine", "loops", "hardware")
#: How deeply containers and ``@struct`` objects may nest in a checkpoint; far above what a
#: state needs and well inside Python's recursion limit when decoding.
MAX_DEPTH = 100


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read as asked (the message says why)."""


def encode(value: Any, path: str = "") -> Any:
    """``value`` as plain data (tensors kept as they are, detached)."""
    return _encode(value, path, 0)


def _encode(value: Any, path: str, depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise CheckpointError(f"cannot save {path or 'the root'}: it is a meta tensor")
        return value.detach()
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    nests = isinstance(value, (dict, list, tuple)) or STRUCTS.get(_name(type(value))) is type(value)
    if nests and depth >= MAX_DEPTH:
        raise CheckpointError(
            f"cannot save {_short(path)}: it is nested deeper than {MAX_DEPTH} levels"
        )
    deeper = depth + 1
    if isinstance(value, dict):
        return {
            _KIND: "dict",
            "items": [
                [_key(k, path), _encode(v, f"{path}[{k!r}]", deeper)] for k, v in value.items()
            ],
        }
    if isinstance(value, list):
        items = [_encode(v, f"{path}[{i}]", deeper) for i, v in enumerate(value)]
        return {_KIND: "list", "items": items}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        items = [_encode(v, f"{path}[{i}]", deeper) for i, v in enumerate(value)]
        return {_KIND: "tuple", "items": items}
    if isinstance(value, torch.dtype):
        return {_KIND: "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_KIND: "device", "name": str(value)}
    cls = type(value)
    name = _name(cls)
    if STRUCTS.get(name) is cls:
        d = value.__dict__
        return {
            _KIND: "struct",
            "type": name,
            "data": {f: _encode(d[f], f"{path}.{f}", deeper) for f in cls.__struct_data__},
            "static": {f: _encode(d[f], f"{path}.{f}", deeper) for f in cls.__struct_static__},
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


def _key(key: Any, path: str) -> Any:
    if key is None or type(key) in (bool, int, float, str):
        return key
    if isinstance(key, (int, float, str)):
        return encode(key, path)
    raise CheckpointError(f"cannot save {path}: dict key {key!r} is not a str or a number")


def _struct_class(name: str) -> type:
    cls = STRUCTS.get(name)  # as written: a user's own module may be named ``engine``
    if cls is None and name.split(".")[0].split(":")[0] in _LEGACY_PACKAGES:
        name = f"{_OWN_PACKAGE}.{name}"
        cls = STRUCTS.get(name)
    if cls is None:
        module = name.partition(":")[0]
        if module.split(".")[0] == _OWN_PACKAGE:
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
            cls = STRUCTS.get(name)
    if cls is None:
        raise CheckpointError(
            f"the checkpoint holds a {name} but no such @struct class is loaded; import the "
            "module that defines it before loading (or the checkpoint comes from a newer "
            "version)"
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


def decode(data: Any, path: str = "") -> Any:
    """The value ``encode`` turned into ``data``; a malformed node (nesting deeper than
    ``MAX_DEPTH`` included) is a ``CheckpointError`` naming its path."""
    try:
        return _decode(data, path, 0)
    except RecursionError:  # called with little stack left: still a clear error
        raise CheckpointError(
            f"malformed checkpoint at {_short(path)}: nested too deeply to decode"
        ) from None


def _decode(data: Any, path: str, depth: int) -> Any:
    if not isinstance(data, dict):
        if isinstance(data, (list, tuple)):
            raise CheckpointError(f"malformed checkpoint at {_short(path)}: bare sequence")
        return data
    if depth >= MAX_DEPTH:
        raise CheckpointError(
            f"malformed checkpoint at {_short(path)}: nested deeper than {MAX_DEPTH} levels"
        )
    try:
        return _decode_node(data, path, depth + 1)
    except RecursionError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
        detail = f"{type(err).__name__}: {err}"
        raise CheckpointError(
            f"malformed checkpoint at {path or 'the root'}: {detail[:200]}"
        ) from None


def _decode_node(data: dict[str, Any], path: str, depth: int) -> Any:
    kind = data.get(_KIND)
    if kind == "dict":
        return {k: _decode(v, f"{path}[{k!r}]", depth) for k, v in data["items"]}
    if kind == "list":
        return [_decode(v, f"{path}[{i}]", depth) for i, v in enumerate(data["items"])]
    if kind == "tuple":
        return tuple([_decode(v, f"{path}[{i}]", depth) for i, v in enumerate(data["items"])])
    if kind == "dtype":
        dtype = getattr(torch, data["name"], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"unknown dtype {data['name']!r} at {path}")
        return dtype
    if kind == "device":
        return torch.device(data["name"])
    if kind == "struct":
        cls = _struct_class(data["type"])
        fields = dict(data["data"])
        fields.update(data["static"])
        expected = cls.__struct_fields__
        for name in expected - set(fields):  # added since the file was written: its default
            default = _field_default(cls, name)
            if default is not _NO_DEFAULT:
                fields[name] = encode(default)
        if set(fields) != expected:
            raise CheckpointError(
                f"{data['type']} at {path or 'the root'} has fields {sorted(fields)} in the "
                f"checkpoint but {sorted(expected)} in this version"
            )
        obj = object.__new__(cls)
        obj.__dict__.update({f: _decode(v, f"{path}.{f}", depth) for f, v in fields.items()})
        return obj
    raise CheckpointError(f"malformed checkpoint at {path or 'the root'}: unknown node {kind!r}")
