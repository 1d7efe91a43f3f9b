"""Ensemble states: K training states stacked along a new leading axis, and one taken out.

An ensemble state is an ordinary ``TrainState`` whose parameters, buffers, optimizer state,
gradient accumulator and precision state have every tensor stacked along a new axis 0 (the
member axis, of size K). Counters and other plain values (``progress``, optimizer step
counts, ...) are shared: all members must agree on them. ``state.rng`` is the ensemble's own
key (the step's randomness is drawn from it, for all members at once); each member's own key
is kept in ``state.extra["ensemble"]`` (an ``EnsembleInfo``), so that ``member(state, i)``
gives back an ordinary state that plain engine steps, checkpoints and
``engine.checkpoint.export_state_dict`` accept, and ``stack`` undoes ``member`` exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from purestep.engine import rng, tree
from purestep.engine.state import TrainState
from purestep.engine.tree import NAMESPACE, struct

__all__ = ["EXTRA_KEY", "STACKED_FIELDS", "EnsembleInfo", "is_ensemble", "member", "size", "stack"]

#: The ``TrainState`` fields whose tensors carry the member axis.
STACKED_FIELDS = ("params", "buffers", "opt_state", "grad_accum", "precision")
#: Where an ensemble state keeps its ``EnsembleInfo`` in ``state.extra``.
EXTRA_KEY = "ensemble"


@struct
class EnsembleInfo:
    """``keys``: the random key of each member (``member(state, i).rng``), one per member."""

    keys: tuple[int, ...]


def is_ensemble(state: Any) -> bool:
    """Whether ``state`` is an ensemble state (a stacked ``TrainState``)."""
    return isinstance(state, TrainState) and isinstance(state.extra.get(EXTRA_KEY), EnsembleInfo)


def _info(state: Any) -> EnsembleInfo:
    if not is_ensemble(state):
        raise TypeError(
            "expected an ensemble state (built by hardware.ensemble(k).build_state, "
            f"engine.init(..., strategy=ensemble) or hardware.stack), got {type(state).__name__}"
            + (" without ensemble info in extra" if isinstance(state, TrainState) else "")
        )
    return state.extra[EXTRA_KEY]


def size(state: TrainState) -> int:
    """The number of members K of an ensemble state."""
    return len(_info(state).keys)


def member(state: TrainState, i: int) -> TrainState:
    """Member ``i`` of an ensemble state as an ordinary ``TrainState`` (tensors copied).

    Its tensors are copies, not views of the stacked ones, so saving it writes one member's
    worth of data; its key is the member's key; ``callbacks``, ``loop`` and the rest of
    ``extra`` are the ensemble's (shared).
    """
    info = _info(state)
    k = len(info.keys)
    if isinstance(i, bool) or not isinstance(i, int):
        raise TypeError(f"member index must be an int, got {type(i).__name__}")
    if not -k <= i < k:
        raise IndexError(f"member index {i} is out of range for an ensemble of {k}")
    i %= k

    def pick(x: Any) -> Any:
        return x[i].clone() if isinstance(x, torch.Tensor) else x

    changes = {f: tree.map(pick, getattr(state, f)) for f in STACKED_FIELDS}
    extra = {n: v for n, v in state.extra.items() if n != EXTRA_KEY}
    return state.replace(**changes, rng=info.keys[i], extra=extra)


def _stack_field(values: list[Any], field: str) -> Any:
    """The member trees of one field stacked leaf by leaf (shared leaves must agree)."""
    first = values[0]
    spec = optree.tree_structure(first, namespace=NAMESPACE)
    for i, v in enumerate(values[1:], 1):
        other = optree.tree_structure(v, namespace=NAMESPACE)
        if other != spec:
            raise ValueError(
                f"member {i}'s {field} has another structure than member 0's: {other} vs {spec}"
            )
    paths = [p for p, _ in tree.flatten_with_paths(first)]
    columns = zip(*(optree.tree_leaves(v, namespace=NAMESPACE) for v in values))
    out = []
    for path, column in zip(paths, columns):
        head = column[0]
        where = f"{field}{path}"
        if isinstance(head, torch.Tensor):
            for i, t in enumerate(column):
                if not isinstance(t, torch.Tensor) or t.shape != head.shape:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(
                        f"cannot stack {where}: member {i} has {got}, member 0 {tuple(head.shape)}"
                    )
            out.append(torch.stack([t.detach() for t in column]))
        else:
            if any(type(x) is not type(head) or x != head for x in column):
                raise ValueError(
                    f"members disagree on {where} ({list(column)}): an ensemble shares its "
                    "counters and other non-tensor values"
                )
            out.append(head)
    return optree.tree_unflatten(spec, out)


def stack(states: Sequence[TrainState], *, key: int | None = None) -> TrainState:
    """An ensemble state from member states (the inverse of ``member``).

    Every tensor of ``STACKED_FIELDS`` is stacked along a new axis 0; the members must have
    the same structure and shapes and equal counters (``progress``, optimizer counts).
    ``callbacks``, ``loop`` and ``extra`` are taken from the first member. ``key`` is the ensemble's
    own key (default: derived from the first member's key and K); the members' keys are
    kept, so ``member(stack(states), i)`` equals ``states[i]``.
    """
    states = list(states)
    if not states:
        raise ValueError("stack() needs at least one state")
    for i, s in enumerate(states):
        if not isinstance(s, TrainState):
            raise TypeError(f"stack() takes TrainStates; item {i} is a {type(s).__name__}")
        if is_ensemble(s):
            raise ValueError(f"item {i} is already an ensemble state; take members out first")
    first = states[0]
    for i, s in enumerate(states[1:], 1):
        if not tree.trees_equal(s.progress, first.progress):
            raise ValueError(
                f"members disagree on progress: member {i} has {s.progress}, member 0 "
                f"{first.progress}; an ensemble's members share their counters"
            )
    stacked = {f: _stack_field([getattr(s, f) for s in states], f) for f in STACKED_FIELDS}
    keys = tuple(int(s.rng) for s in states)
    if key is None:
        key = rng.fold_in(first.rng, "ensemble", len(states))
    extra = {**first.extra, EXTRA_KEY: EnsembleInfo(keys)}
    return first.replace(**stacked, rng=key, extra=extra)
