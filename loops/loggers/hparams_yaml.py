"""``hparams.yaml``: hyper-parameters written with PyYAML's safe dumper, read with ``safe_load``.

``to_plain`` turns hyper-parameter values into plain data first (mappings, lists and
scalars); ``dump_yaml`` writes that in block style, keys in their given order, and
``load_yaml`` reads it back with ``yaml.safe_load``, so ``load_yaml(dump_yaml(x)) == x``
(tuples come back as lists; NaN as NaN). Only the safe loader is used: nothing read from an
``hparams.yaml`` can construct a Python object.
"""

from __future__ import annotations

import argparse
import array
import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

__all__ = [
    "MAX_DEPTH",
    "MAX_TENSOR_VALUES",
    "MAX_TEXT",
    "MAX_VALUES",
    "dump_yaml",
    "load_yaml",
    "to_plain",
]


def to_plain(value: Any) -> Any:
    """``value`` as YAML-able data: mappings, lists and scalars, of a bounded size.

    Namespaces and dataclass instances become mappings, tuples and sets lists, one-element
    tensors and numpy scalars numbers, other tensors nested lists; anything else its name
    (functions, classes) or ``str()`` (paths, dtypes, devices).

    Bounded, so that writing hyper-parameters never expands something huge: a tensor or
    array of more than ``MAX_TENSOR_VALUES`` elements (counted from its shape or length:
    tensors, numpy arrays, memoryviews, ``array.array``; bytes by their length) is written
    as a summary of its shape and dtype, its values never read
    (``torch.zeros(1).expand(2**27)`` costs nothing), and so is an array-like object whose
    size cannot be told; one
    call converts at most ``MAX_VALUES`` values and ``MAX_TEXT`` characters of text in all
    (what is past that is replaced by a note saying how much was left out), and nesting
    deeper than ``MAX_DEPTH`` levels (a list holding itself) is cut the same way.
    """
    return _plain(value, _Budget(), 0)


#: A tensor or array with more elements is summarised (shape, dtype), its values not written.
MAX_TENSOR_VALUES = 1000
#: Values (scalars and container items) one ``to_plain`` call writes at most.
MAX_VALUES = 100_000
#: Characters of text (all strings together) one ``to_plain`` call writes at most.
MAX_TEXT = 1_000_000
#: Nesting levels ``to_plain`` follows.
MAX_DEPTH = 64


class _Budget:
    """What is left of one ``to_plain`` call's bounds (``MAX_VALUES``, ``MAX_TEXT``)."""

    def __init__(self) -> None:
        self.values = MAX_VALUES
        self.text = MAX_TEXT

    def string(self, text: str) -> str:
        """``text``, cut to the characters left (with a note of how many were dropped)."""
        if len(text) > self.text:
            kept = max(self.text, 0)
            text = (
                f"{text[:kept]}... [{len(text) - kept} more characters not written: "
                f"hyper-parameter text is limited to {MAX_TEXT} characters]"
            )
        self.text -= len(text)
        return text


def _plain(value: Any, budget: _Budget, depth: int) -> Any:
    """``to_plain`` of ``value`` at nesting ``depth``, drawing on ``budget``."""
    budget.values -= 1
    if _is_scalar(value):
        value = _exact(value)
        return budget.string(value) if isinstance(value, str) else value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    is_container = isinstance(value, (Mapping, list, tuple, set, frozenset))
    if is_container and depth >= MAX_DEPTH:
        return budget.string(
            f"<{type(value).__name__} nested deeper than {MAX_DEPTH} levels: not written>"
        )
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for i, (k, v) in enumerate(value.items()):
            if budget.values <= 0:
                out["..."] = _left_out(len(value) - i, "entries")
                break
            key = _exact(k) if _is_scalar(k) else str(k)
            key = budget.string(key) if isinstance(key, str) else key  # before its value
            out[key] = _plain(v, budget, depth + 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = []
        for i, v in enumerate(value):
            if budget.values <= 0:
                items.append(_left_out(len(value) - i, "items"))
                break
            items.append(_plain(v, budget, depth + 1))
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, (bytes, bytearray)):
        return _bytes(value, budget)
    if hasattr(value, "tolist"):  # tensors, numpy arrays and scalars, memoryviews, arrays
        return _array(value, budget, depth)
    return budget.string(getattr(value, "__qualname__", None) or str(value))


def _bytes(value: bytes | bytearray, budget: _Budget) -> str:
    """Bytes as their ``str()`` when at most ``MAX_TENSOR_VALUES`` long, else a summary of
    their length: the text of a long one (about 4 characters a byte) is never built."""
    if len(value) <= MAX_TENSOR_VALUES:
        return budget.string(str(value))
    return budget.string(
        f"<{type(value).__name__} of {len(value)} bytes: values not written: more than "
        f"{MAX_TENSOR_VALUES} elements>"
    )


def _count(value: Any) -> int | None:
    """How many elements ``value`` (a tensor, array, memoryview, ...) has, from its shape
    or length without reading its data; None when that cannot be told (then it is not
    read either)."""
    if callable(getattr(value, "numel", None)):  # tensors
        count = value.numel()
    elif isinstance(value, memoryview):  # nbytes is its shape's, strides aside
        count = value.nbytes // value.itemsize if value.itemsize else None
    elif isinstance(value, array.array):
        count = len(value)
    else:  # numpy arrays and scalars (and what looks like them)
        count = getattr(value, "size", None)
    if isinstance(count, bool) or not isinstance(count, int):
        return None
    return count


def _shape_and_type(value: Any) -> tuple[tuple[int, ...] | None, Any]:
    """The shape and element type shown in a summary (None when not told)."""
    if isinstance(value, array.array):
        return (len(value),), value.typecode
    if isinstance(value, memoryview):
        return tuple(value.shape or ()), value.format
    try:
        shape = tuple(int(n) for n in getattr(value, "shape", ()))
    except (TypeError, ValueError):
        shape = None
    return shape, getattr(value, "dtype", None)


def _left_out(count: int, what: str) -> str:
    """The note standing for the ``count`` entries a container had past ``MAX_VALUES``."""
    return (
        f"... {count} more {what} not written: hyper-parameters are limited to {MAX_VALUES} values"
    )


def _array(value: Any, budget: _Budget, depth: int) -> Any:
    """A tensor or array as its values (nested lists; a number for one element) when it
    has at most ``MAX_TENSOR_VALUES`` elements and they can be read; else a summary. The
    element count comes from the shape: a large tensor's data is never touched."""
    numel = _count(value)
    small = numel is not None and numel <= MAX_TENSOR_VALUES  # unknown sizes: not read
    if small:
        try:
            values = value.tolist()
        except Exception:  # a meta, sparse or otherwise unreadable tensor: summarised
            pass
        else:
            return _plain(values, budget, depth)
    shape, dtype = _shape_and_type(value)
    note = "values not written"
    if numel is None:
        note += ": its size is unknown"
    elif not small:
        note += f": more than {MAX_TENSOR_VALUES} elements"
    return budget.string(f"<{type(value).__name__} shape={shape} dtype={dtype}: {note}>")


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _exact(value: Any) -> Any:
    """A scalar as its exact built-in type (``numpy.float64``, enums of int/str: plain)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # the characters, not an enum's ``Cls.NAME``
    return int(value) if isinstance(value, int) else float(value)


class _Dumper(yaml.SafeDumper):
    """The safe dumper, with tuples as lists and a clear error for anything not plain."""


def _represent_tuple(dumper: yaml.SafeDumper, value: tuple) -> yaml.Node:
    return dumper.represent_list(list(value))


def _refuse(dumper: yaml.SafeDumper, value: Any) -> yaml.Node:
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to YAML; use to_plain()")


_Dumper.add_representer(tuple, _represent_tuple)
_Dumper.add_representer(None, _refuse)  # the fallback for every type without a representer


def dump_yaml(data: Any) -> str:
    """``data`` (a mapping, list or scalar of plain values) as block-style YAML text.

    Keys keep their order. Characters outside ASCII are escaped (as Lightning's
    ``hparams.yaml`` does): PyYAML writes some of them raw in a way it reads back
    differently (a NEL, U+0085, comes back as a space).
    """
    return yaml.dump(
        data,
        Dumper=_Dumper,
        default_flow_style=False,
        sort_keys=False,
    )


def load_yaml(text: str) -> Any:
    """Read YAML text with ``yaml.safe_load`` (plain data only); ``ValueError`` if malformed."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"malformed YAML: {error}") from error
