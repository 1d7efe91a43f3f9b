"""Turn the Trainer's ``accelerator`` / ``devices`` / ``strategy`` / ``precision`` flags into a
strategy value."""

from __future__ import annotations

from typing import Any

import torch

from purestep.engine.strategy import Strategy

from .ddp import ddp_from_flags
from .fsdp import fsdp_from_flags
from .precision import _ALIASES
from .single import single_device

__all__ = ["from_flags"]

_ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


def _device_count(devices: Any) -> int | None:
    if devices in ("auto", None):
        return None
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    raise ValueError(f"devices must be 'auto', an int or a list of device indices, got {devices!r}")


def from_flags(
    accelerator: str = "auto",
    devices: Any = "auto",
    strategy: Any = "auto",
    precision: Any = None,
) -> Strategy:
    """The strategy the flags describe (one device here; several processes need "ddp").

    ``precision=None`` means "32-true". A ready ``Strategy`` value is used as it is; asking
    for another precision alongside it is an error (the strategy carries its precision).
    """
    if isinstance(strategy, Strategy):
        own = getattr(getattr(strategy, "precision", None), "name", None)
        if precision is not None and own is not None and _ALIASES.get(precision, precision) != own:
            raise ValueError(
                f"precision={precision!r} conflicts with the strategy's own precision "
                f"{own!r}; pass the precision to the strategy instead"
            )
        return strategy
    if precision is None:
        precision = "32-true"
    if accelerator not in _ACCELERATORS:
        raise ValueError(f"accelerator must be one of {_ACCELERATORS}, got {accelerator!r}")
    use_cuda = accelerator in ("gpu", "cuda") or (
        accelerator == "auto" and torch.cuda.is_available()
    )
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError(f"accelerator={accelerator!r} was requested but CUDA is not available")
    count = _device_count(devices)
    if count is not None and count < 1 and count != -1:
        raise ValueError(f"devices must be at least 1 (or -1 for all), got {devices!r}")
    if strategy == "ddp":
        return ddp_from_flags(use_cuda, devices, count, precision)
    if strategy == "fsdp":
        return fsdp_from_flags(use_cuda, devices, count, precision)
    if strategy not in ("auto", "single_device"):
        raise ValueError(
            f"unknown strategy {strategy!r}; use 'auto', 'single_device', 'ddp', 'fsdp' or a "
            "strategy value "
            "from hardware (e.g. hardware.single_device('cpu'))"
        )
    if count not in (None, 1):
        raise ValueError(
            f"devices={devices!r} asks for several devices: start one process per device "
            "(torchrun or hardware.launch) and pass strategy='ddp'"
        )
    index = None
    if use_cuda:
        index = devices[0] if isinstance(devices, (list, tuple)) else torch.cuda.current_device()
    device = torch.device("cuda", index) if use_cuda else torch.device("cpu")
    return single_device(device, precision)
