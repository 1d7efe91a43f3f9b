"""Turn the Trainer's ``accelerator`` / ``devices`` / ``strategy`` / ``precision`` flags into a
strategy value.

A cluster environment (``hardware.cluster``: ``Trainer(plugins=[SLURMEnvironment()])``, or
``cluster=`` here) chooses who started the processes instead of detecting it; it goes to
``strategy="ddp"`` / ``"fsdp"`` (``"auto"`` then means ``"ddp"``: a cluster environment
means several processes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from purestep.engine.strategy import Strategy

from .ddp import ddp_from_flags
from .fsdp import fsdp_from_flags
from .precision import _ALIASES
from .single import single_device

__all__ = ["WithCluster", "from_flags"]

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


@dataclasses.dataclass(frozen=True)
class WithCluster:
    """A ``strategy`` flag together with the cluster environment to start it in (what
    ``Trainer(plugins=[...])`` hands ``from_flags`` as its strategy)."""

    strategy: Any
    cluster: Any


def from_flags(
    accelerator: str = "auto",
    devices: Any = "auto",
    strategy: Any = "auto",
    precision: Any = None,
    cluster: Any = None,
) -> Strategy:
    """The strategy the flags describe (one device here; several processes need "ddp").

    ``precision=None`` means "32-true". A ready ``Strategy`` value is used as it is; asking
    for another precision alongside it is an error (the strategy carries its precision).
    ``cluster``: a cluster environment or its name (``hardware.cluster.resolve``) for
    ``"ddp"`` / ``"fsdp"`` / ``"auto"``; a ready strategy value must have been made with
    the same one.
    """
    if isinstance(strategy, WithCluster):
        if cluster is not None and cluster != strategy.cluster:
            raise ValueError(
                f"two cluster environments: {cluster!r} and {strategy.cluster!r}; pass one"
            )
        strategy, cluster = strategy.strategy, strategy.cluster
    if cluster is not None:
        from .cluster import resolve

        cluster = resolve(cluster)  # a name becomes its value; a wrong one is an error
        if isinstance(strategy, Strategy) and getattr(strategy, "cluster", None) != cluster:
            raise ValueError(
                f"the cluster environment {cluster!r} cannot change a ready strategy value "
                f"(its processes were already started with "
                f"{getattr(strategy, 'cluster', None)!r}); pass it when making the "
                "strategy: hardware.ddp(cluster=...) or hardware.fsdp(cluster=...)"
            )
        if strategy == "auto":
            strategy = "ddp"
        elif strategy == "single_device":
            raise ValueError(
                f"strategy='single_device' runs one process; the cluster environment "
                f"{cluster!r} needs strategy='ddp' or 'fsdp'"
            )
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
        return ddp_from_flags(use_cuda, devices, count, precision, cluster)
    if strategy == "fsdp":
        return fsdp_from_flags(use_cuda, devices, count, precision, cluster)
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
