"""EarlyStopping: every rule of Lightning's early stopping, driven through ``dispatch``."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from purestep import engine
from purestep.engine import optim
from purestep.engine.state import Progress
from purestep.loops.callbacks import EarlyStopping, StoppingReason, init_states
from purestep.loops.config import LoopConfig
from purestep.loops.events import Context, Requests, dispatch

INF = math.inf
NAN = math.nan


def _state(cb, epoch=0):
    state = engine.init(nn.Linear(2, 1), optim.sgd(0.1))
    state = state.replace(progress=Progress(epoch=epoch))
    return init_states([cb], state)


def _ctx(state, metrics, fn="fit", stage="train", config=None, **kw):
    return Context(stage=stage, fn=fn, state=state, metrics=metrics, config=config, **kw)


def run(cb, values, key="val_loss", event="on_train_epoch_end", **ctx_kw):
    """Check ``values`` in turn; returns the final state, the index of every check that
    requested a stop, and all messages."""
    state = _state(cb)
    stops, messages = [], []
    for i, v in enumerate(values):
        state = state.replace(progress=Progress(epoch=i))
        state, req = dispatch(event, [cb], state, _ctx(state, {key: v}, **ctx_kw))
        if req.stop:
            stops.append(i)
        messages += req.messages
    return state.callbacks[cb.key], stops, messages


# --------------------------------------------------------------------------- patience


def test_patience_counts_checks_and_equality_is_no_improvement():
    s, stops, _ = run(EarlyStopping("val_loss", patience=3), [1.0, 2.0, 1.0, 1.0])
    assert stops == [3]
    assert s["wait_count"] == 3 and s["best_score"] == 1.0
    assert s["stopping_reason"] == StoppingReason.PATIENCE_EXHAUSTED
    assert s["stopped_epoch"] == 3


def test_improvement_resets_wait_count():
    s, stops, _ = run(EarlyStopping("val_loss", patience=2), [3.0, 4.0, 2.0, 5.0])
    assert stops == [] and s["wait_count"] == 1 and s["best_score"] == 2.0


def test_patience_zero_stops_at_first_non_improving_check():
    _, stops, _ = run(EarlyStopping("val_loss", patience=0), [1.0, 0.5, 0.5])
    assert stops == [2]


def test_keeps_checking_after_a_stop():
    s, stops, _ = run(EarlyStopping("val_loss", patience=1), [1.0, 1.0, 1.0])
    assert stops == [1, 2] and s["wait_count"] == 2 and s["stopped_epoch"] == 2


def test_max_mode():
    s, stops, _ = run(EarlyStopping("acc", mode="max", patience=1), [0.1, 0.5, 0.4], key="acc")
    assert stops == [2] and s["best_score"] == 0.5


# --------------------------------------------------------------------------- min_delta


def test_min_delta_min_mode():
    s, _, _ = run(EarlyStopping("val_loss", min_delta=0.5), [1.0, 0.6])
    assert s["best_score"] == 1.0 and s["wait_count"] == 1  # 0.6 is not below 1.0 - 0.5
    s, _, _ = run(EarlyStopping("val_loss", min_delta=0.5), [1.0, 0.4])
    assert s["best_score"] == 0.4 and s["wait_count"] == 0


def test_min_delta_max_mode():
    s, _, _ = run(EarlyStopping("m", mode="max", min_delta=0.5), [1.0, 1.4], key="m")
    assert s["best_score"] == 1.0 and s["wait_count"] == 1
    s, _, _ = run(EarlyStopping("m", mode="max", min_delta=0.5), [1.0, 1.6], key="m")
    assert s["best_score"] == 1.6 and s["wait_count"] == 0


def test_negative_min_delta_is_not_normalised():
    # min mode with min_delta=-0.5: anything below best + 0.5 counts as an improvement
    s, _, _ = run(EarlyStopping("val_loss", min_delta=-0.5), [1.0, 1.2])
    assert s["best_score"] == 1.2 and s["wait_count"] == 0


# --------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    ("mode", "threshold", "values", "expected"),
    [
        ("min", 0.5, [1.0, 0.5], []),  # strict: reaching the threshold is not enough
        ("min", 0.5, [1.0, 0.49], [1]),
        ("max", 0.9, [0.5, 0.9], []),
        ("max", 0.9, [0.5, 0.91], [1]),
    ],
)
def test_stopping_threshold_is_strict(mode, threshold, values, expected):
    cb = EarlyStopping("m", mode=mode, stopping_threshold=threshold, patience=10)
    s, stops, _ = run(cb, values, key="m")
    assert stops == expected
    if expected:
        assert s["stopping_reason"] == StoppingReason.STOPPING_THRESHOLD
        assert s["best_score"] == values[0]  # threshold rules leave best and wait alone


@pytest.mark.parametrize(
    ("mode", "threshold", "values", "expected"),
    [
        ("min", 5.0, [1.0, 5.0], []),
        ("min", 5.0, [1.0, 5.1], [1]),
        ("max", 0.1, [0.5, 0.1], []),
        ("max", 0.1, [0.5, 0.09], [1]),
    ],
)
def test_divergence_threshold_is_strict(mode, threshold, values, expected):
    cb = EarlyStopping("m", mode=mode, divergence_threshold=threshold, patience=10)
    s, stops, _ = run(cb, values, key="m")
    assert stops == expected
    if expected:  # divergence does not count as a non-improving check
        assert s["stopping_reason"] == StoppingReason.DIVERGENCE_THRESHOLD
        assert s["wait_count"] == 0 and s["best_score"] == values[0]
    else:  # on the threshold: an ordinary non-improving check
        assert s["wait_count"] == 1


def test_rule_order_non_finite_then_stopping_then_divergence():
    cb = EarlyStopping("m", stopping_threshold=10.0, divergence_threshold=5.0)
    s, stops, _ = run(cb, [7.0], key="m")  # both thresholds match: stopping wins
    assert stops == [0] and s["stopping_reason"] == StoppingReason.STOPPING_THRESHOLD
    s, stops, _ = run(cb, [NAN], key="m")
    assert s["stopping_reason"] == StoppingReason.NON_FINITE_METRIC


# --------------------------------------------------------------------------- check_finite


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_check_finite_stops_on_non_finite(bad):
    s, stops, _ = run(EarlyStopping("val_loss", patience=5), [1.0, bad])
    assert stops == [1] and s["stopping_reason"] == StoppingReason.NON_FINITE_METRIC
    assert s["best_score"] == 1.0 and s["wait_count"] == 0


def test_without_check_finite_nan_is_a_non_improving_check():
    s, stops, _ = run(EarlyStopping("val_loss", check_finite=False, patience=2), [1.0, NAN, NAN])
    assert stops == [2] and s["wait_count"] == 2 and s["best_score"] == 1.0


def test_tensor_metrics_are_compared_in_their_dtype():
    values = [torch.tensor(1.0), torch.tensor([0.5], dtype=torch.float32), torch.tensor(0.5)]
    s, stops, _ = run(EarlyStopping("val_loss", patience=1), values)
    assert stops == [2] and s["best_score"] == 0.5 and isinstance(s["best_score"], float)


def test_multi_element_tensor_metric_is_refused():
    with pytest.raises(ValueError, match="single value"):
        run(EarlyStopping("val_loss"), [torch.ones(2)])


# --------------------------------------------------------------------------- missing monitor


def test_strict_missing_monitor_lists_available_keys():
    cb = EarlyStopping("val_loss")
    state = _state(cb)
    with pytest.raises(RuntimeError, match=r"`val_loss` which is not available.*`a`, `b`"):
        dispatch("on_train_epoch_end", [cb], state, _ctx(state, {"a": 1.0, "b": 2.0}))


def test_non_strict_missing_monitor_is_skipped():
    cb = EarlyStopping("val_loss", strict=False, verbose=True)
    state = _state(cb)
    new, req = dispatch("on_train_epoch_end", [cb], state, _ctx(state, {"a": 1.0}))
    assert new.callbacks[cb.key] == cb.init() and not req.stop
    assert len(req.messages) == 1 and "not available" in req.messages[0]
    quiet = EarlyStopping("val_loss", strict=False)
    _, req = dispatch("on_train_epoch_end", [quiet], state, _ctx(state, {"a": 1.0}))
    assert not req


# --------------------------------------------------------------------------- skipping


@pytest.mark.parametrize(
    "ctx_kw",
    [
        {"fn": "validate"},
        {"stage": "sanity_check"},
        {"config": LoopConfig.create(fast_dev_run=1)},
    ],
)
def test_skipped_outside_fit_in_sanity_check_and_fast_dev_run(ctx_kw):
    cb = EarlyStopping("val_loss", patience=0)
    for event in ("on_train_epoch_end", "on_validation_end"):
        state = _state(cb)
        # a missing monitor would raise if the check ran
        new, req = dispatch(event, [cb], state, _ctx(state, {}, **ctx_kw))
        assert not req and new.callbacks[cb.key] == cb.init()


def test_reads_the_loop_config_flags():
    LoopConfig = pytest.importorskip("purestep.loops.config").LoopConfig
    cb = EarlyStopping("v", patience=0)
    _, stops, _ = run(cb, [1, 1], "v", config=LoopConfig.create(val_check_interval=0.5))
    assert stops == []  # checked at validation end instead
    _, stops, _ = run(
        cb, [1, 1], "v", "on_validation_end", config=LoopConfig.create(val_check_interval=0.5)
    )
    assert stops == [1]
    _, stops, _ = run(cb, [1, 1], "v", config=LoopConfig.create(fast_dev_run=True))
    assert stops == []


def test_check_point_resolved_from_config():
    every_epoch = LoopConfig.create(val_check_interval=1.0, check_val_every_n_epoch=1)
    half_epoch = LoopConfig.create(val_check_interval=0.5, check_val_every_n_epoch=1)
    every_other = LoopConfig.create(val_check_interval=1.0, check_val_every_n_epoch=2)
    for config, on_epoch_end in [(every_epoch, True), (half_epoch, False), (every_other, False)]:
        _, a, _ = run(EarlyStopping("v", patience=0), [1, 1], "v", config=config)
        _, b, _ = run(
            EarlyStopping("v", patience=0), [1, 1], "v", "on_validation_end", config=config
        )
        assert (a, b) == (([1], []) if on_epoch_end else ([], [1]))
    # no config: the Lightning defaults (check at the training epoch end)
    _, a, _ = run(EarlyStopping("v", patience=0), [1, 1], "v")
    assert a == [1]
    # an explicit choice wins over the config
    cb = EarlyStopping("v", patience=0, check_on_train_epoch_end=False)
    _, b, _ = run(cb, [1, 1], "v", "on_validation_end", config=every_epoch)
    assert b == [1]


# --------------------------------------------------------------------------- messages


def test_verbose_messages():
    cb = EarlyStopping("val_loss", patience=1, verbose=True, min_delta=0.1)
    _, _, messages = run(cb, [1.0, 0.5, 0.45])
    assert messages == [
        "Metric val_loss improved. New best score: 1.000",
        "Metric val_loss improved by 0.500 >= min_delta = 0.1. New best score: 0.500",
        "Monitored metric val_loss did not improve in the last 1 records. Best score: 0.500. "
        "Signaling Trainer to stop.",
    ]
    s, _, _ = run(cb, [1.0, 0.5, 0.45])
    assert s["message"] == messages[-1]


def test_threshold_and_non_finite_messages():
    cb = EarlyStopping("m", verbose=True, stopping_threshold=0.5, divergence_threshold=8.0)
    assert run(cb, [0.4], "m")[2] == [
        "Stopping threshold reached: m = 0.4 < 0.5. Signaling Trainer to stop."
    ]
    assert run(cb, [9.0], "m")[2] == [
        "Divergence threshold reached: m = 9.0 < 8.0. Signaling Trainer to stop."
    ]
    assert run(cb, [1.0, NAN], "m")[2][-1] == (
        "Monitored metric m = nan is not finite. Previous best value was 1.000. "
        "Signaling Trainer to stop."
    )


def test_not_verbose_has_no_messages():
    assert run(EarlyStopping("val_loss", patience=0), [1.0, 2.0])[2] == []


def test_rank_prefix_and_rank_zero_only():
    cb = EarlyStopping("v", verbose=True)
    msgs = run(cb, [1.0], "v", world_size=2, rank=1)[2]
    assert msgs == ["[rank: 1] Metric v improved. New best score: 1.000"]
    quiet = EarlyStopping("v", verbose=True, log_rank_zero_only=True)
    assert run(quiet, [1.0], "v", world_size=2, rank=1)[2] == []
    assert len(run(quiet, [1.0], "v", world_size=2, rank=0)[2]) == 1


# --------------------------------------------------------------------------- state


def test_state_round_trips_through_torch_save_weights_only():
    cb = EarlyStopping("val_loss", patience=3)
    s, _, _ = run(cb, [1.0, 0.5, 0.7, 0.8])
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded == s
    # continuing from the loaded state behaves as continuing from the original
    state = _state(cb).replace(callbacks={cb.key: loaded})
    state, req = dispatch("on_train_epoch_end", [cb], state, _ctx(state, {"val_loss": 0.9}))
    assert req.stop and state.callbacks[cb.key]["wait_count"] == 3


def test_restored_patience_wins():
    cb = EarlyStopping("v", patience=5)
    state = _state(cb)
    state = state.replace(callbacks={cb.key: {**cb.init(), "patience": 1, "best_score": 0.0}})
    _, req = dispatch("on_train_epoch_end", [cb], state, _ctx(state, {"v": 1.0}))
    assert req.stop


def test_initial_state():
    assert EarlyStopping("v").init()["best_score"] == INF
    assert EarlyStopping("v", mode="max").init()["best_score"] == -INF
    assert EarlyStopping("v").monitoring is True


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode='avg'"):
        EarlyStopping("v", mode="avg")
    with pytest.raises(TypeError, match="metric name"):
        EarlyStopping(None)
    with pytest.raises(TypeError, match="patience"):
        EarlyStopping("v", patience=1.5)


def test_name_sets_the_state_key():
    a, b = EarlyStopping("x", name="es_x"), EarlyStopping("y", name="es_y")
    state = init_states([a, b], engine.init(nn.Linear(2, 1), optim.sgd(0.1)))
    assert set(state.callbacks) == {"es_x", "es_y"}


def test_a_stop_comes_with_its_message():
    cb = EarlyStopping("v", patience=0, verbose=True)
    state = _state(cb)
    state, _ = dispatch("on_train_epoch_end", [cb], state, _ctx(state, {"v": 1.0}))
    _, req = dispatch("on_train_epoch_end", [cb], state, _ctx(state, {"v": 1.0}))
    assert isinstance(req, Requests) and req.stop and "did not improve" in req.messages[0]


# --------------------------------------------------------------------------- property


def brute_force(values, mode, patience, min_delta, stopping, divergence, check_finite):
    """An independent restatement of the rules: (first stop index or None, wait, best)."""
    best = INF if mode == "min" else -INF
    wait = 0
    for i, v in enumerate(values):
        if check_finite and (v != v or v in (INF, -INF)):
            return i, wait, best
        if mode == "min":
            if stopping is not None and v < stopping:
                return i, wait, best
            if divergence is not None and v > divergence:
                return i, wait, best
            improved = v + min_delta < best
        else:
            if stopping is not None and v > stopping:
                return i, wait, best
            if divergence is not None and v < divergence:
                return i, wait, best
            improved = v - min_delta > best
        if improved:
            best, wait = v, 0
        else:
            wait += 1
            if wait >= patience:
                return i, wait, best
    return None, wait, best


values_st = st.lists(
    st.one_of(
        st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, NAN, INF, -INF]),
        st.floats(-5, 5, allow_nan=False),
    ),
    min_size=1,
    max_size=15,
)


@given(
    values=values_st,
    mode=st.sampled_from(["min", "max"]),
    patience=st.integers(0, 4),
    min_delta=st.sampled_from([0.0, 0.1, 0.5, -0.2]),
    stopping=st.one_of(st.none(), st.sampled_from([-1.0, 0.0, 1.0, 3.0])),
    divergence=st.one_of(st.none(), st.sampled_from([-2.0, 2.0, 4.0])),
    check_finite=st.booleans(),
)
def test_stops_exactly_where_brute_force_says(
    values, mode, patience, min_delta, stopping, divergence, check_finite
):
    cb = EarlyStopping(
        "m",
        mode=mode,
        patience=patience,
        min_delta=min_delta,
        stopping_threshold=stopping,
        divergence_threshold=divergence,
        check_finite=check_finite,
    )
    expected_stop, expected_wait, expected_best = brute_force(
        values, mode, patience, min_delta, stopping, divergence, check_finite
    )
    state = _state(cb)
    stopped_at = None
    for i, v in enumerate(values):
        state, req = dispatch("on_train_epoch_end", [cb], state, _ctx(state, {"m": v}))
        if req.stop:
            stopped_at = i
            break
    assert stopped_at == expected_stop
    s = state.callbacks[cb.key]
    assert s["wait_count"] == expected_wait
    assert s["best_score"] == expected_best
    assert (s["stopping_reason"] != 0) == (expected_stop is not None)
