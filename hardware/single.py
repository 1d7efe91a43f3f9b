"""One process, one device: the strategy most runs use and every other one is measured by."""

from __future__ import annotations

import torch

from purestep.engine.loss_scale import DynamicLossScale
from purestep.engine.strategy import Precision, Strategy

from .precision import precision as make_precision

__all__ = ["SingleDevice", "single_device"]


class SingleDevice(Strategy):
    """Everything on ``device`` (``Strategy.place``); collectives are identities; this
    process is the primary."""

    def __init__(self, device: torch.device, precision: Precision) -> None:
        self.device = device
        self.precision = precision


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def single_device(
    device: torch.device | str | None = None,
    precision: str | int | Precision = "32-true",
    *,
    loss_scale: DynamicLossScale | None = None,
) -> SingleDevice:
    """A single-device strategy on ``device`` (default: the current CUDA device, else CPU)."""
    dev = _default_device() if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    policy = (
        precision
        if isinstance(precision, Precision)
        else make_precision(precision, dev, loss_scale=loss_scale)
    )
    return SingleDevice(dev, policy)
