"""``ReduceLROnPlateau``: torch's metric-driven learning-rate rule as a pure function.

``plateau = ReduceLROnPlateau(mode="min", factor=0.1, patience=10, ...)`` takes
``torch.optim.lr_scheduler.ReduceLROnPlateau``'s arguments with its defaults;
``plateau.init()`` gives its counters (``PlateauState``: the best value so far, the bad
epochs, the cooldown left, the steps taken), which live in the training state, and
``plateau.update(state, metric, lrs) -> (new_lrs, new_state)`` is one ``scheduler.step(
metric)``: the same comparisons in the same float arithmetic, so on any sequence of metric
values the learning rates after each step equal torch's (tested against torch with
hypothesis). ``lrs`` holds one learning rate per parameter group (``min_lr`` may give one
floor per group, as in torch).

The Trainer runs it from a scheduler config (``{"scheduler": plateau, "monitor":
"val_loss"}``) and writes the new rates into the optimizer state through
``engine.optim.set_hyperparams``; a custom loop can call ``update`` itself.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from purestep.engine.tree import struct

__all__ = ["PlateauState", "ReduceLROnPlateau"]


@struct
class PlateauState:
    """torch's counters: ``best``, ``num_bad_epochs``, ``cooldown_counter``, ``last_epoch``
    (the number of ``update`` calls)."""

    best: float
    num_bad_epochs: int = 0
    cooldown_counter: int = 0
    last_epoch: int = 0


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"ReduceLROnPlateau({name}=...) must be a number, got {value!r}")
    return float(value)


class ReduceLROnPlateau:
    """Reduce the learning rate by ``factor`` once the metric has not improved for
    ``patience`` steps (see the module doc); arguments and defaults as in torch."""

    def __init__(
        self,
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_lr: float | Sequence[float] = 0.0,
        eps: float = 1e-8,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau(mode={mode!r}) must be 'min' or 'max'")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(
                f"ReduceLROnPlateau(threshold_mode={threshold_mode!r}) must be 'rel' or 'abs'"
            )
        factor = _number("factor", factor)
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau(factor={factor}) must be < 1.0")
        for name, value in (("patience", patience), ("cooldown", cooldown)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ReduceLROnPlateau({name}={value!r}) must be an int >= 0")
        self.mode = mode
        self.factor = factor
        self.patience = patience
        self.threshold = _number("threshold", threshold)
        self.threshold_mode = threshold_mode
        self.cooldown = cooldown
        if isinstance(min_lr, (list, tuple)):
            self.min_lr: float | tuple[float, ...] = tuple(_number("min_lr", v) for v in min_lr)
        else:
            self.min_lr = _number("min_lr", min_lr)
        self.eps = _number("eps", eps)

    def __repr__(self) -> str:
        return (
            f"ReduceLROnPlateau(mode={self.mode!r}, factor={self.factor}, "
            f"patience={self.patience}, threshold={self.threshold}, "
            f"threshold_mode={self.threshold_mode!r}, cooldown={self.cooldown}, "
            f"min_lr={self.min_lr}, eps={self.eps})"
        )

    def init(self) -> PlateauState:
        """The counters before the first step (``best`` is the worst value of the mode)."""
        return PlateauState(best=math.inf if self.mode == "min" else -math.inf)

    def is_better(self, a: float, best: float) -> bool:
        """torch's comparison of a new value with the best one."""
        if self.mode == "min" and self.threshold_mode == "rel":
            return a < best * (1.0 - self.threshold)
        if self.mode == "min":
            return a < best - self.threshold
        if self.threshold_mode == "rel":
            return a > best * (self.threshold + 1.0)
        return a > best + self.threshold

    def update(
        self, state: PlateauState, metric: Any, lrs: Sequence[float]
    ) -> tuple[list[float], PlateauState]:
        """One ``scheduler.step(metric)``: the learning rates after it and the new counters."""
        current = float(metric)
        best, bad, cooldown = state.best, state.num_bad_epochs, state.cooldown_counter
        if self.is_better(current, best):
            best, bad = current, 0
        else:
            bad += 1
        if cooldown > 0:
            cooldown -= 1
            bad = 0
        new = [float(lr) for lr in lrs]
        if bad > self.patience:
            floors = self._floors(len(new))
            for i, old in enumerate(new):
                candidate = max(old * self.factor, floors[i])
                if old - candidate > self.eps:
                    new[i] = candidate
            cooldown = self.cooldown
            bad = 0
        return new, PlateauState(best, bad, cooldown, state.last_epoch + 1)

    def _floors(self, groups: int) -> tuple[float, ...]:
        if isinstance(self.min_lr, tuple):
            if len(self.min_lr) != groups:
                raise ValueError(
                    f"ReduceLROnPlateau has {len(self.min_lr)} min_lr values for {groups} "
                    "parameter group(s)"
                )
            return self.min_lr
        return (self.min_lr,) * groups
