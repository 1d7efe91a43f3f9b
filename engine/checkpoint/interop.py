"""Weights in and out: plain ``state_dict``s that ``nn.Module`` and other tools understand.

``export_state_dict(state, model)`` gives what ``model.load_state_dict`` takes (parameters
and persistent buffers under every name the module uses, tied weights included).
``load_weights(state, source, model)`` puts weights from a plain ``state_dict``, a file
holding one, or a Lightning-style ``.ckpt`` (a dict with a ``"state_dict"`` entry, keys
usually prefixed by the attribute that held the model) into a state, as initial parameters
for fine-tuning. Files are read with ``weights_only=True``; a file that needs arbitrary
objects is refused with advice rather than unpickled, and so is one whose tensors need more
data than their storage holds (a stride-0 ``expand``-ed view; see ``safe_load``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from purestep.engine.bind import canonical_names, export_state_dict  # re-exported
from purestep.engine.state import TrainState

from .codec import CheckpointError
from .safe_load import torch_load

__all__ = ["export_state_dict", "load_weights", "read_state_dict"]


def read_state_dict(source: Any, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``state_dict`` from a dict, a file holding one, or a Lightning-style checkpoint."""
    if isinstance(source, Mapping):
        data: Any = dict(source)
    else:
        data = torch_load(
            str(source),
            storage_options=storage_options,
            advice="If you trust the file, extract its weights once in a trusted session "
            "(load it with weights_only=False and save its ['state_dict'] alone). ",
        )
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
    kinds = {**{n: "params" for n in state.params}, **{n: "buffers" for n in state.buffers}}
    slot_names = {**{n: n for n in kinds}, **canonical_names(model)}
    # What the source must cover: the model's state_dict (persistent tensors only; the
    # state keeps its own values of non-persistent buffers), by canonical name.
    required = {slot_names[k] for k in model.state_dict(keep_vars=True) if k in slot_names}
    keys = list(sd)
    cut = _strip_prefix(keys, set(slot_names)) if prefix is None else prefix
    tables = {"params": dict(state.params), "buffers": dict(state.buffers)}
    problems, seen = [], set()
    for key in keys:
        name = key[len(cut) :] if cut and key.startswith(cut) else key
        target = slot_names.get(name)
        kind = kinds.get(target) if target is not None else None
        if kind is None:
            problems.append(f"{key}: not in the model")
            continue
        table = tables[kind]
        current = table[target]
        value = sd[key]
        if value.shape != current.shape:
            problems.append(
                f"{key}: shape {tuple(value.shape)} vs {tuple(current.shape)} in the model"
            )
            continue
        table[target] = value.detach().to(device=current.device, dtype=current.dtype, copy=True)
        seen.add(target)
    problems += [f"{n}: missing in the source" for n in kinds if n in required and n not in seen]
    if problems and strict:
        raise CheckpointError(
            f"the weights do not match the model ({len(problems)} differences):\n  "
            + "\n  ".join(problems)
            + "\nPass strict=False to load what matches."
        )
    return state.replace(params=tables["params"], buffers=tables["buffers"])
