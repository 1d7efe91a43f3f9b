"""Stop training when a monitored metric stops improving (Lightning's ``EarlyStopping`` rules).

A check reads ``ctx.metrics[monitor]`` and applies the first matching rule: a non-finite
value stops; crossing ``stopping_threshold`` (strictly) stops; crossing
``divergence_threshold`` (strictly) stops; an improvement by more than ``min_delta`` resets
the patience counter; anything else (equality included) counts one more check without
improvement, and ``patience`` such checks in a row stop. The counters live in the callback's
state, so they survive checkpoints; the stop is a ``Requests.stop`` the driver honours.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any

import torch

from .. import schedule
from ..config import default_config
from ..events import NOTHING, Context, Requests, Stage
from .base import Callback

__all__ = ["EarlyStopping", "StoppingReason"]


class StoppingReason(enum.IntEnum):
    """Why early stopping fired (stored as a plain int in the state)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


def check_on_train_epoch_end(config: Any, explicit: bool | None = None) -> bool:
    """Whether the check runs at the end of the training epoch (else at validation end).

    An explicit choice wins; otherwise it is the epoch end exactly when validation runs once
    at the end of every epoch (``val_check_interval == 1.0 and check_val_every_n_epoch == 1``).
    """
    if explicit is not None:
        return bool(explicit)
    return schedule.early_stopping_on_train_epoch_end(config or default_config())


class EarlyStopping(Callback):
    """Request a stop when ``monitor`` has not improved for ``patience`` checks.

    ``mode``: ``"min"`` (lower is better) or ``"max"``. ``min_delta``: the margin an
    improvement must exceed (its sign is not normalised: a negative value allows a worse
    score to count as an improvement). ``strict``: a missing monitor is an error (else it is
    skipped, with a message when ``verbose``). ``check_finite``: stop on NaN / inf.
    ``stopping_threshold``: stop once the metric is strictly better than it;
    ``divergence_threshold``: stop once it is strictly worse. ``check_on_train_epoch_end``:
    where to check (``None``: decided from the loop config, see ``check_on_train_epoch_end``).
    The check is skipped outside ``fit``, during the sanity check and under ``fast_dev_run``.
    With ``verbose`` the decisions come back as ``Requests.messages``.
    """

    monitoring = True

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
        name: str | None = None,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"EarlyStopping(monitor=...) must be a metric name, got {monitor!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}) is not supported: use 'min' or 'max'")
        if not isinstance(patience, numbers.Integral) or isinstance(patience, bool):
            raise TypeError(f"EarlyStopping(patience=...) must be an int, got {patience!r}")
        self.monitor = monitor
        self.mode = mode
        self.min_delta = float(min_delta) if mode == "max" else -float(min_delta)
        self.patience = int(patience)
        self.verbose = verbose
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        if name is not None:
            self.name = name

    # ----------------------------------------------------------------------- state

    def init(self) -> dict[str, Any]:
        return {
            "wait_count": 0,
            "stopped_epoch": 0,
            "best_score": math.inf if self.mode == "min" else -math.inf,
            "patience": self.patience,
            "stopping_reason": int(StoppingReason.NOT_STOPPED),
            "message": None,
        }

    # ----------------------------------------------------------------------- events

    def on_train_epoch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if not self._on_epoch_end(ctx) or self._skip(ctx):
            return state, NOTHING
        return self.check(state, ctx)

    def on_validation_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if self._on_epoch_end(ctx) or self._skip(ctx):
            return state, NOTHING
        return self.check(state, ctx)

    def _on_epoch_end(self, ctx: Context) -> bool:
        return check_on_train_epoch_end(ctx.config, self.check_on_train_epoch_end)

    @staticmethod
    def _skip(ctx: Context) -> bool:
        return (
            ctx.fn != "fit"
            or ctx.stage == Stage.SANITY_CHECK
            or bool(getattr(ctx.config, "fast_dev_run", False))
        )

    # ----------------------------------------------------------------------- the rules

    def _better(self, a: Any, b: Any) -> bool:
        """Strictly better in this mode (``<`` for min, ``>`` for max)."""
        return bool(a < b) if self.mode == "min" else bool(a > b)

    def check(self, state: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], Requests]:
        """One early-stopping check against ``ctx.metrics`` (no skip rules applied)."""
        if self.monitor not in ctx.metrics:
            available = "`, `".join(ctx.metrics)
            text = (
                f"Early stopping conditioned on metric `{self.monitor}` which is not available. "
                "Pass in or modify your `EarlyStopping` callback to use any of the following: "
                f"`{available}`"
            )
            if self.strict:
                raise RuntimeError(text)
            return state, self._say(ctx, text)

        current = _scalar(ctx.metrics[self.monitor], self.monitor)
        best = state["best_score"]
        symbol = "<" if self.mode == "min" else ">"
        new = dict(state)
        reason = StoppingReason.NOT_STOPPED
        if self.check_finite and not _finite(current):
            reason = StoppingReason.NON_FINITE_METRIC
            text = (
                f"Monitored metric {self.monitor} = {_show(current)} is not finite. "
                f"Previous best value was {best:.3f}. Signaling Trainer to stop."
            )
        elif self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            reason = StoppingReason.STOPPING_THRESHOLD
            text = (
                f"Stopping threshold reached: {self.monitor} = {_show(current)} {symbol} "
                f"{self.stopping_threshold}. Signaling Trainer to stop."
            )
        elif self.divergence_threshold is not None and self._better(
            -current, -self.divergence_threshold
        ):
            reason = StoppingReason.DIVERGENCE_THRESHOLD
            text = (
                f"Divergence threshold reached: {self.monitor} = {_show(current)} {symbol} "
                f"{self.divergence_threshold}. Signaling Trainer to stop."
            )
        elif self._better(current - self.min_delta, best):
            value = float(current)
            if math.isfinite(best):
                text = (
                    f"Metric {self.monitor} improved by {abs(best - value):.3f} >= "
                    f"min_delta = {abs(self.min_delta)}. New best score: {value:.3f}"
                )
            else:
                text = f"Metric {self.monitor} improved. New best score: {value:.3f}"
            new["best_score"] = value
            new["wait_count"] = 0
        else:
            new["wait_count"] = state["wait_count"] + 1
            text = None
            if new["wait_count"] >= state["patience"]:
                reason = StoppingReason.PATIENCE_EXHAUSTED
                text = (
                    f"Monitored metric {self.monitor} did not improve in the last "
                    f"{new['wait_count']} records. Best score: {best:.3f}. "
                    "Signaling Trainer to stop."
                )
        if reason is StoppingReason.NOT_STOPPED:
            return new, self._say(ctx, text)
        new["stopped_epoch"] = ctx.epoch
        new["stopping_reason"] = int(reason)
        new["message"] = text
        return new, Requests(stop=True) | self._say(ctx, text)

    def _say(self, ctx: Context, text: str | None) -> Requests:
        """``text`` as a message when verbose (rank-prefixed when several processes run)."""
        if not (self.verbose and text):
            return NOTHING
        if ctx.world_size > 1:
            if self.log_rank_zero_only and ctx.rank != 0:
                return NOTHING
            text = f"[rank: {ctx.rank}] {text}"
        return Requests(messages=(text,))


def _scalar(value: Any, name: str) -> Any:
    """A metric as a python float or a 0-d tensor (kept, so comparisons use its dtype)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"EarlyStopping monitors {name!r}, which is a tensor of shape "
                f"{tuple(value.shape)}; it needs a single value"
            )
        return value.detach().reshape(())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"EarlyStopping monitors {name!r}, which is a {type(value).__name__}")


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value))
    return math.isfinite(value)


def _show(value: Any) -> float:
    return float(value)
