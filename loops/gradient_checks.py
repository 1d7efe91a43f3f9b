"""What ``fit`` looks at between a backward pass and its optimizer update.

``terminate_on_nan`` (a non-finite loss or gradient stops the run before the update it would
feed, so the state and the last checkpoint hold no NaN) and ``track_grad_norm`` (the p-norm
of every gradient and of them all, logged with the batch). Under several processes the
checks agree across ranks, so every rank stops at the same batch with the same error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GradientChecks", "NonFiniteLossError", "grad_norm_type"]


class NonFiniteLossError(ValueError):
    """``terminate_on_nan``: a loss or gradient was NaN or infinite (raised before the
    optimizer update it would have fed, so the state and the last checkpoint are whole)."""


def grad_norm_type(value: Any) -> float | None:
    """Lightning's ``track_grad_norm``: -1 (off) -> None, else the p of the p-norm (a
    positive number or ``"inf"``) as a float (None stays None)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.lower() != "inf":
            raise ValueError(f"track_grad_norm must be -1, a p > 0 or 'inf', got {value!r}")
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"track_grad_norm must be -1, a p > 0 or 'inf', got {value!r}")
    if value == -1:
        return None
    if not value > 0:
        raise ValueError(f"track_grad_norm must be -1, a p > 0 or 'inf', got {value!r}")
    return float(value)


class GradientChecks:
    """The two checks of one fit. ``where()`` names the batch for error messages; ``norms``
    holds the batch's gradient norms to log (emptied by ``start_batch``)."""

    def __init__(
        self,
        driver: Any,
        *,
        terminate_on_nan: bool,
        grad_norm_p: float | None,
        where: Callable[[], str],
    ) -> None:
        self.driver = driver
        self.terminate_on_nan = terminate_on_nan
        self.grad_norm_p = grad_norm_p
        self.where = where
        self.norms: dict[str, torch.Tensor] = {}

    @property
    def inspects_gradients(self) -> bool:
        return self.terminate_on_nan or self.grad_norm_p is not None

    def start_batch(self) -> None:
        """A new batch: no norms yet."""
        if self.norms:
            self.norms = {}

    def check_loss(self, loss: torch.Tensor | None) -> None:
        """``terminate_on_nan``'s check of the step's loss, agreed across ranks (one small
        all-reduce a step): a NaN on one rank stops every rank with the same error, naming
        the rank, instead of leaving the others to fail in their next collective."""
        bad = loss is not None and not bool(torch.isfinite(loss).all())
        drv = self.driver
        if drv.world_size > 1:
            if not drv.strategy.reduce_flag(bad, "any"):
                return
            seen = drv.strategy.all_gather_object(loss.item() if bad else None)
            found = [(r, v) for r, v in enumerate(seen) if v is not None]
        elif not bad:
            return
        else:
            found = [(None, loss.item())]
        where = ", ".join(f"{v} on rank {r}" if r is not None else f"{v}" for r, v in found)
        raise NonFiniteLossError(
            f"terminate_on_nan: the loss returned by the training step is {where} "
            f"({self.where()}); training stopped before the optimizer update, so the "
            "state and the last checkpoint hold no NaN"
        )

    def inspect(self, grads: Any) -> None:
        """``track_grad_norm``'s norms of the gradients the optimizer is about to use and
        ``terminate_on_nan``'s check of them (before the update)."""
        values = grads.grads
        if not values:  # a skipped batch: no gradients to look at
            return
        names = list(values)
        tensors = list(values.values())
        if self.terminate_on_nan and getattr(grads, "finite", True):
            self._check_finite(names, tensors)
        p = self.grad_norm_p
        if p is None:
            return
        sharded = getattr(self.driver.strategy, "gradient_norms", None)  # FSDP: whole grads
        norms = sharded(tensors, p) if sharded is not None else torch._foreach_norm(tensors, p)
        prefix = f"grad_{p}_norm"
        found = self.norms
        found.pop(f"{prefix}_total", None)
        found.update({f"{prefix}/{n}": v.detach() for n, v in zip(names, norms)})
        # the norm of every gradient of the batch (several optimizers: all of theirs)
        stacked = torch.stack([v.float() for v in found.values()])
        found[f"{prefix}_total"] = torch.linalg.vector_norm(stacked, p)

    def _check_finite(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Stop on a NaN or inf gradient. A float16 overflow (``grads.finite`` False) is the
        loss scaler's routine (the update is skipped, the scale lowered): never checked."""
        drv = self.driver
        finite = [bool(torch.isfinite(t).all()) for t in tensors]
        # sharded gradients (FSDP): a NaN may sit in one rank's shard only; every rank
        # stops together, not one while the others wait in the next collective
        stop = not all(finite)
        if drv.world_size > 1:
            stop = drv.strategy.reduce_flag(stop, "any")
        if not stop:
            return
        bad: Any = [n for n, ok in zip(names, finite) if not ok]
        if drv.world_size > 1:  # name the ranks whose gradients (or shards) hold it
            held = drv.strategy.all_gather_object(bool(bad))
            ranks = [r for r, b in enumerate(held) if b]
            bad = f"{bad or 'the shards of another rank'} (on rank(s) {ranks})"
        raise NonFiniteLossError(
            f"terminate_on_nan: detected nan and/or inf values in the gradients of "
            f"{bad} ({self.where()}); training stopped before the optimizer update, "
            "so the state and the last checkpoint hold no NaN"
        )
