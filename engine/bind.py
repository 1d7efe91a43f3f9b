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
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch import nn

__all__ = ["Binder"]


def _slots(model: nn.Module, named: str) -> tuple[list[tuple[dict[str, Any], str, str]], list[str]]:
    """``(owner dict, attribute, canonical name)`` for every slot, and the canonical names."""
    canonical: dict[int, str] = {}
    for name, tensor in getattr(model, named)():
        if tensor is not None:
            canonical.setdefault(id(tensor), name)
    slots = []
    for name, tensor in getattr(model, named)(remove_duplicate=False):
        if tensor is None:
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        table = owner._parameters if named == "named_parameters" else owner._buffers
        slots.append((table, attr, canonical[id(tensor)]))
    names = list(dict.fromkeys(c for _, _, c in slots))
    return slots, names


class Binder:
    """Binds state tensors into a module template's parameter and buffer slots."""

    __slots__ = (
        "_all_slots",
        "_buffer_slots",
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
    __slots__ = ("_binder", "_buffers", "_params", "_saved", "_saved_modes", "_training")

    def __init__(
        self, binder: Binder, params: dict[str, Any], buffers: dict[str, Any], training: bool
    ) -> None:
        self._binder = binder
        self._params = params
        self._buffers = buffers
        self._training = training
        self._saved: list[Any] = []
        self._saved_modes: list[nn.Module] = []

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
        flipped = self._saved_modes = [m for m in b._modules if m.training != training]
        for m in flipped:
            m.training = training
        return b.model

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
        for m in self._saved_modes:
            m.training = not self._training
        self._saved_modes = []
