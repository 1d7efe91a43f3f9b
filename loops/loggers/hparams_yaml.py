"""``hparams.yaml``: hyper-parameters written with PyYAML's safe dumper, read with ``safe_load``.

``to_plain`` turns hyper-parameter values into plain data first (mappings, lists and
scalars); ``dump_yaml`` writes that in block style, keys in their given order, and
``load_yaml`` reads it back with ``yaml.safe_load``, so ``load_yaml(dump_yaml(x)) == x``
(tuples come back as lists; NaN as NaN). Only the safe loader is used: nothing read from an
``hparams.yaml`` can construct a Python object.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

__all__ = ["dump_yaml", "load_yaml", "to_plain"]


def to_plain(value: Any) -> Any:
    """``value`` as YAML-able data: mappings, lists and scalars.

    Namespaces and dataclass instances become mappings, tuples and sets lists, one-element
    tensors and numpy scalars numbers, other tensors nested lists; anything else its name
    (functions, classes) or ``str()`` (paths, dtypes, devices).
    """
    if _is_scalar(value):
        return _exact(value)
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {_exact(k) if _is_scalar(k) else str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((to_plain(v) for v in value), key=repr)
    if hasattr(value, "tolist"):  # tensors, numpy arrays and numpy scalars
        return to_plain(value.tolist())
    return getattr(value, "__qualname__", None) or str(value)


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
