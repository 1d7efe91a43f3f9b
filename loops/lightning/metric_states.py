"""torchmetrics objects in a Lightning-style module, their states as mergeable engine metrics.

A module keeps ``self.acc = torchmetrics.Accuracy(...)``, calls ``self.acc(preds, y)`` in a
step and logs the object: ``self.log("val_acc", self.acc)``. Lightning then logs the batch
value per step and ``compute()`` over the epoch's updates at the epoch's end, then resets
the metric. Here each step starts from the metric's default states (``reset()``), so after
the step the metric holds this batch's states only; ``snapshot`` turns them into a
``TorchMetricState``: an ``engine.metrics`` metric whose fields are those states, merged
with each state's ``dist_reduce_fx`` (sum, max or min; element-wise and in logging order,
as torchmetrics' own updates accumulate) and synced across processes the same way. The
loop keeps the merged states in the training state's epoch accumulators, so they are
checkpointed and a resumed run computes the same epoch value; ``compute()`` loads the
merged states into the torchmetrics object and calls its own ``compute`` (with its
cross-process sync off: the states are synced already). The value per step is
``compute()`` of the batch's states, which is what torchmetrics' ``forward`` returns.

States that are lists (``dist_reduce_fx="cat"``: AUROC without thresholds and the like),
averaged (``"mean"``) or reduced by a custom function are refused, naming the metric:
their merge is not a fixed element-wise rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from purestep.engine import metrics as M
from purestep.engine.tree import field, struct

__all__ = [
    "TorchMetricState",
    "compute_refused",
    "is_torchmetric",
    "metric_modules",
    "snapshot",
]

#: The metric objects ``compute`` loads the states into, by key ("<class>:<path>").
_OBJECTS: dict[str, Any] = {}
_CLASSES: dict[tuple, type] = {}


def is_torchmetric(obj: Any) -> bool:
    """Whether ``obj`` is a ``torchmetrics.Metric`` (without importing torchmetrics)."""
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(obj, tm.Metric)


def _op(metric: Any, name: str) -> str:
    """The engine's sync op for one of ``metric``'s states, or a ``TypeError``."""
    from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum

    reduction = metric._reductions.get(name)
    ops = {dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min"}
    default = metric._defaults[name]
    if isinstance(default, list) or reduction not in ops:
        kind = "a list" if isinstance(default, list) else f"reduced by {reduction!r}"
        raise TypeError(
            f"{type(metric).__name__}'s state {name!r} is {kind}: purestep keeps metric states "
            "that merge element-wise by sum, max or min (Accuracy, F1Score, MeanSquaredError "
            "and most classification and regression metrics); use a metric of that kind, or "
            "thresholds=N for the curve metrics"
        )
    return ops[reduction]


def metric_modules(module: nn.Module) -> dict[str, Any]:
    """The torchmetrics objects among ``module``'s submodules, by path, each checked."""
    found = {}
    for path, sub in module.named_modules():
        if is_torchmetric(sub) and not _is_collection(sub):
            for name in sub._defaults:
                _op(sub, name)
            found[path] = sub
    return found


def _is_collection(obj: Any) -> bool:
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(obj, tm.MetricCollection)


def register(module: nn.Module) -> dict[str, Any]:
    """Find the module's metrics and remember them for ``compute`` (keys by class and path);
    their state classes are made here, before a checkpoint that holds them is read."""
    found = metric_modules(module)
    for path, metric in found.items():
        _OBJECTS[_key(module, path)] = metric
        _state_class(metric)  # now: a checkpoint read before the first step names it
    return found


def _key(module: nn.Module, path: str) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}:{path}"


class TorchMetricState(M.Metric):
    """The base of the per-metric-class state structs (see the module doc)."""

    key: str
    sync_ops: ClassVar[Mapping[str, str]] = {}

    def merge(self, other: TorchMetricState) -> TorchMetricState:
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(self).__name__} with {type(other).__name__}")
        merged = {}
        for name, op in self.sync_ops.items():
            a, b = getattr(self, name), getattr(other, name)
            merged[name] = (
                a + b
                if op == "sum"
                else (torch.maximum(a, b) if op == "max" else torch.minimum(a, b))
            )
        return self.replace(**merged)

    @classmethod
    def empty(cls, *, device: Any = None) -> TorchMetricState:
        raise TypeError(f"{cls.__name__} has no empty value: it comes from a metric's states")

    def states(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.sync_ops}

    def compute(self) -> torch.Tensor:
        metric = _OBJECTS.get(self.key)
        if metric is None:
            raise RuntimeError(
                f"no torchmetrics object for {self.key}: the module that logged it is not being run"
            )
        return load_and_compute(metric, self.states())


def load_and_compute(metric: Any, states: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``metric.compute()`` over ``states``; the metric's own states are put back after."""
    saved = {name: getattr(metric, name) for name in metric._defaults}
    saved_flags = (metric._update_count, metric._computed, metric._to_sync)
    try:
        for name, value in states.items():
            setattr(metric, name, value)
        metric._update_count = max(1, metric._update_count)
        metric._computed = None
        metric._to_sync = False  # synced already, as engine metrics
        value = metric.compute()
    finally:
        for name, value_ in saved.items():
            setattr(metric, name, value_)
        metric._update_count, metric._computed, metric._to_sync = saved_flags
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(
            f"{type(metric).__name__}.compute() gave {type(value).__name__}"
            f"{'' if not isinstance(value, torch.Tensor) else tuple(value.shape)}: self.log "
            "takes metrics whose value is one number (average='macro'/'micro', not 'none')"
        )
    return value.detach().reshape(())


def _state_class(metric: Any) -> type:
    """The ``TorchMetricState`` subclass for ``metric``'s class and states (made once, named
    from them, so a checkpoint written by another process finds the same class)."""
    names = tuple(sorted(metric._defaults))
    ops = tuple(_op(metric, n) for n in names)
    cls_name = f"{type(metric).__module__}.{type(metric).__qualname__}"
    signature = (cls_name, names, ops)
    found = _CLASSES.get(signature)
    if found is None:
        digest = hashlib.sha256(repr(signature).encode()).hexdigest()[:12]
        namespace = {
            "__annotations__": {n: "torch.Tensor" for n in names} | {"key": "str"},
            "__module__": __name__,
            "__qualname__": f"State_{type(metric).__name__}_{digest}",
            "sync_ops": dict(zip(names, ops)),
            **{n: dataclasses.field() for n in names},
            "key": field(static=True),
        }
        found = struct(type(namespace["__qualname__"], (TorchMetricState,), namespace))
        _CLASSES[signature] = found
    return found


def snapshot(metric: Any, key: str) -> TorchMetricState:
    """The metric's current states (this step's) as a ``TorchMetricState``."""
    cls = _state_class(metric)
    states = {n: getattr(metric, n).detach().clone() for n in cls.sync_ops}
    return cls(key=key, **states)


def key_of(module: nn.Module, metric: Any) -> str | None:
    """The registry key of ``metric`` inside ``module`` (None when it is not one of its)."""
    for path, sub in module.named_modules():
        if sub is metric:
            return _key(module, path)
    return None


class compute_refused:
    """Inside a hook the metrics hold one batch's states, not the epoch's: calling their
    ``compute()`` there is refused, naming the way that works, instead of giving a wrong
    number. (Their ``update`` and ``reset`` are harmless.)"""

    def __init__(self, metrics: dict[str, Any], hook: str) -> None:
        self.metrics, self.hook = metrics, hook

    def __enter__(self) -> None:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"metric.compute() in {self.hook} is not supported under purestep.Trainer: "
                "log the metric object from the step instead, self.log('val_acc', self.acc), "
                "and the epoch value is computed over the epoch's updates (and reset) for you"
            )

        self.saved = {path: m.__dict__.get("compute") for path, m in self.metrics.items()}
        for metric in self.metrics.values():
            metric.__dict__["compute"] = refuse

    def __exit__(self, *exc: Any) -> None:
        for path, metric in self.metrics.items():
            metric.__dict__["compute"] = self.saved[path]
