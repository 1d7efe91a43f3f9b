"""One process, one device: the strategy most runs use and every other one is measured by."""

from __future__ import annotations

from typing import Any

import torch

from engine.loss_scale import DynamicLossScale
from engine.strategy import Precision, Strategy
from engine.tree import to_device

from .precision import precision as make_precision

__all__ = ["SingleDevice", "single_device"]


class SingleDevice(Strategy):
    """Everything on ``device``; collectives are identities; this process is the primary."""

    def __init__(self, device: torch.device, precision: Precision) -> None:
        self.device = device
        self.precision = precision
        self._non_blocking = device.type == "cuda"

    def place(self, tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            if tree.device == self.device:
                return tree
            return tree.to(self.device, non_blocking=self._non_blocking)
        return to_device(tree, self.device, non_blocking=self._non_blocking)


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
