"""Hypothesis strategies and a fit simulator, for property-testing loop logic.

``configs()`` draws valid ``LoopConfig`` values, ``progress()`` draws consistent
``engine.Progress`` counters, ``data_sizes()`` draws dataset lengths in batches, and
``simulate_fit`` runs Lightning's fit decisions (``loops.schedule``) without any model, so
a hand-written loop can be checked against what ``fit`` would do::

    from hypothesis import given, strategies as st
    from purestep.loops import schedule, testing

    def my_steps(config, length):  # a custom loop: how many optimizer steps does it take?
        steps, batches = 0, schedule.train_batches(config, length)
        for epoch in range(config.max_epochs):
            factor = schedule.accumulation_factor(config, epoch)
            for i in range(batches):
                if schedule.reached(steps, config.max_steps):
                    return steps
                steps += schedule.is_optimizer_step(i, factor, batches, i + 1 == batches)
        return steps

    @given(testing.configs(max_epochs=st.integers(0, 3)), testing.data_sizes())
    def test_my_loop_steps_like_fit(config, sizes):
        trace = testing.simulate_fit(config, sizes.train)
        assert my_steps(config, sizes.train) == trace.global_step

Defaults are kept small (a few epochs, a few batches) so simulations are fast; every
strategy takes overrides: a fixed value or a strategy per flag or field. Needs
``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from purestep.engine.state import Progress

from . import schedule
from .config import FLAG_NAMES, LIMIT_FLAGS, LoopConfig

__all__ = ["DataSizes", "FitTrace", "configs", "data_sizes", "progress", "simulate_fit"]


def _as_strategy(value: Any) -> st.SearchStrategy:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


# --------------------------------------------------------------------------- configs


def _limit() -> st.SearchStrategy:
    return st.one_of(st.none(), st.integers(0, 8), st.sampled_from([0.0, 0.5, 1.0]))


def _default_flag_strategies() -> dict[str, st.SearchStrategy]:
    return {
        "max_epochs": st.integers(0, 4),
        "min_epochs": st.one_of(st.none(), st.integers(0, 3)),
        "max_steps": st.one_of(st.just(-1), st.integers(1, 10), st.integers(0, 30)),
        "min_steps": st.one_of(st.none(), st.integers(0, 20)),
        "max_time": st.one_of(st.none(), st.integers(1, 10**6)),
        **{flag: _limit() for flag in LIMIT_FLAGS.values()},
        "check_val_every_n_epoch": st.one_of(st.just(1), st.none(), st.integers(1, 3)),
        "num_sanity_val_steps": st.one_of(st.just(2), st.integers(-1, 3)),
        # mostly off: both override most other flags
        "fast_dev_run": st.sampled_from([False, False, False, False, False, True, 2, 3]),
        "overfit_batches": st.sampled_from([0.0, 0.0, 0.0, 0.0, 0.0, 1, 3, 0.5]),
        "accumulate_grad_batches": st.one_of(
            st.integers(1, 4),
            st.dictionaries(st.integers(0, 4), st.integers(1, 4), min_size=1, max_size=3),
        ),
        "log_every_n_steps": st.one_of(st.just(50), st.integers(0, 5)),
        "reload_dataloaders_every_n_epochs": st.integers(0, 3),
        "gradient_clip_val": st.one_of(st.none(), st.floats(0.0, 10.0)),
        "gradient_clip_algorithm": st.sampled_from(["norm", "value"]),
    }


@st.composite
def _configs(draw: Any, overrides: dict[str, Any]) -> LoopConfig:
    defaults = _default_flag_strategies()

    def pick(name: str, default: st.SearchStrategy | None = None) -> Any:
        if name in overrides:
            return draw(_as_strategy(overrides[name]))
        return draw(default if default is not None else defaults[name])

    flags: dict[str, Any] = {}
    for name in ("max_steps", "min_epochs", "min_steps", "max_time", "num_sanity_val_steps"):
        flags[name] = pick(name)
    flags["max_epochs"] = pick(
        "max_epochs",
        st.one_of(st.integers(0, 4), st.sampled_from([-1, None]))
        if flags["max_steps"] != -1
        else None,
    )
    # Limits and fast_dev_run/overfit_batches exclude each other unless overridden together.
    limit_given = any(flag in overrides for flag in LIMIT_FLAGS.values())
    flags["fast_dev_run"] = pick("fast_dev_run", st.just(False) if limit_given else None)
    flags["overfit_batches"] = pick("overfit_batches", st.just(0.0) if limit_given else None)
    for stage, flag in LIMIT_FLAGS.items():
        taken = flags["fast_dev_run"] or (stage in ("train", "val") and flags["overfit_batches"])
        flags[flag] = pick(flag, st.none() if taken else None)
    # A fractional interval needs epoch checks; an int interval could exceed a short epoch
    # unless the interval counts batches across epochs (check_val_every_n_epoch=None).
    if "val_check_interval" in overrides:
        interval = flags["val_check_interval"] = pick("val_check_interval")
        counts_across = interval is None or isinstance(interval, int)
        flags["check_val_every_n_epoch"] = pick(
            "check_val_every_n_epoch", None if counts_across else st.integers(1, 3)
        )
    else:
        flags["check_val_every_n_epoch"] = every = pick("check_val_every_n_epoch")
        flags["val_check_interval"] = pick(
            "val_check_interval",
            st.integers(1, 5)
            if every is None
            else st.one_of(st.none(), st.sampled_from([0.0, 0.25, 0.5, 1.0])),
        )
    for name in (
        "accumulate_grad_batches",
        "log_every_n_steps",
        "reload_dataloaders_every_n_epochs",
        "gradient_clip_val",
        "gradient_clip_algorithm",
    ):
        flags[name] = pick(name)
    return LoopConfig.create(**flags)


def configs(**overrides: Any) -> st.SearchStrategy[LoopConfig]:
    """Valid ``LoopConfig`` values; ``name=value`` or ``name=strategy`` fixes or narrows a
    flag (e.g. ``configs(fast_dev_run=False, max_epochs=st.integers(1, 3))``).

    Unless overridden, at most 4 epochs run (``max_epochs=None`` is drawn only together with
    ``max_steps``), batch limits are ints or the fractions 0.0/0.5/1.0 (valid for data of at
    least 2 batches) and int ``val_check_interval``s only appear with
    ``check_val_every_n_epoch=None`` (where they cannot exceed the epoch).
    """
    unknown = {name: None for name in overrides if name not in FLAG_NAMES}
    if unknown:
        LoopConfig.create(**unknown)  # raises, suggesting the flag that was meant
    return _configs(overrides)


# --------------------------------------------------------------------------- progress


@st.composite
def _progress(draw: Any, overrides: dict[str, Any]) -> Progress:
    def pick(name: str, default: st.SearchStrategy) -> int:
        return draw(_as_strategy(overrides.get(name, default)))

    epoch = pick("epoch", st.integers(0, 50))
    batch_in_epoch = pick("batch_in_epoch", st.integers(0, 100))
    total_batches = pick("total_batches", st.integers(batch_in_epoch, batch_in_epoch + 100 * epoch))
    step = pick("step", st.integers(0, total_batches))
    samples = pick("samples", st.integers(total_batches, 64 * total_batches))
    micro_step = pick("micro_step", st.integers(0, batch_in_epoch))
    return Progress(
        epoch=epoch,
        step=step,
        batch_in_epoch=batch_in_epoch,
        total_batches=total_batches,
        samples=samples,
        micro_step=micro_step,
    )


def progress(**overrides: Any) -> st.SearchStrategy[Progress]:
    """Consistent ``engine.Progress`` counters: no more steps than batches, at least one
    sample per batch, an open accumulation window no longer than the epoch so far. Fields
    can be fixed or narrowed like ``configs``."""
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Progress)}
    if unknown:
        raise TypeError(f"progress(): unknown Progress fields {sorted(unknown)}")
    return _progress(overrides)


# --------------------------------------------------------------------------- data sizes


@dataclasses.dataclass(frozen=True)
class DataSizes:
    """Dataset lengths in batches (before limits): ``train`` (``math.inf`` when unsized) and
    one length per validation, test and predict loader."""

    train: int | float
    val: tuple[int, ...] = (2,)
    test: tuple[int, ...] = (2,)
    predict: tuple[int, ...] = (2,)


def data_sizes(
    min_batches: int = 2, max_batches: int = 12, max_loaders: int = 2, unsized: bool = False
) -> st.SearchStrategy[DataSizes]:
    """``DataSizes`` with lengths in ``[min_batches, max_batches]`` and 0 to ``max_loaders``
    loaders per evaluation stage (1 to ``max_loaders`` for validation); ``unsized=True`` also
    draws an unsized training set (``math.inf``)."""
    length = st.integers(min_batches, max_batches)
    train = st.one_of(length, st.just(math.inf)) if unsized else length
    loaders = st.lists(length, min_size=0, max_size=max_loaders).map(tuple)
    val = st.lists(length, min_size=1, max_size=max(1, max_loaders)).map(tuple)
    return st.builds(DataSizes, train=train, val=val, test=loaders, predict=loaders)


# --------------------------------------------------------------------------- simulation


@dataclasses.dataclass(frozen=True)
class FitTrace:
    """What a simulated fit did.

    ``batches``: ``(epoch, batch_idx)`` of every training batch run; ``steps``: those that
    stepped the optimizer; ``validations``: the batches after which validation ran;
    ``logged_steps``: logger steps of the training rows written; ``sanity_batches``: per
    validation loader (empty when no sanity check ran); ``num_training_batches``: per epoch,
    after limits; ``epochs``: epochs run; ``global_step``; ``reason``: why fit stopped;
    ``messages``: other messages fit showed, in order.
    """

    batches: tuple[tuple[int, int], ...]
    steps: tuple[tuple[int, int], ...]
    validations: tuple[tuple[int, int], ...]
    logged_steps: tuple[int, ...]
    sanity_batches: tuple[int | float, ...]
    num_training_batches: int | float
    epochs: int
    global_step: int
    reason: str
    messages: tuple[str, ...] = ()


def simulate_fit(
    config: LoopConfig,
    train_batches: int | float,
    stop_at: int | None = None,
    *,
    val_batches: Sequence[int | float] | None = None,
) -> FitTrace:
    """Run Lightning's fit decisions over data of ``train_batches`` batches (before limits;
    ``math.inf`` when unsized) and ``val_batches`` per validation loader (default: one loader
    as long as the training data, 2 batches when that is unsized; ``()``: no validation).

    ``stop_at``: a stop is requested at the end of the training batch whose 0-based index
    across epochs is ``stop_at`` (like a callback at ``on_train_batch_end``), then honoured
    as soon as ``min_epochs``/``min_steps`` allow. Raises what fit would raise for the
    data sizes (a fraction leaving less than a batch, an interval longer than the epoch), and
    ``ValueError`` for a simulation that would never end (unsized data, nothing to stop it).
    """
    if val_batches is None:
        val_batches = (2,) if train_batches == math.inf else (train_batches,)
    n = (
        schedule.train_batches(config, train_batches)
        if not schedule.training_skipped(config)
        else 0
    )
    enabled = schedule.validation_enabled(config, has_val_data=len(val_batches) > 0)
    val_counts = schedule.eval_batches(config, "val", val_batches) if enabled else ()
    sanity: tuple[int | float, ...] = ()
    if schedule.should_run_sanity_check(config, enabled=enabled):
        sanity = schedule.sanity_batches(config, val_counts)
        if schedule.evaluation_skipped(sanity):
            sanity = ()
    # An unsized epoch never ends by itself: only max_steps or an honoured stop ends it.
    stoppable = stop_at is not None and config.min_epochs == 0
    if n == math.inf and config.max_epochs != 0 and config.max_steps == -1 and not stoppable:
        raise ValueError(
            "simulate_fit: unsized training data and nothing that ends the first epoch "
            "(set max_steps, or stop_at with min_epochs=0)"
        )
    every = schedule.val_check_batch(config, n)
    validate_runs = enabled and not schedule.evaluation_skipped(val_counts)

    batches: list[tuple[int, int]] = []
    steps: list[tuple[int, int]] = []
    validations: list[tuple[int, int]] = []
    logged: list[int] = []
    messages = list(schedule.startup_messages(config))
    epochs_done = global_step = stepped_batches = 0
    total_idx = -1
    should_stop = False
    while True:
        verdict = schedule.fit_done(
            config,
            num_training_batches=n,
            global_step=global_step,
            epochs_done=epochs_done,
            should_stop=should_stop,
        )
        if verdict.done:
            break
        epoch = epochs_done
        factor = schedule.accumulation_factor(config, epoch)
        batch_idx, last = -1, False
        while True:
            epoch_verdict = schedule.epoch_done(
                config,
                batches_done=batch_idx + 1,
                num_training_batches=n,
                is_last_batch=last,
                global_step=global_step,
                epochs_done=epochs_done,
                should_stop=should_stop,
            )
            if epoch_verdict.reason and epoch_verdict.reason not in messages:
                messages.append(epoch_verdict.reason)
            if epoch_verdict.done:
                break
            batch_idx += 1
            total_idx += 1
            last = schedule.is_last_batch(batch_idx, n)
            batches.append((epoch, batch_idx))
            stepped = schedule.is_optimizer_step(batch_idx, factor, n, last)
            if stepped:
                global_step += 1
                steps.append((epoch, batch_idx))
            if stop_at is not None and total_idx == stop_at:
                should_stop = True
            if schedule.should_log_step(
                config, stepped_batches, should_stop, accumulating=not stepped
            ):
                logged.append(schedule.logger_step(stepped_batches))
            if validate_runs and schedule.should_validate(
                config,
                epoch=epoch,
                batch_idx=batch_idx,
                total_batch_idx=total_idx,
                is_last_batch=last,
                val_check_batch=every,
                should_stop=should_stop,
                can_stop_early=schedule.can_stop_early(config, epochs_done, global_step),
            ):
                validations.append((epoch, batch_idx))
            stepped_batches += stepped
        epochs_done += 1
    return FitTrace(
        batches=tuple(batches),
        steps=tuple(steps),
        validations=tuple(validations),
        logged_steps=tuple(logged),
        sanity_batches=sanity,
        num_training_batches=n,
        epochs=epochs_done,
        global_step=global_step,
        reason=verdict.reason,
        messages=tuple(messages),
    )
