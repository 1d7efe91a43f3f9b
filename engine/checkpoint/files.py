"""Save a whole ``TrainState`` with metadata, and load it back safely.

A checkpoint file is ``torch.save`` of a dict of plain data: ``format`` (the magic string
``"purestep-checkpoint"``), ``version``, ``metadata`` (library versions, the loop config, and
whatever the caller adds) and ``state`` (the encoded state, see ``codec``). It is written
atomically (``storage``) and read with ``torch.load(weights_only=True)``, so loading never
runs code from the file. Errors name the file: a pickle payload is refused, a truncated or
corrupt file is reported as such, a foreign file (e.g. a Lightning ``.ckpt``) is told apart.
``load(url, target=state)`` checks the file against a target structure and lists every
mismatch; ``strict=False`` takes what matches and keeps the target's values for the rest.
"""

from __future__ import annotations

import pickle
import platform
import warnings
import zipfile
from collections.abc import Mapping
from typing import Any

import torch

from engine import tree

from . import storage
from .codec import CheckpointError, decode, encode

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "conform",
    "load",
    "load_metadata",
    "read",
    "save",
    "versions",
]

FORMAT = "purestep-checkpoint"
FORMAT_VERSION = 1


def versions() -> dict[str, str]:
    """The library versions recorded in every checkpoint."""
    try:
        from importlib.metadata import version

        ours = version("purestep")
    except Exception:  # not installed as a distribution (e.g. run from a checkout)
        ours = "unknown"
    return {"purestep": ours, "torch": str(torch.__version__), "python": platform.python_version()}


def serialize(state: Any, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The plain-data payload of a checkpoint (what ``torch.save`` writes)."""
    meta = {"versions": versions(), **dict(metadata or {})}
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "metadata": encode(meta, "metadata"),
        "state": encode(state),
    }


def save(
    state: Any,
    url: str,
    *,
    metadata: Mapping[str, Any] | None = None,
    commit: str = "auto",
    fsync: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Write ``state`` (any pytree of tensors, numbers, strings, containers and ``@struct``
    objects) and ``metadata`` to ``url`` atomically. See ``storage.write_atomic``."""
    payload = serialize(state, metadata)
    write_payload(payload, url, commit=commit, fsync=fsync, storage_options=storage_options)


def write_payload(
    payload: dict[str, Any],
    url: str,
    *,
    commit: str = "auto",
    fsync: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    storage.write_atomic(
        url,
        lambda f: torch.save(payload, f),
        commit=commit,
        fsync=fsync,
        storage_options=storage_options,
    )


def read(
    url: str,
    *,
    map_location: Any = "cpu",
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The raw payload of a checkpoint, checked to be ours; errors name the file."""
    handle = storage.open_read(url, commit=commit, storage_options=storage_options)
    try:
        with handle as f:
            local = getattr(f, "name", None) if storage.is_local_url(url) else None
            source = local if isinstance(local, str) else f
            payload = torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing to load {url}: it holds Python objects other than tensors and plain "
            "containers (a pickle payload?); nothing from it was run. "
            f"Detail: {_unpickler_detail(err)}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError) as err:
        raise CheckpointError(
            f"{url} is corrupt or truncated and cannot be read: {str(err).splitlines()[0][:300]}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        keys = sorted(payload)[:8] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{url} is not a purestep checkpoint (found {keys}); to start from another "
            "framework's weights use engine.checkpoint.load_weights"
        )
    if payload.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{url} has checkpoint format {payload['version']}, newer than this version "
            f"reads ({FORMAT_VERSION}); upgrade purestep"
        )
    return payload


def _unpickler_detail(err: Exception) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if "Unsupported" in ln or "error" in ln]
    return (lines[-1] if lines else str(err).splitlines()[0])[:300]


def load_metadata(url: str, **kwargs: Any) -> dict[str, Any]:
    """The metadata of a checkpoint (library versions, config, ...)."""
    return decode(read(url, **kwargs)["metadata"], "metadata")


def load(
    url: str,
    *,
    target: Any = None,
    strict: bool = True,
    map_location: Any = "cpu",
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """``(state, metadata)`` from ``url``.

    With a ``target`` (e.g. a fresh ``engine.init(...)`` state) the file must match its
    structure, shapes and dtypes, and tensors land on the target's devices; every
    difference is listed in one error. ``strict=False`` takes the matching leaves from the
    file and keeps the target's for the rest (a warning lists them).
    """
    payload = read(url, map_location=map_location, commit=commit, storage_options=storage_options)
    state = decode(payload["state"])
    metadata = decode(payload["metadata"], "metadata")
    if target is not None:
        state = _fit_to(state, target, strict=strict, url=url)
    return state, metadata


def conform(loaded: Any, target: Any, *, url: str, what: str = "state") -> Any:
    """``loaded`` checked against ``target``'s structure, shapes and dtypes and placed on
    its devices; every difference is listed in one ``CheckpointError``."""
    try:
        return _fit_to(loaded, target, strict=True, url=url)
    except CheckpointError as err:
        raise CheckpointError(f"{what}: {err}") from None


def _fit_to(loaded: Any, target: Any, *, strict: bool, url: str) -> Any:
    """``loaded`` checked against (and placed like) ``target``; see ``load``."""
    have = dict(tree.flatten_with_paths(loaded))
    want = tree.flatten_with_paths(target)
    want_paths = {p for p, _ in want}
    problems: list[str] = []
    values = []
    for path, leaf in want:
        if path not in have:
            problems.append(f"{path}: missing in the checkpoint")
            values.append(leaf)
            continue
        got = have[path]
        problem = _mismatch(got, leaf)
        if problem:
            problems.append(f"{path}: {problem}")
            values.append(leaf)
            continue
        if isinstance(leaf, torch.Tensor) and got.device != leaf.device:
            got = got.to(leaf.device)
        values.append(got)
    extra = [p for p in have if p not in want_paths]
    problems += [f"{p}: in the checkpoint but not in the target" for p in extra]
    if problems and strict:
        listing = "\n  ".join(problems)
        raise CheckpointError(
            f"{url} does not match the target state ({len(problems)} differences):\n  {listing}"
            "\nPass strict=False to load what matches (e.g. for fine-tuning)."
        )
    if problems:
        warnings.warn(
            f"partial restore from {url}; kept the target's values for:\n  "
            + "\n  ".join(problems),
            stacklevel=3,
        )
    if not problems and tree.structure(loaded) == tree.structure(target):
        return tree.unflatten(tree.structure(loaded), values)
    return tree.unflatten(tree.structure(target), values)


def _mismatch(got: Any, want: Any) -> str | None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"a {type(got).__name__} in the checkpoint, a tensor in the target"
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)} in the checkpoint, {tuple(want.shape)} in the target"
        if got.dtype != want.dtype:
            return f"dtype {got.dtype} in the checkpoint, {want.dtype} in the target"
        return None
    if isinstance(got, torch.Tensor):
        return f"a tensor in the checkpoint, a {type(want).__name__} in the target"
    if type(got) is not type(want) and not (
        isinstance(got, (int, float)) and isinstance(want, (int, float))
    ):
        return f"a {type(got).__name__} in the checkpoint, a {type(want).__name__} in the target"
    return None
