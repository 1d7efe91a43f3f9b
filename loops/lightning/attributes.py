"""The Python attributes of a Lightning-style module, watched.

Parameters, buffers and logged values live in the ``TrainState``; a list of outputs or a
counter that a hook keeps on ``self`` does not, so a resumed run would not have it.
``AttributeWatch`` fingerprints the module's own attributes (identity, size, a scalar's
value, a tensor's version) and reports the first change of each by name, with the way to
keep such values.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["AttributeWatch"]

_INTERNAL: dict[type, frozenset[str]] = {}
#: What the adapter attaches to a module for a run (its log, its trainer, manual mode's API).
_ATTACHED = frozenset(
    {
        "log",
        "log_dict",
        "_trainer",
        "optimizers",
        "manual_backward",
        "toggle_optimizer",
        "untoggle_optimizer",
        "clip_gradients",
        "lr_schedulers",
    }
)


def _internal_names(base: type) -> frozenset[str]:
    """The attributes a bare instance of ``base`` has (nn.Module's and Lightning's own
    bookkeeping), plus the ones the adapter sets: everything else on a module is the
    user's, and watched."""
    found = _INTERNAL.get(base)
    if found is None:
        found = _INTERNAL[base] = frozenset(base().__dict__) | _ATTACHED
    return found


def _fingerprint(value: Any) -> Any:
    """What tells a changed attribute: identity, size, a scalar's value, a tensor's version."""
    if isinstance(value, (bool, int, float, str, bytes, type(None))):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    try:
        size = len(value)
    except TypeError:
        size = None
    return (id(value), size)


class AttributeWatch:
    """Fingerprints of ``module``'s user attributes; ``check(where)`` warns once per name."""

    def __init__(self, module: nn.Module, base: type) -> None:
        self.module = module
        self.internal = _internal_names(base)
        self.warned: set[str] = set()
        self.seen = self.fingerprints()

    def fingerprints(self) -> dict[str, Any]:
        attributes = self.module.__dict__
        self._names = set(attributes)
        self._user = [k for k in attributes if k not in self.internal]
        return {k: _fingerprint(attributes[k]) for k in self._user}

    def _now(self) -> dict[str, Any]:
        """The fingerprints, cheaply when no attribute was added or removed since the last
        look (the usual step: then only the user's attributes are looked at)."""
        attributes = self.module.__dict__
        if attributes.keys() != self._names:
            return self.fingerprints()
        return {k: _fingerprint(attributes[k]) for k in self._user}

    def accept(self) -> None:
        """What the attributes are now is the module's own (after attaching, after a
        checkpoint's ``on_load_checkpoint`` restored them)."""
        self.seen = self.fingerprints()

    def check(self, where: str) -> None:
        now = self._now()
        if now == self.seen:
            return
        changed = sorted(k for k in set(now) | set(self.seen) if now.get(k) != self.seen.get(k))
        self.seen = now
        new = [k for k in changed if k not in self.warned]
        if not new:
            return
        self.warned.update(new)
        warnings.warn(
            f"{type(self.module).__name__}.{where} changed the Python attributes {new} of the "
            "module. They are not part of the TrainState, so a run resumed from a checkpoint "
            "will not have them. Keep what the run depends on in the logged metrics or a "
            "callback's state, or put it in on_save_checkpoint(checkpoint) and read it back "
            "in on_load_checkpoint(checkpoint).",
            UserWarning,
            stacklevel=3,
        )
