"""Run an ``nn.Module`` template on tensors taken from the state, without keeping them.

``Binder(model)`` records once where every parameter and buffer lives (tied weights
included). ``binder.bind(params, buffers, training)`` is a context manager that puts the
given tensors in those slots and sets train/eval mode for the duration of the block, then
puts back exactly what was there before: the template is left as it was found, and the
state's tensors are never written into the template for longer than the block. This costs
a few dictionary assignments, far less than ``torch.func.functional_call``, and composes
with ``torch.func`` transforms (the tensors bound may be functorch-wrapped).

Buffers that the forward pass replaces (``self.buf = new``) rather than updates in place are
read back by ``collect_buffers()`` inside the block. A bound template is not thread-safe:
use one template per thread.

**Modes.** Normally the block flips each module's ``training`` flag to the requested mode
directly. A model in which some class overrides ``train()`` (the fine-tuning idiom that keeps
BatchNorm frozen: ``super().train(mode); self.bn.eval()``) gets ``model.train(mode)`` called
instead, when its root is in the other mode, and every module's flag restored on exit; when
the root is already in the requested mode its flags are left as the template has them.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .state import TrainState

__all__ = ["Binder", "canonical_names", "export_state_dict"]


def _canonical(model: nn.Module, named: str) -> dict[str, str]:
    """``slot name -> canonical name`` for ``named`` ("named_parameters"/"named_buffers")."""
    first: dict[int, str] = {}
    return {
        name: first.setdefault(id(tensor), name)
        for name, tensor in getattr(model, named)(remove_duplicate=False)
        if tensor is not None
    }


def canonical_names(model: nn.Module) -> dict[str, str]:
    """``slot name -> canonical name`` for every parameter and buffer slot of ``model``.

    A tied tensor fills several slots (``remove_duplicate=False`` names); its canonical name
    is the first name ``named_parameters`` / ``named_buffers`` give it, the key it has in a
    ``TrainState``.
    """
    return {**_canonical(model, "named_parameters"), **_canonical(model, "named_buffers")}


def _overrides_train(model: nn.Module) -> bool:
    """Whether ``model.train(mode)`` may set modes other than ``mode`` (a class overrides it)."""
    if type(model).eval is not nn.Module.eval:
        return True
    return any(type(m).train is not nn.Module.train for m in model.modules())


def _slots(model: nn.Module, named: str) -> tuple[list[tuple[dict[str, Any], str, str]], list[str]]:
    """``(owner dict, attribute, canonical name)`` for every slot, and the canonical names."""
    slots = []
    for name, canon in _canonical(model, named).items():
        owner_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        table = owner._parameters if named == "named_parameters" else owner._buffers
        slots.append((table, attr, canon))
    names = list(dict.fromkeys(c for _, _, c in slots))
    return slots, names


class Binder:
    """Binds state tensors into a module template's parameter and buffer slots."""

    __slots__ = (
        "_all_slots",
        "_buffer_slots",
        "_custom_train",
        "_modules",
        "_param_slots",
        "buffer_names",
        "model",
        "param_names",
    )

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected an nn.Module template, got {type(model).__name__}")
        self.model = model
        self._param_slots, self.param_names = _slots(model, "named_parameters")
        self._buffer_slots, self.buffer_names = _slots(model, "named_buffers")
        self._all_slots = self._param_slots + self._buffer_slots
        self._modules = list(model.modules())
        self._custom_train = _overrides_train(model)

    def check(self, params: dict[str, Any], buffers: dict[str, Any]) -> None:
        """Raise a clear error if ``params``/``buffers`` do not match the template's names."""
        for what, given, expected in (
            ("parameters", params, self.param_names),
            ("buffers", buffers, self.buffer_names),
        ):
            if set(given) != set(expected):
                missing = sorted(set(expected) - set(given))
                extra = sorted(set(given) - set(expected))
                raise KeyError(
                    f"the state's {what} do not match the model template: "
                    f"missing {missing}, unexpected {extra}"
                )

    def bind(self, params: dict[str, Any], buffers: dict[str, Any], training: bool) -> _Bound:
        """A context manager in which the template computes with ``params`` and ``buffers``."""
        return _Bound(self, params, buffers, training)

    def collect_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers currently in the template's slots (call inside ``bind``)."""
        return {canon: table[attr] for table, attr, canon in self._buffer_slots}


class _Bound:
    __slots__ = (
        "_binder",
        "_buffers",
        "_params",
        "_saved",
        "_saved_flags",
        "_saved_modes",
        "_training",
    )

    def __init__(
        self, binder: Binder, params: dict[str, Any], buffers: dict[str, Any], training: bool
    ) -> None:
        self._binder = binder
        self._params = params
        self._buffers = buffers
        self._training = training
        self._saved: list[Any] = []
        self._saved_modes: list[nn.Module] = []
        self._saved_flags: list[bool] | None = None

    def __enter__(self) -> nn.Module:
        b = self._binder
        params, buffers = self._params, self._buffers
        saved = self._saved = []
        try:
            for table, attr, canon in b._param_slots:
                saved.append(table[attr])
                table[attr] = params[canon]
            for table, attr, canon in b._buffer_slots:
                saved.append(table[attr])
                table[attr] = buffers[canon]
        except KeyError as missing:
            self._restore()
            raise KeyError(
                f"the state has no tensor for {missing} of the model template; "
                f"was it initialised from a different model?"
            ) from None
        training = self._training
        if b._custom_train:
            self._set_mode_by_train(training)
        else:
            flipped = self._saved_modes = [m for m in b._modules if m.training != training]
            for m in flipped:
                m.training = training
        return b.model

    def _set_mode_by_train(self, training: bool) -> None:
        """Call the model's own ``train``/``eval`` when the root must change mode."""
        b = self._binder
        model = b.model
        if model.training == training:
            return
        self._saved_flags = [m.training for m in b._modules]
        try:
            if training:
                model.train(True)
            else:
                model.eval()
        except BaseException:
            self._restore_flags()
            self._restore()
            raise

    def _restore_flags(self) -> None:
        flags = self._saved_flags
        if flags is not None:
            for m, flag in zip(self._binder._modules, flags):
                m.training = flag
            self._saved_flags = None

    def _restore(self) -> None:
        saved = self._saved
        for (table, attr, _), original in zip(self._binder._all_slots, saved):
            table[attr] = original
        self._saved = []

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._restore()
        if self._saved_flags is not None:
            self._restore_flags()
            return
        for m in self._saved_modes:
            m.training = not self._training
        self._saved_modes = []


def export_state_dict(state: TrainState, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The state's weights as a ``state_dict`` (with ``model``: its exact keys and order)."""
    tensors = {**state.params, **state.buffers}
    if model is None:
        return dict(tensors)
    by_slot = canonical_names(model)
    out = {}
    for key in model.state_dict(keep_vars=True):
        source = by_slot.get(key)
        if source is None or source not in tensors:
            raise KeyError(f"the state has no tensor for {key!r} of the model's state_dict")
        out[key] = tensors[source]
    return out
