"""A state as a JSON skeleton and its tensors, keyed by DCP key, and back.

``codec.encode`` turns the state into plain data; every tensor in it is replaced by a
reference ``{"__tensor__": "<section>.<i>"}`` and handed to DCP under that key, one section
per top-level part of the state (a ``TrainState``'s fields, a dict's identifier keys, else
``root``), numbered in the encoded tree's order. The skeleton goes into the manifest. Which
tensors belong to a part is read from the references inside its skeleton
(``_references``), never from the keys' prefixes: a dict's keys that are not identifiers
share the ``root`` section.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..codec import CheckpointError, decode, encode
from .folder import MANIFEST

_TENSOR = "__tensor__"
#: The parts of a state the model and optimizer decide: with a target, their tensors are
#: loaded laid out like the target's (sharded or not); the rest comes from the file as is.
MODEL_SECTIONS = ("params", "buffers", "opt_state", "precision")
#: How deeply a skeleton may nest (a crafted manifest must not exhaust the stack).
_MAX_DEPTH = 200


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


def _tensors_of(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, {DCP key: tensor})`` of ``value``."""
    tensors: dict[str, torch.Tensor] = {}
    return _split_sections(encode(value), tensors), tensors


def _join(tree: Any, tensors: Mapping[str, torch.Tensor], depth: int = 0) -> Any:
    """The skeleton ``tree`` with each reference replaced by its tensor in ``tensors`` (a
    reference to a key it does not hold is a malformed checkpoint)."""
    if depth > _MAX_DEPTH:
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


def _references(tree: Any, depth: int = 0) -> list[str]:
    """The DCP keys the skeleton ``tree`` refers to, in tree order (each once)."""
    if depth > _MAX_DEPTH:
        raise CheckpointError("malformed sharded checkpoint: nested too deeply")
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            key = tree[_TENSOR]
            if not isinstance(key, str):
                raise CheckpointError(f"malformed sharded checkpoint: no tensor {key!r}")
            return [key]
        children = list(tree.values())
    elif isinstance(tree, list):
        children = tree
    else:
        return []
    found = [k for child in children for k in _references(child, depth + 1)]
    return list(dict.fromkeys(found))


def _record(state: Any) -> dict[str, Any]:
    """The progress record of ``state`` (as ``files.read_record`` gives a file's), written
    into the manifest so that resume discovery ranks a folder without reading its tensors."""
    from ..files import _PROGRESS_FIELDS

    progress = getattr(state, "progress", None)
    try:
        counters = {f: int(getattr(progress, f)) for f in _PROGRESS_FIELDS}
    except (AttributeError, TypeError, ValueError, RuntimeError):
        counters = None
    return {"progress": counters}


def _parts(skeleton: Any) -> dict[str, Any] | None:
    """The top-level parts of a manifest's state (as ``_split_sections`` made them): a
    ``@struct``'s data fields, or a dict's string keys; None for a state without parts."""
    if isinstance(skeleton, dict) and skeleton.get("__kind__") == "struct":
        data = skeleton.get("data")
        if isinstance(data, dict):
            return data
    if isinstance(skeleton, dict) and skeleton.get("__kind__") == "dict":
        items = skeleton.get("items")
        if isinstance(items, list) and all(isinstance(i, list) and len(i) == 2 for i in items):
            return {k: v for k, v in items if isinstance(k, str)}
    return None


def _fields(skeleton: Any, path: str) -> dict[str, Any]:
    """``_parts`` of a manifest's state; a state without parts is a ``CheckpointError``."""
    found = _parts(skeleton)
    if found is None:
        raise CheckpointError(f"{path}: malformed {MANIFEST} (its state has no parts)")
    return found


def _has_part(target: Any, part: str) -> bool:
    """Whether ``target`` (a mapping or a state) has ``part``."""
    return part in target if isinstance(target, Mapping) else hasattr(target, part)


def _part_of(target: Any, part: str) -> Any:
    """``target``'s ``part``: a mapping's key or a state's field."""
    if not _has_part(target, part):
        raise CheckpointError(f"the target state has no {part} to load into")
    return target[part] if isinstance(target, Mapping) else getattr(target, part)


def _decoded(
    manifest: dict[str, Any], tensors: Mapping[str, torch.Tensor], path: str
) -> tuple[Any, dict[str, Any]]:
    """``(state, metadata)`` of a manifest, its references filled from ``tensors``."""
    state = decode(_join(manifest["state"], tensors), "state")
    return state, _metadata(manifest, path)


def _metadata(manifest: dict[str, Any], path: str) -> dict[str, Any]:
    """The metadata a manifest holds, with the versions and world size that wrote it."""
    meta = decode(_join(manifest.get("metadata", {}), {}), "metadata")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: malformed metadata")
    return {**meta, "versions": manifest.get("versions"), "world_size": manifest.get("world_size")}
