"""Skip steps whose gradients hold NaN or Inf, and give up after too many in a row.

The check costs one host sync (the only ``.item()`` in the optimizers): the max-abs norm of
every tensor, which is NaN or Inf exactly when the tensor has a non-finite element (a sum
or L2 norm could overflow on large finite values). A skipped step leaves the inner state
and the params untouched (``apply`` returns the same tensor objects; ``update`` returns
zeros) and counts in ``consecutive`` and ``skipped``. It also bumps a per-thread counter,
``skip_count()``, which a train step reads before and after its optimizer call to learn that
the step was skipped (and keep its old buffers) without a second host sync.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from purestep.engine.tree import struct

from . import _util
from .base import GradientTransformation, Params, Updates, step

__all__ = ["NonFiniteError", "SkipNonFiniteState", "all_finite", "skip_count", "skip_nonfinite"]

Tensor = torch.Tensor


_SKIPS = threading.local()


def skip_count() -> int:
    """How many updates ``skip_nonfinite`` has skipped in this thread (ever)."""
    return getattr(_SKIPS, "n", 0)


class NonFiniteError(FloatingPointError):
    """Raised by ``skip_nonfinite`` when gradients stay non-finite for too many steps."""


@struct
class SkipNonFiniteState:
    """``consecutive``: non-finite steps in a row (0 after a good step); ``skipped``: total
    non-finite steps skipped; ``inner_state``."""

    consecutive: int
    skipped: int
    inner_state: Any


def all_finite(tensors: list[Tensor]) -> bool:
    """Whether every element of every tensor is finite (one host sync)."""
    if not tensors:
        return True
    norms = torch._foreach_norm(tensors, math.inf)
    if _util.groups(tensors) is not None:
        first = tensors[0].device
        norms = [n.to(device=first, dtype=torch.float64) for n in norms]
    return math.isfinite(torch.stack(norms).amax().item())


def skip_nonfinite(
    inner: GradientTransformation, max_consecutive: int | None = None
) -> GradientTransformation:
    """Run ``inner`` only on finite gradients; skip (no-op) the others.

    With ``max_consecutive = N`` up to N non-finite steps in a row are skipped and the next
    one raises ``NonFiniteError`` (``N = 0`` raises on the first); ``None`` never raises.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"skip_nonfinite() needs a GradientTransformation, got {type(inner).__name__}"
        )
    if max_consecutive is not None and (
        isinstance(max_consecutive, bool)
        or not isinstance(max_consecutive, int)
        or max_consecutive < 0
    ):
        raise ValueError(f"max_consecutive must be None or an int >= 0, got {max_consecutive!r}")

    def init(params: Params) -> SkipNonFiniteState:
        return SkipNonFiniteState(consecutive=0, skipped=0, inner_state=inner.init(params))

    def skipped(state: SkipNonFiniteState) -> SkipNonFiniteState:
        consecutive = state.consecutive + 1
        if max_consecutive is not None and consecutive > max_consecutive:
            raise NonFiniteError(
                f"gradients were non-finite (NaN or Inf) for {consecutive} steps in a row, "
                f"more than max_consecutive={max_consecutive} ({state.skipped} skipped before "
                "in total); the run is diverging: lower the learning rate, clip the "
                "gradients or check the loss and the data"
            )
        _SKIPS.n = getattr(_SKIPS, "n", 0) + 1
        return state.replace(consecutive=consecutive, skipped=state.skipped + 1)

    def update(updates: Updates, state: SkipNonFiniteState, params: Params | None = None):
        if all_finite(list(updates.values())):
            out, inner_state = inner.update(updates, state.inner_state, params)
            return out, SkipNonFiniteState(0, state.skipped, inner_state)
        return {n: torch.zeros_like(u) for n, u in updates.items()}, skipped(state)

    def apply(grads: Updates, state: SkipNonFiniteState, params: Params) -> tuple:
        if all_finite(list(grads.values())):
            new_params, inner_state = step(inner, grads, state.inner_state, params)
            return new_params, SkipNonFiniteState(0, state.skipped, inner_state)
        return dict(params), skipped(state)

    return GradientTransformation(init, update, apply)
