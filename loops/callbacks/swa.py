"""Stochastic Weight Averaging (Lightning's ``StochasticWeightAveraging``), as a pure callback.

From epoch ``swa_start`` to the last one, the callback averages the parameters at the start
of every epoch (what Lightning does: the parameters the previous epoch ended with), with
``torch.optim.swa_utils``' own arithmetic, so the average **equals** an ``AveragedModel``
fed the same parameters; from that epoch the learning rate follows ``SWALR``'s annealing to
``swa_lrs`` (``annealing_epochs`` epochs, "cos" or "linear"), set through the injected
hyper-parameters (``Requests(hyperparams=...)``; build the optimizer with
``optim.inject_hyperparams`` with a constant ``lr``: one given as a schedule is recomputed at
every step and would override SWA's). A scheduler from ``configure_optimizers`` keeps running,
but in the SWA epochs SWA's rate is the one every batch uses (held at each batch start, also
after a mid-epoch resume), as Lightning swaps the scheduler for ``SWALR``. When the last
epoch ends, the final state gets the averaged parameters, and for a model with BatchNorm
its running statistics recomputed over the training data
(``torch.optim.swa_utils.update_bn``, one pass in the order of the epoch
after the last, the extra epoch Lightning runs for it; each forward is the task's training
step, which the Trainer gives as ``driver.extra["training_step"]``, so any batch structure
and any preprocessing in the step are what BatchNorm sees, as in Lightning) — a
``Requests(weights=...)``.

Everything the average needs (the averaged tensors, how many were averaged, the epoch of
the latest update, the learning rates SWA started from) is the callback's state in
``TrainState.callbacks``: it is checkpointed with the run, and a run resumed from any
checkpoint, a SIGKILLed one included, ends bitwise like the uninterrupted one. Lightning
keeps it in the callback object and restores it through ``state_dict`` hooks.

``average_update`` is shared with ``EMA``; ``recompute_batchnorm`` is usable on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import swa_utils

from purestep.engine import rng, tree
from purestep.engine.export import to_module
from purestep.engine.optim.multi import find_injected

from ..events import NOTHING, Context, Requests
from .base import Callback

__all__ = [
    "StochasticWeightAveraging",
    "average_update",
    "conform",
    "has_batchnorm",
    "recompute_batchnorm",
]

AvgFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MultiAvgFn = Callable[[list[torch.Tensor], list[torch.Tensor], Any], None]

#: ``fold_in`` datum of the key the BatchNorm pass's forward calls draw from (dropout).
_BN_KEY = "swa_batchnorm"


def conform(average: Mapping[Any, torch.Tensor], weights: Mapping[Any, Any]) -> dict[Any, Any]:
    """``average`` laid out like ``weights`` where a checkpoint changed its layout: a sharded
    checkpoint restores callback state as full plain tensors (``engine.checkpoint.sharded``),
    so an average of FSDP's DTensor parameters comes back whole on every rank; each rank
    keeps its own shard again (no communication: every rank holds the whole tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = dict(average)
    for k, v in average.items():
        w = weights.get(k)
        if isinstance(w, DTensor) and not isinstance(v, DTensor):
            out[k] = distribute_tensor(
                v.detach().to(w.device), w.device_mesh, w.placements, src_data_rank=None
            )
    return out


def average_update(
    average: Mapping[str, torch.Tensor] | None,
    current: Mapping[str, torch.Tensor],
    n_averaged: int,
    *,
    avg_fn: AvgFn | None = None,
    multi_avg_fn: MultiAvgFn | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """A new average of ``current`` into ``average`` (``n_averaged`` tensors so far), with
    ``AveragedModel.update_parameters``' arithmetic: the first update copies; later ones run
    ``multi_avg_fn`` (default: torch's SWA running mean) on each (device, dtype) group, or
    ``avg_fn(average, current, n_averaged)`` per tensor. Pure: the inputs are not written
    (torch's functions update copies). ``device``: where the average lives (None: with the
    parameters); an average found elsewhere (a checkpoint loads it on the CPU) moves there."""
    moved = {
        k: (v.detach().to(device) if device is not None else v.detach()) for k, v in current.items()
    }
    if average is None or n_averaged == 0:
        return {k: v.clone() for k, v in moved.items()}
    missing = sorted(set(moved) ^ set(average))
    if missing:
        raise KeyError(f"the average and the weights differ in {missing}")
    # where the average lives: a resumed run's checkpoint loads it on the CPU (and whole)
    average = conform(average, moved)
    out = {k: average[k].detach().to(moved[k].device, copy=True) for k in moved}
    if avg_fn is not None and multi_avg_fn is None:
        for k, v in moved.items():
            n = torch.tensor(n_averaged, dtype=torch.long, device=out[k].device)
            out[k] = avg_fn(out[k], v, n).detach()
        return out
    groups: dict[tuple[Any, Any], list[str]] = {}
    for k, t in out.items():
        groups.setdefault((t.device, t.dtype), []).append(k)
    for (dev, _), names in groups.items():
        n = torch.tensor(n_averaged, dtype=torch.long, device=dev)
        if multi_avg_fn is not None:
            multi_avg_fn([out[k] for k in names], [moved[k] for k in names], n)
        elif dev.type in _foreach_devices():  # AveragedModel's default, device by device
            swa_utils.get_swa_multi_avg_fn()([out[k] for k in names], [moved[k] for k in names], n)
        else:
            mean = swa_utils.get_swa_avg_fn()
            for k in names:
                out[k] = mean(out[k], moved[k], n)
    return out


def _foreach_devices() -> list[str]:
    """The device types ``AveragedModel`` averages with foreach kernels (elsewhere, tensor by
    tensor: the two round differently, and the average matches whichever torch runs)."""
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
    except ImportError:  # pragma: no cover - older or newer torch
        return ["cuda", "xpu"]
    return list(_get_foreach_kernels_supported_devices())


def has_batchnorm(model: nn.Module | None) -> bool:
    """Whether ``model`` has a BatchNorm layer (whose statistics need recomputing)."""
    return model is not None and any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()
    )


class _StepForward(nn.Module):
    """``update_bn``'s model when the training step is known: its forward runs the step's
    loss function over the module (the loss is dropped), so BatchNorm sees what training
    feeds it, whatever the batch's structure (Lightning's BatchNorm epoch runs the
    ``training_step`` with backward skipped)."""

    def __init__(self, module: nn.Module, loss_fn: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.module = module
        self._loss_fn = loss_fn

    def forward(self, batch: Any) -> Any:
        return self._loss_fn(self.module, batch)


def recompute_batchnorm(
    state: Any,
    template: nn.Module,
    params: Mapping[str, torch.Tensor],
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, torch.Tensor]:
    """The buffers after ``torch.optim.swa_utils.update_bn`` over ``batches`` of
    ``template`` carrying ``params`` and ``state``'s buffers. With ``loss_fn(apply, batch)``
    (the training step) each forward is that step's, on the whole batch; without, ``update_bn``'s
    own (``module(batch[0])`` for a tuple or list batch, ``module(batch)`` else). A pure
    function: the pass runs on a copy of the template, its random draws (dropout) under a key
    derived from the state's."""
    module = to_module(state.replace(params={**state.params, **params}), template)
    first = next(iter(params.values()), None)
    device = first.device if first is not None else None
    with rng.scope(rng.fold_in(state.rng, _BN_KEY)):
        if loss_fn is None:
            swa_utils.update_bn(batches, module, device=device)
        else:  # update_bn hands the wrapper each batch whole (a 1-tuple's element)
            placed = ((_to_device(b, device),) for b in batches)
            swa_utils.update_bn(placed, _StepForward(module, loss_fn), device=None)
    return {k: b.detach() for k, b in module.named_buffers() if k in state.buffers}


def _to_device(batch: Any, device: torch.device | None) -> Any:
    if device is None:
        return batch
    return tree.map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


class StochasticWeightAveraging(Callback):
    """SWA with Lightning's arguments (see the module doc).

    ``swa_lrs``: the learning rate SWA anneals to, one float or one per injected optimizer
    (parameter group). ``swa_epoch_start``: the (1-based) epoch SWA starts at, or a float in
    (0, 1]: that fraction of ``max_epochs``. ``annealing_epochs``: epochs of annealing (0:
    ``swa_lrs`` at once). ``annealing_strategy``: "cos" or "linear". ``avg_fn(averaged,
    current, num_averaged)``: another average (default: the running mean, as
    ``AveragedModel``). ``device``: where the average is kept (default "cpu", as Lightning;
    None keeps it with the parameters).
    """

    def __init__(
        self,
        swa_lrs: float | Sequence[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        avg_fn: AvgFn | None = None,
        device: torch.device | str | None = "cpu",
        *,
        name: str | None = None,
    ) -> None:
        if isinstance(swa_epoch_start, float):
            if not 0 < swa_epoch_start <= 1:
                raise ValueError(
                    f"swa_epoch_start as a float must be in (0, 1], got {swa_epoch_start}"
                )
        elif not (
            isinstance(swa_epoch_start, int)
            and not isinstance(swa_epoch_start, bool)
            and swa_epoch_start >= 1
        ):
            raise ValueError(
                f"swa_epoch_start must be an int >= 1 or a float in (0, 1], got {swa_epoch_start!r}"
            )
        lrs = swa_lrs if isinstance(swa_lrs, (list, tuple)) else [swa_lrs]
        if not lrs or not all(_positive(x) for x in lrs):
            raise ValueError(f"swa_lrs must be a positive float or a list of them, got {swa_lrs!r}")
        if not (
            isinstance(annealing_epochs, int)
            and not isinstance(annealing_epochs, bool)
            and annealing_epochs >= 0
        ):
            raise ValueError(f"annealing_epochs must be an int >= 0, got {annealing_epochs!r}")
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(
                f"annealing_strategy must be 'cos' or 'linear', got {annealing_strategy!r}"
            )
        if avg_fn is not None and not callable(avg_fn):
            raise TypeError(f"avg_fn must be callable, got {type(avg_fn).__name__}")
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a torch.device, a str or None, got {device!r}")
        self.swa_lrs = swa_lrs
        self.swa_epoch_start = swa_epoch_start
        self.annealing_epochs = annealing_epochs
        self.annealing_strategy = annealing_strategy
        self.avg_fn = avg_fn
        self.device = device
        if name is not None:
            self.name = name

    # ------------------------------------------------------------------ pure decisions

    def init(self) -> dict[str, Any]:
        return {"average": None, "n_averaged": 0, "latest_update_epoch": -1, "initial_lrs": None}

    def bounds(self, max_epochs: int) -> tuple[int, int]:
        """``(swa_start, swa_end)``: the 0-based first and last SWA epochs (Lightning's)."""
        start = self.swa_epoch_start
        if isinstance(start, float):
            start = int(max_epochs * start)
        return max(start - 1, 0), max_epochs - 1

    def alpha(self, epochs_into_swa: int) -> float:
        """How far the learning rate has moved from its initial value to ``swa_lrs`` in the
        ``epochs_into_swa``-th SWA epoch (0-based): ``SWALR``'s annealing."""
        if self.annealing_epochs == 0:
            return 1.0
        t = max(0.0, min(1.0, epochs_into_swa / self.annealing_epochs))
        if self.annealing_strategy == "cos":
            return (1 - math.cos(math.pi * t)) / 2
        return t

    def lrs_for(self, epoch: int, initial: Sequence[float], max_epochs: int) -> list[float]:
        """The learning rate of each injected optimizer in SWA epoch ``epoch``."""
        start, _ = self.bounds(max_epochs)
        a = self.alpha(epoch - start)
        targets = self._targets(len(initial))
        return [s * a + lr * (1 - a) for s, lr in zip(targets, initial)]

    def _targets(self, count: int) -> list[float]:
        lrs = list(self.swa_lrs) if isinstance(self.swa_lrs, (list, tuple)) else None
        if lrs is None:
            return [float(self.swa_lrs)] * count
        if len(lrs) != count:
            raise ValueError(
                f"swa_lrs has {len(lrs)} values but the optimizer state has {count} injected "
                "learning rate(s); give one per parameter group, or a single float"
            )
        return [float(x) for x in lrs]

    @staticmethod
    def _max_epochs(ctx: Context) -> int:
        max_epochs = getattr(ctx.config, "max_epochs", None)
        if not isinstance(max_epochs, int) or max_epochs < 1:
            raise ValueError(
                "StochasticWeightAveraging needs Trainer(max_epochs=N): SWA runs over the last "
                f"epochs of the run (max_epochs is {max_epochs!r})"
            )
        return max_epochs

    @staticmethod
    def _current_lrs(opt_state: Any) -> list[float]:
        found = [s.hyperparams["lr"] for s in find_injected(opt_state) if "lr" in s.hyperparams]
        if not found or any(isinstance(x, tuple) for x in found):
            raise ValueError(
                "StochasticWeightAveraging sets the learning rate: build the optimizer with "
                "engine.optim.inject_hyperparams(...)(lr=...) so the state holds it"
            )
        return [float(x) for x in found]

    # ------------------------------------------------------------------ events

    def on_fit_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        max_epochs = self._max_epochs(ctx)
        self._targets(len(self._current_lrs(ctx.state.opt_state)))  # fail before step 1
        model = ctx.extra.get("model")
        if (
            has_batchnorm(model)
            and ctx.extra.get("training_step") is None
            and type(model).forward is nn.Module.forward
        ):
            raise ValueError(
                "StochasticWeightAveraging recomputes the BatchNorm statistics at the end, but "
                f"the model ({type(model).__name__}) has no forward and the training step "
                "cannot stand in for it (manual optimization): give the model a forward, or "
                "use a model without BatchNorm"
            )
        start, end = self.bounds(max_epochs)
        if start > end:
            raise ValueError(
                f"swa_epoch_start={self.swa_epoch_start!r} starts SWA after the last epoch "
                f"(max_epochs={max_epochs})"
            )
        return state, NOTHING

    def on_train_epoch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        max_epochs = self._max_epochs(ctx)
        start, end = self.bounds(max_epochs)
        epoch = ctx.epoch
        if not start <= epoch <= end:
            return state, NOTHING
        new = dict(state)
        if new["initial_lrs"] is None:
            new["initial_lrs"] = tuple(self._current_lrs(ctx.state.opt_state))
        if epoch > new["latest_update_epoch"]:
            new["average"] = average_update(
                new["average"],
                ctx.state.params,
                new["n_averaged"],
                avg_fn=self.avg_fn,
                device=self.device,
            )
            new["n_averaged"] += 1
            new["latest_update_epoch"] = epoch
        lrs = self.lrs_for(epoch, new["initial_lrs"], max_epochs)
        return new, Requests(hyperparams={"lr": lrs if len(lrs) > 1 else lrs[0]})

    def on_train_batch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        """Hold SWA's learning rate for every batch of an SWA epoch. The task's own
        schedulers keep running: a step-interval one sets its rate before every batch, and an
        epoch one sets its rate again when a run resumes mid-epoch (where
        ``on_train_epoch_start`` does not fire); Lightning swaps the scheduler for ``SWALR``."""
        if state["initial_lrs"] is None:
            return state, NOTHING
        max_epochs = self._max_epochs(ctx)
        start, end = self.bounds(max_epochs)
        if not start <= ctx.epoch <= end:
            return state, NOTHING
        lrs = self.lrs_for(ctx.epoch, state["initial_lrs"], max_epochs)
        if self._current_lrs(ctx.state.opt_state) == lrs:
            return state, NOTHING
        return state, Requests(hyperparams={"lr": lrs if len(lrs) > 1 else lrs[0]})

    def on_train_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if state["average"] is None:
            return state, NOTHING
        _, end = self.bounds(self._max_epochs(ctx))
        if ctx.epoch != end + 1:  # stopped before the last epoch: Lightning keeps the weights
            return state, NOTHING
        params = {
            k: v.to(ctx.state.params[k].device, ctx.state.params[k].dtype)
            for k, v in conform(state["average"], ctx.state.params).items()
        }
        weights: dict[str, Any] = {"params": params}
        model = ctx.extra.get("model")
        data = ctx.extra.get("train_data")
        if has_batchnorm(model) and data is not None:
            source, num = data
            batches = source.iterate(ctx.epoch)
            if num is not None and num != math.inf:
                batches = (b for _, b in zip(range(int(num)), batches))
            loss_fn = ctx.extra.get("training_step")
            weights["buffers"] = recompute_batchnorm(ctx.state, model, params, batches, loss_fn)
        return state, Requests(weights=weights)
