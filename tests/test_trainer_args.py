"""Trainer flags from PURESTEP_TRAINER_* environment variables and from argparse; hints for
Lightning flags this Trainer spells otherwise."""

from __future__ import annotations

import argparse
import re
import sys

import pytest

from purestep.loops import Trainer
from purestep.loops.trainer_args import (
    ENV_PREFIX,
    LIGHTNING_FLAGS,
    check_flag_names,
    flag_names,
    parse_flag,
    parse_value,
)


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
    monkeypatch.setenv(ENV_PREFIX + "NOT_A_FLAG", "1")  # unknown names: ignored, with a warning
    with pytest.warns(UserWarning, match="NOT_A_FLAG names no Trainer flag and is ignored$"):
        t = Trainer(enable_progress_bar=False)
    assert t.config.max_epochs == 3 and t.config.val_check_interval == 0.25
    assert t.loggers == [] and t.strategy.precision.name == "64-true"
    assert t.config.limit_val_batches == 1.0
    monkeypatch.delenv(ENV_PREFIX + "NOT_A_FLAG")
    t = Trainer(max_epochs=7, enable_progress_bar=False)
    assert t.config.max_epochs == 7


def test_bad_environment_values_fail_like_bad_arguments(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "LIMIT_TRAIN_BATCHES", "1.5")
    with pytest.raises(ValueError, match="limit_train_batches") as caught:
        Trainer()
    if sys.version_info >= (3, 11):  # the error says where the value came from
        assert caught.value.__notes__ == [
            f"Flags from the environment: {ENV_PREFIX}LIMIT_TRAIN_BATCHES='1.5'"
        ]


@pytest.mark.parametrize(
    ("variable", "hint"),
    [
        ("MAX_EPOCH", f"; did you mean {ENV_PREFIX}MAX_EPOCHS?"),  # misspelt
        ("max_epochs", f"; did you mean {ENV_PREFIX}MAX_EPOCHS?"),  # lower case
        ("ENABLE_PROGRESSBAR", f"; did you mean {ENV_PREFIX}ENABLE_PROGRESS_BAR?"),
        ("GPUS", f" (gpus is a Lightning flag: {LIGHTNING_FLAGS['gpus']})"),
        ("ZZZ", ""),
    ],
)
def test_environment_variables_naming_no_flag_are_ignored_with_a_warning(
    monkeypatch, variable, hint
):
    monkeypatch.setenv(ENV_PREFIX + variable, "2")
    expected = f"{ENV_PREFIX}{variable} names no Trainer flag and is ignored{hint}"
    with pytest.warns(UserWarning, match=f"^{re.escape(expected)}$"):
        t = Trainer(logger=False)
    assert t.config.max_epochs == 1000  # Lightning's default: the variable changed nothing


@pytest.mark.parametrize(
    ("text", "value"),
    [(t, True) for t in ("true", "True", "TRUE", "yes", "Yes", "on", "ON", "1")]
    + [(t, False) for t in ("false", "False", "FALSE", "no", "NO", "off", "Off", "0")],
)
@pytest.mark.parametrize("flag", ["donate_state", "detect_anomaly", "enable_checkpointing"])
def test_boolean_flags_take_the_usual_spellings_from_the_environment(
    monkeypatch, flag, text, value
):
    monkeypatch.setenv(ENV_PREFIX + flag.upper(), text)
    assert getattr(Trainer(logger=False), flag) is value


def test_optional_boolean_flags_take_none_and_mixed_flags_keep_their_other_values(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "ENABLE_PROGRESS_BAR", "none")  # bool | None
    assert Trainer(logger=False).enable_progress_bar is True  # None: the default
    monkeypatch.setenv(ENV_PREFIX + "FAST_DEV_RUN", "3")  # int | bool: 3 batches, not True
    assert Trainer(logger=False).config.fast_dev_run == 3
    monkeypatch.setenv(ENV_PREFIX + "FAST_DEV_RUN", "yes")
    assert Trainer(logger=False).config.fast_dev_run == 1
    monkeypatch.delenv(ENV_PREFIX + "FAST_DEV_RUN")
    monkeypatch.setenv(ENV_PREFIX + "DETERMINISTIC", "warn")  # bool | str | None
    assert Trainer(logger=False).deterministic == "warn"
    monkeypatch.setenv(ENV_PREFIX + "DETERMINISTIC", "Off")
    assert Trainer(logger=False).deterministic is False
    monkeypatch.setenv(ENV_PREFIX + "DETERMINISTIC", "1")  # no int in its type: a boolean
    assert Trainer(logger=False).deterministic is True
    monkeypatch.setenv(ENV_PREFIX + "DETERMINISTIC", "NONE")
    assert Trainer(logger=False).deterministic is None
    monkeypatch.setenv(ENV_PREFIX + "FAST_DEV_RUN", "1")  # int | bool: one batch
    assert Trainer(logger=False).config.fast_dev_run == 1


@pytest.mark.parametrize(
    ("flag", "text", "accepted"),
    [
        ("DONATE_STATE", "maybe", "true/false, yes/no, on/off, 1/0"),
        ("DONATE_STATE", "None", "true/false, yes/no, on/off, 1/0"),  # not optional
        ("ENABLE_MODEL_SUMMARY", "2", "true/false, yes/no, on/off, 1/0, None"),
    ],
)
def test_bad_boolean_values_name_the_variable_and_the_spellings(monkeypatch, flag, text, accepted):
    monkeypatch.setenv(ENV_PREFIX + flag, text)
    expected = f"{ENV_PREFIX}{flag}={text!r} is not a boolean; accepted (any case): {accepted}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        Trainer(logger=False)


def test_parse_flag_reads_for_the_flags_type():
    assert parse_flag("off", "bool") is False and parse_flag("1", "bool | None") is True
    assert parse_flag("1", "int | bool") == 1 and type(parse_flag("1", "int | bool")) is int
    assert parse_flag("false", "Any") == "false"  # not a boolean flag: kept as text
    assert parse_flag("3", "int | None") == 3


# Lightning 1.5 flags (and a few later ones) with what the error must name.
LIGHTNING_HINTS = {
    "gpus": 'accelerator="gpu", devices=N',
    "tpu_cores": "not available yet",
    "ipus": "not available yet",
    "num_processes": 'devices=N with strategy="ddp"',
    "num_nodes": "torchrun --nnodes=N",
    "auto_select_gpus": "not available yet",
    "resume_from_checkpoint": "fit(..., ckpt_path=...)",
    "weights_save_path": "ModelCheckpoint(dirpath=...)",
    "checkpoint_callback": "use enable_checkpointing",
    "progress_bar_refresh_rate": "use enable_progress_bar",
    "weights_summary": "ModelSummary(max_depth=...)",
    "flush_logs_every_n_steps": "CSVLogger(..., flush_logs_every_n_steps=N)",
    "process_position": "not available yet",
    "log_gpu_memory": "not available yet",
    "amp_backend": 'precision="16-mixed"',
    "amp_level": 'precision="16-mixed"',
    "move_metrics_to_cpu": "not available yet",
    "replace_sampler_ddp": "deterministic order",
    "use_distributed_sampler": "deterministic order",
    "sync_batchnorm": "hardware.ddp(sync_batchnorm=True)",
    "distributed_backend": 'strategy="ddp"',
    "truncated_bptt_steps": "not available yet",
    "stochastic_weight_avg": "StochasticWeightAveraging(swa_lrs=...)",
    "plugins": "not available yet",
    "reload_dataloaders_every_epoch": "reload_dataloaders_every_n_epochs=1",
}


def test_every_lightning_flag_has_a_hint_and_none_is_a_flag_here():
    assert set(LIGHTNING_FLAGS) == set(LIGHTNING_HINTS)
    assert not set(LIGHTNING_FLAGS) & set(flag_names(Trainer.__init__))


@pytest.mark.parametrize("flag", sorted(LIGHTNING_HINTS))
def test_lightning_flags_name_their_replacement(flag):
    assert LIGHTNING_HINTS[flag] in LIGHTNING_FLAGS[flag]
    expected = f"Trainer got unknown flag(s): `{flag}` (a Lightning flag: {LIGHTNING_FLAGS[flag]})"
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        Trainer(**{flag: 1})
    with pytest.raises(TypeError, match=re.escape(LIGHTNING_FLAGS[flag])):
        Trainer.from_argparse_args({}, **{flag: 1})


def test_lightning_flags_and_misspellings_together():
    with pytest.raises(TypeError) as caught:
        Trainer(gpus=1, max_epoch=2)
    assert str(caught.value) == (
        f"Trainer got unknown flag(s): `gpus` (a Lightning flag: {LIGHTNING_FLAGS['gpus']}), "
        "`max_epoch` (did you mean `max_epochs`?)"
    )


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


def test_boolean_options_take_the_usual_spellings(capsys):
    parser = Trainer.add_argparse_args(argparse.ArgumentParser())
    args = parser.parse_args(["--enable_progress_bar", "no", "--donate_state", "OFF"])
    assert args.enable_progress_bar is False and args.donate_state is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--donate_state", "maybe"])
    assert "--donate_state='maybe' is not a boolean" in capsys.readouterr().err


def test_every_flag_but_callbacks_has_an_option():
    parser = Trainer.add_argparse_args(argparse.ArgumentParser())
    options = {a.dest for a in parser._actions if a.dest != "help"}
    assert options == set(flag_names(Trainer.__init__)) - {"callbacks"}
