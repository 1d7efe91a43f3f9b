"""LoopConfig: Lightning's defaults and normalisation, overrides, and clear refusals."""

from __future__ import annotations

import dataclasses
import datetime
import math
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from purestep.loops import testing
from purestep.loops.config import FLAG_NAMES, LoopConfig, normalize_limit, parse_duration

LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")


def same(a, b) -> bool:
    return type(a) is type(b) and a == b


# --------------------------------------------------------------------------- defaults


def test_defaults_are_lightnings_after_normalisation():
    c = LoopConfig()
    assert (c.max_epochs, c.min_epochs, c.max_steps, c.min_steps, c.max_time) == (
        1000,
        0,
        -1,
        None,
        None,
    )
    for flag in LIMITS:
        assert same(getattr(c, flag), 1.0)
    assert same(c.val_check_interval, 1.0)
    assert c.check_val_every_n_epoch == 1
    assert c.num_sanity_val_steps == 2
    assert c.fast_dev_run == 0
    assert same(c.overfit_batches, 0.0)
    assert c.accumulate_grad_batches == 1
    assert c.log_every_n_steps == 50
    assert c.reload_dataloaders_every_n_epochs == 0
    assert c.gradient_clip_val is None
    assert c.gradient_clip_algorithm == "norm"
    assert c == LoopConfig.create()
    assert c.flags == {}


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, 1.0),
        (0, 0),
        (0.0, 0.0),
        (1, 1),
        (1.0, 1.0),
        (0.25, 0.25),
        (2, 2),
        (2.0, 2),
        (7.0, 7),
    ],
)
def test_limits_keep_int_vs_fraction(given, expected):
    for flag in LIMITS:
        assert same(getattr(LoopConfig.create(**{flag: given}), flag), expected)


@pytest.mark.parametrize("bad", [-1, -0.5, 1.5, 2.5, float("nan"), float("inf")])
def test_bad_limits_are_refused_naming_the_flag(bad):
    for flag in LIMITS:
        with pytest.raises(ValueError, match=rf"`{flag}=.*\[0\.0, 1\.0\] or a whole number"):
            LoopConfig.create(**{flag: bad})


@pytest.mark.parametrize("bad", ["1", True, [1]])
def test_limits_of_the_wrong_type_are_refused(bad):
    with pytest.raises(TypeError, match="`limit_val_batches` must be a fraction"):
        LoopConfig.create(limit_val_batches=bad)


@given(st.floats(0, 1e6, allow_nan=False) | st.integers(0, 10**6))
def test_normalize_limit_is_idempotent_and_whole_numbers_above_one_become_ints(x):
    try:
        once = normalize_limit(x, "limit_train_batches")
    except ValueError:
        assert x > 1 and x != int(x)
        return
    assert same(normalize_limit(once, "limit_train_batches"), once)
    if x > 1:
        assert same(once, int(x))
    else:
        assert same(once, x)


# --------------------------------------------------------------------------- fast_dev_run


@pytest.mark.parametrize(("flag", "n"), [(True, 1), (1, 1), (3, 3)])
def test_fast_dev_run_overrides_limits_and_counters(flag, n):
    c = LoopConfig.create(
        fast_dev_run=flag,
        max_epochs=5,
        max_steps=100,
        num_sanity_val_steps=4,
        check_val_every_n_epoch=None,
        val_check_interval=7,
    )
    for limit in LIMITS:
        assert same(getattr(c, limit), n)
    assert (c.max_steps, c.max_epochs, c.num_sanity_val_steps) == (n, 1, 0)
    assert same(c.val_check_interval, 1.0)
    assert c.check_val_every_n_epoch == 1
    assert c.fast_dev_run == n


def test_fast_dev_run_off_changes_nothing():
    assert (
        LoopConfig.create(fast_dev_run=False) == LoopConfig.create(fast_dev_run=0) == LoopConfig()
    )


def test_fast_dev_run_leaves_min_accumulation_and_logging_alone():
    c = LoopConfig.create(
        fast_dev_run=2, min_epochs=3, accumulate_grad_batches=4, log_every_n_steps=7
    )
    assert (c.min_epochs, c.accumulate_grad_batches, c.log_every_n_steps) == (3, 4, 7)


def test_negative_fast_dev_run_is_refused():
    with pytest.raises(ValueError, match=r"`fast_dev_run=-1`.*int >= 0"):
        LoopConfig.create(fast_dev_run=-1)
    with pytest.raises(TypeError, match="`fast_dev_run` must be True/False or an int"):
        LoopConfig.create(fast_dev_run=0.5)


@pytest.mark.parametrize("flag", LIMITS)
def test_fast_dev_run_with_explicit_limits_is_refused(flag):
    with pytest.raises(ValueError, match=rf"both fast_dev_run=2 and limits.*{flag}=0\.5"):
        LoopConfig.create(fast_dev_run=2, **{flag: 0.5})
    with pytest.raises(ValueError, match="both fast_dev_run=True and limits"):
        LoopConfig.create(fast_dev_run=True, **{flag: 1.0})  # 1.0 = all batches, not one
    assert LoopConfig.create(fast_dev_run=2, **{flag: 2}) == LoopConfig.create(fast_dev_run=2)


# --------------------------------------------------------------------------- overfit_batches


def test_overfit_batches_sets_train_and_val_limits_only():
    c = LoopConfig.create(overfit_batches=3, limit_test_batches=0.5)
    assert same(c.limit_train_batches, 3) and same(c.limit_val_batches, 3)
    assert same(c.limit_test_batches, 0.5) and same(c.limit_predict_batches, 1.0)
    f = LoopConfig.create(overfit_batches=0.25)
    assert same(f.limit_train_batches, 0.25) and same(f.limit_val_batches, 0.25)
    assert LoopConfig.create(overfit_batches=0) == LoopConfig()


def test_overfit_wins_over_fast_dev_run_for_train_and_val():
    c = LoopConfig.create(overfit_batches=0.5, fast_dev_run=2)
    assert same(c.limit_train_batches, 0.5) and same(c.limit_val_batches, 0.5)
    assert same(c.limit_test_batches, 2) and same(c.limit_predict_batches, 2)
    assert c.max_steps == 2


def test_overfit_with_a_different_explicit_limit_is_refused():
    with pytest.raises(ValueError, match=r"both overfit_batches=2 and limit_val_batches=0\.5"):
        LoopConfig.create(overfit_batches=2, limit_val_batches=0.5)


# --------------------------------------------------------------------------- epochs and steps


def test_max_epochs_default_depends_on_other_bounds():
    assert LoopConfig.create().max_epochs == 1000
    assert LoopConfig.create(max_steps=5).max_epochs == -1
    assert LoopConfig.create(max_steps=0).max_epochs == -1
    assert LoopConfig.create(max_time="00:01:00:00").max_epochs == -1
    assert LoopConfig.create(max_epochs=3, max_steps=5).max_epochs == 3


def test_min_epochs_default_depends_on_min_steps():
    assert LoopConfig.create().min_epochs == 0
    assert LoopConfig.create(min_steps=4).min_epochs == 1
    assert LoopConfig.create(min_steps=4, min_epochs=0).min_epochs == 0


def test_num_sanity_val_steps_minus_one_means_all():
    assert LoopConfig.create(num_sanity_val_steps=-1).num_sanity_val_steps == math.inf
    with pytest.raises(ValueError, match=r"`num_sanity_val_steps=-2`.*or -1"):
        LoopConfig.create(num_sanity_val_steps=-2)


@pytest.mark.parametrize(
    ("flags", "error", "pattern"),
    [
        ({"max_epochs": -2}, ValueError, r"`max_epochs=-2`.*-1 \(no limit\) or an int >= 0"),
        ({"max_steps": -5}, ValueError, r"`max_steps=-5`.*-1 \(no limit\)"),
        ({"min_epochs": -1}, ValueError, r"`min_epochs=-1`"),
        ({"min_steps": -1}, ValueError, r"`min_steps=-1`"),
        ({"max_epochs": 2.0}, TypeError, r"`max_epochs` must be None, -1"),
        ({"max_steps": "10"}, TypeError, r"`max_steps` must be .*got str '10'"),
        ({"max_epochs": True}, TypeError, r"`max_epochs` must be"),
        ({"log_every_n_steps": -1}, ValueError, r"`log_every_n_steps=-1`"),
        ({"reload_dataloaders_every_n_epochs": -1}, ValueError, r"reload_dataloaders"),
        ({"check_val_every_n_epoch": 0}, ValueError, r"`check_val_every_n_epoch=0`"),
        ({"check_val_every_n_epoch": 1.0}, TypeError, r"`check_val_every_n_epoch` must be"),
        ({"val_check_interval": 0}, ValueError, r"`val_check_interval=0`.*Use 0\.0"),
        ({"val_check_interval": -1}, ValueError, r"`val_check_interval=-1`"),
        (
            {"gradient_clip_algorithm": "l2"},
            ValueError,
            r"`gradient_clip_algorithm='l2'`.*'norm' or 'value'",
        ),
        ({"gradient_clip_algorithm": None}, TypeError, r"gradient_clip_algorithm"),
        ({"gradient_clip_val": "1"}, TypeError, r"`gradient_clip_val` must be None or a number"),
        ({"gradient_clip_val": -1.0}, ValueError, r"`gradient_clip_val=-1.0`"),
    ],
)
def test_bad_values_are_refused_with_the_flag_and_accepted_values(flags, error, pattern):
    with pytest.raises(error, match=pattern):
        LoopConfig.create(**flags)


def test_float_interval_needs_epoch_checks():
    with pytest.raises(
        ValueError, match=r"`val_check_interval=0\.5`.*an int .* check_val_every_n_epoch=None"
    ):
        LoopConfig.create(val_check_interval=0.5, check_val_every_n_epoch=None)
    with pytest.raises(ValueError, match=r"`val_check_interval=2\.0`"):
        LoopConfig.create(val_check_interval=2.0, check_val_every_n_epoch=None)
    c = LoopConfig.create(val_check_interval=3, check_val_every_n_epoch=None)
    assert (c.val_check_interval, c.check_val_every_n_epoch) == (3, None)
    assert same(LoopConfig.create(check_val_every_n_epoch=None).val_check_interval, 1.0)


def test_gradient_clip_values_are_normalised():
    c = LoopConfig.create(gradient_clip_val=1, gradient_clip_algorithm="VALUE")
    assert same(c.gradient_clip_val, 1.0) and c.gradient_clip_algorithm == "value"


def test_log_every_n_steps_none_means_default():
    assert LoopConfig.create(log_every_n_steps=None).log_every_n_steps == 50


# --------------------------------------------------------------------------- max_time


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        ("00:12:00:00", 12 * 3600.0),
        (" 1:02:03:04 ", 86400 + 2 * 3600 + 3 * 60 + 4.0),
        ("10:00:00:01", 10 * 86400 + 1.0),
        ({"hours": 1, "minutes": 30}, 5400.0),
        (datetime.timedelta(minutes=2), 120.0),
        (90, 90.0),
        (1.5, 1.5),
        (None, None),
    ],
)
def test_max_time_formats(given, seconds):
    assert LoopConfig.create(max_time=given).max_time == seconds
    assert parse_duration(given) == seconds


@pytest.mark.parametrize("bad", ["12:00:00", "00:1:00:00", "a:00:00:00", "", -1, float("inf")])
def test_bad_max_time_is_refused(bad):
    with pytest.raises(ValueError, match=r"`max_time=.*DD:HH:MM:SS"):
        LoopConfig.create(max_time=bad)


def test_max_time_dict_with_unknown_keys_is_refused():
    with pytest.raises(ValueError, match=r"`max_time=\{'hour': 1\}`.*timedelta"):
        LoopConfig.create(max_time={"hour": 1})
    with pytest.raises(TypeError, match="`max_time` must be"):
        LoopConfig.create(max_time=[1])


# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (3, 3),
        ({0: 3}, 3),
        ({2: 3}, ((0, 1), (2, 3))),
        ({5: 2, 0: 4, 9: 1}, ((0, 4), (5, 2), (9, 1))),
        ({0: 2, 3: 2}, 2),
        ({1: 1}, 1),
        (((0, 1), (2, 3)), ((0, 1), (2, 3))),
    ],
)
def test_accumulation_schedules_are_normalised(given, expected):
    assert LoopConfig.create(accumulate_grad_batches=given).accumulate_grad_batches == expected


@pytest.mark.parametrize(
    ("given", "pattern"),
    [
        (0, r"`accumulate_grad_batches=0`.*int >= 1"),
        (-2, r"`accumulate_grad_batches=-2`"),
        ({}, r"`accumulate_grad_batches=\{\}`.*non-empty"),
        ({-1: 2}, r"Epoch key -1 is not an int >= 0"),
        ({0: 0}, r"Factor 0 for epoch 0 is not an int >= 1"),
        ({1.0: 2}, r"Epoch key 1.0"),
    ],
)
def test_bad_accumulation_is_refused(given, pattern):
    with pytest.raises(ValueError, match=pattern):
        LoopConfig.create(accumulate_grad_batches=given)


def test_accumulation_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="`accumulate_grad_batches` must be an int >= 1"):
        LoopConfig.create(accumulate_grad_batches="2")


def test_the_users_schedule_is_not_mutated():
    schedule = {2: 3}
    LoopConfig.create(accumulate_grad_batches=schedule)
    assert schedule == {2: 3}


# --------------------------------------------------------------------------- names, flags


def test_unknown_flags_get_a_suggestion():
    with pytest.raises(TypeError, match=r"unknown flag `max_epoch`\. Did you mean `max_epochs`\?"):
        LoopConfig.create(max_epoch=3)
    with pytest.raises(
        TypeError, match=r"unknown flag `limit_valid_batches`\. Did you mean `limit_val_batches`"
    ):
        LoopConfig.create({"limit_valid_batches": 0.5})
    with pytest.raises(TypeError, match=r"unknown flag `zzz`\. Known flags: max_epochs"):
        LoopConfig.create(zzz=1)


def test_flags_keep_what_the_user_passed():
    schedule = {1: 2}
    c = LoopConfig.create(
        max_steps=10,
        limit_val_batches=1.0,
        accumulate_grad_batches=schedule,
        max_time=datetime.timedelta(seconds=30),
    )
    assert c.flags == {
        "max_steps": 10,
        "limit_val_batches": 1.0,
        "accumulate_grad_batches": {1: 2},
        "max_time": 30.0,
    }
    schedule[5] = 9
    c.flags["max_steps"] = 99
    assert c.flags["accumulate_grad_batches"] == {1: 2} and c.flags["max_steps"] == 10


def test_with_flags_reapplies_defaults_but_replace_edits_resolved_values():
    c = LoopConfig.create(max_steps=10)
    assert c.max_epochs == -1
    assert c.with_flags(max_steps=-1).max_epochs == 1000
    assert dataclasses.replace(c, max_steps=-1).max_epochs == -1
    assert LoopConfig.create(fast_dev_run=2).with_flags(fast_dev_run=False) == LoopConfig()


def test_as_dict_lists_every_flag_with_its_normalised_value():
    c = LoopConfig.create(accumulate_grad_batches={2: 4}, limit_val_batches=3.0)
    d = c.as_dict()
    assert tuple(d) == FLAG_NAMES
    assert d["accumulate_grad_batches"] == {0: 1, 2: 4}
    assert same(d["limit_val_batches"], 3) and d["max_epochs"] == 1000


def test_config_is_frozen_and_hashable():
    c = LoopConfig.create(max_epochs=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_epochs = 4  # type: ignore[misc]
    assert hash(c) == hash(LoopConfig.create(max_epochs=3))
    assert len({c, LoopConfig.create(max_epochs=3)}) == 1


@given(testing.configs())
def test_flags_recreate_the_config_and_revalidation_changes_nothing(c):
    assert LoopConfig.create(**c.flags) == c
    replaced = dataclasses.replace(c)
    assert replaced == c and hash(replaced) == hash(c)
    assert LoopConfig.create(**replaced.flags) == c
    assert pickle.loads(pickle.dumps(c)) == c


@given(testing.configs())
def test_normalised_values_have_the_documented_forms(c):
    for flag in (*LIMITS, "overfit_batches", "val_check_interval"):
        value = getattr(c, flag)
        assert (type(value) is int and value >= 0) or (type(value) is float and 0 <= value <= 1)
    assert type(c.max_epochs) is int and c.max_epochs >= -1
    assert type(c.min_epochs) is int and c.min_epochs >= 0
    assert c.num_sanity_val_steps == math.inf or type(c.num_sanity_val_steps) is int
    assert all(f >= 1 for _, f in c.accumulation_schedule)
    assert c.accumulation_schedule[0][0] == 0
    if c.fast_dev_run:
        assert (c.max_epochs, c.max_steps, c.num_sanity_val_steps) == (1, c.fast_dev_run, 0)
        assert same(c.limit_test_batches, c.fast_dev_run)
    if c.overfit_batches:
        assert same(c.limit_train_batches, c.overfit_batches)
        assert same(c.limit_val_batches, c.overfit_batches)
