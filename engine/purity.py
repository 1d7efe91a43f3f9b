"""The step's purity checks: in-place writes to the input state, and metrics that alias it.

A forward pass must not write the state's parameters (or, in eval and predict, its
buffers) in place: the version counters taken before it tell afterwards
(``modified_in_place``, ``check_unchanged``). ``norm_layer_buffers`` names the buffers
whose kernels update them without moving the counter (BatchNorm statistics), which a train
step therefore always copies. ``unaliased`` copies the metrics that share storage with
parameters a donating update is about to overwrite.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .bind import canonical_names
from .state import TrainState
from .tree import leaves, map

__all__ = [
    "check_unchanged",
    "modified_in_place",
    "norm_layer_buffers",
    "raise_params_modified",
    "unaliased",
]

Tensor = torch.Tensor


def modified_in_place(tensors: Mapping[str, Tensor], versions: list[int]) -> list[str]:
    """The names of ``tensors`` whose version counter moved since ``versions`` was taken
    (``[t._version for t in tensors.values()]``): they were written in place."""
    if [t._version for t in tensors.values()] == versions:
        return []
    return [n for (n, t), v in zip(tensors.items(), versions) if t._version != v]


def raise_params_modified(names: list[str]) -> None:
    raise RuntimeError(
        f"the forward pass modified parameters {names} in place (e.g. weight clipping with "
        "clamp_ under no_grad); that rewrote the input state's parameters, which breaks the "
        "step's purity. Apply such constraints outside the forward pass: to the new state's "
        "params after the step (state.replace(params=...)) or in an optimizer transform"
    )


def check_unchanged(
    params: Mapping[str, Tensor],
    param_versions: list[int],
    buffers: Mapping[str, Tensor],
    buffer_versions: list[int],
    where: str = "eval mode",
) -> None:
    """Raise ``RuntimeError`` if a forward pass that binds the state's tensors uncopied
    (eval, predict, per-sample) wrote parameters or buffers in place. The version counters
    tell after the fact: the input state has changed by then."""
    changed = modified_in_place(params, param_versions)
    if changed:
        raise_params_modified(changed)
    changed = modified_in_place(buffers, buffer_versions)
    if changed:
        raise RuntimeError(
            f"the model modified buffers {changed} in place in {where}, which changed the "
            f"training state; make the forward pass leave buffers alone in {where}"
        )


def norm_layer_buffers(model: nn.Module) -> frozenset[str]:
    """State names of the buffers of BatchNorm/InstanceNorm layers (their kernels update the
    running statistics in place without moving the version counter)."""
    canonical = canonical_names(model)
    return frozenset(
        canonical[f"{prefix}.{name}" if prefix else name]
        for prefix, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, nn.modules.batchnorm._NormBase)
        for name, b in module._buffers.items()
        if b is not None
    )


def _storage(t: Tensor) -> int:
    """Where ``t``'s storage starts (a DTensor's: its local shard's; it has no storage of its
    own to ask)."""
    if type(t) is Tensor or type(t) is nn.Parameter:
        return t.untyped_storage().data_ptr()
    local = getattr(t, "_local_tensor", None)
    return (local if local is not None else t).untyped_storage().data_ptr()


def unaliased(metrics: dict[str, Any], state: TrainState) -> dict[str, Any]:
    """``metrics`` with a copy of every tensor that shares storage with the state's parameters
    (a metric that is a parameter's value, say a learnable temperature): a donating update
    is about to overwrite those, and the step reports the values the forward pass saw. The
    loss function sees the parameters and the batch, never the optimizer state, so only the
    parameters are looked at (a dict: no tree walk over the optimizer state every step).
    Unchanged (the same dict) when nothing is shared, the usual case."""
    values = list(metrics.values())
    if all(type(v) is Tensor for v in values):  # the usual flat dict: no tree walk
        tensors = values
    else:
        tensors = [t for t in leaves(metrics) if isinstance(t, Tensor)]
    if not tensors:
        return metrics
    owned = {_storage(p) for p in state.params.values()}
    if not any(_storage(t) in owned for t in tensors):
        return metrics

    def copy_if_shared(x: Any) -> Any:
        if isinstance(x, Tensor) and _storage(x) in owned:
            return x.clone()
        return x

    return map(copy_if_shared, metrics)
