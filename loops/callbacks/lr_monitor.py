"""Log the learning rates (and optionally momentum, weight decay) the optimizer state holds.

Hyper-parameters are visible only when the optimizer was built with
``engine.optim.inject_hyperparams``: they then live in the state as 0-d tensors. This
callback walks ``ctx.state.opt_state`` (through chains, masks, partitions and any other
wrapper state), finds each injected learning rate and logs it under Lightning's names:
``lr-<Optimizer>``, with ``/<label>`` (or ``/pg<i>``) for each partition it sits in, a
``-1``, ``-2`` suffix for repeats, and ``-momentum`` / ``-weight_decay`` for the others.

``<Optimizer>`` is torch's class name for the named optimizers, which the injected state
records (``lr-SGD``, ``lr-Adam``, ``lr-AdamW``, ``lr-RMSprop``, ``lr-Adagrad``); for other
factories it is the inner optimizer state's class name less ``State``. With several
optimizers (a ``MultiOptState``) each is named the same way, in configuration order
(``lr-Adam``, ``lr-Adam-1``, ...), unless its scheduler config has a ``name``, which
replaces ``lr-<Optimizer>`` (Lightning's rule).

**Which value.** Per step (``logging_interval="step"``) the monitor logs at the end of each
batch that stepped, on the logging cadence, from the state after the step: what the
injected state holds then is the value that step used (a schedule injected into the
optimizer records the value it evaluated; a scheduler config writes its value before the
batch). So the row of step ``k`` carries the learning rate step ``k`` trained with. Per
epoch, it logs at ``on_train_epoch_start``, after the epoch's schedulers set their values.
The value logged is the float the optimizer runs with (the injected 0-d float64 tensor,
read as a Python float, as Lightning logs ``param_group["lr"]``): ``lr=0.1`` logs exactly
0.1, not its float32 rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from purestep.engine.optim import InjectHyperparamsState, MultiOptState, PartitionState

from .. import schedule
from ..config import default_config
from ..events import NOTHING, Context, Requests
from .base import Callback

__all__ = ["Injected", "LearningRateMonitor", "find_hyperparams", "should_log_step"]

_LR_KEYS = ("lr", "learning_rate")
# Lower-case factory names (as an optimizer state may record them) -> torch's class names.
_TORCH_NAMES = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "rmsprop": "RMSprop",
    "adagrad": "Adagrad",
}
# States of wrappers, which say nothing about which optimizer runs inside them.
_WRAPPER_STATES = frozenset(
    {
        "EmptyState",
        "InjectHyperparamsState",
        "MaskedState",
        "PartitionState",
        "AccumulateState",
        "SkipNonFiniteState",
        "ScaleByScheduleState",
    }
)


class Injected(NamedTuple):
    """One injected optimizer found in an optimizer state: its log name (``lr-Adam/decay``)
    and its hyper-parameters (name -> 0-d tensor, or a tuple of them)."""

    key: str
    hyperparams: Mapping[str, Any]


def find_hyperparams(opt_state: Any, names: Mapping[str, str] | None = None) -> list[Injected]:
    """Every injected optimizer (one with a learning rate) in ``opt_state``, in tree order,
    named as ``LearningRateMonitor`` logs it. ``names``: optimizer name -> the log name its
    scheduler config gives (several optimizers)."""
    found: list[tuple[str, tuple[str, ...], Mapping[str, Any]]] = []
    names = names or {}
    if isinstance(opt_state, MultiOptState):
        for optimizer, inner in opt_state.states.items():
            own: list[tuple[str, tuple[str, ...], Mapping[str, Any]]] = []
            _walk(inner, (), own)
            given = names.get(optimizer)
            found += [(given, g, h) if given else (f"lr-{n}", g, h) for n, g, h in own]
    else:
        _walk(opt_state, (), found)
        # one optimizer: its scheduler's name, whatever the optimizer is called
        given = next(iter(names.values())) if len(names) == 1 else names.get("0")
        found = [(given, g, h) if given else (f"lr-{n}", g, h) for n, g, h in found]
    seen: dict[str, int] = {}
    out = []
    for base, groups, hyperparams in found:
        suffix = "".join(f"/{g}" for g in groups)
        repeat = seen.get(base + suffix, 0)
        seen[base + suffix] = repeat + 1
        key = (f"{base}-{repeat}" if repeat else base) + suffix
        out.append(Injected(key, hyperparams))
    return out


def _walk(node: Any, groups: tuple[str, ...], found: list) -> None:
    if isinstance(node, torch.Tensor):
        return
    if isinstance(node, InjectHyperparamsState):
        if any(k in node.hyperparams for k in _LR_KEYS):
            found.append((_optimizer_name(node), groups, node.hyperparams))
        _walk(node.inner_state, groups, found)
    elif isinstance(node, PartitionState):
        for i, (label, inner) in enumerate(node.inner_states.items()):
            _walk(inner, (*groups, label if isinstance(label, str) else f"pg{i + 1}"), found)
    elif isinstance(node, (tuple, list)):
        for child in node:
            _walk(child, groups, found)
    elif isinstance(node, Mapping):
        for child in node.values():
            if not isinstance(child, torch.Tensor):
                _walk(child, groups, found)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            _walk(getattr(node, f.name), groups, found)


def _optimizer_name(state: InjectHyperparamsState) -> str:
    """The name the state records (``optim.adamw``'s: ``AdamW``), else its inner optimizer
    state's class less ``State``."""
    recorded = getattr(state, "name", None)
    if isinstance(recorded, str) and recorded:
        return _TORCH_NAMES.get(recorded, recorded)
    return _state_name(state.inner_state) or "Optimizer"


def _state_name(node: Any) -> str | None:
    if isinstance(node, (tuple, list)):
        for child in reversed(node):
            name = _state_name(child)
            if name:
                return name
        return None
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return None
    cls = type(node).__name__
    if cls not in _WRAPPER_STATES and cls.endswith("State") and len(cls) > len("State"):
        return cls[: -len("State")]
    for f in dataclasses.fields(node):
        name = _state_name(getattr(node, f.name))
        if name:
            return name
    return None


def should_log_step(ctx: Context) -> bool:
    """Lightning's step-logging cadence, asked before the step of this batch runs:
    ``(batches_that_stepped + 1) % log_every_n_steps == 0`` or a stop was requested
    (``log_every_n_steps == 0``: never)."""
    return schedule.should_log_step(
        ctx.config or default_config(), ctx.progress.step, ctx.should_stop
    )


class LearningRateMonitor(Callback):
    """Log injected learning rates at training batch starts and/or epoch starts.

    ``logging_interval``: ``"step"`` (at ``on_train_batch_start``, on the logging cadence),
    ``"epoch"`` (at ``on_train_epoch_start``) or ``None`` (both). ``log_momentum`` adds
    ``-momentum`` (``momentum``, or ``betas[0]`` for Adam-like optimizers) and
    ``log_weight_decay`` adds ``-weight_decay``, when those are injected too.
    """

    def __init__(
        self,
        logging_interval: str | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
        name: str | None = None,
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}) must be "
                "None, 'step' or 'epoch'"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        if name is not None:
            self.name = name

    def on_train_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if ctx.extra.get("num_loggers") == 0:
            raise ValueError(
                "Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger."
            )
        found = find_hyperparams(ctx.state.opt_state, ctx.extra.get("lr_scheduler_names"))
        if not found:
            return state, Requests(
                messages=(
                    "LearningRateMonitor: the optimizer state holds no learning rate, so none "
                    "is logged. Build the optimizer with engine.optim.inject_hyperparams, e.g. "
                    "optim.inject_hyperparams(optim.adamw)(lr=1e-3), to make it visible.",
                )
            )
        messages = []
        for item in found:
            hp = item.hyperparams
            if self.log_momentum and "momentum" not in hp and "betas" not in hp:
                messages.append(
                    f"LearningRateMonitor: {item.key} has no injected momentum or betas, so "
                    f"{item.key}-momentum is not logged; pass them to the injected factory."
                )
            if self.log_weight_decay and "weight_decay" not in hp:
                messages.append(
                    f"LearningRateMonitor: {item.key} has no injected weight_decay, so "
                    f"{item.key}-weight_decay is not logged; pass it to the injected factory."
                )
        return state, Requests(messages=tuple(messages)) if messages else NOTHING

    def on_train_batch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if self.logging_interval == "epoch":
            return state, NOTHING
        stepped = getattr(ctx.outputs, "stepped", True)
        if not stepped:
            return state, NOTHING
        # this batch's step index: the counter before the step counted it
        index = max(ctx.progress.step - 1, 0)
        if not schedule.should_log_step(ctx.config or default_config(), index, ctx.should_stop):
            return state, NOTHING
        return state, self._log(ctx)

    def on_train_epoch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if self.logging_interval == "step":
            return state, NOTHING
        return state, self._log(ctx)

    def values(self, opt_state: Any, names: Mapping[str, str] | None = None) -> dict[str, float]:
        """The values this monitor logs for ``opt_state``: log name -> float (``names``: the
        scheduler configs' log names, by optimizer)."""
        out: dict[str, float] = {}
        for key, hp in find_hyperparams(opt_state, names):
            lr = next(hp[k] for k in _LR_KEYS if k in hp)
            out[key] = float(lr)
            if self.log_momentum:
                if "momentum" in hp:
                    out[f"{key}-momentum"] = float(hp["momentum"])
                elif "betas" in hp:
                    out[f"{key}-momentum"] = float(hp["betas"][0])
            if self.log_weight_decay and "weight_decay" in hp:
                out[f"{key}-weight_decay"] = float(hp["weight_decay"])
        return out

    def _log(self, ctx: Context) -> Requests:
        values = self.values(ctx.state.opt_state, ctx.extra.get("lr_scheduler_names"))
        if not values:
            return NOTHING
        # 0-d float64 tensors: the driver turns a Python float into a float32 tensor, which
        # would log 0.1 as 0.10000000149011612; the loggers get the optimizer's own float
        return Requests(log={k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()})
