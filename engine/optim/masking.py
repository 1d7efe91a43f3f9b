"""Apply transforms to some params only: ``masked`` (one transform on a subset, the rest
passed through) and ``partition`` (one transform per label, e.g. torch's param groups).

``masked`` follows optax: the updates of unmasked params pass through unchanged, so it is
meant for a link of a chain (``masked(add_decayed_weights(...), mask)`` before the
optimizer). As the whole optimizer, ``step(masked(adam(), mask), ...)`` adds the raw
gradient to every unmasked param (gradient ascent at learning rate 1), exactly what
``update`` followed by ``apply_updates`` gives; to train some params and freeze the rest,
use ``partition({"train": adam(), "frozen": set_to_zero()}, labels)``.

Masks and labels are a dict ``name -> bool / label`` or a function ``(name, tensor) ->
bool / label``, evaluated on the updates' names (and tensors) at every call, so they stay
out of the state. ``decay_mask`` is the usual "decay weights, not biases and norms" rule.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from purestep.engine.tree import struct

from .base import GradientTransformation, Params, Updates, apply_updates, step

__all__ = ["MaskedState", "PartitionState", "decay_mask", "masked", "partition"]

Tensor = torch.Tensor
Mask = Mapping[str, bool] | Callable[[str, Tensor], bool]
Labels = Mapping[str, Hashable] | Callable[[str, Tensor], Hashable]


def decay_mask(params_or_name: Any, tensor: Tensor | None = None) -> Any:
    """True for tensors with ``ndim >= 2`` (weight matrices, conv kernels), False otherwise
    (biases, norm scales, scalars).

    ``decay_mask(params)`` gives the dict ``name -> bool``; ``decay_mask(name, tensor)`` the
    single answer, so ``decay_mask`` itself can be passed as a ``mask``.
    """
    if tensor is None:
        if not isinstance(params_or_name, Mapping):
            raise TypeError("decay_mask takes a params dict, or (name, tensor)")
        return {n: t.ndim >= 2 for n, t in params_or_name.items()}
    return tensor.ndim >= 2


def _resolve(spec: Any, tensors: Mapping[str, Tensor], what: str) -> dict[str, Any]:
    """``name -> value`` of a mask / labels spec over ``tensors``' names."""
    if isinstance(spec, Mapping):
        missing = [n for n in tensors if n not in spec]
        if missing:
            raise KeyError(f"{what} has no entry for {missing[:5]} (it must cover every param)")
        return {n: spec[n] for n in tensors}
    return {n: spec(n, t) for n, t in tensors.items()}


def _check_spec(spec: Any, what: str) -> None:
    if not (isinstance(spec, Mapping) or callable(spec)):
        raise TypeError(
            f"{what} must be a dict name -> value or a function (name, tensor) -> value, "
            f"got {type(spec).__name__}"
        )


@struct
class MaskedState:
    """The inner transform's state, over the masked params only."""

    inner_state: Any


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply ``inner`` where ``mask`` is true; other updates pass through unchanged.

    In ``apply`` (the fused ``step``) that means unmasked params become ``param + grad``,
    as ``update`` then ``apply_updates`` would make them (optax's semantics). To freeze
    the unmasked params instead, use ``partition(..., set_to_zero())`` (see module doc).
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked() needs a GradientTransformation, got {type(inner).__name__}")
    _check_spec(mask, "mask")

    def selected(tensors: Mapping[str, Tensor]) -> list[str]:
        return [n for n, keep in _resolve(mask, tensors, "mask").items() if keep]

    def init(params: Params) -> MaskedState:
        return MaskedState(inner.init({n: params[n] for n in selected(params)}))

    def update(updates: Updates, state: MaskedState, params: Params | None = None) -> tuple:
        names = selected(updates)
        sub = {n: updates[n] for n in names}
        sub_params = None if params is None else {n: params[n] for n in names}
        new_sub, inner_state = inner.update(sub, state.inner_state, sub_params)
        out = dict(updates)
        out.update(new_sub)
        return out, MaskedState(inner_state)

    def apply(grads: Updates, state: MaskedState, params: Params) -> tuple:
        names = selected(grads)
        chosen = set(names)
        sub = {n: grads[n] for n in names}
        new_sub, inner_state = step(inner, sub, state.inner_state, {n: params[n] for n in names})
        rest = {n: g for n, g in grads.items() if n not in chosen}
        out = apply_updates({n: params[n] for n in rest}, rest) if rest else {}
        new = dict(params)
        new.update(new_sub)
        new.update(out)
        return new, MaskedState(inner_state)

    return GradientTransformation(init, update, apply)


@struct
class PartitionState:
    """``label -> state`` of that label's transform (over that label's params)."""

    inner_states: dict[Any, Any]


def partition(
    transforms: Mapping[Hashable, GradientTransformation], labels: Labels
) -> GradientTransformation:
    """Apply ``transforms[label]`` to the params labelled ``label`` (like param groups).

    Every param needs a label that ``transforms`` has; use ``set_to_zero()`` to freeze a
    group. A transform whose group is empty in a call is not called.
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError("partition() needs a non-empty dict label -> GradientTransformation")
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"partition(): transforms[{label!r}] is a {type(tx).__name__}, "
                "not a GradientTransformation"
            )
    _check_spec(labels, "labels")
    transforms = dict(transforms)

    def split(tensors: Mapping[str, Tensor]) -> dict[Any, list[str]]:
        groups: dict[Any, list[str]] = {label: [] for label in transforms}
        for name, label in _resolve(labels, tensors, "labels").items():
            try:
                groups[label].append(name)
            except (KeyError, TypeError):
                raise KeyError(
                    f"param {name!r} has label {label!r}, which is not one of the transforms' "
                    f"labels {list(transforms)}"
                ) from None
        return groups

    def init(params: Params) -> PartitionState:
        groups = split(params)
        return PartitionState(
            {
                label: tx.init({n: params[n] for n in groups[label]})
                for label, tx in transforms.items()
            }
        )

    def update(updates: Updates, state: PartitionState, params: Params | None = None) -> tuple:
        groups = split(updates)
        new_states = dict(state.inner_states)
        new: dict[str, Tensor] = {}
        for label, names in groups.items():
            if not names:
                continue
            sub = {n: updates[n] for n in names}
            sub_params = None if params is None else {n: params[n] for n in names}
            out, new_states[label] = transforms[label].update(
                sub, state.inner_states[label], sub_params
            )
            new.update(out)
        return {n: new[n] for n in updates}, PartitionState(new_states)

    def apply(grads: Updates, state: PartitionState, params: Params) -> tuple:
        groups = split(grads)
        new_states = dict(state.inner_states)
        new = dict(params)
        for label, names in groups.items():
            if not names:
                continue
            sub = {n: grads[n] for n in names}
            out, new_states[label] = step(
                transforms[label], sub, state.inner_states[label], {n: params[n] for n in names}
            )
            new.update(out)
        return new, PartitionState(new_states)

    return GradientTransformation(init, update, apply)
