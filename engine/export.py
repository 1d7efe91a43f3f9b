"""From a ``TrainState`` back to an ordinary ``nn.Module``: ``to_module(state, net)``.

The module given to ``engine.init``, the steps and ``Trainer.fit`` is only a template and is
never changed by training; the trained weights are in the state. ``to_module`` makes a
trained module out of the two: a deep copy of the template holding copies of the state's
parameters and buffers (with their dtype and device: a meta-device template comes back on
the state's device), tied weights still tied, the template untouched. ``inplace=True``
loads the state into the given module instead, as ``module.load_state_dict`` would.
``engine.checkpoint.load_module(path, template)`` does the same from a checkpoint file.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .bind import canonical_names, export_state_dict
from .state import TrainState

__all__ = ["export_state_dict", "to_module"]

#: Where an ensemble state keeps its member keys in ``state.extra`` (``hardware.members``;
#: the engine does not import ``hardware``).
_ENSEMBLE_KEY = "ensemble"


def _slot_values(state: TrainState, model: nn.Module) -> dict[str, torch.Tensor]:
    """``slot name -> the state's tensor`` for every parameter and buffer slot of ``model``
    (tied slots map to one tensor), checked against the template's shapes."""
    if not isinstance(state, TrainState):
        raise TypeError(f"to_module: expected a TrainState, got {type(state).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_module: expected the nn.Module template, got {type(model).__name__}")
    if _ENSEMBLE_KEY in state.extra:
        raise ValueError(
            "to_module: this is an ensemble state (every tensor has a leading member axis); "
            "pick a member first: to_module(hardware.member(state, i), net)"
        )
    values = export_state_dict(state, model)  # the state_dict's slots (persistent ones)
    tensors = {**state.params, **state.buffers}
    slots = canonical_names(model)
    for slot, canon in slots.items():  # non-persistent buffers: in the state, not a state_dict
        if slot not in values:
            if canon not in tensors:
                raise KeyError(f"to_module: the state has no tensor for {slot!r} of the module")
            values[slot] = tensors[canon]
    unused = sorted(set(tensors) - set(slots.values()))
    if unused:
        raise KeyError(
            f"to_module: the state has tensors the module has no slot for: {unused}; is this "
            "the template the state was made from?"
        )
    template = dict(model.named_parameters(remove_duplicate=False))
    template.update(model.named_buffers(remove_duplicate=False))
    wrong = [
        f"{slot}: state {tuple(values[slot].shape)}, module {tuple(t.shape)}"
        for slot, t in template.items()
        if slot in values and values[slot].shape != t.shape
    ]
    if wrong:
        raise ValueError(
            "to_module: shapes differ between the state and the module: " + "; ".join(wrong)
        )
    return values


def _owner(model: nn.Module, slot: str) -> tuple[nn.Module, str]:
    path, _, attr = slot.rpartition(".")
    return model.get_submodule(path), attr


def to_module(state: TrainState, model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """A trained ``nn.Module``: ``model`` (the template) with ``state``'s weights.

    By default returns a deep copy of ``model`` whose parameters and buffers are copies of
    the state's (same dtype and device; ``requires_grad`` and the train/eval mode as in the
    template; tied weights stay one tensor), and ``model`` is left as it was; its forward
    pass computes what the engine's steps compute with the state bound. A template on the
    meta device works (the copy gets the state's tensors). ``inplace=True`` copies the
    state's values into ``model``'s own tensors (like ``model.load_state_dict``: the
    module keeps its tensor objects, dtypes and devices) and returns ``model``.

    An ensemble state has one set of weights per member: pick one with
    ``hardware.member(state, i)``. Precision is the strategy's, not the module's: under a
    ``"*-true"`` precision the weights come back in that dtype and inputs must be cast to it
    (the steps cast them), and under ``"*-mixed"`` run the module in ``torch.autocast`` to
    compute what the steps compute.
    """
    values = _slot_values(state, model)
    if inplace:
        meta = [slot for slot, t in _slot_tensors(model) if t.is_meta]
        if meta:
            raise ValueError(
                f"to_module(inplace=True): {meta} are on the meta device and have no storage "
                "to load into; use to_module(state, net) for a materialised copy"
            )
        with torch.no_grad():
            for slot, target in _slot_tensors(model):
                target.copy_(values[slot])
        return model
    # The template's own tensors are shared by the deep copy, not copied (every slot gets
    # the state's tensor below), so a large model is not held twice on its device.
    memo = {id(t): t for _, t in _slot_tensors(model)}
    clone = copy.deepcopy(model, memo)
    made: dict[int, torch.Tensor] = {}  # one new tensor per state tensor: ties stay tied
    for slot, old in list(_slot_tensors(clone)):
        source = values[slot]
        new = made.get(id(source))
        if new is None:
            new = source.detach().clone()
            if isinstance(old, nn.Parameter):
                new = nn.Parameter(new, requires_grad=old.requires_grad)
            made[id(source)] = new
        owner, attr = _owner(clone, slot)
        table = owner._parameters if isinstance(old, nn.Parameter) else owner._buffers
        table[attr] = new
    return clone


def _slot_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer slot of ``model`` with its tensor (tied ones repeated)."""
    out = list(model.named_parameters(remove_duplicate=False))
    out += list(model.named_buffers(remove_duplicate=False))
    return out
