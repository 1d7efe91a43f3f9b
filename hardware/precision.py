"""Precision policies: the numeric formats a model trains in, named as users know them.

``"32-true"`` and ``"64-true"`` and ``"bf16-true"`` (and ``"16-true"``) keep parameters,
buffers and floating inputs in that dtype. ``"bf16-mixed"`` and ``"16-mixed"`` keep float32
parameters and run the forward pass under ``torch.autocast``; ``"16-mixed"`` also scales the
loss with a pure dynamic loss scaler whose state lives in ``TrainState.precision`` (steps with
non-finite gradients are skipped and the scale backs off). A device that cannot autocast to
the requested dtype is refused when the policy is built, with a clear error.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from purestep.engine.loss_scale import DynamicLossScale
from purestep.engine.strategy import Precision
from purestep.engine.tree import cast

__all__ = ["MixedPrecision", "TruePrecision", "precision", "PRECISIONS"]

PRECISIONS = ("64-true", "32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")

_ALIASES: dict[Any, str] = {
    64: "64-true",
    "64": "64-true",
    32: "32-true",
    "32": "32-true",
    16: "16-mixed",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
}

_TRUE_DTYPES = {
    "64-true": torch.float64,
    "32-true": torch.float32,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
}


class TruePrecision(Precision):
    """Parameters, buffers and floating inputs all held in one dtype."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = _TRUE_DTYPES[name]

    def convert_state(self, params, buffers):
        return cast(params, self.dtype), cast(buffers, self.dtype)

    def convert_input(self, batch: Any) -> Any:
        if self.dtype == torch.float32:
            return batch
        if isinstance(batch, torch.Tensor):
            return batch.to(self.dtype) if batch.is_floating_point() else batch
        return cast(batch, self.dtype)


class MixedPrecision(Precision):
    """float32 parameters; the forward pass autocasts to float16 or bfloat16."""

    def __init__(
        self, name: str, device_type: str, loss_scale: DynamicLossScale | None = None
    ) -> None:
        self.name = name
        self.device_type = device_type
        self.dtype = torch.float16 if name == "16-mixed" else torch.bfloat16
        _check_autocast(device_type, self.dtype, name)
        if self.dtype == torch.float16:
            self.scaler = loss_scale if loss_scale is not None else DynamicLossScale()
        elif loss_scale is not None:
            raise ValueError(f"{name!r} does not scale the loss; loss_scale must be None")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)


def _check_autocast(device_type: str, dtype: torch.dtype, name: str) -> None:
    """Refuse a mixed policy that this device cannot run, instead of failing mid-training."""
    reason = None
    if not torch.amp.is_autocast_available(device_type):
        reason = f"torch has no autocast for device type {device_type!r}"
    else:
        try:
            with torch.autocast(device_type, dtype=dtype):
                probe = torch.nn.functional.linear(
                    torch.ones(2, 2, device=device_type), torch.ones(2, 2, device=device_type)
                )
            if probe.dtype != dtype:
                reason = f"autocast on {device_type!r} does not produce {dtype}"
        except (RuntimeError, ValueError) as err:
            reason = str(err).splitlines()[0]
    if reason is not None:
        raise RuntimeError(
            f"precision {name!r} is not supported on device type {device_type!r}: {reason}. "
            f"Use '32-true'{' or bf16-mixed' if dtype == torch.float16 else ''} instead."
        )


def precision(
    name: str | int,
    device: torch.device | str = "cpu",
    *,
    loss_scale: DynamicLossScale | None = None,
) -> Precision:
    """The policy called ``name`` for ``device`` (aliases: 64, 32, 16, "bf16")."""
    canonical = _ALIASES.get(name, name)
    if canonical not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
    if loss_scale is not None and canonical != "16-mixed":
        raise ValueError(f"loss_scale applies to '16-mixed' only, not {canonical!r}")
    if canonical in _TRUE_DTYPES:
        return TruePrecision(canonical)
    return MixedPrecision(canonical, torch.device(device).type, loss_scale)
