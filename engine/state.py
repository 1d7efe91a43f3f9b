"""The training state: one immutable pytree holding everything that shapes the rest of a run.

``TrainState`` carries the parameters and buffers (detached tensors, keyed by the names
``nn.Module.named_parameters`` / ``named_buffers`` give), the optimizer state, the loop
``Progress``, the run's random key, the callbacks' states, the gradient accumulator of an
open accumulation window, the loss-scaler state of mixed precision, the loops' own state
(``loop``) and ``extra`` for anything else a loop needs. Nothing that influences the future
of a run lives anywhere else, so saving this tree is saving the run. ``init`` builds one
from an ``nn.Module`` template without touching the module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import rng
from .tree import field, struct

__all__ = ["Progress", "TrainState", "init", "materialize", "trainable_names"]


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
    """Everything a training run is, as a pytree. Update it with ``state.replace(...)``.

    ``loop`` is the loops' own state (``purestep.loops.LoopState``: stop request, the values
    callbacks see, epoch accumulators, reload epochs), read and replaced like ``progress``.
    The engine runs no loop, so it neither types nor fills it: it is None until a loop first
    runs on the state, and every loop entry point fills it in (``loops.loop_state.ready``).
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any
    progress: Progress
    rng: int
    callbacks: dict[str, Any] = field(default_factory=dict)
    grad_accum: dict[str, torch.Tensor] | None = None
    precision: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    loop: Any = None  # last: positional construction from before the field keeps its meaning


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters the optimizer updates (those with ``requires_grad``)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


#: The byte every non-float tensor of a meta template starts as (floats start as NaN): an
#: invalid bool, an unlikely integer.
_UNWRITTEN_BYTE = 0xA5


def _uses_nan(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.element_size() >= 2


def _mark_unwritten(module: nn.Module) -> list[tuple[str, torch.Tensor, int]]:
    """Fill every tensor of ``module`` with a sentinel; ``(name, tensor, version)`` of each."""
    marks = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t is None or t.numel() == 0:
            continue
        data = t.detach()
        if _uses_nan(data):
            data.fill_(float("nan"))
        else:
            data.reshape(-1).view(torch.uint8).fill_(_UNWRITTEN_BYTE)
        marks.append((name, t, t._version))
    return marks


def _unwritten(module: nn.Module, marks: list[tuple[str, torch.Tensor, int]]) -> list[str]:
    """Names of marked tensors nothing wrote: still in their slot, version counter unmoved
    (so no in-place op on them or their views) and still all sentinel (so no ``.data``
    write either)."""
    now = dict([*module.named_parameters(), *module.named_buffers()])
    found = []
    for name, t, version in marks:
        if now.get(name) is not t or t._version != version:
            continue
        data = t.detach()
        if _uses_nan(data):
            untouched = bool(torch.isnan(data).all())
        else:
            untouched = bool((data.reshape(-1).view(torch.uint8) == _UNWRITTEN_BYTE).all())
        if untouched:
            found.append(name)
    return found


def materialize(
    template: nn.Module, key: int, init_fn: Callable[[nn.Module], None] | None = None
) -> nn.Module:
    """A copy of ``template`` whose tensors are initialised under ``key``.

    The copy's submodules' ``reset_parameters()`` run (or ``init_fn(copy)`` does, instead)
    with torch's generators seeded from ``key`` (``rng.scope``), so the result is a pure
    function of ``key``. A template with tensors on the meta device gets empty CPU storage
    first, every tensor filled with a sentinel (NaN, or the byte 0xA5 for integers and
    bools); a tensor that no reset (or ``init_fn``) writes would hold that sentinel, so it
    raises ``ValueError`` naming them: a bare ``nn.Parameter`` or a buffer computed in
    ``__init__`` (``inv_freq``, masks) has no ``reset_parameters`` to recreate it. A
    template with real tensors keeps the values of tensors no reset writes.
    """
    clone = copy.deepcopy(template)
    marks = None
    if any(t.is_meta for t in _tensors(clone)):
        clone = clone.to_empty(device="cpu")
        with torch.no_grad():
            marks = _mark_unwritten(clone)
    with rng.scope(key), torch.no_grad():
        if init_fn is not None:
            init_fn(clone)
        else:
            for module in clone.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    if marks:
        missing = _unwritten(clone, marks)
        if missing:
            who = (
                "init_fn"
                if init_fn is not None
                else "any reset_parameters() (their modules have none, or it leaves them)"
            )
            raise ValueError(
                f"the template is on the meta device and {missing} are not initialised by "
                f"{who}, so they would hold uninitialised memory. Pass init_fn=fn: "
                "fn(module) gets the materialised copy, runs under the seed's key and must "
                "set every parameter and buffer (e.g. with torch.nn.init or tensor.copy_)"
            )
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
    mutated). A template on the meta device is materialised first (``materialize``): every
    submodule's ``reset_parameters()`` (or ``init_fn``) runs under a key derived from
    ``seed``, and a tensor neither initialises is an error. The
    strategy, when given, places the state on its device, converts it to its precision and
    supplies the loss-scaler state. The optimizer state covers the trainable parameters only.
    """
    if strategy is not None:
        built = strategy.build_state(model, optimizer, seed=seed, init_fn=init_fn)
        if built is not NotImplemented:
            return built
    run_key = rng.key(seed)
    has_meta = any(t.is_meta for t in _tensors(model))
    source = (
        materialize(model, rng.fold_in(run_key, rng.Purpose.INIT), init_fn) if has_meta else model
    )
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
