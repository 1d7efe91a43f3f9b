"""Evaluation: run an eval step over one or several datasets and aggregate what it returns.

``run_evaluation`` is the primitive that ``fit`` (validation and the sanity check),
``validate`` and ``test`` share: the ``on_validation_*`` / ``on_test_*`` events in
Lightning's order, per-dataloader aggregation of the step's values (epoch means weighted by
batch size; ``/dataloader_idx_<i>`` suffixes when there are several dataloaders), the values
callbacks see, and logging. An evaluation with no batches at all is skipped: no events fire
and the result is ``[]``. The sanity check logs nothing and leaves the values callbacks see
untouched. ``validate`` and ``test`` are the stand-alone compositions.

Logging (Lightning's rules): epoch values go to the loggers in one row at the end, at the
driver's ``logger_step`` (during fit: the step of the last training row), together with what
callbacks logged at ``on_*_epoch_end`` and the current ``epoch``; values a step logs with
``on_step=True`` are written every batch, at a per-dataloader counter that survives across
the validations of one fit and does not count sanity-check batches.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from purestep.engine import metrics, tree
from purestep.engine.state import TrainState
from purestep.engine.step import batch_size
from purestep.hardware.members import is_ensemble
from purestep.hardware.members import size as ensemble_size

from . import aggregate, loop_state, schedule
from .data import length
from .driver import Driver, prepare
from .events import BatchPosition, Stage
from .profiling import section

__all__ = ["run_evaluation", "test", "validate"]

EvalStep = Callable[..., Any]


def _event_prefix(stage: str) -> str:
    return "test" if stage == Stage.TEST else "validation"


#: What the profiler calls each stage's whole run, batch fetch and step (loops.profiling).
_ACTIONS = {
    Stage.VALIDATE: ("run_validation", "[EvaluationLoop].val_next", "validation_step"),
    Stage.SANITY_CHECK: ("run_sanity_check", "[EvaluationLoop].val_next", "validation_step"),
    Stage.TEST: ("run_test", "[EvaluationLoop].test_next", "test_step"),
}


def _counter_key(fn: str, stage: str, dataloader_idx: int) -> str:
    return f"{fn}/{_event_prefix(stage)}/{dataloader_idx}"


def _has_member_axis(metric: metrics.Metric, k: int) -> bool:
    """Whether every tensor of ``metric`` has a leading member axis of size ``k`` (what an
    ensemble's eval step returns for a metric computed under vmap)."""
    tensors = [t for t in tree.leaves(metric) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.dim() >= 1 and t.shape[0] == k for t in tensors)


def per_member(values: Any, k: int) -> Any:
    """An ensemble eval step's values with every metric split into its ``k`` members.

    An ``engine.metrics`` metric whose tensors carry a member axis ``[K]`` (what an
    ensemble's eval step returns for ``metrics.Accuracy.of(...)`` and the like) becomes
    ``<name>/<i>``, member ``i``'s metric, and ``<name>``, the members merged (with equal
    counts per member, as when all see the same batch: their mean), each accumulated exactly
    over the evaluation. It is how a ``[K]`` tensor is logged (``aggregate.resolve``: each
    member under ``<name>/<i>``, the mean under ``<name>``, the members off the progress
    bar). Other values pass unchanged.
    """
    if not isinstance(values, Mapping):
        return values
    out: dict[str, Any] = {}
    for name, value in values.items():
        logged = value if isinstance(value, aggregate.Logged) else None
        raw = logged.value if logged is not None else value
        if not (isinstance(raw, metrics.Metric) and _has_member_axis(raw, k)):
            out[name] = value
            continue
        members = [
            tree.map(lambda t, i=i: t[i] if isinstance(t, torch.Tensor) else t, raw)
            for i in range(k)
        ]
        pooled = functools.reduce(lambda a, b: a.merge(b), members)
        if logged is None:
            out[name] = pooled
            out.update({f"{name}/{i}": m for i, m in enumerate(members)})
        else:
            out[name] = logged.replace(value=pooled)
            quiet = logged.replace(prog_bar=False) if logged.prog_bar else logged
            out.update({f"{name}/{i}": quiet.replace(value=m) for i, m in enumerate(members)})
    return out


def run_evaluation(
    state: TrainState,
    step: EvalStep,
    sources: Sequence[Any],
    *,
    stage: str,
    driver: Driver,
    max_batches: Sequence[int | float],
    epoch: int | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Evaluate ``state`` on every source; return the new state and one dict per source.

    ``stage`` is ``Stage.VALIDATE``, ``Stage.SANITY_CHECK`` or ``Stage.TEST``;
    ``max_batches[i]`` limits source ``i``; ``epoch`` picks the data order of the sources
    (the current epoch by default). Sources are ``loops.data`` batch streams. Each result
    dict holds that source's logged epoch values (suffixed when there are several sources)
    and what callbacks logged at ``on_*_epoch_end``.
    """
    if stage not in (Stage.VALIDATE, Stage.SANITY_CHECK, Stage.TEST):
        raise ValueError(
            f"run_evaluation: stage must be {Stage.VALIDATE!r}, {Stage.SANITY_CHECK!r} or "
            f"{Stage.TEST!r}, got {stage!r}"
        )
    if len(max_batches) != len(sources):
        raise ValueError(
            f"run_evaluation: {len(sources)} sources but {len(max_batches)} batch limits"
        )
    if schedule.evaluation_skipped(max_batches):
        return state, []
    if state.loop is None:  # a state straight from engine.init, or a custom loop's
        state = loop_state.ready(state)
    prefix = _event_prefix(stage)
    members = ensemble_size(state) if is_ensemble(state) else 0
    sanity = stage == Stage.SANITY_CHECK
    epoch = state.progress.epoch if epoch is None else epoch
    previous_stage, driver.stage = driver.stage, stage
    previous_position = driver.position  # the fit batch an evaluation runs inside
    several = len(sources) > 1
    per_loader: list[dict[str, float]] = []
    prof = driver.profiler
    run_action, next_action, step_action = _ACTIONS[stage]
    if prof is not None:
        prof.start(run_action)
    try:
        state = driver.fire(f"on_{prefix}_start", state, num_batches=list(max_batches))
        state = driver.fire(f"on_{prefix}_epoch_start", state, num_batches=list(max_batches))
        counters = dict(state.loop.eval_steps)
        logged: dict[str, Any] = {}
        callback_values: dict[str, Any] = {}
        for i, (source, limit) in enumerate(zip(sources, max_batches)):
            if limit == 0:
                per_loader.append({})
                continue
            acc: dict[str, Any] = {}
            specs: dict[str, aggregate.MetricSpec] = {}
            suffix = f"/dataloader_idx_{i}" if several else ""
            counter_key = _counter_key(driver.fn, stage, i)
            batches = source.iterate(epoch)
            if prof is not None:
                batches = prof.profile_iterable(batches, next_action, limit)
            elif limit != float("inf"):
                batches = itertools.islice(batches, int(limit))
            for batch_idx, batch in enumerate(batches):
                fields = {"batch": batch, "batch_idx": batch_idx, "dataloader_idx": i}
                driver.position = BatchPosition(
                    batch_idx, i, limit, len(sources), batch_idx + 1 == limit, state.progress
                )
                state = driver.fire(f"on_{prefix}_batch_start", state, num_batches=limit, **fields)
                with driver.evaluation_mode(), section(prof, step_action):
                    out = step(state, batch, index=batch_idx)
                if members > 1:
                    out = per_member(out, members)
                resolved = aggregate.resolve(out, stage)
                if any(spec.kept for spec, _ in resolved.values()):
                    state, resolved = _keep(state, resolved)
                acc = aggregate.accumulate(acc, resolved, batch_size(batch))
                specs.update(aggregate.specs_of(resolved))
                if not sanity:
                    to_log, _, _ = aggregate.step_values(resolved)
                    if to_log:
                        n = counters.get(counter_key, 0)
                        driver.log_metrics({k + suffix: v for k, v in to_log.items()}, n)
                        counters[counter_key] = n + 1
                state = driver.fire(
                    f"on_{prefix}_batch_end",
                    state,
                    outputs=out,
                    num_batches=limit,
                    is_last_batch=batch_idx + 1 == limit,
                    **fields,
                )
            if driver.world_size > 1:  # an evaluation covers every process's shard
                acc = driver.strategy.sync_metrics(acc)
            to_log, bar, to_callbacks = aggregate.epoch_values(acc, specs, suffix)
            logged.update(to_log)
            callback_values.update(to_callbacks)
            if not sanity:
                driver.progress_bar_metrics.update(bar)
            per_loader.append({k: float(v) for k, v in to_log.items()})
        if not sanity:
            loop = state.loop.replace(
                callback_metrics={**state.loop.callback_metrics, **callback_values},
                eval_steps=counters,
            )
            state = state.replace(loop=loop)
        with driver.collecting() as at_epoch_end:
            state = driver.fire(f"on_{prefix}_epoch_end", state, num_batches=list(max_batches))
        if not sanity:
            row = {**logged, **at_epoch_end}
            if row:
                driver.log_metrics({**row, "epoch": state.progress.epoch}, driver.logger_step)
        state = driver.fire(f"on_{prefix}_end", state, num_batches=list(max_batches))
        state = _drop_ended(state, Stage.VALIDATE if sanity else stage)
    finally:
        driver.stage = previous_stage
        driver.position = previous_position
        if prof is not None:
            prof.stop(run_action)
    extra = {k: float(v) for k, v in at_epoch_end.items()}
    return state, [{**values, **extra} for values in per_loader]


def _keep(state: TrainState, resolved: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
    """The step's kept values (``aggregate.keep``) merged into the state's kept accumulators
    at once (the batch-end and epoch-end events see them, and they outlive the evaluation);
    the rest of ``resolved``, for this evaluation's accumulators."""
    kept = {name: entry for name, entry in resolved.items() if entry[0].kept}
    loop = state.loop.replace(
        train_epoch=aggregate.accumulate(state.loop.train_epoch, kept, 0),
        train_specs={**state.loop.train_specs, **aggregate.specs_of(kept)},
    )
    rest = {name: entry for name, entry in resolved.items() if not entry[0].kept}
    return state.replace(loop=loop), rest


def _drop_ended(state: TrainState, stage: str) -> TrainState:
    """The evaluation is over (after ``on_*_end``): the kept accumulators that end with its
    epoch dropped (``aggregate.drop_ended``: Lightning resets the metrics its steps logged)."""
    loop = state.loop
    acc = aggregate.drop_ended(loop.train_epoch, loop.train_specs, stage)
    if acc is loop.train_epoch:  # the usual: nothing ends with it
        return state
    return state.replace(loop=loop.replace(train_epoch=acc))


def evaluate(
    stage: str,
    state: TrainState,
    step: EvalStep,
    data: Any,
    *,
    config: Any = None,
    callbacks: Sequence[Any] = (),
    loggers: Sequence[Any] = (),
    observers: Sequence[Any] = (),
    driver: Driver | None = None,
    max_batches: Sequence[int | float] | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """A stand-alone evaluation (``validate`` or ``test``): setup, the evaluation, teardown.

    On Ctrl-C the ``on_exception`` handlers run, the loggers are finalized "interrupted"
    and ``(state, [])`` is returned; other exceptions propagate after the same handling
    (loggers finalized "failed").
    """
    from .data import as_list

    if stage not in (Stage.VALIDATE, Stage.TEST):
        raise ValueError(f"evaluate: stage must be {Stage.VALIDATE!r} or {Stage.TEST!r}")
    fn = "validate" if stage == Stage.VALIDATE else "test"
    driver, config = prepare(
        fn, driver, config, callbacks=callbacks, loggers=loggers, observers=observers
    )
    driver.set_default_extra(model=getattr(step, "model", None), num_loggers=len(driver.loggers))
    sources = as_list(data)
    if max_batches is None:
        stage_key = "val" if stage == Stage.VALIDATE else "test"
        max_batches = schedule.eval_batches(config, stage_key, [length(s) for s in sources])
    driver.logger_step = state.progress.step
    return driver.run(
        state,
        lambda s: run_evaluation(
            s, step, sources, stage=stage, driver=driver, max_batches=max_batches
        ),
        interrupted=[],
    )


def validate(
    state: TrainState, step: EvalStep, data: Any, **kwargs: Any
) -> tuple[TrainState, list[dict[str, float]]]:
    """Evaluate on validation data outside of fit: ``on_validation_*`` events, values logged
    with the ``val_`` prefix; one dict per dataset. Keywords as ``evaluate``."""
    return evaluate(Stage.VALIDATE, state, step, data, **kwargs)


def test(
    state: TrainState, step: EvalStep, data: Any, **kwargs: Any
) -> tuple[TrainState, list[dict[str, float]]]:
    """Evaluate on test data: ``on_test_*`` events, values logged with the ``test_`` prefix;
    one dict per dataset. Keywords as ``evaluate``."""
    return evaluate(Stage.TEST, state, step, data, **kwargs)


test.__test__ = False  # not a pytest test
