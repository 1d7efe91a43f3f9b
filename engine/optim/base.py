"""The gradient-transformation protocol, composition and how updates reach the params.

A ``GradientTransformation`` is a pair of pure functions over name-keyed dicts of tensors:
``init(params) -> state`` and ``update(updates, state, params=None) -> (updates, state)``,
plus an optional fused ``apply(grads, state, params) -> (new_params, state)``. ``apply``
exists because torch's foreach kernels fuse multiply-adds (``addcdiv``, ``add(alpha=)``):
writing ``params + updates`` as separate ops rounds differently, so the named optimizers
apply their step with exactly torch's arithmetic there, and ``step`` prefers it.

Transforms never modify their inputs, except under ``donating()``: then the built-in
transforms may write in place into the incoming updates, their own state tensors and (in
``apply`` / ``apply_updates``) the params, like JAX's buffer donation. The donated inputs are
consumed, including any buffers that earlier states share with them. Under the weaker
``owning_updates()`` only the incoming updates are overwritten. Results are bitwise the same
either way. A transform must never return updates that alias its own state, so
that the next transform of a chain may write into them when donating.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

from purestep.engine.tree import struct

from ._util import take

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "OptState",
    "Params",
    "Updates",
    "apply_updates",
    "chain",
    "differentiable",
    "donating",
    "identity",
    "is_differentiable",
    "is_donating",
    "owning_updates",
    "owns_updates",
    "set_to_zero",
    "step",
]

Tensor = torch.Tensor
Params = dict[str, Tensor]
Updates = dict[str, Tensor]
OptState = Any


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(updates, state, params=None) -> (updates, state)``;
    optional ``apply(grads, state, params) -> (new_params, state)``, the fused path that
    ``step`` uses when present."""

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    apply: Callable[[Updates, OptState, Params], tuple[Params, OptState]] | None = None


@struct
class EmptyState:
    """The state of a stateless transform."""


# --------------------------------------------------------------------------- donation

_DONATING: ContextVar[bool] = ContextVar("purestep_optim_donating", default=False)


class _Setting:
    """A context that sets a context variable for its block. A class rather than a
    generator context manager: the train step enters one every step, and this takes half
    the time (0.7 against 1.4 us here)."""

    __slots__ = ("_token", "_value", "_var")

    def __init__(self, var: ContextVar[bool], value: bool) -> None:
        self._var, self._value, self._token = var, value, None

    def __enter__(self) -> None:
        self._token = self._var.set(self._value)

    def __exit__(self, *exc: object) -> None:
        self._var.reset(self._token)


def donating(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this block built-in transforms may reuse their inputs' storage (see module doc)."""
    return _Setting(_DONATING, bool(enabled))


def is_donating() -> bool:
    """Whether the current context donates inputs (``donating()``)."""
    return _DONATING.get()


_OWNS_UPDATES: ContextVar[bool] = ContextVar("purestep_optim_owns_updates", default=False)


def owning_updates(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this block the incoming updates (gradients) are the transform's to overwrite.

    Weaker than ``donating()``: states and params stay untouched; only the gradient tensors
    handed to ``update``/``apply`` may be reused as scratch space (the train step does this
    with the fresh gradients it owns, saving a parameter-sized temporary per transform).
    Clipping, scaling, weight decay and the named optimizers then write into them; the
    results are bitwise the same.

    The flag is ambient (a context variable), so it also covers every tensor a transform
    hands on inside the block. A custom transform that passes a built-in one data it does
    not own (a gradient it keeps in its own state, a buffer shared with its caller, updates
    it will read again afterwards) must make that call under ``owning_updates(False)``, or
    pass a copy; otherwise the built-in transform overwrites that data. Likewise a custom
    transform must not return updates that alias its state or the params.
    """
    return _Setting(_OWNS_UPDATES, bool(enabled))


def owns_updates() -> bool:
    """Whether the incoming updates may be overwritten (``owning_updates()`` or donating)."""
    return _OWNS_UPDATES.get() or _DONATING.get()


_DIFFERENTIABLE: ContextVar[bool] = ContextVar("purestep_optim_differentiable", default=False)


class _Differentiable:
    """``differentiable()``: sets the differentiable flag and clears donation and owned
    updates for its block (a class, like ``_Setting``, entered once per step)."""

    __slots__ = ("_tokens",)

    def __init__(self) -> None:
        self._tokens: tuple = ()

    def __enter__(self) -> None:
        self._tokens = (
            _DIFFERENTIABLE.set(True),
            _DONATING.set(False),
            _OWNS_UPDATES.set(False),
        )

    def __exit__(self, *exc: object) -> None:
        diff, donate, owns = self._tokens
        _OWNS_UPDATES.reset(owns)
        _DONATING.reset(donate)
        _DIFFERENTIABLE.reset(diff)


def differentiable() -> contextlib.AbstractContextManager[None]:
    """Within this block the built-in transforms keep the autograd graph of their update.

    Nothing is written in place (no donation, no owned updates, out-of-place temporaries
    where an in-place op would overwrite a value autograd saved), the named optimizers run
    their ``torch._foreach_*`` ops per tensor (whose autograd nodes save less:
    ``_per_tensor``), and ``sgd``, ``adam`` and
    ``adamw`` hyper-parameters given as tensors that require grad (directly, or stored by
    ``inject_hyperparams``) get their gradient. The values computed are bitwise those of
    the same step outside the block (see ``_util.with_tangent``).
    """
    return _Differentiable()


def is_differentiable() -> bool:
    """Whether the current context keeps the update's graph (``differentiable()``).

    False while ``torch.compile`` traces (a differentiable step is never compiled, and
    dynamo cannot read a ``ContextVar``: the compiled step's graph stays as it was)."""
    if torch.compiler.is_compiling():
        return False
    return _DIFFERENTIABLE.get()


# --------------------------------------------------------------------------- applying


def apply_updates(params: Mapping[str, Tensor], updates: Mapping[str, Tensor]) -> Params:
    """``params + updates`` name by name; params without an update are kept as they are.

    Updates must have their params' dtypes. Under ``donating()`` the params are updated in
    place (the returned dict holds the same tensor objects).
    """
    if len(updates) == len(params):
        names = list(params)
    else:
        extra = [n for n in updates if n not in params]
        if extra:
            raise KeyError(f"updates for unknown params: {extra[:5]}")
        names = [n for n in params if n in updates]
    if not names:
        return dict(params)
    p = [params[n] for n in names]
    u = take(updates, names, "updates")
    if _DONATING.get():
        torch._foreach_add_(p, u)
        new = p
    else:
        new = torch._foreach_add(p, u)
    out = dict(params)
    out.update(zip(names, new))
    return out


def step(
    tx: GradientTransformation,
    grads: Mapping[str, Tensor],
    state: OptState,
    params: Mapping[str, Tensor],
) -> tuple[Params, OptState]:
    """One optimizer step: ``tx.apply`` when present, else ``update`` then ``apply_updates``.

    The named optimizers' ``apply`` is bitwise equal to ``torch.optim.X(foreach=True)``.
    """
    apply = getattr(tx, "apply", None)
    if apply is not None:
        return apply(grads, state, params)
    updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates), state


# --------------------------------------------------------------------------- composition


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply ``txs`` in order; the state is the tuple of their states.

    ``apply`` runs the updates of all but the last transform, then the last one's ``apply``
    (or its ``update`` and ``apply_updates``), so ``chain(clip, adam)`` keeps Adam's fused,
    torch-exact arithmetic.
    """
    for i, tx in enumerate(txs):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"chain() argument {i} must be a GradientTransformation, got {type(tx).__name__}"
            )
    if not txs:
        return identity()

    def init(params: Params) -> tuple:
        return tuple(tx.init(params) for tx in txs)

    def update(updates: Updates, state: tuple, params: Params | None = None) -> tuple:
        _check_len(state)
        new_state = []
        for tx, s in zip(txs, state):
            updates, s = tx.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    def apply(grads: Updates, state: tuple, params: Params) -> tuple:
        _check_len(state)
        new_state = []
        updates = grads
        for tx, s in zip(txs[:-1], state):
            updates, s = tx.update(updates, s, params)
            new_state.append(s)
        new_params, s = step(txs[-1], updates, state[-1], params)
        new_state.append(s)
        return new_params, tuple(new_state)

    def _check_len(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(txs):
            raise TypeError(
                f"chain of {len(txs)} transforms needs a tuple of {len(txs)} states, got "
                f"{type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )

    return GradientTransformation(init, update, apply)


def identity() -> GradientTransformation:
    """Pass updates through unchanged (the same tensor objects)."""

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None) -> tuple:
        return dict(updates), state

    return GradientTransformation(init, update)


def set_to_zero() -> GradientTransformation:
    """Replace updates by zeros (freezes params, e.g. one label of ``partition``).

    Its ``apply`` returns the params untouched (the same objects).
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None) -> tuple:
        return {n: torch.zeros_like(u) for n, u in updates.items()}, state

    def apply(grads: Updates, state: EmptyState, params: Params) -> tuple:
        return dict(params), state

    return GradientTransformation(init, update, apply)
