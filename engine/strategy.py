"""The seam between pure steps and hardware: what a step asks of a strategy and a precision.

A strategy is a value the step builders and loops receive; swapping it changes no user code.
This module defines the interface (as base classes whose methods are the do-nothing,
single-process behaviour) and is all the engine knows of hardware: ``hardware`` implements
single device, DDP and ensembles on top of it. ``Local()`` is what a step uses when given no
strategy: tensors stay where they are, full precision, one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from . import rng
from .loss_scale import DynamicLossScale
from .tree import to_device

__all__ = ["Local", "Precision", "Strategy", "step_generators"]

ReduceOp = str  # "mean" | "sum" | "max" | "min"


# One shared do-nothing context (``nullcontext`` is reusable and re-entrant).
_NO_AUTOCAST = contextlib.nullcontext()


class Precision:
    """A numeric precision policy; this base class is full precision (it does nothing).

    ``convert_state`` and ``convert_input`` cast parameters/buffers and floating inputs (the
    "-true" policies); ``autocast`` returns the context the forward pass runs in (the
    "-mixed" policies); ``scaler`` is a ``DynamicLossScale`` when the loss must be scaled.
    """

    name: str = "32-true"
    scaler: DynamicLossScale | None = None

    def init(self) -> Any:
        """The precision's part of the training state (the loss-scaler state, or None)."""
        return None if self.scaler is None else self.scaler.init()

    def convert_state(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return params, buffers

    def convert_input(self, batch: Any) -> Any:
        return batch

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return _NO_AUTOCAST

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Strategy:
    """Placement, collectives and process identity; this base class is one local process."""

    rank: int = 0
    world_size: int = 1
    device: torch.device | None = None
    precision: Precision = Precision()

    @property
    def is_primary(self) -> bool:
        """Whether this process writes logs and checkpoints."""
        return self.rank == 0

    def place(self, tree: Any) -> Any:
        """``tree`` with its tensors on this strategy's device (as they are without one)."""
        device = self.device
        if device is None:
            return tree
        non_blocking = device.type == "cuda"
        if isinstance(tree, torch.Tensor):
            return tree if tree.device == device else tree.to(device, non_blocking=non_blocking)
        if isinstance(tree, (tuple, list)) and all(
            isinstance(x, torch.Tensor) and x.device == device for x in tree
        ):
            return tree  # the usual batch, already in place: no tree walk
        return to_device(tree, device, non_blocking=non_blocking)

    def prepare_state(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Parameters and buffers placed and converted for training under this strategy."""
        return self.precision.convert_state(self.place(params), self.place(buffers))

    def all_reduce(self, tree: Any, op: ReduceOp = "mean") -> Any:
        """``tree`` reduced over processes (identity for one process)."""
        return tree

    def broadcast(self, tree: Any, src: int = 0) -> Any:
        """``tree`` as process ``src`` has it (identity for one process)."""
        return tree

    def barrier(self) -> None:
        """Wait until every process gets here (nothing to wait for in one process)."""

    def reduce_flag(self, flag: bool, op: str = "any") -> bool:
        """A decision agreed by every process ("any" or "all"); the flag itself here."""
        return bool(flag)

    def sync_metrics(self, tree: Any) -> Any:
        """``engine.metrics`` values merged over processes (unchanged for one process)."""
        return tree

    def sync_buffers(self, buffers: Any, op: str = "mean") -> Any:
        """Buffers (e.g. BatchNorm statistics) combined over processes (unchanged here)."""
        return buffers

    def sync_step_buffers(self, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The buffers a train-step call produced, kept in step across processes.

        The train step calls it after every call (every micro-batch) when ``world_size > 1``;
        DDP applies its ``buffers=`` policy here. Unchanged for one process.
        """
        return buffers

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in rank order."""
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Process ``src``'s ``obj`` (picklable), e.g. a folder rank 0 chose."""
        return obj

    def data_options(self) -> dict[str, int]:
        """How data sources shard for this process (``loops.data.source`` keywords)."""
        return {"rank": self.rank, "world_size": self.world_size}

    def convert_model(self, model: Any) -> Any:
        """The module template to use under this strategy (e.g. with SyncBatchNorm)."""
        return model

    # Strategies that change the shape of the computation (e.g. ensembles, which vmap the
    # step over a leading axis of the state) build the state and the steps themselves.
    # ``engine.init`` / ``engine.train_step`` / ``eval_step`` / ``predict_step`` call these
    # first; returning ``NotImplemented`` (the default) means "use the ordinary builder".

    def build_state(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        return NotImplemented

    def build_train_step(self, model: Any, loss_fn: Any, optimizer: Any, **kwargs: Any) -> Any:
        return NotImplemented

    def build_eval_step(self, model: Any, fn: Any) -> Any:
        return NotImplemented

    def build_predict_step(self, model: Any, fn: Any) -> Any:
        return NotImplemented

    def rng_devices(self, tensors: Iterable[torch.Tensor] = ()) -> tuple[torch.device, ...]:
        """Devices whose default generators a step must seed (CPU is always seeded).

        This strategy's device; without one (``Local``), the non-CPU devices of ``tensors``
        (the steps pass the state's parameters on their first call), so that a state moved
        to CUDA by hand draws its dropout masks from a seeded generator too.
        """
        device = self.device
        if device is not None:
            return (device,) if device.type != "cpu" else ()
        found: dict[torch.device, None] = {}
        for t in tensors:
            if t.device.type != "cpu":
                found[t.device] = None
        return tuple(found)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, precision={self.precision.name!r})"


class Local(Strategy):
    """The default strategy: one process, tensors wherever they already are, full precision.

    Having no device of its own, it has the steps seed the generators of the devices the
    state's parameters are on (``rng_devices``, asked on a step's first call), so a state
    moved to CUDA by hand draws its dropout masks from a scoped CUDA generator too.
    """


def step_generators(
    strategy: Strategy, params: Iterable[torch.Tensor]
) -> tuple[torch.Generator, ...]:
    """The global generators a step scopes, computed once on its first call: those of the
    strategy's device, or without one (``Local``) of the devices the first state's
    parameters ``params`` live on."""
    return rng.default_generators(strategy.rng_devices(params))
