"""Weights in and out: plain ``state_dict``s that ``nn.Module`` and other tools understand.

``export_state_dict(state, model)`` gives what ``model.load_state_dict`` takes (parameters
and persistent buffers under every name the module uses, tied weights included).
``load_weights(state, source, model)`` puts weights from a plain ``state_dict``, a file
holding one, or a Lightning-style ``.ckpt`` (a dict with a ``"state_dict"`` entry, keys
usually prefixed by the attribute that held the model) into a state, as initial parameters
for fine-tuning. Files are read with ``weights_only=True``; a file that needs arbitrary
objects is refused with advice rather than unpickled.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from engine.state import TrainState

from . import storage
from .codec import CheckpointError

__all__ = ["export_state_dict", "load_weights", "read_state_dict"]


def export_state_dict(state: TrainState, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The state's weights as a ``state_dict`` (with ``model``: its exact keys and order)."""
    tensors = {**state.params, **state.buffers}
    if model is None:
        return dict(tensors)
    canonical: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        canonical.setdefault(id(t), name)
    by_slot = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_slot[name] = canonical[id(t)]
    out = {}
    for key in model.state_dict(keep_vars=True):
        source = by_slot.get(key)
        if source is None or source not in tensors:
            raise KeyError(f"the state has no tensor for {key!r} of the model's state_dict")
        out[key] = tensors[source]
    return out


def read_state_dict(source: Any, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``state_dict`` from a dict, a file holding one, or a Lightning-style checkpoint."""
    if isinstance(source, Mapping):
        data: Any = dict(source)
    else:
        url = str(source)
        with storage.open_read(url, storage_options=storage_options) as f:
            try:
                data = torch.load(f, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(
                    f"refusing to load {url}: it holds Python objects besides tensors (nothing "
                    "from it was run). If you trust the file, extract the weights once: "
                    "torch.save(torch.load(path, weights_only=False)['state_dict'], 'w.pt'). "
                    f"Detail: {str(err).splitlines()[-1][:200]}"
                ) from None
            except (RuntimeError, EOFError, ValueError) as err:
                raise CheckpointError(f"{url} is corrupt or truncated: {err}") from None
    if isinstance(data, Mapping) and isinstance(data.get("state_dict"), Mapping):
        data = dict(data["state_dict"])
    if not isinstance(data, Mapping) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointError("expected a state_dict: a mapping of names to tensors")
    return dict(data)


def _strip_prefix(keys: list[str], wanted: set[str]) -> str:
    """The prefix (e.g. ``"model."``) whose removal makes the most keys match ``wanted``."""
    best, best_hits = "", sum(k in wanted for k in keys)
    prefixes = {k[: i + 1] for k in keys for i, c in enumerate(k) if c == "."}
    for prefix in sorted(prefixes, key=len):
        hits = sum(k[len(prefix) :] in wanted for k in keys if k.startswith(prefix))
        if hits > best_hits:
            best, best_hits = prefix, hits
    return best


def load_weights(
    state: TrainState,
    source: Any,
    model: nn.Module,
    *,
    strict: bool = True,
    prefix: str | None = None,
) -> TrainState:
    """``state`` with parameters and buffers taken from ``source`` (see the module doc).

    ``prefix`` is removed from the source's keys (found automatically when None). With
    ``strict``, missing and unexpected keys and shape mismatches are one error listing them
    all; otherwise matching tensors are taken and the rest keep the state's values. The
    optimizer state is left alone (fresh training from these weights).
    """
    sd = read_state_dict(source)
    names = {**{n: "params" for n in state.params}, **{n: "buffers" for n in state.buffers}}
    slot_names = dict(zip(names, names))
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        canonical = next(
            (n for n, u in [*model.named_parameters(), *model.named_buffers()] if u is t), name
        )
        slot_names.setdefault(name, canonical)
    keys = list(sd)
    cut = _strip_prefix(keys, set(slot_names)) if prefix is None else prefix
    params, buffers = dict(state.params), dict(state.buffers)
    problems, seen = [], set()
    for key in keys:
        name = key[len(cut) :] if cut and key.startswith(cut) else key
        target = slot_names.get(name)
        if target is None:
            problems.append(f"{key}: not in the model")
            continue
        table = params if names.get(target) == "params" else buffers
        current = table[target]
        value = sd[key]
        if value.shape != current.shape:
            problems.append(
                f"{key}: shape {tuple(value.shape)} vs {tuple(current.shape)} in the model"
            )
            continue
        table[target] = value.detach().to(device=current.device, dtype=current.dtype).clone()
        seen.add(target)
    missing = [n for n in names if n not in seen]
    problems += [f"{n}: missing in the source" for n in missing]
    if problems and strict:
        raise CheckpointError(
            f"the weights do not match the model ({len(problems)} differences):\n  "
            + "\n  ".join(problems)
            + "\nPass strict=False to load what matches."
        )
    return state.replace(params=params, buffers=buffers)
