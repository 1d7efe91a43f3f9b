"""Save a whole ``TrainState`` with metadata, and load it back safely.

A checkpoint file is ``torch.save`` of a dict of plain data: ``format`` (the magic string
``"purestep-checkpoint"``), ``version``, ``record``, ``metadata`` (library versions, the loop
config, and whatever the caller adds) and ``state`` (the encoded state, see ``codec``). It is
written atomically (``storage``) and read with ``torch.load(weights_only=True)``, so loading
never runs code from the file. ``record`` is a small JSON record of the state's progress,
stored as the payload's first tensor, so it is the archive entry ``data/0``: ``read_record``
reads it from the zip without unpickling anything, for discovery to rank files by (files
written before records have none; ``read_record`` returns None for them). Errors name the
file: a pickle payload is refused, a corrupt, truncated or special file (FIFO, directory)
is reported as such, a foreign file (e.g. a Lightning ``.ckpt``) is told apart.
``load(url, target=state)`` checks the file against a target and lists every mismatch
(``matching``); ``strict=False`` takes what matches and keeps the target's values for the rest.
``load_payload`` does the same for a payload already read, so a file is read only once.

``load_module(url, template)`` is the trained ``nn.Module`` of a checkpoint (full or
weights-only): the template with the file's parameters and buffers (``engine.to_module``),
on the template's devices unless ``map_location`` says otherwise. ``check_plain`` is the
rule for data that hooks add to a checkpoint (``loops``: a Task's ``on_save_checkpoint``,
a DataModule's ``state_dict``, hyper-parameters): tensors, numbers, strings, ``None``,
dtypes, devices and dicts/lists/tuples of them, no ``@struct`` objects, both when it is
written and when it is read back, within ``codec``'s budget of values and string bytes.
What a file may make ``read`` and ``load`` build is bounded before anything is built: see
``safe_load`` (the pickle's expansion, tensor layouts) and ``codec`` (the decoded size).
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from purestep.engine.bind import canonical_names
from purestep.engine.state import Progress, TrainState

from . import storage
from .codec import MAX_DEPTH, Budget, CheckpointError, _at, _label, decode, encode
from .matching import conform, fit_to
from .safe_load import corrupt, open_archive, read_entry, torch_load

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "check_plain",
    "conform",
    "load",
    "load_module",
    "load_metadata",
    "load_payload",
    "read",
    "read_record",
    "save",
    "versions",
]

FORMAT = "purestep-checkpoint"
FORMAT_VERSION = 1
_RECORD_MAGIC = b"purestep-record\n"
_RECORD_MAX_BYTES = 64 * 1024
_PROGRESS_FIELDS = ("epoch", "step", "batch_in_epoch", "total_batches")


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
        "record": _record_tensor(state),  # the first tensor: the archive entry data/0
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


def _record_tensor(state: Any) -> torch.Tensor:
    """The record of ``state`` (its progress, if it has one) as a uint8 tensor."""
    progress = getattr(state, "progress", None)
    try:
        counters = {f: int(getattr(progress, f)) for f in _PROGRESS_FIELDS}
    except (AttributeError, TypeError, ValueError):
        counters = None
    record = {"format": FORMAT, "version": FORMAT_VERSION, "progress": counters}
    data = _RECORD_MAGIC + json.dumps(record, sort_keys=True).encode()
    return torch.tensor(list(data), dtype=torch.uint8)


def read_record(
    url: str, *, commit: str = "auto", storage_options: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The small record of a checkpoint (``{"progress": {"epoch", "step", "batch_in_epoch",
    "total_batches"} or None, ...}``), read from the zip without unpickling anything; None
    for a file without one (written before records). The file is checked as ``load``
    checks it first (a regular file, a zip ``torch.save`` could have written; only the
    record's checksum is verified, so just the zip directory and the record are read), so a
    file refused here would not load either."""
    opened = open_archive(url, commit=commit, storage_options=storage_options, verify=False)
    with opened as (f, archive):
        names = [i.filename for i in archive.infolist()]
        prefix = next(n for n in names if n.rsplit("/", 1)[-1] == "data.pkl")[: -len("data.pkl")]
        try:
            info = archive.getinfo(prefix + "data/0")
        except KeyError:
            return None
        if info.file_size > _RECORD_MAX_BYTES:
            return None
        data = read_entry(f, info, url)
    return _parse_record(data, url)


def payload_record(payload: dict[str, Any], url: str = "") -> dict[str, Any] | None:
    """The record a loaded payload carries (as ``read_record`` reads it), or None."""
    tensor = payload.get("record")
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        return None
    return _parse_record(tensor.numpy().tobytes(), url)


def matches_record(state: Any, record: dict[str, Any] | None) -> bool:
    """Whether the progress a record states is the decoded state's own (a record that lies
    about it must not win the ranking); True when either has no progress."""
    progress = getattr(state, "progress", None)
    stated = (record or {}).get("progress")
    if stated is None or progress is None:
        return True
    return all(getattr(progress, f, None) == v for f, v in stated.items())


def _parse_record(data: bytes, url: str) -> dict[str, Any] | None:
    if not data.startswith(_RECORD_MAGIC):
        return None
    try:
        record = json.loads(data[len(_RECORD_MAGIC) :])
        progress = record["progress"]
        if progress is not None:
            progress = {f: progress[f] for f in _PROGRESS_FIELDS}
            if not all(type(v) is int for v in progress.values()):
                raise ValueError("progress counters are not integers")
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise corrupt(url, f"its record does not decode ({err})") from None
    return {**record, "progress": progress}


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
    payload = torch_load(
        url, map_location=map_location, commit=commit, storage_options=storage_options
    )
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        keys = _some_keys(payload) if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{url} is not a purestep checkpoint (found {keys}); to start from another "
            "framework's weights use engine.checkpoint.load_weights"
        )
    if type(payload.get("version", 0)) is not int:
        raise CheckpointError(f"{url}: malformed checkpoint: its version is not an integer")
    if payload.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{url} has checkpoint format {payload['version']}, newer than this version "
            f"reads ({FORMAT_VERSION}); upgrade purestep"
        )
    return payload


def _some_keys(payload: dict[Any, Any]) -> list[str]:
    """Up to 8 of a foreign payload's keys for a message: strings cut to 40 characters,
    non-string keys by their type (``str`` of a crafted key made of shared tuples would
    not finish)."""
    shown = []
    for key in payload:
        if isinstance(key, str):
            shown.append(key if len(key) <= 40 else f"{key[:40]}...")
        else:
            shown.append(str(key) if isinstance(key, (int, float)) else type(key).__name__)
        if len(shown) == 8:
            break
    return sorted(shown)


def load_metadata(url: str, **kwargs: Any) -> dict[str, Any]:
    """The metadata of a checkpoint (library versions, config, ...)."""
    return _decode_entry(read(url, **kwargs), "metadata", url)


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

    With a ``target`` the file is checked against it and its tensors land on the target's
    devices; every difference is listed in one error. For a ``TrainState`` target (e.g. a
    fresh ``engine.init(...)``) only what the model and optimizer decide is checked (params,
    buffers, opt_state, precision, and the accumulated gradients against the params); the
    run's position (progress, key, callbacks, extra, the accumulation window) comes from the
    file. ``strict=False`` takes what matches and keeps the target's values for the rest (a
    warning lists them); if the model came back only partly, an open accumulation window is
    dropped with it (see ``matching``). Any other target is matched as a whole.
    """
    payload = read(url, map_location=map_location, commit=commit, storage_options=storage_options)
    return _unpack(payload, url=url, target=target, strict=strict)


def load_payload(
    payload: dict[str, Any], *, url: str, target: Any = None, strict: bool = True
) -> tuple[Any, dict[str, Any]]:
    """``load`` of a payload already read (``read``, ``read_latest``); ``url`` names it in
    errors. Lets a caller validate a file and restore from it with one read."""
    return _unpack(payload, url=url, target=target, strict=strict)


def _unpack(
    payload: dict[str, Any], *, url: str, target: Any, strict: bool
) -> tuple[Any, dict[str, Any]]:
    state = _decode_entry(payload, "state", url)
    metadata = _decode_entry(payload, "metadata", url)
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{url}: malformed checkpoint: its metadata is not a dict")
    if target is not None:
        state = fit_to(state, target, strict=strict, url=url, stacklevel=4)
    return state, metadata


def _decode_entry(payload: dict[str, Any], entry: str, url: str) -> Any:
    """``payload[entry]`` decoded; a malformed one is a ``CheckpointError`` naming the file."""
    if entry not in payload:
        raise CheckpointError(f"{url}: malformed checkpoint: it has no {entry!r} entry")
    root = "metadata" if entry == "metadata" else ""
    try:
        return decode(payload[entry], root)
    except CheckpointError as err:
        raise CheckpointError(f"{url}: {err}") from None


_PLAIN_LEAVES = (bool, int, float, str, torch.dtype, torch.device)


def check_plain(value: Any, what: str, *, url: str | None = None) -> Any:
    """``value`` if it is plain data (see the module doc), else a ``CheckpointError``
    naming the offending node under ``what`` (and the file, for data read from ``url``).
    Structs are refused although the codec could carry them: decoding a file rebuilds
    registered purestep ``@struct`` classes (and nothing else), so check_plain refuses
    them afterwards, and hook data that reaches a hook is plain, whatever a crafted file
    says. The walk counts against a ``codec.Budget`` (every use of a shared value counted
    again), so data that would expand past what a checkpoint may hold is refused before
    it is walked further."""
    budget = Budget("decode" if url is not None else "encode")
    try:
        _check_plain(value, what, 0, url, budget)
    except CheckpointError as err:
        if url is not None and not str(err).startswith(url):
            raise CheckpointError(f"{url}: {err}") from None
        raise
    return value


def _check_plain(value: Any, path: str, depth: int, url: str | None, budget: Budget) -> None:
    budget.spend(len(value) if type(value) is str else 0, path)
    if value is None or isinstance(value, (torch.Tensor, *_PLAIN_LEAVES)):
        return
    plain_tuple = isinstance(value, tuple) and not hasattr(value, "_fields")
    if isinstance(value, (dict, list)) or plain_tuple:
        if depth >= MAX_DEPTH:
            raise CheckpointError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise CheckpointError(
                        f"{path}: the dict key {repr(k)[:100]} is not a str or a number"
                    )
                budget.text -= len(k) if isinstance(k, str) else 0
                _check_plain(v, _at(path, f"[{_label(k)}]"), depth + 1, url, budget)
        else:
            for i, v in enumerate(value):
                _check_plain(v, _at(path, f"[{i}]"), depth + 1, url, budget)
        return
    kind = type(value).__name__
    plain = "plain data (tensors, numbers, strings, None and dicts/lists/tuples of them)"
    if url is not None:
        raise CheckpointError(f"{url}: {path} holds a {kind}, not {plain}")
    raise CheckpointError(f"cannot save {path}: a {kind} is not {plain}")


def load_module(
    url: str,
    template: nn.Module,
    *,
    map_location: Any = None,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> nn.Module:
    """The trained module of the checkpoint at ``url``: a copy of ``template`` (the module
    the run was built from; it is not changed) holding the file's parameters and buffers,
    as ``engine.to_module(state, template)`` makes it. Works for full and weights-only
    checkpoints. Keys and shapes must match the template exactly (one ``CheckpointError``
    naming the file says what differs). ``map_location`` (as for ``torch.load``) places the
    tensors; by default each lands on its template tensor's device (a meta-device template:
    on the CPU)."""
    location = "cpu" if map_location is None else map_location
    payload = read(url, map_location=location, commit=commit, storage_options=storage_options)
    state, _ = load_payload(payload, url=url)
    return module_from(state, template, url=url, to_template=map_location is None)


def module_from(loaded: Any, template: nn.Module, *, url: str, to_template: bool) -> nn.Module:
    """``load_module`` of a state already decoded (a ``TrainState`` or a weights-only
    payload); ``to_template``: move each tensor to its template tensor's device first."""
    from purestep.engine.export import to_module  # at call time: the command line's start-up

    if isinstance(loaded, TrainState):
        state = loaded
    elif (
        isinstance(loaded, dict)
        and loaded.get("weights_only") is True
        and isinstance(loaded.get("params"), dict)
        and isinstance(loaded.get("buffers"), dict)
    ):
        state = TrainState(loaded["params"], loaded["buffers"], None, Progress(), 0)
    else:
        raise CheckpointError(
            f"{url} holds a {type(loaded).__name__}, not a training state or weights"
        )
    if not isinstance(template, nn.Module):
        raise TypeError(f"expected the nn.Module template, got {type(template).__name__}")
    if to_template:
        devices = {}
        slots = dict(template.named_parameters(remove_duplicate=False))
        slots.update(template.named_buffers(remove_duplicate=False))
        for slot, canon in canonical_names(template).items():
            if not slots[slot].is_meta:
                devices[canon] = slots[slot].device

        def place(table: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                k: v.to(devices[k]) if k in devices and isinstance(v, torch.Tensor) else v
                for k, v in table.items()
            }

        state = state.replace(params=place(state.params), buffers=place(state.buffers))
    try:
        return to_module(state, template)
    except (KeyError, ValueError) as err:
        detail = err.args[0] if err.args else str(err)
        raise CheckpointError(
            f"{url}: its weights do not fit the module: {str(detail).removeprefix('to_module: ')}"
        ) from None
