"""Aggregate the values steps return into what loggers, the progress bar and callbacks see.

A step's loss and metrics play the part of Lightning's ``self.log`` calls. Each value is
logged under ``<stage>_<name>`` (``train_loss``, ``val_acc``, ``test_loss``; a name that
already starts with the prefix is kept as it is). Per stage the defaults are Lightning's:
training values are logged per step, evaluation values per epoch (averaged over the
evaluation, weighted by batch size). Wrap a value in ``log(value, on_step=..., on_epoch=...,
reduce=..., prog_bar=..., logger=...)`` to choose. A value may be a number, a scalar tensor
or an ``engine.metrics`` metric (e.g. ``Accuracy.of(logits, y)``), which merges exactly.
When both ``on_step`` and ``on_epoch`` are set the names fork into ``<name>_step`` and
``<name>_epoch``. A 1-D tensor (one value per member of an ensemble) is logged per element
as ``<name>/<i>`` and as the mean of its elements under ``<name>``. The training loss is
logged as ``train_loss`` per step; to log it otherwise, return it among the metrics too:
``return loss, {"loss": log(loss, on_epoch=True)}``.

The epoch accumulators are ``engine.metrics`` pytrees kept in the training state, so a run
resumed mid-epoch reports the same epoch averages as one never interrupted.

A value wrapped in ``keep(metric)`` is not reported at all: the loops merge it into the
state's kept accumulators (in the loop state's ``train_epoch``, beside the training epoch's
own, whichever stage's step returned it), which outlive epochs and evaluations and which
callbacks replace or drop with ``Requests(kept=...)``. It is how a step adds lasting state:
a Lightning-style module's torchmetrics states (``loops.lightning.metric_states``). A kept
value whose ``dropped_after`` names a stage lasts until that stage's epoch ends (after its
``on_train_epoch_end``; an evaluation's after its ``on_validation_end`` / ``on_test_end``):
the loops drop it then (``drop_ended``), before the next commit point.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from purestep.engine import metrics as M
from purestep.engine.tree import field, struct

__all__ = [
    "KEPT",
    "Logged",
    "MetricSpec",
    "accumulate",
    "drop_ended",
    "epoch_values",
    "keep",
    "kept",
    "log",
    "plain_step_values",
    "put_kept",
    "reported",
    "resolve",
    "specs_of",
    "step_values",
]

_REDUCERS = {"mean": M.Mean, "sum": M.Sum, "max": M.Max, "min": M.Min}
_REDUCE_FUNCTIONS = {
    torch.mean: "mean",
    torch.sum: "sum",
    torch.max: "max",
    torch.min: "min",
    sum: "sum",
    max: "max",
    min: "min",
}
_STAGE_PREFIX = {"train": "train_", "validate": "val_", "sanity_check": "val_", "test": "test_"}


@struct
class Logged:
    """A value with logging options (see ``log``)."""

    value: Any
    on_step: bool | None = field(static=True, default=None)
    on_epoch: bool | None = field(static=True, default=None)
    reduce: str = field(static=True, default="mean")
    prog_bar: bool | None = field(static=True, default=None)
    logger: bool = field(static=True, default=True)
    #: False: the name is logged as given, without the stage's prefix (``self.log`` of a
    #: Lightning-style module names its values itself)
    prefix: bool = field(static=True, default=True)
    #: True: a kept accumulator, never reported (``keep``)
    kept: bool = field(static=True, default=False)


def log(
    value: Any,
    *,
    on_step: bool | None = None,
    on_epoch: bool | None = None,
    reduce: Any = "mean",
    prog_bar: bool | None = None,
    logger: bool = True,
) -> Logged:
    """Mark a returned value with how to log it (defaults depend on the stage).

    ``on_step`` / ``on_epoch``: Lightning's defaults when None (training: per step;
    evaluation: per epoch). ``reduce``: how the epoch value combines the steps' values,
    ``"mean"`` (weighted by batch size; also ``"avg"``), ``"sum"``, ``"max"`` or ``"min"``
    (or ``torch.mean``, ``torch.sum``, ``torch.max``, ``torch.min``, ``sum``, ``max``,
    ``min``); ``engine.metrics`` values merge by their own rule. ``prog_bar``: show on the
    progress bar (default: only the loss). ``logger``: send to the loggers.
    """
    name = _REDUCE_FUNCTIONS.get(reduce) if callable(reduce) else None
    if name is None and isinstance(reduce, str):
        name = {"avg": "mean"}.get(reduce.lower(), reduce.lower())
    if name not in _REDUCERS:
        raise ValueError(
            f"log(reduce=...) must be one of {sorted(_REDUCERS)} (or torch.mean, torch.sum, "
            f"torch.max, torch.min), got {reduce!r}"
        )
    for flag, value_ in (("on_step", on_step), ("on_epoch", on_epoch), ("prog_bar", prog_bar)):
        if value_ is not None and not isinstance(value_, bool):
            raise TypeError(f"log({flag}=...) must be a bool or None, got {value_!r}")
    if not isinstance(logger, bool):
        raise TypeError(f"log(logger=...) must be a bool, got {logger!r}")
    if on_step is False and on_epoch is False:
        raise ValueError("log(on_step=False, on_epoch=False) would log nothing")
    return Logged(value, on_step, on_epoch, name, prog_bar, logger)


@struct
class MetricSpec:
    """How one logged name is reported (resolved from ``log`` options and stage defaults)."""

    on_step: bool = field(static=True)
    on_epoch: bool = field(static=True)
    reduce: str = field(static=True)
    prog_bar: bool = field(static=True)
    logger: bool = field(static=True)
    kept: bool = field(static=True, default=False)

    @property
    def forked(self) -> bool:
        return self.on_step and self.on_epoch


#: The spec of every kept value (``keep``): merged per epoch, shown to no one.
KEPT = MetricSpec(
    on_step=False, on_epoch=True, reduce="mean", prog_bar=False, logger=False, kept=True
)


def keep(metric: Any) -> Logged:
    """A step's ``engine.metrics`` value for the loop to keep in the state, unreported: it
    merges (by its own ``merge``) into the kept accumulator of its name, which lasts across
    epochs, evaluations and stages until a callback's ``Requests(kept=...)`` replaces or
    drops it. The name is used as given (no stage prefix)."""
    return Logged(metric, False, True, "mean", False, False, prefix=False, kept=True)


def kept(
    acc: Mapping[str, Any], specs: Mapping[str, MetricSpec], *, ending: str | None = None
) -> dict[str, Any]:
    """The kept accumulators among ``acc`` (see ``keep``); ``ending``: a stage whose epoch
    has ended, whose kept values (``drop_ended``) are left out."""
    return {
        name: m
        for name, m in acc.items()
        if _is_kept(specs, name) and (ending is None or not _ends_with(m, ending))
    }


def drop_ended(acc: Mapping[str, Any], specs: Mapping[str, MetricSpec], stage: str) -> Any:
    """``acc`` without the kept accumulators that end with ``stage``'s epoch: those whose
    ``dropped_after`` names the stage (a Lightning-style module's metric logged from that
    stage's step, which Lightning resets when the epoch ends). ``acc`` itself when none."""
    ended = [name for name, m in acc.items() if _ends_with(m, stage) and _is_kept(specs, name)]
    if not ended:
        return acc
    return {name: m for name, m in acc.items() if name not in ended}


def _ends_with(metric: Any, stage: str) -> bool:
    return stage in getattr(metric, "dropped_after", ())


def reported(acc: Mapping[str, Any], specs: Mapping[str, MetricSpec]) -> dict[str, Any]:
    """The accumulators of ``acc`` that are reported (all but the kept ones)."""
    if not any(_is_kept(specs, name) for name in acc):
        return dict(acc)
    return {name: m for name, m in acc.items() if not _is_kept(specs, name)}


def _is_kept(specs: Mapping[str, MetricSpec], name: str) -> bool:
    spec = specs.get(name)
    return spec is not None and spec.kept


def put_kept(
    acc: Mapping[str, Any], specs: Mapping[str, MetricSpec], changes: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, MetricSpec]]:
    """``(acc, specs)`` with the kept accumulators ``changes`` names replaced by its values
    (``None`` drops one), as a ``Requests(kept=...)`` asks."""
    acc, specs = dict(acc), dict(specs)
    for name, value in changes.items():
        old = specs.get(name)
        if old is not None and not old.kept:
            raise ValueError(f"Requests(kept=...) names {name!r}, which is a logged value")
        if value is None:
            acc.pop(name, None)
            continue
        if not isinstance(value, M.Metric):
            raise TypeError(
                f"Requests(kept={{{name!r}: ...}}) takes an engine.metrics metric or None, got "
                f"{type(value).__name__}"
            )
        acc[name] = value
        specs[name] = KEPT
    return acc, specs


def _full_name(name: str, stage: str) -> str:
    prefix = _STAGE_PREFIX.get(stage, "")
    return name if name.startswith(prefix) else prefix + name


_SPECS: dict[tuple, tuple[str, MetricSpec]] = {}


def _spec(name: str, stage: str, opts: Logged | None) -> tuple[str, MetricSpec]:
    """``(full name, spec)`` for a value logged under ``name`` at ``stage`` (memoised: the
    same names and options come back every batch)."""
    key = (
        stage,
        name,
        None
        if opts is None
        else (
            opts.on_step,
            opts.on_epoch,
            opts.reduce,
            opts.prog_bar,
            opts.logger,
            opts.prefix,
            opts.kept,
        ),
    )
    found = _SPECS.get(key)
    if found is None and opts is not None and opts.kept:
        found = _SPECS[key] = (name, KEPT)
    if found is None:
        training = stage == "train"
        on_step = opts.on_step if opts and opts.on_step is not None else training
        on_epoch = opts.on_epoch if opts and opts.on_epoch is not None else not training
        prog_bar = opts.prog_bar if opts and opts.prog_bar is not None else name == "loss"
        spec = MetricSpec(
            on_step=on_step,
            on_epoch=on_epoch,
            reduce=opts.reduce if opts else "mean",
            prog_bar=prog_bar,
            logger=opts.logger if opts else True,
        )
        full = name if opts is not None and not opts.prefix else _full_name(name, stage)
        found = _SPECS[key] = (full, spec)
    return found


def resolve(values: Mapping[str, Any], stage: str) -> dict[str, tuple[MetricSpec, Any]]:
    """``{full name: (spec, raw value)}`` for a step's values at ``stage``."""
    out: dict[str, tuple[MetricSpec, Any]] = {}
    for name, value in values.items():
        opts = value if isinstance(value, Logged) else None
        raw = value.value if opts is not None else value
        full, spec = _spec(name, stage, opts)
        if isinstance(raw, torch.Tensor) and raw.dim() == 1 and raw.numel() > 1:
            # one value per ensemble member: each member's, and their mean under the name
            values = raw.detach()
            out[full] = (spec, values.mean())
            member_spec = spec.replace(prog_bar=False) if spec.prog_bar else spec
            for i, value in enumerate(values):
                out[f"{full}/{i}"] = (member_spec, value)
            continue
        out[full] = (spec, raw)
    return out


def _scalar(raw: Any) -> torch.Tensor:
    """The value of one step as a 0-d tensor (metrics are computed, numbers wrapped)."""
    if isinstance(raw, M.Metric):
        return raw.compute()
    if isinstance(raw, torch.Tensor):
        if raw.numel() != 1:
            raise ValueError(
                f"a logged tensor must have one element, got shape {tuple(raw.shape)}; "
                "reduce it in the step or return an engine.metrics metric"
            )
        if raw.dim() == 0 and not raw.requires_grad:
            return raw
        return raw.detach().reshape(())
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return torch.tensor(float(raw))
    raise TypeError(
        f"cannot log a value of type {type(raw).__name__}: return numbers, scalar tensors or "
        "engine.metrics metrics"
    )


def accumulate(
    acc: Mapping[str, Any],
    resolved: Mapping[str, tuple[MetricSpec, Any]],
    batch_size: int,
) -> dict[str, Any]:
    """Epoch accumulators with this step's ``on_epoch`` values merged in.

    Means are weighted by the batch size (as Lightning does); metric objects merge as they
    are. A name logged with a different reduction than before is an error.
    """
    new = dict(acc)
    for name, (spec, raw) in resolved.items():
        if not spec.on_epoch:
            continue
        if isinstance(raw, M.Metric):
            metric = raw
        else:
            value = _scalar(raw)
            cls = _REDUCERS[spec.reduce]
            metric = cls.of(value, weight=batch_size) if cls is M.Mean else cls.of(value)
        old = new.get(name)
        if old is not None and type(old) is not type(metric):
            raise TypeError(
                f"{name!r} was logged as {type(old).__name__} and now as "
                f"{type(metric).__name__}; log a name with one reduction"
            )
        new[name] = metric if old is None else old.merge(metric)
    return new


def step_values(
    resolved: Mapping[str, tuple[MetricSpec, Any]],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(to loggers, to the progress bar, to callbacks)`` for this step's ``on_step`` values.

    Callbacks see the plain name and, when forked, ``<name>_step`` too.
    """
    logger: dict[str, torch.Tensor] = {}
    bar: dict[str, torch.Tensor] = {}
    callback: dict[str, torch.Tensor] = {}
    for name, (spec, raw) in resolved.items():
        if not spec.on_step:
            continue
        value = _scalar(raw)
        key = name + "_step" if spec.forked else name
        if spec.logger:
            logger[key] = value
        if spec.prog_bar:
            bar[key] = value
        callback[name] = value
        if spec.forked:
            callback[key] = value
    return logger, bar, callback


_ROUTES: dict[tuple, tuple | None] = {}


def _route(names: tuple[str, ...], stage: str) -> tuple | None:
    """``(full name, spec)`` per name when every default spec is per step only, else None."""
    route = []
    for name in names:
        full, spec = _spec(name, stage, None)
        if spec.on_epoch:
            return None
        route.append((name, full, spec))
    return tuple(route)


def plain_step_values(
    values: Mapping[str, Any], stage: str, known: Mapping[str, MetricSpec]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """``step_values(resolve(values, stage))`` in one pass for the usual training step output
    — every value a plain scalar tensor with the default (per-step) options, under specs
    already in ``known`` — where ``accumulate`` and the known specs would not change. It runs
    every batch, so it skips the general path's intermediate dicts. None when that does not
    hold: use ``resolve`` / ``step_values`` / ``accumulate``."""
    names = tuple(values)
    key = (names, stage)
    route = _ROUTES.get(key, False)
    if route is False:
        route = _ROUTES[key] = _route(names, stage)
    if route is None:
        return None
    logger: dict[str, torch.Tensor] = {}
    bar: dict[str, torch.Tensor] = {}
    callback: dict[str, torch.Tensor] = {}
    for name, full, spec in route:
        value = values[name]
        if (
            type(value) is not torch.Tensor
            or value.dim() != 0
            or value.requires_grad
            or known.get(full) is not spec
        ):
            return None
        if spec.logger:
            logger[full] = value
        if spec.prog_bar:
            bar[full] = value
        callback[full] = value
    return logger, bar, callback


def epoch_values(
    acc: Mapping[str, Any],
    specs: Mapping[str, MetricSpec],
    suffix: str = "",
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(to loggers, to the progress bar, to callbacks)`` for the accumulated epoch values.

    ``suffix`` (e.g. ``/dataloader_idx_1``) is appended after the ``_epoch`` fork.
    """
    logger: dict[str, torch.Tensor] = {}
    bar: dict[str, torch.Tensor] = {}
    callback: dict[str, torch.Tensor] = {}
    for name, metric in acc.items():
        spec = specs[name]
        if spec.kept:  # state a step keeps, reported to no one
            continue
        value = metric.compute().detach()
        key = (name + "_epoch" if spec.forked else name) + suffix
        if spec.logger:
            logger[key] = value
        if spec.prog_bar:
            bar[key] = value
        callback[name + suffix] = value
        if spec.forked:
            callback[key] = value
    return logger, bar, callback


def specs_of(resolved: Mapping[str, tuple[MetricSpec, Any]]) -> dict[str, MetricSpec]:
    """The specs of a resolved step, by name."""
    return {name: spec for name, (spec, _) in resolved.items()}
