"""``predict``: run a predict step over one or several datasets and collect the outputs.

Returns, per dataset, the list of per-batch predictions (tensors detached, on the CPU when
``to_cpu``), with the ``on_predict_*`` events in Lightning's order. Nothing is logged.
Without a ``predict_step`` the prediction is the module on the batch's inputs
(``module(batch[0])`` for tuple and list batches, else ``module(batch)``); a batch that
does not fit that (a dict, several inputs) gets an error saying to define ``predict_step``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from purestep.engine.state import TrainState
from purestep.engine.tree import map as tree_map

from . import schedule
from .data import length
from .driver import Driver, prepare
from .events import BatchPosition, Stage
from .profiling import section

__all__ = ["predict", "run_prediction"]


def _cpu(x: Any) -> Any:
    import torch

    return x.cpu() if isinstance(x, torch.Tensor) else x


def _default_kind(fn: Any) -> str | None:
    """Which default ``fn`` (a predict step's function) is, if it is not a user's
    ``predict_step``: ``"batch"`` for ``engine.predict_step``'s ``apply(batch)``,
    ``"inputs"`` for ``task.default_predict`` (what a Task without ``predict_step``, a
    ``fit(model, loss_fn, ...)`` task and a module without ``fn=`` use); else None."""
    from purestep.engine.step import _default_predict

    from .task import Task, default_predict

    if fn is _default_predict:
        return "batch"
    if fn is default_predict:
        return "inputs"
    owner, func = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
    if not isinstance(owner, Task) or getattr(func, "__name__", None) != "predict_step":
        return None
    if func is Task.predict_step:  # a Task that does not define predict_step
        return "inputs"
    return None


def _predict(step: Any, state: TrainState, batch: Any, index: int) -> Any:
    """``step(state, batch)``; a TypeError from a default prediction gets an explanation."""
    try:
        return step(state, batch, index=index)
    except TypeError as error:
        kind = _default_kind(getattr(step, "fn", None))
        if kind is None:
            raise
        ran = "module(batch)"
        if kind == "inputs" and isinstance(batch, (tuple, list)) and batch:
            ran = "module(batch[0])"
        raise TypeError(
            f"predict: no predict_step is defined, so the default prediction ran {ran} on a "
            f"{type(batch).__name__} batch, and that failed: {error}. Define "
            "predict_step(apply, batch) on the Task, or pass fn=(apply, batch) -> prediction "
            "(to Trainer.predict or engine.predict_step)"
        ) from error


def run_prediction(
    state: TrainState,
    step: Any,
    sources: Sequence[Any],
    *,
    driver: Driver,
    max_batches: Sequence[int | float],
    to_cpu: bool = True,
    keep: bool = True,
) -> tuple[TrainState, list[list[Any]]]:
    """Predict on every source; return the new state and the predictions per source.

    ``keep=False`` discards the outputs (Lightning's ``return_predictions=False``): callbacks
    still see each one at ``on_predict_batch_end``. With no batches at all nothing runs and
    no event fires (one empty list per source is returned).
    """
    if len(max_batches) != len(sources):
        raise ValueError(
            f"run_prediction: {len(sources)} sources but {len(max_batches)} batch limits"
        )
    if schedule.evaluation_skipped(max_batches):
        return state, [[] for _ in sources]
    previous_stage, driver.stage = driver.stage, Stage.PREDICT
    previous_position = driver.position  # the fit batch an evaluation runs inside
    # prediction writers name each batch's samples from the sources' order
    driver.extra["predict_sources"] = list(sources)
    outputs: list[list[Any]] = []
    prof = driver.profiler
    if prof is not None:
        prof.start("run_predict")
    try:
        state = driver.fire("on_predict_start", state, num_batches=list(max_batches))
        state = driver.fire("on_predict_epoch_start", state, num_batches=list(max_batches))
        for i, (source, limit) in enumerate(zip(sources, max_batches)):
            collected: list[Any] = []
            batches = source.iterate(0)
            if prof is not None:
                batches = prof.profile_iterable(batches, "[PredictionLoop].predict_next", limit)
            elif limit != float("inf"):
                batches = itertools.islice(batches, int(limit))
            for batch_idx, batch in enumerate(batches):
                fields = {"batch": batch, "batch_idx": batch_idx, "dataloader_idx": i}
                driver.position = BatchPosition(
                    batch_idx, i, limit, len(sources), batch_idx + 1 == limit, state.progress
                )
                state = driver.fire("on_predict_batch_start", state, num_batches=limit, **fields)
                with driver.evaluation_mode(), section(prof, "predict_step"):
                    out = _predict(step, state, batch, batch_idx)
                if to_cpu:
                    out = tree_map(_cpu, out)
                if keep:
                    collected.append(out)
                state = driver.fire(
                    "on_predict_batch_end",
                    state,
                    outputs=out,
                    num_batches=limit,
                    is_last_batch=batch_idx + 1 == limit,
                    **fields,
                )
            outputs.append(collected)
        state = driver.fire("on_predict_epoch_end", state, num_batches=list(max_batches))
        state = driver.fire("on_predict_end", state, num_batches=list(max_batches))
    finally:
        driver.stage = previous_stage
        driver.position = previous_position
        if prof is not None:
            prof.stop("run_predict")
    return state, outputs


def predict(
    state: TrainState,
    step: Any,
    data: Any,
    *,
    config: Any = None,
    callbacks: Sequence[Any] = (),
    loggers: Sequence[Any] = (),
    observers: Sequence[Any] = (),
    driver: Driver | None = None,
    max_batches: Sequence[int | float] | None = None,
    to_cpu: bool = True,
    keep: bool = True,
) -> tuple[TrainState, list[list[Any]]]:
    """Predict with ``step`` on ``data`` (one dataset or a list): setup, ``run_prediction``,
    teardown. Returns the state and one list of per-batch outputs per dataset.

    ``max_batches`` defaults to ``limit_predict_batches`` of ``config``. On Ctrl-C the
    ``on_exception`` handlers run and ``(state, [])`` is returned; other exceptions
    propagate after the same handling.
    """
    from .data import as_list

    driver, config = prepare(
        "predict", driver, config, callbacks=callbacks, loggers=loggers, observers=observers
    )
    driver.set_default_extra(model=getattr(step, "model", None), num_loggers=len(driver.loggers))
    sources = as_list(data)
    if max_batches is None:
        max_batches = schedule.eval_batches(config, "predict", [length(s) for s in sources])
    return driver.run(
        state,
        lambda s: run_prediction(
            s, step, sources, driver=driver, max_batches=max_batches, to_cpu=to_cpu, keep=keep
        ),
        interrupted=[],
    )
