"""Loop decisions: Lightning's worked examples pinned, and invariants of simulated fits."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from purestep.loops import schedule, testing
from purestep.loops.config import LoopConfig
from purestep.loops.testing import simulate_fit

C = LoopConfig.create


# --------------------------------------------------------------------------- batch counts


@pytest.mark.parametrize(
    ("length", "limit", "expected"),
    [
        (5, 0.5, 2),
        (5, 3, 3),
        (5, 9, 5),
        (5, 1.0, 5),
        (5, 1, 1),
        (5, 0.0, 0),
        (5, 0, 0),
        (7, 0.99, 6),
        (0, 0.1, 0),
        (math.inf, 1.0, math.inf),
        (math.inf, 4, 4),
    ],
)
def test_num_batches_examples(length, limit, expected):
    assert schedule.num_batches(length, limit, "train") == expected


def test_a_fraction_below_one_batch_names_the_stage():
    with pytest.raises(
        ValueError,
        match=r"`limit_train_batches=0\.1` of the train data \(5 batches\).*at least 0\.2",
    ):
        schedule.num_batches(5, 0.1, "train")
    with pytest.raises(ValueError, match=r"`limit_val_batches=0\.2` of the val data \(3 batches\)"):
        schedule.num_batches(3, 0.2, "sanity_check")


def test_unsized_data_takes_only_all_or_a_count():
    with pytest.raises(
        ValueError, match=r"`limit_predict_batches=0\.5`: the predict data has no length"
    ):
        schedule.num_batches(math.inf, 0.5, "predict")


def test_bad_stage_and_length_are_refused():
    with pytest.raises(ValueError, match="unknown stage 'training'"):
        schedule.num_batches(3, 1.0, "training")
    with pytest.raises(ValueError, match="the test data length must be an int >= 0 or math.inf"):
        schedule.num_batches(-1, 1.0, "test")


@given(st.integers(0, 300), st.integers(0, 400) | st.floats(0, 1))
def test_limits_never_exceed_lengths_and_fractions_truncate(length, limit):
    try:
        n = schedule.num_batches(length, limit, "val")
    except ValueError:
        assert isinstance(limit, float) and 0 < limit * length < 1
        return
    assert 0 <= n <= length
    if isinstance(limit, int):
        assert n == (limit if limit < length else length)
    elif length:
        # the largest whole number of batches within the fraction, counted one by one
        assert n == sum(1 for k in range(1, length + 1) if k <= length * limit)


def test_eval_batches_use_the_stage_limit():
    c = C(limit_val_batches=2, limit_test_batches=0.5, overfit_batches=0)
    assert schedule.eval_batches(c, "val", [5, 1, 0]) == (2, 1, 0)
    assert schedule.eval_batches(c, "test", [4, 10]) == (2, 5)
    assert schedule.evaluation_skipped((0, 0)) and not schedule.evaluation_skipped((0, 1))


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("n", "interval", "expected"),
    [
        (7, 0.5, 3),
        (10, 0.25, 2),
        (10, 0.0, 1),
        (10, 1.0, 10),
        (3, 0.1, 1),
        (10, 4, 4),
        (10, 10, 10),
    ],
)
def test_val_check_batch_examples(n, interval, expected):
    assert schedule.val_check_batch(C(val_check_interval=interval), n) == expected


def test_an_int_interval_longer_than_the_epoch_is_refused_unless_it_cannot_matter():
    with pytest.raises(
        ValueError,
        match=r"`val_check_interval=12` must be less than or equal to the number of training "
        r"batches \(10\)",
    ):
        schedule.val_check_batch(C(val_check_interval=12), 10)
    assert (
        schedule.val_check_batch(C(val_check_interval=12, check_val_every_n_epoch=None), 10) == 12
    )
    assert schedule.val_check_batch(C(val_check_interval=12, limit_val_batches=0), 10) == 12


def test_unsized_epochs_validate_at_the_end_or_every_n_batches():
    assert schedule.val_check_batch(C(), math.inf) == math.inf
    assert schedule.val_check_batch(C(val_check_interval=5), math.inf) == 5
    with pytest.raises(
        ValueError, match=r"`val_check_interval=0\.5`: the training data has no length"
    ):
        schedule.val_check_batch(C(val_check_interval=0.5), math.inf)


def validated_batch_indices(config, n, epochs=1):
    trace = simulate_fit(config.with_flags(max_epochs=epochs), n)
    return [b if epochs == 1 else (e, b) for e, b in trace.validations]


def test_a_fraction_that_does_not_divide_the_epoch_skips_the_epoch_end():
    assert validated_batch_indices(C(val_check_interval=0.5), 7) == [2, 5]
    assert validated_batch_indices(C(val_check_interval=0.25), 10) == [1, 3, 5, 7, 9]
    assert validated_batch_indices(C(), 7) == [6]
    assert validated_batch_indices(C(val_check_interval=0.0), 3) == [0, 1, 2]


def test_without_epoch_checks_the_interval_counts_batches_across_epochs():
    c = C(check_val_every_n_epoch=None, val_check_interval=3)
    assert validated_batch_indices(c, 4, epochs=3) == [(0, 2), (1, 1), (2, 0), (2, 3)]


def test_every_second_epoch_validates_odd_epochs():
    c = C(check_val_every_n_epoch=2)
    assert validated_batch_indices(c, 2, epochs=5) == [(1, 1), (3, 1)]
    assert [e for e in range(6) if schedule.is_val_epoch(c, e)] == [1, 3, 5]
    assert not schedule.is_val_epoch(c, 1, enabled=False)


def test_the_interval_counts_batches_not_optimizer_steps():
    trace = simulate_fit(C(max_epochs=1, val_check_interval=2, accumulate_grad_batches=3), 4)
    assert trace.validations == ((0, 1), (0, 3))
    assert trace.steps == ((0, 2), (0, 3))


def test_reaching_max_steps_mid_epoch_gets_no_validation():
    trace = simulate_fit(C(max_steps=3), 10)
    assert trace.validations == () and trace.global_step == 3
    assert trace.reason == "fit stopped: max_steps=3 reached."


def test_an_int_train_limit_paces_validation_when_there_is_no_interval():
    c = C(limit_train_batches=3)
    kwargs = dict(epoch=0, total_batch_idx=0, is_last_batch=False, val_check_batch=math.inf)
    assert [b for b in range(7) if schedule.should_validate(c, batch_idx=b, **kwargs)] == [2, 5]
    assert schedule.should_validate(c, batch_idx=0, **{**kwargs, "is_last_batch": True})


def test_an_honoured_stop_request_validates_at_once():
    kwargs = dict(epoch=0, batch_idx=1, total_batch_idx=1, is_last_batch=False, val_check_batch=10)
    c = C()
    assert not schedule.should_validate(c, **kwargs, should_stop=True, can_stop_early=False)
    assert schedule.should_validate(c, **kwargs, should_stop=True, can_stop_early=True)
    assert not schedule.should_validate(
        c, **kwargs, should_stop=True, can_stop_early=True, enabled=False
    )
    assert schedule.should_validate(
        c, **{**kwargs, "is_last_batch": True, "val_check_batch": 4}, iterator_mode=True
    )


# --------------------------------------------------------------------------- stopping


def test_min_epochs_defers_a_stop_until_whole_epochs_are_done():
    trace = simulate_fit(C(max_epochs=5, min_epochs=2), 4, stop_at=1)
    assert trace.epochs == 2 and len(trace.batches) == 8
    assert trace.validations == ((0, 3), (1, 3))
    assert trace.reason == "fit stopped: a stop was requested."
    assert any("min_epochs=2" in m for m in trace.messages)


def test_min_steps_stop_validates_and_ends_the_epoch_when_met():
    trace = simulate_fit(C(max_epochs=5, min_steps=10), 4, stop_at=7)
    assert trace.batches[-2:] == ((2, 0), (2, 1)) and trace.global_step == 10
    assert trace.validations[-1] == (2, 1)


def test_max_epochs_wins_over_min_epochs():
    trace = simulate_fit(C(max_epochs=1, min_epochs=3), 4, stop_at=0)
    assert trace.epochs == 1 and trace.reason == "fit stopped: max_epochs=1 reached."


def test_fit_done_reasons_in_order():
    c = C(max_epochs=2, max_steps=5)
    args = dict(num_training_batches=3, global_step=0, epochs_done=0, should_stop=False)
    assert schedule.fit_done(c, **args) == (False, "")
    assert not schedule.fit_done(c, **args)
    assert schedule.fit_done(c, **{**args, "num_training_batches": 0}).reason.endswith(
        "no training batches."
    )
    assert schedule.fit_done(c, **{**args, "global_step": 5, "epochs_done": 2}).reason.endswith(
        "max_steps=5 reached."
    )
    assert schedule.fit_done(c, **{**args, "epochs_done": 2}).reason.endswith(
        "max_epochs=2 reached."
    )
    done, reason = schedule.fit_done(c, **{**args, "should_stop": True})
    assert done and reason.endswith("a stop was requested.")
    assert schedule.fit_done(C(min_steps=1), **{**args, "should_stop": True}) == (False, "")


def test_epoch_done_waits_for_validation_and_minimums():
    c = C(min_steps=4)
    args = dict(
        batches_done=3,
        num_training_batches=3,
        is_last_batch=True,
        global_step=3,
        epochs_done=0,
        should_stop=False,
    )
    assert schedule.epoch_done(c, **args)
    assert not schedule.epoch_done(c, **args, validation_done=False)
    mid = {**args, "batches_done": 1, "is_last_batch": False, "should_stop": True}
    verdict = schedule.epoch_done(c, **mid)
    assert not verdict and "min_steps=4" in verdict.reason
    assert schedule.epoch_done(c, **{**mid, "global_step": 4, "epochs_done": 1})


def test_can_stop_early_and_time_limit():
    c = C(min_epochs=2, min_steps=3, max_time=10)
    assert not schedule.can_stop_early(c, 1, 5) and not schedule.can_stop_early(c, 2, 2)
    assert schedule.can_stop_early(c, 2, 3) and schedule.can_stop_early(C(), 0, 0)


def test_where_monitoring_callbacks_act_by_default():
    assert schedule.early_stopping_on_train_epoch_end(C())
    assert schedule.early_stopping_on_train_epoch_end(C(val_check_interval=1))  # by value
    assert not schedule.early_stopping_on_train_epoch_end(C(val_check_interval=0.5))
    assert not schedule.early_stopping_on_train_epoch_end(C(check_val_every_n_epoch=2))
    assert schedule.checkpoint_on_train_epoch_end(C(), has_val_batches=True)
    assert schedule.checkpoint_on_train_epoch_end(C(val_check_interval=0.5), has_val_batches=False)
    assert not schedule.checkpoint_on_train_epoch_end(
        C(val_check_interval=0.5), has_val_batches=True
    )
    none = C(check_val_every_n_epoch=None, val_check_interval=3)
    assert not schedule.checkpoint_on_train_epoch_end(none, has_val_batches=False)


# --------------------------------------------------------------------- accumulation and logging


def test_a_short_last_window_still_steps():
    assert simulate_fit(C(max_epochs=1, accumulate_grad_batches=3), 7).steps == (
        (0, 2),
        (0, 5),
        (0, 6),
    )
    # the epoch's end is known from the count alone (a limit that cuts the data)...
    assert schedule.is_optimizer_step(6, 3, 7, is_last_batch=False)
    # ...or from the iterator of unsized data
    assert schedule.is_optimizer_step(4, 3, math.inf, is_last_batch=True)
    assert not schedule.is_optimizer_step(4, 3, math.inf, is_last_batch=False)


def test_accumulation_schedule_picks_the_latest_started_factor():
    c = C(accumulate_grad_batches={2: 3, 5: 2})
    assert [schedule.accumulation_factor(c, e) for e in range(7)] == [1, 1, 3, 3, 3, 2, 2]
    assert schedule.accumulation_factor(C(accumulate_grad_batches=4), 9) == 4


def test_training_rows_land_at_batches_that_stepped():
    trace = simulate_fit(C(max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=3), 10)
    assert trace.logged_steps == (2, 5, 8)


def test_logging_rule_edges():
    assert not schedule.should_log_step(C(log_every_n_steps=1), 0, True, accumulating=True)
    assert schedule.should_log_step(C(fast_dev_run=True), 5, False)
    assert not schedule.should_log_step(C(log_every_n_steps=0), 9, True)
    assert schedule.should_log_step(C(log_every_n_steps=50), 3, True)
    assert schedule.logger_step(5, at="epoch_end") == 4
    assert schedule.logger_step(5, at="validation") == 5
    assert schedule.logger_step(5, explicit=12.0) == 12
    with pytest.raises(ValueError, match="unknown at='train'"):
        schedule.logger_step(1, at="train")


def test_messages():
    assert schedule.few_batches_warning(C(), 10, has_loggers=True).startswith(
        "The training data has 10 batches"
    )
    assert schedule.few_batches_warning(C(), 10, has_loggers=False) is None
    assert schedule.few_batches_warning(C(fast_dev_run=1), 1, has_loggers=True) is None
    assert "max_epochs was not set" in schedule.startup_messages(C())[0]
    assert schedule.startup_messages(C(max_epochs=1000)) == ()
    assert "fast_dev_run" in schedule.startup_messages(C(fast_dev_run=2))[0]


# --------------------------------------------------------------------- sanity check and reloads


def test_sanity_check_rules():
    c = C()
    assert schedule.should_run_sanity_check(c, enabled=True)
    assert not schedule.should_run_sanity_check(c, enabled=False)
    assert not schedule.should_run_sanity_check(C(num_sanity_val_steps=0), enabled=True)
    assert schedule.should_run_sanity_check(c, enabled=True, resumed=True)  # epoch-end checkpoint
    assert not schedule.should_run_sanity_check(c, enabled=True, resumed=True, mid_epoch=True)
    assert not schedule.should_run_sanity_check(C(max_steps=9), enabled=True, resumed=True)
    assert schedule.sanity_batches(c, (5, 1, 0)) == (2, 1, 0)
    assert schedule.sanity_batches(C(num_sanity_val_steps=-1), (5, math.inf)) == (5, math.inf)
    assert simulate_fit(C(max_epochs=1, limit_val_batches=0), 3).sanity_batches == ()
    assert simulate_fit(
        C(max_epochs=1, limit_val_batches=3), 3, val_batches=(9, 1)
    ).sanity_batches == (2, 1)


def test_train_loader_reloads_every_n_epochs():
    c = C(reload_dataloaders_every_n_epochs=2)
    last, loads = None, []
    for epoch in range(5):
        if schedule.should_reload(c, epoch, last):
            last = epoch
            loads.append(epoch)
    assert loads == [0, 2, 4]
    assert not schedule.should_reload(C(), 3, 0)


def test_val_loader_reloads_follow_validation_epochs():
    c = C(reload_dataloaders_every_n_epochs=1, check_val_every_n_epoch=2)
    loads, last = ["sanity"], 0 if schedule.sanity_check_sets_val_reload(c, 0) else None
    for epoch in range(4):
        if schedule.is_val_epoch(c, epoch) and schedule.should_reload(c, epoch, last):
            last = epoch
            loads.append(epoch)
    assert loads == ["sanity", 1, 3]


# --------------------------------------------------------------------------- estimates


@pytest.mark.parametrize(
    ("flags", "n", "expected"),
    [
        ({"max_epochs": -1}, 10, math.inf),
        ({"max_steps": 7}, 10, 7),
        ({"max_epochs": 2, "accumulate_grad_batches": 3}, 10, 8),
        ({"max_epochs": 2, "max_steps": 5}, 10, 5),
        ({"max_epochs": 0}, 10, 10),
        ({"max_epochs": 3}, math.inf, -1),
        ({"max_epochs": 3, "max_steps": 4}, math.inf, 4),
        ({"max_epochs": 3, "accumulate_grad_batches": {1: 2}}, 5, 5 + 3 + 3),
    ],
)
def test_estimated_stepping_batches_examples(flags, n, expected):
    assert schedule.estimated_stepping_batches(C(**flags), n) == expected


# ----------------------------------------------------------------- properties of simulated fits


def factor_at(config, epoch):
    return max((e, f) for e, f in config.accumulation_schedule if e <= epoch)[1]


def expected_run(config, n):
    """Brute force, without the schedule module: the batches a stop-free fit runs, and
    those after which it validates."""
    batches, validated, steps, total = [], [], 0, 0
    epoch = 0
    while config.max_epochs == -1 or epoch < config.max_epochs:
        if config.max_steps != -1 and steps >= config.max_steps:
            break
        window = factor_at(config, epoch)
        for b in range(n):
            if config.max_steps != -1 and steps >= config.max_steps:
                break
            batches.append((epoch, b))
            steps += (b + 1) % window == 0 or b == n - 1
            total += 1
            every = config.check_val_every_n_epoch
            interval = config.val_check_interval
            period = interval if isinstance(interval, int) else max(1, math.floor(n * interval))
            position = total if every is None else b + 1
            in_val_epoch = every is None or (epoch + 1) % every == 0
            if config.limit_val_batches and in_val_epoch and position % period == 0:
                validated.append((epoch, b))
        epoch += 1
    return batches, validated, steps


@st.composite
def fit_cases(draw, **overrides):
    n = draw(st.integers(1, 9))
    interval = st.one_of(st.none(), st.sampled_from([0.0, 0.3, 0.5, 1.0]), st.integers(1, n))
    config = draw(
        testing.configs(
            val_check_interval=interval, fast_dev_run=False, limit_train_batches=None, **overrides
        )
    )
    return config, n


@given(fit_cases())
def test_validation_and_steps_match_a_brute_force_count(case):
    config, n = case
    trace = simulate_fit(config, n, val_batches=(4,))
    batches, validated, steps = expected_run(config, n)
    assert list(trace.batches) == batches
    assert list(trace.validations) == validated
    assert trace.global_step == len(trace.steps) == steps


@given(testing.configs(), testing.data_sizes(), st.one_of(st.none(), st.integers(0, 40)))
def test_maxima_bound_every_fit_and_validation_stays_in_validation_epochs(config, sizes, stop_at):
    trace = simulate_fit(config, sizes.train, stop_at, val_batches=sizes.val)
    if config.max_steps != -1:
        assert trace.global_step <= config.max_steps
    if config.max_epochs != -1:
        assert trace.epochs <= config.max_epochs
    assert trace.num_training_batches <= sizes.train
    every = config.check_val_every_n_epoch
    assert all(every is None or (e + 1) % every == 0 for e, _ in trace.validations)
    assert set(trace.validations) <= set(trace.batches)
    assert len(trace.logged_steps) <= trace.global_step and list(trace.logged_steps) == sorted(
        set(trace.logged_steps)
    )


@given(testing.configs(), testing.data_sizes())
def test_every_accumulation_window_ends_in_exactly_one_step(config, sizes):
    trace = simulate_fit(config, sizes.train)
    n, steps = trace.num_training_batches, set(trace.steps)
    for epoch in range(trace.epochs):
        run = [b for e, b in trace.batches if e == epoch]
        window = factor_at(config, epoch)
        for start in range(0, len(run), window):
            members = run[start : start + window]
            stepped = [b for b in members if (epoch, b) in steps]
            ends_epoch = members[-1] == n - 1
            complete = len(members) == window or ends_epoch
            assert stepped == ([members[-1]] if complete else [])


@given(
    testing.configs(fast_dev_run=st.integers(1, 3), overfit_batches=0.0),
    testing.data_sizes(min_batches=1),
)
def test_fast_dev_run_runs_n_batches_of_every_stage(config, sizes):
    n = config.fast_dev_run
    trace = simulate_fit(config, sizes.train, val_batches=sizes.val)
    assert trace.epochs == 1 and trace.sanity_batches == ()
    assert len(trace.batches) == min(n, sizes.train)
    assert trace.global_step >= 1 and trace.validations == ((0, len(trace.batches) - 1),)
    for stage in ("val", "test", "predict"):
        lengths = getattr(sizes, stage)
        assert schedule.eval_batches(config, stage, lengths) == tuple(min(n, k) for k in lengths)


@given(testing.configs(max_epochs=st.integers(1, 4)), testing.data_sizes(), st.integers(0, 30))
def test_minimums_win_over_an_early_stop_request(config, sizes, stop_at):
    trace = simulate_fit(config, sizes.train, stop_at)
    if trace.reason.endswith("a stop was requested."):
        assert trace.epochs >= config.min_epochs
        assert trace.global_step >= (config.min_steps or 0)
    no_minimums = config.min_epochs == 0 and not config.min_steps
    if no_minimums and stop_at < len(trace.batches):
        # honoured right after the requesting batch
        assert len(trace.batches) == stop_at + 1


@given(testing.configs(max_steps=-1, max_epochs=st.integers(1, 4)), testing.data_sizes())
def test_estimated_stepping_batches_is_exact_without_early_stops(config, sizes):
    n = schedule.train_batches(config, sizes.train)
    assume(n > 0)
    assert (
        schedule.estimated_stepping_batches(config, n)
        == simulate_fit(config, sizes.train).global_step
    )


@given(
    testing.configs(
        max_steps=st.integers(1, 20),
        max_epochs=-1,
        limit_train_batches=None,
        val_check_interval=st.one_of(st.none(), st.integers(1, 5)),
    )
)
def test_unsized_epochs_end_by_max_steps(config):
    trace = simulate_fit(config, math.inf)
    assert trace.global_step == config.max_steps and trace.epochs == 1
    interval = config.val_check_interval
    every = interval if isinstance(interval, int) else None
    expected = [(0, b) for e, b in trace.batches if every and (b + 1) % every == 0]
    if every is None:  # validation only at the (never reached) end of the epoch
        expected = []
    validates = config.limit_val_batches and schedule.is_val_epoch(config, 0)
    assert list(trace.validations) == (expected if validates else [])
