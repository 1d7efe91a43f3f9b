"""An already-built torch optimizer as a ``from_torch`` transform (for the pair of it and the
torch LR scheduler built on it, as Lightning users return them from configure_optimizers).

``from_instance(opt, named_params)`` reads each param group's constructor arguments (its
current values: a scheduler's constructor may have set the lr of its step 0, or a cycled
momentum, and training starts from those, as torch's own pair does) and gives
``from_torch(type(opt), ...)`` with them, one ``param_groups`` entry per group when there
are several. What LR schedulers add to a group (``initial_lr``, ``max_lr``, ...) is no
argument and is left out; the scheduler's translation (``torch_schedules``) reads it. The
groups name their params by the module's names: ``named_params`` (the module's
``named_parameters()``) maps the instance's tensors to them, by identity; without it the
groups' own ``param_names`` (torch's, for an optimizer built on named parameters) do.

Momentum cycling (``CyclicLR``, ``OneCycleLR``) writes ``momentum``, or ``betas[0]`` of
Adam-like optimizers. A ``betas`` tuple cannot be set entry by entry through
``set_hyperparams``, so with ``momentum_alias=True`` (``beta1_as_momentum(tx)``) the state
also holds a scalar ``momentum`` (``torch_schedules.MOMENTUM_NAMES``) that each step uses
as ``betas[0]``; the state's ``betas`` then holds the value the latest step used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from ._torch_setup import _qualname, group_arguments
from .base import GradientTransformation, Params, Updates, step
from .from_torch import from_torch
from .hyperparams import InjectHyperparamsState
from .multi import find_injected
from .torch_schedules import MOMENTUM_NAMES

__all__ = ["beta1_as_momentum", "from_instance"]

Tensor = torch.Tensor
#: The module's parameters by name: ``named_parameters()`` as a dict or as its pairs.
Named = Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
_ALIAS = MOMENTUM_NAMES["betas"]


def _arguments(opt: Optimizer, i: int, group: Mapping[str, Any], what: str) -> dict[str, Any]:
    args, other = group_arguments(opt, group)
    if other:
        raise ValueError(
            f"{what}: param group {i} of the {_qualname(type(opt))} holds {other[0]!r}, which "
            "is no argument of its class, so from_torch cannot rebuild the optimizer from it; "
            "drop that entry from the param group"
        )
    for key, value in args.items():
        if isinstance(value, Tensor) and value.numel() != 1:
            raise TypeError(f"{what}: param group {i}'s {key!r} is a tensor of several values")
    return args


def _names(opt: Optimizer, named_params: Named | None, what: str) -> list[list[str]] | None:
    """Each group's param names (the module's trainable ones), or None without a module."""
    if named_params is None:
        given = [g.get("param_names") for g in opt.param_groups]
        return [list(n) for n in given] if all(n is not None for n in given) else None
    pairs = named_params.items() if isinstance(named_params, Mapping) else named_params
    by_id = {id(t): n for n, t in pairs}
    groups = []
    for i, group in enumerate(opt.param_groups):
        names = []
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise ValueError(
                    f"{what}: param group {i} of the {_qualname(type(opt))} holds a tensor of "
                    f"shape {tuple(p.shape)} that is not a parameter of the module being "
                    "trained; build the optimizer on the module's own parameters (e.g. "
                    "self.model.parameters())"
                )
            if p.requires_grad:
                names.append(name)
        groups.append(names)
    return groups


def from_instance(
    opt: Optimizer,
    named_params: Named | None = None,
    *,
    momentum_alias: bool = False,
    what: str = "optimizer",
) -> tuple[GradientTransformation, list[str] | None]:
    """``opt`` as ``(from_torch transform, the names of the params it updates)`` (see the
    module doc). The names are None when no module is given; with several param groups the
    transform then raises at ``init``, since its groups cannot name their params."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{what} must be a torch.optim.Optimizer instance, got {type(opt)}")
    cls = type(opt)
    args = [_arguments(opt, i, g, what) for i, g in enumerate(opt.param_groups)]
    names = _names(opt, named_params, what)
    if momentum_alias and not all("betas" in a for a in args):
        raise ValueError(f"{what}: {_qualname(cls)} has no betas to cycle")
    if len(args) == 1:
        tx = from_torch(cls, **args[0])
    elif names is None:
        tx = _unnamed(cls, len(args), what)
    else:
        groups = []
        for group, a, n in zip(opt.param_groups, args, names):
            label = {"name": group["name"]} if isinstance(group.get("name"), str) else {}
            groups.append({"params": n, **a, **label})
        tx = from_torch(cls, **args[0], param_groups=groups)
    if momentum_alias:
        tx = beta1_as_momentum(tx)
    flat = None if names is None else [n for group in names for n in group]
    return tx, flat


def _unnamed(cls: type, n: int, what: str) -> GradientTransformation:
    def refuse(*_: Any) -> Any:
        raise ValueError(
            f"{what}: the {_qualname(cls)} has {n} param groups, and without the module "
            "its params cannot be named; give it to the Trainer through a Task's "
            "configure_optimizers, or write optim.from_torch(..., param_groups=[...])"
        )

    return GradientTransformation(refuse, refuse, refuse)


# --------------------------------------------------------------------------- beta1 alias


def _rebuild(node: Any, fn: Callable[[InjectHyperparamsState], Any]) -> Any:
    """``node`` (an optimizer state) with ``fn`` applied to every ``InjectHyperparamsState``
    that holds ``betas`` (inner ones first); unchanged parts are kept as they are."""
    if isinstance(node, Tensor):
        return node
    if isinstance(node, InjectHyperparamsState):
        inner = _rebuild(node.inner_state, fn)
        if inner is not node.inner_state:
            node = node.replace(inner_state=inner)
        return fn(node) if "betas" in node.hyperparams else node
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return tuple(_rebuild(c, fn) for c in node)
    if isinstance(node, list):
        return [_rebuild(c, fn) for c in node]
    if isinstance(node, dict):
        return {k: _rebuild(v, fn) for k, v in node.items()}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for f in dataclasses.fields(node):
            old = getattr(node, f.name)
            new = _rebuild(old, fn)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(node, **changes) if changes else node
    return node


def _add_alias(s: InjectHyperparamsState) -> InjectHyperparamsState:
    hp = s.hyperparams
    if _ALIAS in hp:
        raise ValueError(
            f"beta1_as_momentum: the optimizer state ({s.name or 'an injected optimizer'}) "
            f"holds both betas and {_ALIAS!r}; which one a cycling scheduler drives is unclear"
        )
    if not isinstance(hp["betas"], tuple):
        raise TypeError(f"beta1_as_momentum: betas must be a tuple, got {hp['betas']!r:.60}")
    return s.replace(hyperparams={**hp, _ALIAS: hp["betas"][0].clone()})


def _to_betas(s: InjectHyperparamsState) -> InjectHyperparamsState:
    """The state the inner transform knows: ``betas[0]`` is the scalar ``momentum``."""
    hp = dict(s.hyperparams)
    beta1 = hp.pop(_ALIAS)
    hp["betas"] = (beta1.clone(), *hp["betas"][1:])
    return s.replace(hyperparams=hp)


def beta1_as_momentum(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` with a scalar ``momentum`` in its state standing for ``betas[0]`` of every
    injected optimizer that has ``betas`` (a ``from_torch`` Adam-like class, or
    ``inject_hyperparams(optim.adam)``): each step runs with ``betas[0] = momentum``, so
    ``set_hyperparams({"momentum": m})`` (what a momentum-cycling scheduler requests) sets
    beta1. ``init`` refuses a state without ``betas`` anywhere."""

    def back(new: Any, old: Any) -> Any:
        used = iter([s.hyperparams[_ALIAS] for s in find_injected(old) if _ALIAS in s.hyperparams])
        return _rebuild(new, lambda s: s.replace(hyperparams={**s.hyperparams, _ALIAS: next(used)}))

    def init(params: Params) -> Any:
        state = tx.init(params)
        if not any("betas" in s.hyperparams for s in find_injected(state)):
            raise ValueError(
                "beta1_as_momentum: the optimizer has no injected betas to cycle (a torch "
                "scheduler cycles betas[0] of Adam-like optimizers); build it with betas, or "
                "give the scheduler cycle_momentum=False"
            )
        return _rebuild(state, _add_alias)

    def update(updates: Updates, state: Any, params: Params | None = None) -> tuple:
        out, new = tx.update(updates, _rebuild(state, _to_betas), params)
        return out, back(new, state)

    def apply(grads: Updates, state: Any, params: Params) -> tuple:
        new_params, new = step(tx, grads, _rebuild(state, _to_betas), params)
        return new_params, back(new, state)

    return GradientTransformation(init, update, apply)
