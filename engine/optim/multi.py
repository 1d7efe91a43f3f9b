"""Several named optimizers in one optimizer state, and changing injected hyper-parameters.

A training state that several optimizers update (a GAN's generator and discriminator, each
over its own parameters) keeps them in one ``MultiOptState``: ``states`` maps each
optimizer's name to its own state (its moments, its schedule's count, its injected
hyper-parameters), ``steps`` to the number of updates it has made. Everything a resumed run
needs is there, so the state checkpoints and resumes like a single optimizer's.

``set_hyperparams(opt_state, {"lr": 0.05})`` is the pure way to change a hyper-parameter that
``inject_hyperparams`` keeps in the state: it returns a new optimizer state whose injected
``lr`` is 0.05 (the input is not modified). ``"gen/lr"`` changes the optimizer named ``gen``
only; a bare name changes every injected optimizer that has it. Metric-driven schedules
(``ReduceLROnPlateau``, a callback's own rule) request such changes and the loop's driver
carries them out between steps (``loops.events.Requests.hyperparams``). A hyper-parameter
given to ``inject_hyperparams`` as a schedule is recomputed at every step, so a value
written for it lasts until the next update only: change hyper-parameters injected as floats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from purestep.engine.tree import struct

from .hyperparams import InjectHyperparamsState

__all__ = [
    "MultiOptState",
    "find_injected",
    "injected_values",
    "set_hyperparams",
]


@struct
class MultiOptState:
    """``states``: optimizer name -> that optimizer's state (in configuration order);
    ``steps``: optimizer name -> the updates it has made."""

    states: dict[str, Any]
    steps: dict[str, int]


def find_injected(opt_state: Any) -> list[InjectHyperparamsState]:
    """Every ``InjectHyperparamsState`` in ``opt_state``, in tree order."""
    found: list[InjectHyperparamsState] = []
    _walk(opt_state, found)
    return found


def _walk(node: Any, found: list) -> None:
    if isinstance(node, torch.Tensor):
        return
    if isinstance(node, InjectHyperparamsState):
        found.append(node)
        _walk(node.inner_state, found)
    elif isinstance(node, (tuple, list)):
        for child in node:
            _walk(child, found)
    elif isinstance(node, Mapping):
        for child in node.values():
            _walk(child, found)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            _walk(getattr(node, f.name), found)


def injected_values(opt_state: Any, name: str) -> list[float]:
    """The values of the injected hyper-parameter ``name`` in ``opt_state`` (one per injected
    optimizer that has it, in tree order: one per parameter group of a ``partition``)."""
    return [float(s.hyperparams[name]) for s in find_injected(opt_state) if name in s.hyperparams]


def _split_key(key: str, names: Any) -> tuple[str | None, str]:
    if "/" in key:
        optimizer, _, hp = key.rpartition("/")
        if names is None:
            raise KeyError(
                f"hyper-parameter {key!r} names optimizer {optimizer!r}, but the state holds "
                f"one optimizer: use the bare name ({hp!r})"
            )
        if optimizer not in names:
            raise KeyError(
                f"hyper-parameter {key!r}: no optimizer named {optimizer!r} (there are "
                f"{list(names)})"
            )
        return optimizer, hp
    return None, key


def set_hyperparams(opt_state: Any, changes: Mapping[str, Any]) -> Any:
    """``opt_state`` with injected hyper-parameters replaced (see the module doc).

    ``changes``: ``{"lr": value}`` or ``{"<optimizer>/lr": value}``; a value is a float (one
    for every parameter group) or a sequence of floats, one per injected optimizer that has
    the hyper-parameter (``partition`` groups, in tree order). A name no injected optimizer
    has is a ``KeyError``; a wrong number of values a ``ValueError``.
    """
    if not changes:
        return opt_state
    names = list(opt_state.states) if isinstance(opt_state, MultiOptState) else None
    for key, value in changes.items():
        optimizer, hp = _split_key(key, names)
        if optimizer is None:
            opt_state = _set_in(opt_state, hp, value, key)
        else:
            inner = _set_in(opt_state.states[optimizer], hp, value, key)
            opt_state = opt_state.replace(states={**opt_state.states, optimizer: inner})
    return opt_state


def _set_in(tree: Any, hp: str, value: Any, key: str) -> Any:
    count = sum(hp in s.hyperparams for s in find_injected(tree))
    if count == 0:
        raise KeyError(
            f"no injected hyper-parameter {hp!r} in the optimizer state ({key!r}); build the "
            f"optimizer with engine.optim.inject_hyperparams(...)({hp}=...) to make it settable"
        )
    if isinstance(value, (tuple, list)):
        values = [float(v) for v in value]
        if len(values) != count:
            raise ValueError(
                f"{key!r}: {len(values)} values given for {count} injected optimizer(s)"
            )
    else:
        values = [float(value)] * count
    position = iter(values)

    def rebuild(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return node
        if isinstance(node, InjectHyperparamsState):
            inner = rebuild(node.inner_state)
            hyper = node.hyperparams
            if hp in hyper:
                current = hyper[hp]
                if isinstance(current, tuple):
                    raise ValueError(f"{key!r}: the injected {hp!r} is a tuple; set a float one")
                hyper = {**hyper, hp: torch.tensor(next(position), dtype=torch.float64)}
            if hyper is node.hyperparams and inner is node.inner_state:
                return node
            return node.replace(hyperparams=hyper, inner_state=inner)
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(rebuild(c) for c in node)
        if isinstance(node, list):
            return [rebuild(c) for c in node]
        if isinstance(node, dict):
            return {k: rebuild(v) for k, v in node.items()}
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {}
            for f in dataclasses.fields(node):
                old = getattr(node, f.name)
                new = rebuild(old)
                if new is not old:
                    changes[f.name] = new
            return dataclasses.replace(node, **changes) if changes else node
        return node

    return rebuild(tree)
