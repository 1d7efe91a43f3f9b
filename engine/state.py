"""The training state: one immutable pytree holding everything that shapes the rest of a run.

``TrainState`` carries the parameters and buffers (detached tensors, keyed by the names
``nn.Module.named_parameters`` / ``named_buffers`` give), the optimizer state, the loop
``Progress``, the run's random key, the callbacks' states, the gradient accumulator of an
open accumulation window, the loss-scaler state of mixed precision, and ``extra`` for any
loop that needs more. Nothing that influences the future of a run lives anywhere else, so
saving this tree is saving the run. ``init`` builds one from an ``nn.Module`` template
without touching the module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import rng
from .tree import field, struct

__all__ = ["Progress", "TrainState", "init", "trainable_names"]


@struct
class Progress:
    """Loop counters, all plain ints (cheap to update, exact to save).

    ``step`` counts optimizer steps (what loggers and schedules call the global step);
    ``batch_in_epoch`` is the data position inside the current epoch (batches consumed);
    ``total_batches`` counts training batches over the run; ``samples`` counts training
    samples; ``micro_step`` is the number of micro-batches already accumulated in the open
    gradient-accumulation window (0 when no window is open).
    """

    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    total_batches: int = 0
    samples: int = 0
    micro_step: int = 0


@struct
class TrainState:
    """Everything a training run is, as a pytree. Update it with ``state.replace(...)``."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any
    progress: Progress
    rng: int
    callbacks: dict[str, Any] = field(default_factory=dict)
    grad_accum: dict[str, torch.Tensor] | None = None
    precision: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters the optimizer updates (those with ``requires_grad``)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _materialize(model: nn.Module, key: int, init_fn: Callable[[nn.Module], None] | None):
    """Real tensors for a template that lives on the meta device, initialised under ``key``.

    The template is deep-copied (cheap on meta), given empty CPU storage, and each submodule
    with a ``reset_parameters`` method re-initialises itself (or ``init_fn(copy)`` runs) with
    torch's RNG seeded from the key, so the result is a pure function of the seed.
    """
    clone = copy.deepcopy(model).to_empty(device="cpu")
    with rng.scope(rng.fold_in(key, rng.Purpose.INIT)), torch.no_grad():
        if init_fn is not None:
            init_fn(clone)
        else:
            for module in clone.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    return clone


def init(
    model: nn.Module,
    optimizer: Any,
    *,
    seed: int = 0,
    strategy: Any = None,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> TrainState:
    """A fresh ``TrainState`` for ``model`` trained with ``optimizer``.

    Parameters and buffers are detached copies of the module's (the module is never
    mutated). A template on the meta device is materialised first: every submodule's
    ``reset_parameters()`` (or ``init_fn``) runs under a key derived from ``seed``. The
    strategy, when given, places the state on its device, converts it to its precision and
    supplies the loss-scaler state. The optimizer state covers the trainable parameters only.
    """
    if strategy is not None:
        built = strategy.build_state(model, optimizer, seed=seed, init_fn=init_fn)
        if built is not NotImplemented:
            return built
    run_key = rng.key(seed)
    has_meta = any(t.is_meta for t in _tensors(model))
    source = _materialize(model, run_key, init_fn) if has_meta else model
    params = {n: p.detach().clone() for n, p in source.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in source.named_buffers() if b is not None}
    precision_state = None
    if strategy is not None:
        params, buffers = strategy.prepare_state(params, buffers)
        precision_state = strategy.precision.init()
    trainable = set(trainable_names(model))
    opt_params = {n: p for n, p in params.items() if n in trainable}
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=optimizer.init(opt_params),
        progress=Progress(),
        rng=run_key,
        precision=precision_state,
    )


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)
