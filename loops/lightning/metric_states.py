"""torchmetrics objects in a Lightning-style module: their states live in the TrainState.

Logged from a step. ``self.log("val_acc", self.acc)`` logs the batch value per step and
``compute()`` over the epoch's updates at the epoch's end. Each step starts from the
metric's default states (``reset()``), so after it the metric holds this batch's states
only; ``snapshot`` turns them into a ``TorchMetricState``: an ``engine.metrics`` metric whose
fields are those states, merged with each state's ``dist_reduce_fx`` (sum, max or min;
element-wise and in logging order, as torchmetrics' own updates accumulate) and synced
across processes the same way. The loop keeps the merged states in the epoch accumulators,
so a resumed run computes the same epoch value; ``compute()`` loads them into the
torchmetrics object and calls its own ``compute`` (its cross-process sync off: the states
are synced already). The value per step is ``compute()`` of the batch's states, which is
what torchmetrics' ``forward`` returns.

Used in hooks (``update`` / ``forward`` in a step, ``compute()`` / ``reset()`` / ``update``
/ ``self.log(name, metric)`` in a hook). Design, in four lines:

1. every metric a step touches also returns its batch's states as a *kept* value
   (``aggregate.keep(KeptStates)``, named ``"torchmetrics/<path>"``): the loops merge it into
   the state's kept accumulator, which is the metric's states since its last ``reset()``, a
   pure function of the state that lasts across epochs, evaluations and stages;
2. a hook runs with every metric loaded from its kept accumulator (``in_hook``; lazily,
   at the hook's first use of the metric), so ``compute()``, ``update`` and ``reset()``
   act on the states torchmetrics would hold;
3. what the hook changed (a reset, an update) goes back as ``Requests(kept=...)``, which
   replaces or drops the accumulator: the steps after it continue from there;
4. ``compute()`` in a hook under several processes merges every rank's states with each
   state's ``dist_reduce_fx`` (the strategy's metric sync, as for logged values; for two
   ranks or integer states that is bitwise torchmetrics' own synced value); a hook runs on
   every rank, so every rank takes part.

So ``update`` in ``validation_step``, ``self.log("val_acc", self.val_acc.compute())`` and
``self.val_acc.reset()`` in ``on_validation_epoch_end`` give torchmetrics' numbers; a metric
never reset keeps accumulating across epochs, as in torchmetrics; checkpoints hold the
states and a resumed run computes the same. Lightning's own rules are kept too: a metric
logged from a step is reset when its stage's epoch ends, as Lightning resets it (its kept
states carry the stage, ``KeptStates.dropped_after``, and the loops drop them after the
``on_train_epoch_end`` hooks, or after an evaluation's ``on_validation_end`` /
``on_test_end``, before the next commit point: a checkpoint there resumes the same), and
``self.log(name, metric)`` in an ``on_*_epoch_end`` hook logs its ``compute()`` and then
resets it. The sanity check leaves no trace (its updates
are dropped with it; Lightning keeps them in a metric that is never reset).

Refused, each with an error naming the way that works: ``compute()`` inside a step (a step
sees its batch only: use what ``forward`` returns, ``value = self.acc(preds, y)``, or
compute in an epoch hook); ``compute()``, ``reset()`` or ``update`` in
``on_before_optimizer_step`` (the batch's update is not merged yet); ``self.log(name,
metric)`` in a hook other than ``on_*_epoch_end``. Updates in ``predict_step`` are not kept
(a warning says so). Under DDP each rank keeps its own states, and a checkpoint holds
every rank's (``loops.resume``: the loop's per-rank accumulators are gathered when it is
written), so each rank of a resumed run continues from its own.

States that are lists (``dist_reduce_fx="cat"``: AUROC without thresholds and the like),
averaged (``"mean"``) or reduced by a custom function are refused, naming the metric:
their merge is not a fixed element-wise rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from purestep.engine import metrics as M
from purestep.engine.tree import field, struct

from .. import aggregate
from .deferred_metrics import PENDING, deferred, load_pending

__all__ = [
    "KEPT_PREFIX",
    "KeptStates",
    "TorchMetricState",
    "end_step",
    "in_hook",
    "is_torchmetric",
    "metric_modules",
    "snapshot",
    "start_step",
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
    _STEP.close()  # a run starts: nothing of an earlier one's failed step is left
    for path, metric in found.items():
        _OBJECTS[_key(module, path)] = metric
        _state_class(metric)  # now: a checkpoint read before the first step names it
        _unguard(metric)
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


# ---------------------------------------------------------------------- kept states

#: A metric's kept accumulator is named ``KEPT_PREFIX + <its path in the module>``.
KEPT_PREFIX = "torchmetrics/"
#: The update count a step's metrics start from: below it after the step, ``reset()`` was
#: called in the step (torchmetrics' ``reset`` sets the count to 0; ``forward`` and
#: ``update`` add one).
_FRESH = 1 << 40


@struct
class KeptStates(M.Metric):
    """A metric's states since its last ``reset()``, kept in the TrainState (see the module
    doc): ``states`` by name, ``updates`` (torchmetrics' update count, for its warnings),
    ``ops`` how each state merges (its ``dist_reduce_fx``). A step's value with
    ``restart=True`` (the step called ``reset()``) replaces what it is merged into instead
    of adding to it. ``dropped_after``: the stages (``Stage.TRAIN``, ``VALIDATE``, ``TEST``)
    whose step logged the metric during the stage's epoch: the loops drop the kept states
    when that epoch ends (``aggregate.drop_ended``), as Lightning resets a logged metric."""

    states: dict[str, torch.Tensor]
    updates: torch.Tensor
    key: str = field(static=True)
    ops: tuple[tuple[str, str], ...] = field(static=True)
    restart: bool = field(static=True, default=False)
    dropped_after: tuple[str, ...] = field(static=True, default=())

    def merge(self, other: KeptStates) -> KeptStates:
        if type(other) is not type(self) or other.ops != self.ops:
            raise TypeError(f"cannot merge the kept states of {self.key} with {other!r}")
        ends = self.dropped_after
        if other.dropped_after != ends:  # logged in this epoch by either: still so
            ends = tuple(sorted({*ends, *other.dropped_after}))
        if other.restart:
            return other.replace(restart=False, dropped_after=ends)
        merged = {}
        for name, op in self.ops:
            a, b = self.states[name], other.states[name]
            merged[name] = (
                a + b
                if op == "sum"
                else (torch.maximum(a, b) if op == "max" else torch.minimum(a, b))
            )
        return self.replace(states=merged, updates=self.updates + other.updates, dropped_after=ends)

    @classmethod
    def empty(cls, *, device: Any = None) -> KeptStates:
        raise TypeError("KeptStates has no empty value: it comes from a metric's states")

    def compute(self) -> torch.Tensor:
        """This process's value (no cross-process merge: that is the hooks' ``compute()``)."""
        metric = _OBJECTS.get(self.key)
        if metric is None:
            raise RuntimeError(f"no torchmetrics object for {self.key}")
        return load_and_compute(metric, self.states)


_OPS: dict[tuple, tuple[tuple[str, str], ...]] = {}


def _kept(
    metric: Any,
    key: str,
    updates: int,
    restart: bool,
    states: Mapping[str, torch.Tensor] | None = None,
    dropped_after: tuple[str, ...] = (),
) -> KeptStates:
    """``states`` (by default ``metric``'s now) as ``KeptStates``, copied: the metric goes
    on changing."""
    names = tuple(sorted(metric._defaults))
    ops = _OPS.get((type(metric), names))
    if ops is None:
        ops = _OPS[(type(metric), names)] = tuple((n, _op(metric, n)) for n in names)
    states = _states(metric) if states is None else states
    return KeptStates(
        states={n: states[n].detach().clone() for n, _ in ops},
        updates=torch.tensor(int(updates), dtype=torch.int64),
        key=key,
        ops=ops,
        restart=restart,
        dropped_after=dropped_after,
    )


def _states(metric: Any) -> dict[str, torch.Tensor]:
    return {n: getattr(metric, n) for n in metric._defaults}


def _load(metric: Any, states: Mapping[str, torch.Tensor], updates: int) -> None:
    for name, value in states.items():
        setattr(metric, name, value)
    metric._update_count = updates
    metric._computed = None
    metric._forward_cache = None


# ---------------------------------------------------------------------- in a step


class _Step:
    """The step being run: its hook, and the metrics whose ``compute()`` it called."""

    def __init__(self) -> None:
        self.hook: str | None = None
        self.computed: list[str] = []

    def close(self) -> None:
        self.hook, self.computed = None, []


_STEP = _Step()


def _guard(metric: Any, path: str) -> None:
    """``metric.compute()`` noted when a step calls it (``forward`` computes the batch value
    with ``_should_unsync`` off: not noted). torchmetrics keeps ``compute`` on the instance
    and leaves it out of pickles and copies, so this wrapper never travels with one."""
    original = metric.__dict__.get("compute")
    if original is None or getattr(original, "_purestep_original", None) is not None:
        return

    def compute(*args: Any, **kwargs: Any) -> Any:
        if _STEP.hook is not None and metric._should_unsync:
            _STEP.computed.append(path)
        return original(*args, **kwargs)

    compute._purestep_original = original
    metric.__dict__["compute"] = compute


def _unguard(metric: Any) -> None:
    original = getattr(metric.__dict__.get("compute"), "_purestep_original", None)
    if original is not None:
        metric.__dict__["compute"] = original


def start_step(metrics: Mapping[str, Any], hook: str) -> None:
    """Before a step: each metric at its default states (the step updates its batch's only)."""
    _STEP.hook, _STEP.computed = hook, []
    for path, metric in metrics.items():
        metric.reset()
        metric._update_count = _FRESH
        _guard(metric, path)


#: The stage whose epoch a step's logged metric belongs to (``KeptStates.dropped_after``).
_STAGE_OF = {"training_step": "train", "validation_step": "validate", "test_step": "test"}


def end_step(module: nn.Module, metrics: Mapping[str, Any], logged: set[str]) -> dict[str, Any]:
    """After a step: the kept value (``aggregate.keep``) of every metric it touched, by name.
    ``logged``: the paths of the metrics it logged: their kept states are dropped when the
    stage's epoch ends (``KeptStates.dropped_after``), as Lightning resets them then."""
    hook, computed = _STEP.hook, _STEP.computed
    _STEP.close()
    stage = _STAGE_OF.get(hook)
    out = {}
    for path, metric in metrics.items():
        _unguard(metric)
        count = metric._update_count
        reset = count < _FRESH
        updates = count if reset else count - _FRESH
        metric._update_count = updates
        if not reset and not updates:
            continue  # not touched by this step
        if hook == "predict_step":
            _warn_predict(module, path)
            continue
        ends = (stage,) if stage is not None and path in logged else ()
        kept = _kept(metric, _key(module, path), updates, reset, dropped_after=ends)
        out[KEPT_PREFIX + path] = aggregate.keep(kept)
    if computed:
        path = computed[0]
        raise NotImplementedError(
            f"{type(module).__name__}.{hook} called {path}.compute(): under purestep.Trainer a "
            "step holds its batch's states only, so it cannot give torchmetrics' value over "
            "the updates so far. Use the batch value forward returns (value = "
            f"self.{path}(preds, target)), or compute() in an epoch hook (on_train_epoch_end, "
            "on_validation_epoch_end), where the metric holds every update since its reset()"
        )
    return out


_WARNED: set[tuple[type, str]] = set()


def _warn_predict(module: nn.Module, path: str) -> None:
    if (type(module), path) in _WARNED:
        return
    _WARNED.add((type(module), path))
    warnings.warn(
        f"{type(module).__name__}.predict_step updated the metric {path}: under purestep.Trainer "
        "the updates of predict_step are not kept, so compute() in a hook does not see them",
        UserWarning,
        stacklevel=4,
    )


# ---------------------------------------------------------------------- in a hook


def _sync(metric: Any, states: Mapping[str, torch.Tensor], strategy: Any) -> dict[str, Any]:
    """``states`` merged across every process with each state's ``dist_reduce_fx``."""
    cls = _state_class(metric)
    merged = strategy.sync_metrics({"m": cls(key="sync", **dict(states))})["m"]
    return merged.states()


def _computing(metric: Any, original: Any, strategy: Any, to_sync: bool) -> Any:
    """``metric.compute`` in a hook: over every process's states when the metric syncs on
    compute and several processes run (torchmetrics' own sync stays off: the strategy
    merges, as for logged values), then the metric's own states again."""

    def compute(*args: Any, **kwargs: Any) -> Any:
        if strategy is None or not to_sync:
            return original(*args, **kwargs)
        local = _states(metric)
        try:
            for name, value in _sync(metric, local, strategy).items():
                setattr(metric, name, value)
            return original(*args, **kwargs)
        finally:
            for name, value in local.items():
                setattr(metric, name, value)

    return compute


def _refused(hook: str, path: str) -> Any:
    def compute(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{path}.compute() in {hook} is not supported under purestep.Trainer: the batch's "
            "update is merged into the metric's states after the optimizer step; compute it "
            "in on_train_batch_end or an epoch hook"
        )

    return compute


class in_hook:
    """A hook's view of the metrics: each loaded with its kept states (a copy) from
    ``state``, its ``compute()`` merging every process's states; after the hook, what it
    changed (``changes``: path -> new ``KeptStates`` or None for none) and each metric put
    back as it was. ``finish`` turns the metric objects the hook logged into numbers.

    A metric is loaded when the hook first reads or writes one of its states, update
    counters or methods (``deferred_metrics``): most hooks touch none, and then cost nothing per
    metric but a class swap each way."""

    def __init__(self, metrics: Mapping[str, Any], ctx: Any, hook: str, view: Any = None):
        self.metrics, self.hook = metrics, hook
        self.state = ctx.state
        several = getattr(ctx, "world_size", 1) > 1
        self.strategy = getattr(view, "strategy", None) if several and view is not None else None
        self.changes: dict[str, KeptStates | None] = {}
        self.after: dict[str, tuple[dict[str, torch.Tensor], int]] = {}

    def __enter__(self) -> in_hook:
        self.saved: dict[str, tuple] = {}
        self.loaded: dict[str, tuple] = {}
        self.classes: dict[str, type] = {}
        # inside a training batch (in manual optimization, inside its step): nothing loaded
        self.refuse = self.hook == "on_before_optimizer_step"
        if not self.refuse:
            _STEP.close()  # a hook runs between steps (a failed step left nothing to note)
        self.acc = self.state.loop.train_epoch if self.metrics else {}
        for path, metric in self.metrics.items():
            if id(metric) in PENDING:  # an enclosing hook's, not loaded yet: now
                load_pending(metric)
            cls = type(metric)
            self.classes[path] = cls
            PENDING[id(metric)] = (self, path)
            object.__setattr__(metric, "__class__", deferred(cls, tuple(metric._defaults)))
        return self

    def _load_metric(self, path: str) -> None:
        """Load the metric at ``path`` (its first use in the hook): its class back, its
        own states saved, the kept ones loaded (a copy) and its ``compute`` wrapped."""
        metric = self.metrics[path]
        object.__setattr__(metric, "__class__", self.classes[path])
        if not self.refuse:
            _unguard(metric)
        original = metric.__dict__.get("compute") or type(metric).compute.__get__(metric)
        self.saved[path] = (
            _states(metric),
            metric._update_count,
            metric._computed,
            metric._forward_cache,
            metric._to_sync,
            original,
        )
        if self.refuse:  # the step's own states stay: nothing is loaded
            self.loaded[path] = (_states(metric), _versions(metric), metric._update_count, ())
            metric.__dict__["compute"] = _refused(self.hook, path)
            return
        kept = self.acc.get(KEPT_PREFIX + path)
        if kept is None:
            states = {n: _default(metric, n) for n in metric._defaults}
            updates, ends = 0, ()
        else:
            states = {n: t.clone() for n, t in kept.states.items()}
            updates, ends = int(kept.updates), kept.dropped_after
        _load(metric, states, updates)
        metric._to_sync = False  # the strategy merges (``_computing``)
        self.loaded[path] = (states, _versions(metric), updates, ends)
        metric.__dict__["compute"] = _computing(
            metric, original, self.strategy, self.saved[path][4]
        )

    def __exit__(self, *exc: Any) -> None:
        for path, metric in self.metrics.items():  # the metrics the hook never used
            if path not in self.saved:
                if PENDING.get(id(metric), (None,))[0] is self:
                    del PENDING[id(metric)]
                object.__setattr__(metric, "__class__", self.classes[path])
        error = None
        for path, metric in self.metrics.items():
            if path not in self.saved:
                continue
            states, updates, computed, cache, to_sync, original = self.saved[path]
            if exc[0] is None and error is None:
                try:
                    self._read(path, metric)
                except NotImplementedError as err:  # raised once every metric is back
                    error = err
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed = updates, computed
            metric._forward_cache, metric._to_sync = cache, to_sync
            if original is not None:
                metric.__dict__["compute"] = original
        if error is not None:
            raise error

    def _read(self, path: str, metric: Any) -> None:
        """What the hook did to ``metric``: its states after, and a change if it made one."""
        loaded, versions, updates, ends = self.loaded[path]
        now = _states(metric)
        count = metric._update_count
        self.after[path] = (now, count)
        if count == updates and all(
            now[n] is loaded[n] and now[n]._version == versions[n] for n in loaded
        ):
            return  # untouched (a hook that only read it)
        if count == updates and all(_same(now[n], loaded[n]) for n in loaded):
            return  # the same numbers (a collection's compute points its members at one)
        if self.refuse:
            raise NotImplementedError(
                f"{self.hook} changed the metric {path} (reset() or update): not supported "
                "under purestep.Trainer, where the batch's update is merged after the "
                "optimizer step; do it in on_train_batch_end or an epoch hook"
            )
        key = _registry_key(metric, path)
        if count == 0 and all(_same(now[n], metric._defaults[n]) for n in now):
            # reset: nothing kept, but that a step logged it this epoch (Lightning resets
            # it at the epoch's end all the same: so do the updates after this one)
            self.changes[path] = _kept(metric, key, 0, False, now, ends) if ends else None
        else:
            self.changes[path] = _kept(metric, key, count, False, now, ends)

    def finish(self, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``values`` with each torchmetrics object the hook logged replaced by its
        ``compute()`` (over every process; Lightning then resets it: so here), and the
        ``Requests(kept=...)`` of what the hook changed."""
        out = dict(values)
        for name, value in values.items():
            if not is_torchmetric(value):
                continue
            if not self.hook.endswith("_epoch_end"):
                raise NotImplementedError(
                    f"self.log({name!r}, metric) in {self.hook} is not supported under "
                    "purestep.Trainer: log it from an on_*_epoch_end hook, log "
                    f"metric.compute() here, or log the metric object from the step"
                )
            path = next((p for p, m in self.metrics.items() if m is value), None)
            if path is None:
                raise ValueError(
                    f"self.log({name!r}, metric): the metric must be an attribute of the "
                    "module (a submodule), as Lightning requires"
                )
            out[name] = self._value(path, value)
            self.changes[path] = None  # logged: reset after the epoch, as Lightning does
        kept = {KEPT_PREFIX + path: change for path, change in self.changes.items()}
        return out, kept

    def _value(self, path: str, metric: Any) -> torch.Tensor:
        states, count = self.after.get(path, (None, 0))
        if states is None and path not in self.saved:  # not used by the hook: as kept
            kept = self.acc.get(KEPT_PREFIX + path)
            if kept is not None:
                states = {n: t.clone() for n, t in kept.states.items()}
                count = int(kept.updates)
        if states is None:
            states = {n: _default(metric, n) for n in metric._defaults}
        saved = (_states(metric), metric._update_count, metric._computed, metric._to_sync)
        try:
            _load(metric, states, count)
            if self.strategy is not None and saved[3]:
                for name, value in _sync(metric, states, self.strategy).items():
                    setattr(metric, name, value)
            metric._to_sync = False
            value = metric.compute()
        finally:
            for name, value_ in saved[0].items():
                setattr(metric, name, value_)
            metric._update_count, metric._computed, metric._to_sync = saved[1:]
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ValueError(
                f"self.log(name, {path}) in {self.hook}: its compute() gave "
                f"{type(value).__name__}; self.log takes metrics whose value is one number"
            )
        return value.detach().reshape(())


def _default(metric: Any, name: str) -> torch.Tensor:
    return metric._defaults[name].detach().clone()


def _versions(metric: Any) -> dict[str, int]:
    return {n: getattr(metric, n)._version for n in metric._defaults}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def _registry_key(metric: Any, path: str) -> str:
    """The registry key (``_key``) of a registered metric object, found by identity."""
    for key, obj in _OBJECTS.items():
        if obj is metric:
            return key
    return path
