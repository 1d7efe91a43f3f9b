"""Trainer flags from PURESTEP_TRAINER_* environment variables and from argparse."""

from __future__ import annotations

import argparse

import pytest

from purestep.loops import Trainer
from purestep.loops.trainer_args import ENV_PREFIX, check_flag_names, flag_names, parse_value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3", 3),
        ("0.5", 0.5),
        ("None", None),
        ("False", False),
        ("{0: 2, 3: 1}", {0: 2, 3: 1}),
        ("cpu", "cpu"),
        ("bf16-mixed", "bf16-mixed"),
        ("00:01:00:00", "00:01:00:00"),
        ("false", "false"),  # not a Python literal: kept as text, as in Lightning
    ],
)
def test_parse_value(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_environment_defaults_and_explicit_arguments_win(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "MAX_EPOCHS", "3")
    monkeypatch.setenv(ENV_PREFIX + "VAL_CHECK_INTERVAL", "0.25")
    monkeypatch.setenv(ENV_PREFIX + "LOGGER", "False")
    monkeypatch.setenv(ENV_PREFIX + "PRECISION", "64-true")
    monkeypatch.setenv(ENV_PREFIX + "LIMIT_VAL_BATCHES", "")  # empty: ignored
    monkeypatch.setenv(ENV_PREFIX + "NOT_A_FLAG", "1")  # unknown names: ignored
    t = Trainer(enable_progress_bar=False)
    assert t.config.max_epochs == 3 and t.config.val_check_interval == 0.25
    assert t.loggers == [] and t.strategy.precision.name == "64-true"
    assert t.config.limit_val_batches == 1.0
    t = Trainer(max_epochs=7, enable_progress_bar=False)
    assert t.config.max_epochs == 7


def test_bad_environment_values_fail_like_bad_arguments(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "LIMIT_TRAIN_BATCHES", "1.5")
    with pytest.raises(ValueError, match="limit_train_batches"):
        Trainer()


def test_unknown_flags_suggest_the_closest():
    with pytest.raises(TypeError, match=r"`max_step` \(did you mean `max_steps`\?\)"):
        Trainer(max_step=3)
    with pytest.raises(TypeError, match="`zzz`"):
        check_flag_names({"zzz": 1}, ["max_epochs"])
    with pytest.raises(TypeError):
        Trainer(3)  # flags are keyword-only


def test_argparse_round_trip():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)  # the script's own option
    Trainer.add_argparse_args(parser)
    args = parser.parse_args(
        [
            "--max_epochs",
            "4",
            "--val_check_interval",
            "0.5",
            "--accumulate_grad_batches",
            "{0: 1, 2: 4}",
            "--precision",
            "bf16-mixed",
            "--max_time",
            "00:00:10:00",
            "--logger",
            "False",
            "--enable_progress_bar",
            "False",
        ]
    )
    assert not hasattr(args, "min_epochs")  # unset flags stay out (env or defaults apply)
    t = Trainer.from_argparse_args(args, limit_train_batches=2)
    c = t.config
    assert (c.max_epochs, c.val_check_interval, c.max_time) == (4, 0.5, 600.0)
    assert c.accumulate_grad_batches == ((0, 1), (2, 4)) and c.limit_train_batches == 2
    assert t.strategy.precision.name == "bf16-mixed" and t.loggers == []
    with pytest.raises(TypeError, match="did you mean `max_epochs`"):
        Trainer.from_argparse_args(args, max_epoch=1)
    assert (
        Trainer.from_argparse_args({"max_steps": 5, "other": 1}, logger=False).config.max_steps == 5
    )


def test_every_flag_but_callbacks_has_an_option():
    parser = Trainer.add_argparse_args(argparse.ArgumentParser())
    options = {a.dest for a in parser._actions if a.dest != "help"}
    assert options == set(flag_names(Trainer.__init__)) - {"callbacks"}
