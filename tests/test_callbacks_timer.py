"""Timer: duration formats, when it stops, and a budget that survives a resume."""

from __future__ import annotations

import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from purestep import engine
from purestep.engine import optim
from purestep.loops.callbacks import Timer, init_states, parse_duration
from purestep.loops.events import Context, dispatch


class Run:
    """Fires events at given driver-clock readings and collects the requests."""

    def __init__(self, cb, state=None, fn="fit"):
        self.cb = cb
        if state is None:
            state = engine.init(nn.Linear(2, 1), optim.sgd(0.1))
        self.state = init_states([cb], state)
        self.fn = fn

    def __call__(self, event, elapsed, stage="train"):
        ctx = Context(stage=stage, fn=self.fn, state=self.state, elapsed=elapsed)
        self.state, req = dispatch(event, [self.cb], self.state, ctx)
        return req

    @property
    def cb_state(self):
        return self.state.callbacks[self.cb.key]


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize(
    ("duration", "seconds"),
    [
        ("00:00:01:30", 90.0),
        ("1:02:03:04", 93784.0),
        ("  12:00:00:00 ", 12 * 86400.0),
        ({"minutes": 2, "seconds": 5}, 125.0),
        (datetime.timedelta(hours=1), 3600.0),
        (5, 5.0),
        (2.5, 2.5),
        (None, None),
    ],
)
def test_duration_formats(duration, seconds):
    assert parse_duration(duration) == seconds
    assert Timer(duration).duration == seconds


@pytest.mark.parametrize("bad", ["1:2:3:4", "01:00:00", "aa:00:00:00", "1:00:00:00:00", ""])
def test_bad_duration_strings(bad):
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        Timer(bad)


def test_other_bad_durations():
    with pytest.raises(ValueError, match="timedelta arguments"):
        Timer({"mins": 1})
    with pytest.raises(ValueError, match="seconds >= 0"):
        Timer(-1)
    with pytest.raises(ValueError, match="seconds >= 0"):
        Timer(datetime.timedelta(seconds=-5))
    with pytest.raises(ValueError, match="Timer: `duration=nan` is not valid"):
        Timer(float("nan"))
    with pytest.raises(TypeError, match="number of seconds"):
        Timer([1, 2])
    with pytest.raises(TypeError, match="number of seconds"):
        Timer(True)
    with pytest.raises(ValueError, match="interval='batch'"):
        Timer(10, interval="batch")


# --------------------------------------------------------------------------- stopping


def test_stops_at_train_batch_end_once_the_budget_is_spent():
    run = Run(Timer(10))
    assert not run("on_fit_start", 0.0)
    run("on_train_start", 0.0)
    assert not run("on_train_batch_end", 9.99)
    req = run("on_train_batch_end", 10.0)
    assert req.stop
    assert req.messages == (
        "Time limit reached. Elapsed time is 0:00:10. Signaling Trainer to stop.",
    )
    assert run.cb.time_elapsed() == 10.0
    assert run.cb.time_remaining() == 0.0


def test_not_verbose_stops_silently():
    run = Run(Timer(1, verbose=False))
    run("on_train_start", 0.0)
    req = run("on_train_batch_end", 3725.0)
    assert req.stop and not req.messages


def test_message_hours():
    run = Run(Timer("00:01:00:00"))
    run("on_train_start", 0.0)
    assert "Elapsed time is 1:02:05." in run("on_train_batch_end", 3725.9).messages[0]


def test_epoch_interval_checks_at_epoch_end_only():
    run = Run(Timer(10, interval="epoch"))
    run("on_train_start", 0.0)
    assert not run("on_train_batch_end", 20.0)
    assert run("on_train_epoch_end", 21.0).stop


def test_no_duration_never_stops():
    run = Run(Timer())
    run("on_train_start", 0.0)
    assert not run("on_train_batch_end", 1e9)
    assert run.cb.time_remaining() is None


def test_evaluation_stages_are_timed():
    run = Run(Timer(100))
    run("on_validation_start", 10.0, stage="validate")
    run("on_validation_end", 13.0, stage="validate")
    assert run.cb.time_elapsed("validate") == 3.0
    test_run = Run(Timer(100), fn="test")
    test_run("on_test_start", 2.0, stage="test")
    test_run("on_test_end", 7.5, stage="test")
    assert test_run.cb.time_elapsed("test") == 5.5
    test_run("on_predict_start", 1.0, stage="predict")
    ctx = Context(stage="predict", fn="predict", state=test_run.state, elapsed=4.0)
    assert test_run.cb.time_elapsed("predict", ctx) == 3.0  # live


def test_the_state_holds_no_clock_readings():
    """A resumed run must end bitwise equal to an uninterrupted one: no time in the state."""
    run = Run(Timer(100))
    before = dict(run.state.callbacks)
    run("on_fit_start", 1.0)
    run("on_train_start", 1.0)
    run("on_train_batch_end", 7.0)
    assert run.state.callbacks == before


def test_a_spent_restored_budget_stops_at_fit_start():
    # the driver restores the training time from the checkpoint: ctx.elapsed starts there
    assert Run(Timer(5))("on_fit_start", 5.0).stop
    assert not Run(Timer(5))("on_fit_start", 4.0).stop


@given(
    duration=st.integers(1, 50),
    readings=st.lists(st.integers(0, 10), min_size=1, max_size=20),
    restored=st.integers(0, 30),
)
def test_stops_at_the_first_batch_past_the_budget(duration, readings, restored):
    """Property: with a restored training time R (the driver's clock starts there) and
    increasing readings, the first stop is at the first reading >= the duration."""
    run = Run(Timer(duration, verbose=False))
    clock = float(restored)
    first_stop = -1 if run("on_fit_start", clock).stop else None
    run("on_train_start", clock)
    expected = -1 if restored >= duration else None
    for i, gap in enumerate(readings):
        clock += gap
        if run("on_train_batch_end", clock).stop and first_stop is None:
            first_stop = i
        if expected is None and clock >= duration:
            expected = i
    assert first_stop == expected
