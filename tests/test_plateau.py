"""ReduceLROnPlateau: the learning rates after each step equal torch's on any metric sequence."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purestep.engine import optim
from purestep.engine.optim import PlateauState, ReduceLROnPlateau

_metrics = st.lists(
    st.one_of(
        st.floats(-10, 10, allow_nan=False, width=32),
        st.sampled_from([0.0, 1.0, 1.0001, 0.9999, math.inf, -math.inf, math.nan]),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    metrics=_metrics,
    mode=st.sampled_from(["min", "max"]),
    factor=st.sampled_from([0.1, 0.5, 0.9, 0.333]),
    patience=st.integers(0, 4),
    threshold=st.sampled_from([0.0, 1e-4, 0.01, 0.5]),
    threshold_mode=st.sampled_from(["rel", "abs"]),
    cooldown=st.integers(0, 3),
    min_lr=st.one_of(st.sampled_from([0.0, 1e-3, 0.05]), st.just((0.01, 0.0))),
    eps=st.sampled_from([1e-8, 1e-3]),
    lrs=st.tuples(st.sampled_from([0.1, 1.0, 0.3]), st.sampled_from([0.02, 0.5])),
)
def test_decisions_equal_torch(
    metrics, mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps, lrs
):
    args = dict(
        mode=mode,
        factor=factor,
        patience=patience,
        threshold=threshold,
        threshold_mode=threshold_mode,
        cooldown=cooldown,
        eps=eps,
    )
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs]
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(
        torch.optim.SGD(groups),
        min_lr=list(min_lr) if isinstance(min_lr, tuple) else min_lr,
        **args,
    )
    plateau = ReduceLROnPlateau(min_lr=min_lr, **args)
    state, ours = plateau.init(), list(lrs)
    for value in metrics:
        reference.step(value)
        ours, state = plateau.update(state, value, ours)
        assert ours == [g["lr"] for g in reference.optimizer.param_groups]
        assert state.num_bad_epochs == reference.num_bad_epochs
        assert state.cooldown_counter == reference.cooldown_counter
        assert state.best == reference.best or (
            math.isnan(state.best) and math.isnan(reference.best)
        )
    assert state.last_epoch == reference.last_epoch == len(metrics)


def test_the_update_is_pure_and_its_state_is_plain_data():
    plateau = ReduceLROnPlateau(patience=0)
    state = plateau.init()
    lrs = [0.1]
    new_lrs, new = plateau.update(state, 1.0, lrs)
    assert state == state and state.best == math.inf and lrs == [0.1]
    assert isinstance(new, PlateauState) and new.last_epoch == 1
    assert plateau.update(new, 2.0, new_lrs)[0] == [0.1 * 0.1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "up"}, "mode='up'"),
        ({"threshold_mode": "pct"}, "threshold_mode"),
        ({"factor": 1.0}, "factor=1.0"),
        ({"patience": -1}, "patience=-1"),
        ({"factor": "half"}, "factor"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ReduceLROnPlateau(**kwargs)


def test_min_lr_per_group_must_match_the_groups():
    plateau = ReduceLROnPlateau(patience=0, min_lr=(0.0, 0.0))
    state = plateau.update(plateau.init(), 1.0, [0.1])[1]
    with pytest.raises(ValueError, match="2 min_lr values for 1"):
        plateau.update(state, 2.0, [0.1])


def test_set_hyperparams_is_pure_and_names_optimizers():
    opt = optim.inject_hyperparams(optim.sgd)(lr=0.1)
    params = {"w": torch.zeros(2)}
    state = opt.init(params)
    new = optim.set_hyperparams(state, {"lr": 0.05})
    assert float(state.hyperparams["lr"]) == 0.1 and float(new.hyperparams["lr"]) == 0.05
    multi = optim.MultiOptState(states={"g": state, "d": state}, steps={"g": 0, "d": 0})
    changed = optim.set_hyperparams(multi, {"d/lr": 0.2})
    assert optim.injected_values(changed.states["d"], "lr") == [0.2]
    assert optim.injected_values(changed.states["g"], "lr") == [0.1]
    with pytest.raises(KeyError, match="no optimizer named 'x'"):
        optim.set_hyperparams(multi, {"x/lr": 0.2})
    with pytest.raises(KeyError, match="no injected hyper-parameter 'momentum'"):
        optim.set_hyperparams(state, {"momentum": 0.2})
    with pytest.raises(KeyError, match="no injected"):
        optim.set_hyperparams(optim.sgd(0.1).init(params), {"lr": 0.2})
    with pytest.raises(KeyError, match=r"holds one optimizer: use the bare name \('lr'\)"):
        optim.set_hyperparams(state, {"gen/lr": 0.2})
