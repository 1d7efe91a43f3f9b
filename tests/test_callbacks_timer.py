"""Timer: duration formats, when it stops, and a budget that survives a resume."""

from __future__ import annotations

import datetime
import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import engine
from engine import optim
from loops.callbacks import Timer, init_states, parse_duration
from loops.events import Context, dispatch


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
    with pytest.raises(ValueError, match="non-negative"):
        Timer(-1)
    with pytest.raises(ValueError, match="non-negative"):
        Timer(datetime.timedelta(seconds=-5))
    with pytest.raises(ValueError, match="finite"):
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
    assert run.cb_state["time_elapsed"]["train"] == 10.0


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
    assert run.cb.time_remaining(run.cb_state) is None


def test_sanity_check_time_does_not_count():
    run = Run(Timer(10))
    run("on_fit_start", 0.0)
    run("on_validation_start", 0.0, stage="sanity_check")
    run("on_validation_end", 4.0, stage="sanity_check")
    run("on_train_start", 4.0)
    assert not run("on_train_batch_end", 13.0)
    assert run("on_train_batch_end", 14.0).stop
    assert run.cb_state["time_elapsed"]["sanity_check"] == 4.0


def test_in_fit_validation_counts_and_is_timed():
    run = Run(Timer(100))
    run("on_train_start", 0.0)
    run("on_validation_start", 10.0, stage="validate")
    run("on_validation_end", 13.0, stage="validate")
    times = run.cb_state["time_elapsed"]
    assert times["validate"] == 3.0 and times["train"] == 13.0


def test_test_and_predict_runs_are_timed():
    run = Run(Timer(100), fn="test")
    run("on_test_start", 2.0, stage="test")
    run("on_test_end", 7.5, stage="test")
    assert run.cb_state["time_elapsed"]["test"] == 5.5
    assert run.cb.time_elapsed(run.cb_state, "test") == 5.5
    run("on_predict_start", 1.0, stage="predict")
    ctx = Context(stage="predict", fn="predict", state=run.state, elapsed=4.0)
    assert run.cb.time_elapsed(run.cb_state, "predict", ctx) == 3.0  # live


# --------------------------------------------------------------------------- resuming


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("clock_includes_restored_time", [False, True])
def test_resumed_run_continues_the_budget(clock_includes_restored_time):
    timer = Timer(10)
    first = Run(timer)
    first("on_fit_start", 0.0)
    first("on_train_start", 0.0)
    assert not first("on_train_batch_end", 6.0)
    saved = _round_trip(first.state.callbacks)
    assert saved == first.state.callbacks

    # a new process: the driver's clock restarts at 0, or at the restored 6 s
    base = 6.0 if clock_includes_restored_time else 0.0
    second = Run(timer, first.state.replace(callbacks=saved))
    assert not second("on_fit_start", base)
    second("on_train_start", base)
    assert not second("on_train_batch_end", base + 3.9)
    assert timer.time_remaining(second.cb_state) == pytest.approx(0.1)
    assert second("on_train_batch_end", base + 4.0).stop


def test_spent_restored_budget_stops_at_fit_start():
    timer = Timer(5)
    first = Run(timer)
    first("on_train_start", 0.0)
    first("on_train_batch_end", 5.0)
    second = Run(timer, first.state)
    assert second("on_fit_start", 0.0).stop


@given(
    duration=st.integers(1, 50),
    readings=st.lists(st.integers(0, 10), min_size=1, max_size=20),
    restored=st.integers(0, 30),
)
def test_stops_at_the_first_batch_past_the_budget(duration, readings, restored):
    """Property: with a restored training time R and increasing clock readings, the timer
    stops first at the reading where R + (reading - clock at train start) >= duration.
    (Whole seconds, so the sums are exact.)"""
    timer = Timer(duration, verbose=False)
    run = Run(timer)
    state = run.cb_state
    run.state = run.state.replace(
        callbacks={
            timer.key: {**state, "time_elapsed": {**state["time_elapsed"], "train": restored}}
        }
    )
    clock = 100.0
    first_stop = -1 if run("on_fit_start", clock).stop else None
    run("on_train_start", clock)
    expected = -1 if restored >= duration else None
    for i, gap in enumerate(readings):
        clock += gap
        if run("on_train_batch_end", clock).stop and first_stop is None:
            first_stop = i
        if expected is None and restored + (clock - 100.0) >= duration:
            expected = i
    assert first_stop == expected
