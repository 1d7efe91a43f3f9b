"""``self.log`` / ``self.log_dict`` of a Lightning-style module, as step outputs.

Lightning's ``self.log`` writes into the trainer's result collection. Here a call records
the value in the ``LogBuffer`` of the hook being run; the adapter returns what was recorded
as the step's metrics (``aggregate.Logged`` values, named as given, without a stage prefix),
so the values come out of the pure step, the epoch accumulators live in the ``TrainState``
and a resumed run reports the same epoch values. The defaults follow Lightning's per-hook
table: ``on_step`` in ``training_step`` and the training batch hooks, ``on_epoch``
everywhere else; ``prog_bar=False``, ``logger=True``, ``reduce_fx="mean"`` weighted by
``batch_size`` (else the batch's size, as the loop measures it).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from purestep.engine import metrics as M
from purestep.engine.tree import field, struct

from ..aggregate import Logged, log
from .metric_states import is_torchmetric

__all__ = ["STEP_HOOKS", "LogBuffer", "LightningMean", "batch_size_of"]

#: Hooks whose values Lightning logs per step by default (all others: per epoch).
STEP_HOOKS = frozenset(
    {
        "training_step",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
    }
)
#: Hooks from which Lightning refuses ``self.log`` (nothing would be shown).
NO_LOG_HOOKS = frozenset(
    {
        "predict_step",
        "setup",
        "teardown",
        "prepare_data",
        "configure_optimizers",
        "configure_model",
        "on_fit_start",
        "on_fit_end",
        "on_train_start",
        "on_train_end",
        "on_sanity_check_start",
        "on_sanity_check_end",
        "on_save_checkpoint",
        "on_load_checkpoint",
    }
)


@struct
class LightningMean(M.Metric):
    """The epoch mean of a ``self.log`` value with Lightning's arithmetic, so monitors see
    Lightning's numbers bitwise: a float32 sum of ``value * batch_size`` in logging order and
    an integer count, divided at the end (``engine.metrics.Mean`` sums in float64)."""

    total: torch.Tensor
    count: torch.Tensor
    dtype: torch.dtype = field(static=True, default=torch.float32)

    sync_ops: ClassVar[Mapping[str, str]] = {"total": "sum", "count": "sum"}

    @classmethod
    def of(cls, value: torch.Tensor, batch_size: int) -> LightningMean:
        value = value.detach().to(torch.float32)
        count = torch.tensor(int(batch_size), device=value.device)
        return cls(total=value * batch_size, count=count)

    @classmethod
    def empty(cls, *, device: Any = None) -> LightningMean:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return cls(total=zero, count=torch.zeros((), dtype=torch.int64, device=device))

    def merge(self, other: LightningMean) -> LightningMean:
        return LightningMean(total=self.total + other.total, count=self.count + other.count)

    def compute(self) -> torch.Tensor:
        return self.total / self.count


def batch_size_of(batch: Any) -> int:
    """Lightning's inferred batch size: the first dimension of the first tensor found."""
    if isinstance(batch, torch.Tensor):
        return 1 if batch.dim() == 0 else int(batch.shape[0])
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        items = []
    for item in items:
        found = batch_size_of(item)
        if found:
            return found
    return 0


def _value(value: Any, name: str) -> Any:
    """A loggable value: a number, a one-element tensor, or a metric with ``compute``."""
    if type(value) is torch.Tensor and value.dim() == 0:  # the usual: a scalar tensor
        return value.detach()
    if isinstance(value, bool) or value is None:
        raise ValueError(f"self.log({name!r}, {value!r}): log a number or a one-element tensor")
    if isinstance(value, numbers.Real):
        return torch.tensor(float(value))
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value.detach()
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, ...): `self.log` takes one-element tensors, got shape "
                f"{tuple(value.shape)} (reduce it first, e.g. value.mean())"
            )
        return value.detach().reshape(())
    if isinstance(value, M.Metric) or is_torchmetric(value):
        return value  # a torchmetrics object is read when the hook returns (snapshot)
    raise ValueError(
        f"self.log({name!r}, ...) got a {type(value).__name__}: log a number, a one-element "
        "tensor or an engine.metrics metric"
    )


class LogBuffer:
    """What ``self.log`` recorded in the hook now running (``open`` ... ``take``)."""

    def __init__(self) -> None:
        self.hook: str | None = None
        self._batch: Any = None
        self._outer: list[tuple] = []  # the hooks a nested one runs inside (manual opt.step)
        self._values: dict[str, Logged | torch.Tensor] = {}
        #: whether the last hook's values (``take``) hold a metric object (a torchmetrics
        #: or engine metric), which the adapter then reads
        self.took_metric = False
        self._metric = False

    def open(self, hook: str, batch: Any = None) -> None:
        """Start recording for ``hook``; ``batch`` gives the default ``batch_size``."""
        if self.hook is not None:  # a hook inside a step (manual mode's optimizer step)
            self._outer.append((self.hook, self._values, self._batch, self._metric))
        self.hook, self._values, self._batch, self._metric = hook, {}, batch, False

    def take(self) -> dict[str, Logged | torch.Tensor]:
        """What was logged since ``open``: ``Logged`` values, or plain tensors where the
        loop's defaults for the name are Lightning's (``train_*`` per step)."""
        values, self._values, self.hook = self._values, {}, None
        self.took_metric, self._metric = self._metric, False
        if self._outer:
            self.hook, self._values, self._batch, self._metric = self._outer.pop()
        return values

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Callable = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Lightning's ``LightningModule.log`` (see the module doc). ``sync_dist`` is
        accepted: epoch values of every name are merged exactly across ranks anyway, and
        per-step values are each rank's own (Lightning's default without ``sync_dist``).
        With several evaluation dataloaders the loop appends ``/dataloader_idx_<k>`` to
        every epoch value (``add_dataloader_idx=False`` cannot turn that off here)."""
        hook = self.hook
        if hook is None:
            raise RuntimeError(
                f"self.log({name!r}, ...) was called outside a hook the Trainer runs; log from "
                "training_step, validation_step, test_step or an epoch hook"
            )
        if hook in NO_LOG_HOOKS:
            raise RuntimeError(
                f"self.log({name!r}, ...) cannot be called from {hook} (Lightning refuses it "
                "too): nothing would show it"
            )
        if not isinstance(name, str) or not name:
            raise TypeError(f"self.log: the name must be a non-empty str, got {name!r}")
        per_step = hook in STEP_HOOKS
        on_step = per_step if on_step is None else on_step
        on_epoch = (not per_step) if on_epoch is None else on_epoch
        if not per_step and on_step and hook not in ("validation_step", "test_step"):
            raise ValueError(
                f"self.log({name!r}, on_step=True) in {hook}: an epoch hook has no step to log at"
            )
        if add_dataloader_idx and "/dataloader_idx_" in name:
            raise ValueError(
                f"self.log({name!r}, ...): the evaluation loop adds '/dataloader_idx_<k>' itself "
                "when there are several dataloaders; log the plain name"
            )
        if name in self._values:
            raise ValueError(
                f"self.log({name!r}, ...) was called twice in {hook}; log each name once per call"
            )
        raw = _value(value, name)
        weighted = reduce_fx in ("mean", "avg", torch.mean)
        if type(raw) is not torch.Tensor and (isinstance(raw, M.Metric) or is_torchmetric(raw)):
            self._metric = True
        elif on_epoch and weighted:
            if batch_size is None:  # Lightning infers it from the batch
                batch_size = batch_size_of(self._batch) if self._batch is not None else 1
            raw = LightningMean.of(raw, batch_size or 1)
        if (
            per_step
            and on_step
            and not on_epoch
            and not prog_bar
            and logger is not False
            and name.startswith("train_")
            and type(raw) is torch.Tensor
        ):
            # what the loop does with a plain "train_*" value anyway: no options to carry,
            # and the loop's fast path for plain per-step tensors applies
            self._values[name] = raw
            return
        entry = log(
            raw,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce=reduce_fx,
            prog_bar=bool(prog_bar),
            logger=True if logger is None else bool(logger),
        )
        self._values[name] = entry.replace(prefix=False)

    def log_dict(self, dictionary: Mapping[str, Any], **options: Any) -> None:
        """Lightning's ``log_dict``: ``log`` for each item, with the same options."""
        if not (isinstance(dictionary, Mapping) or callable(getattr(dictionary, "items", None))):
            raise TypeError(f"self.log_dict takes a mapping, got {type(dictionary).__name__}")
        for name, value in dictionary.items():
            self.log(name, value, **options)
