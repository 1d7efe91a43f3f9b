"""Reading a sharded checkpoint, whole or in parts, laid out like a target state.

``load(path, target=None)`` reads it back at any world size. With ``target`` (a state of
the same model and optimizer: a fresh ``engine.init`` under ``hardware.fsdp()`` on any
number of ranks, or a plain single-device state) each of the parts the model and optimizer
decide (``MODEL_SECTIONS``) is compared with the target's by key path, as ``conform``
compares a plain file (every tensor's path, global shape and dtype: the differences are
listed), and its tensors are read laid out like the target's tensor at the same path (DCP
reshards: a DTensor target reads its own chunk of the saved shards, a plain target the
full tensor); everything else comes from the checkpoint as it is. Without a target, plain
full CPU tensors. ``load_parts`` reads only the named parts (what evaluation needs);
``peek`` checks everything but reads no tensor data. Every rank calls them when the target
is sharded.

DCP's ``.metadata`` pickle is read by ``dcp_metadata.SafeReader`` / ``read_metadata`` (only
DCP's metadata classes; data files must be the folder's own); tensor data by DCP with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

import torch

from purestep.engine import tree

from ..codec import CheckpointError, decode
from ..matching import _listing, _mismatch, _path
from .failures import _describe, _distributed, _failures, _quiet
from .folder import MANIFEST, read_manifest
from .skeleton import (
    MODEL_SECTIONS,
    _decoded,
    _fields,
    _has_part,
    _join,
    _metadata,
    _part_of,
    _parts,
    _references,
)


def _empty(entry: Any, device: str | None = None) -> torch.Tensor:
    """An empty tensor of a DCP index entry's global shape and dtype."""
    return torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device=device)


def peek(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(state, metadata)`` of the committed sharded checkpoint at ``path`` with every tensor
    a ``meta``-device placeholder of its saved shape and dtype: all is checked as ``load``
    checks it (manifest, DCP index, data files and extents, the state's decoding) but no
    tensor data is read. Resume discovery uses it to validate a folder that the restore
    then loads laid out like its own state."""
    from ..dcp_metadata import read_metadata

    path = os.path.abspath(os.fspath(path))
    manifest = read_manifest(path)
    saved = read_metadata(path).state_dict_metadata
    dest = {key: _empty(entry, "meta") for key, entry in saved.items()}
    return _decoded(manifest, dest, path)


def load(path: str | os.PathLike, target: Any = None) -> tuple[Any, dict[str, Any]]:
    """``(state, metadata)`` of the sharded checkpoint at ``path``, laid out like ``target``
    (see the module docstring): the parts of ``MODEL_SECTIONS`` that both the checkpoint
    and the target have (a weights-only file has no optimizer state) must match."""
    from ..dcp_metadata import read_metadata

    path = os.path.abspath(os.fspath(path))
    manifest = read_manifest(path)
    saved = read_metadata(path).state_dict_metadata
    dest = {key: _empty(entry) for key, entry in saved.items()}
    if target is not None:
        fields = _parts(manifest["state"]) or {}
        laid_out = [p for p in MODEL_SECTIONS if p in fields and _has_part(target, p)]
        dest.update(_layout(fields, laid_out, saved, target, path))
    _read_tensors(dest, path)
    return _decoded(manifest, dest, path)


def load_parts(
    path: str | os.PathLike, parts: Collection[str], target: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({part: value}, metadata)``: only the top-level ``parts`` (fields of the saved
    ``TrainState``, or keys of a saved dict: say ``("params", "buffers")``, what an
    evaluation needs) of the sharded checkpoint at ``path``; no other tensor is read or
    checked. With ``target`` (a state or a mapping that holds those parts, sharded or not)
    the parts among ``MODEL_SECTIONS`` are compared with its by key path (shapes, dtypes)
    and laid out like its (at any world size, as ``load``). A part the checkpoint does not
    hold is a ``CheckpointError``. Every rank calls it when the target is sharded."""
    from ..dcp_metadata import read_metadata

    path = os.path.abspath(os.fspath(path))
    manifest = read_manifest(path)
    fields = _fields(manifest["state"], path)
    parts = list(dict.fromkeys(parts))
    missing = [p for p in parts if p not in fields]
    if missing:
        raise CheckpointError(
            f"{path} holds no {', '.join(missing)} (its parts: {', '.join(sorted(fields))})"
        )
    saved = read_metadata(path).state_dict_metadata
    keys = [k for p in parts for k in _references(fields[p])]
    _check_indexed(keys, saved, path)
    dest = {key: _empty(saved[key]) for key in keys}
    if target is not None:
        laid_out = [p for p in parts if p in MODEL_SECTIONS]
        dest.update(_layout(fields, laid_out, saved, target, path))
    _read_tensors(dest, path)
    values = {p: decode(_join(fields[p], dest), p) for p in parts}
    return values, _metadata(manifest, path)


def _check_indexed(keys: Collection[str], saved: Mapping[str, Any], path: str) -> None:
    """Every DCP key a skeleton refers to is in the DCP index."""
    unknown = [k for k in keys if k not in saved]
    if unknown:
        raise CheckpointError(
            f"{path}: malformed {MANIFEST}: it refers to tensor {unknown[0]!r}, which its DCP "
            "index does not hold"
        )


def _layout(
    fields: Mapping[str, Any],
    parts: Collection[str],
    saved: Mapping[str, Any],
    target: Any,
    path: str,
) -> dict[str, torch.Tensor]:
    """DCP key -> an empty tensor laid out like the target's tensor at the same key path,
    for the saved ``parts``; their tensors' paths, global shapes and dtypes must be the
    target's (one ``CheckpointError`` lists every difference)."""
    layout: dict[str, torch.Tensor] = {}
    sections: dict[str, list[str]] = {}
    for part in parts:
        keys = _references(fields[part])
        _check_indexed(keys, saved, path)
        placeholders = {key: _empty(saved[key], "meta") for key in keys}
        key_of = {id(t): key for key, t in placeholders.items()}
        theirs = decode(_join(fields[part], placeholders), part)
        problems, pairs = _matched(theirs, _part_of(target, part), f".{part}")
        if problems:
            sections[part] = problems
        for placeholder, mine in pairs:
            layout[key_of[id(placeholder)]] = torch.empty_like(mine)
    if sections:
        count = sum(len(p) for p in sections.values())
        raise CheckpointError(
            f"{path} does not match the target state ({count} differences): it was written "
            "for a different model or optimizer:\n" + _listing(sections)
        )
    return layout


def _matched(
    theirs: Any, mine: Any, prefix: str
) -> tuple[list[str], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(differences, [(saved placeholder, target tensor)])`` of a saved part against the
    target's, leaf by leaf by key path (``matching``'s wording); tensors pair by path only."""
    have = {_path(prefix, p): v for p, v in tree.flatten_with_paths(theirs)}
    want = [(_path(prefix, p), v) for p, v in tree.flatten_with_paths(mine)]
    problems: list[str] = []
    pairs = []
    for key_path, leaf in want:
        if key_path not in have:
            problems.append(f"{key_path}: missing in the checkpoint")
            continue
        problem = _mismatch(have[key_path], leaf)
        if problem:
            problems.append(f"{key_path}: {problem}")
        elif isinstance(leaf, torch.Tensor):
            pairs.append((have[key_path], leaf))
    wanted = {p for p, _ in want}
    problems += [f"{p}: in the checkpoint but not in the target" for p in have if p not in wanted]
    return problems, pairs


def _read_tensors(dest: dict[str, torch.Tensor], path: str) -> None:
    """Read the tensors of ``dest`` (keys of the checkpoint's DCP index) from ``path``
    into it. DCP raises a failed read as its ``CheckpointException``, a ``BaseException``:
    it becomes a ``CheckpointError`` (a refusal of the safe reader as it was)."""
    if not dest:
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..dcp_metadata import SafeReader

    try:
        with _quiet():
            dcp.load(dest, storage_reader=SafeReader(path), no_dist=not _distributed())
    except CheckpointError:
        raise
    except (CheckpointException, Exception) as err:
        refused = [e for _, e in _failures(err) if isinstance(e, CheckpointError)]
        if refused:
            raise refused[0] from err
        raise CheckpointError(
            f"reading the sharded checkpoint {path} failed: {_describe(err)}"
        ) from err
