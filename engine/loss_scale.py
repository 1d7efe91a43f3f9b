"""Dynamic loss scaling for float16 training, as pure functions over a small state.

Half-precision gradients underflow; multiplying the loss by a large scale before the
backward pass keeps them representable. ``DynamicLossScale`` holds the policy (the same
defaults as ``torch.amp.GradScaler``: initial scale 2**16, growth x2 after 2000 finite steps
in a row, back-off x0.5 on a non-finite step); ``LossScaleState`` holds the current scale
and the count of finite steps since the last change. It lives in ``TrainState.precision``,
so the scale is saved and restored with the run. A step whose gradients are not finite is
skipped by the train step, and the scale backs off.
"""

from __future__ import annotations

import torch

from .tree import struct

__all__ = ["DynamicLossScale", "LossScaleState"]


@struct
class LossScaleState:
    """The current loss scale and the number of finite steps since it last changed."""

    scale: float
    growth_tracker: int = 0


class DynamicLossScale:
    """The policy of a dynamic loss scaler; its methods are pure functions of the state."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval}")
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(init_scale={self.init_scale}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval})"
        )

    def init(self) -> LossScaleState:
        """The state at the start of a run."""
        return LossScaleState(scale=self.init_scale, growth_tracker=0)

    def unscale(
        self, grads: dict[str, torch.Tensor], state: LossScaleState
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """Gradients divided by the scale, and whether they are all finite.

        Works in place on ``grads``: the train step hands it fresh tensors it owns.
        """
        tensors = list(grads.values())
        if not tensors:
            return grads, True
        device = tensors[0].device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        inv_scale = torch.full((), 1.0 / state.scale, dtype=torch.float32, device=device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        for dev, group in by_device.items():
            flag = found_inf if dev == device else torch.zeros_like(found_inf, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv_scale.to(dev))
            if flag is not found_inf:
                found_inf += flag.to(device)
        return grads, not bool(found_inf.item())

    def adjust(self, state: LossScaleState, finite: bool) -> LossScaleState:
        """The state after a step whose gradients were (or were not) finite."""
        if not finite:
            return LossScaleState(scale=state.scale * self.backoff_factor, growth_tracker=0)
        tracker = state.growth_tracker + 1
        if tracker >= self.growth_interval:
            return LossScaleState(scale=state.scale * self.growth_factor, growth_tracker=0)
        return LossScaleState(scale=state.scale, growth_tracker=tracker)
