"""``purestep.cli``: the config-file command line (``loops.command_line``, on jsonargparse)."""

from __future__ import annotations

import glob
import inspect
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
import yaml

pytest.importorskip("jsonargparse")

import purestep
from purestep.loops import Trainer
from purestep.loops.callbacks import EarlyStopping
from purestep.loops.command_line import CLI, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A user's module: imported by class path (subclass mode) from a temporary folder.
USER_MODULE = """
import torch
from torch.utils.data import DataLoader, TensorDataset

from purestep import optim
from purestep.loops import DataModule, Task


class Regression(Task):
    def __init__(self, hidden: int = 4, lr: float = 0.1):
        super().__init__(hparams={"hidden": hidden, "lr": lr})
        self.hidden, self.lr = hidden, lr

    def configure_model(self):
        return torch.nn.Sequential(torch.nn.Linear(3, self.hidden), torch.nn.Linear(self.hidden, 1))

    def configure_optimizers(self):
        return optim.sgd(self.lr)

    def training_step(self, apply, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply(x), y)

    validation_step = training_step
    test_step = training_step


class Data(DataModule):
    def __init__(self, n: int = 32, batch_size: int = 8):
        self.n, self.batch_size = n, batch_size

    def _loader(self):
        x = torch.randn(self.n, 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader
"""

_namespace: dict = {}
exec(compile(USER_MODULE, "<cli user module>", "exec"), _namespace)
Regression, Data = _namespace["Regression"], _namespace["Data"]

QUIET = [
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.num_sanity_val_steps",
    "0",
]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The user's module as ``cli_user_task`` in a folder on ``sys.path``."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "cli_user_task.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("cli_user_task", None)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_fit_with_a_yaml_config_and_overrides_runs_and_saves_the_resolved_config(tmp_path):
    config = _write(
        tmp_path / "run.yaml",
        """
        trainer:
          max_epochs: 3
          default_root_dir: {root}
        model:
          hidden: 5
        data:
          batch_size: 4
        """.format(root=tmp_path / "runs"),
    )
    later = _write(tmp_path / "later.yaml", "model:\n  lr: 0.05\n")
    args = ["fit", "--config", config, "--config", later, "--trainer.max_epochs", "1", *QUIET]
    run = cli(Regression, Data, args=args)
    assert isinstance(run, CLI) and run.subcommand == "fit"
    assert isinstance(run.model, Regression) and isinstance(run.datamodule, Data)
    assert (run.model.hidden, run.model.lr, run.datamodule.batch_size) == (5, 0.05, 4)
    assert run.trainer.config.max_epochs == 1  # the command line beats the files
    assert run.result.progress.step == 8  # 32 samples / 4, one epoch
    assert run.config.trainer.max_epochs == 1
    saved = os.path.join(run.trainer.log_dir, "config.yaml")
    assert os.path.dirname(saved).startswith(str(tmp_path / "runs"))
    loaded = yaml.safe_load(_read(saved))
    assert loaded["trainer"]["max_epochs"] == 1 and loaded["model"] == {"hidden": 5, "lr": 0.05}
    assert loaded["seed_everything"] == 0 and loaded["ckpt_path"] is None and "seed" not in loaded

    # the saved file is a config: the same run again (into a new version folder)
    again = cli(Regression, Data, args=["fit", "--config", saved])
    assert again.trainer.log_dir != run.trainer.log_dir
    assert _read(os.path.join(again.trainer.log_dir, "config.yaml")) == _read(saved)


def test_an_existing_config_is_not_overwritten_unless_asked(tmp_path):
    base = [
        "fit",
        "--trainer.logger",
        "false",  # the run folder is default_root_dir itself, the same for every run
        "--trainer.default_root_dir",
        str(tmp_path / "root"),
        "--trainer.max_steps",
        "1",
        "--trainer.enable_checkpointing",
        "false",
        *QUIET,
    ]
    cli(Regression, Data, args=base)
    saved = tmp_path / "root" / "config.yaml"
    first = saved.read_text()
    cli(Regression, Data, args=base)  # the same config again: left as it is
    with pytest.raises(RuntimeError, match="exists and holds another config"):
        cli(Regression, Data, args=[*base, "--model.hidden", "6"])
    assert saved.read_text() == first  # refused before the run
    cli(
        Regression,
        Data,
        args=[*base, "--model.hidden", "6"],
        save_config_kwargs={"overwrite": True},
    )
    assert yaml.safe_load(saved.read_text())["model"]["hidden"] == 6
    cli(Regression, Data, args=[*base, "--model.hidden", "7"], save_config=False)
    assert yaml.safe_load(saved.read_text())["model"]["hidden"] == 6


def test_print_config_prints_the_resolved_yaml_and_it_round_trips(tmp_path, capsys):
    args = ["fit", "--model.hidden", "7", "--trainer.max_epochs", "2", "--seed_everything", "3"]
    with pytest.raises(SystemExit) as exit_info:
        cli(Regression, Data, args=[*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    loaded = yaml.safe_load(printed)
    assert loaded["model"]["hidden"] == 7 and loaded["trainer"]["max_epochs"] == 2
    assert loaded["seed_everything"] == 3 and "min_epochs" in loaded["trainer"]  # None shown
    path = _write(tmp_path / "printed.yaml", printed)
    with pytest.raises(SystemExit):
        cli(Regression, Data, args=["fit", "--config", path, "--print_config"])
    assert capsys.readouterr().out == printed
    # without a subcommand (run=False) the same sections are a config as well
    sections = {k: loaded[k] for k in ("trainer", "model")}
    path = _write(tmp_path / "sections.yaml", yaml.safe_dump(sections))
    built = cli(Regression, Data, args=["--config", path], run=False)
    assert built.model.hidden == 7 and built.trainer.config.max_epochs == 2


@pytest.mark.parametrize(
    ("where", "key", "suggestion"),
    [
        ("yaml", "trainer.max_epohcs", "trainer.max_epochs"),
        ("command line", "trainer.max_epohcs", "trainer.max_epochs"),
        ("yaml", "model.hiden", "model.hidden"),
        ("command line", "data.batch_sise", "data.batch_size"),
        ("command line", "ckpt_pth", "ckpt_path"),
    ],
)
def test_a_misspelt_key_names_it_and_the_closest_valid_one(
    tmp_path, capsys, where, key, suggestion
):
    if where == "yaml":
        group, name = key.split(".")
        args = ["fit", "--config", _write(tmp_path / "bad.yaml", f"{group}:\n  {name}: 2\n")]
    else:
        args = ["fit", f"--{key}", "2"]
    with pytest.raises(SystemExit) as exit_info:
        cli(Regression, Data, args=args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert key.split(".")[-1] in err, err
    assert f"did you mean '{suggestion}'?" in err, err


def test_a_misspelt_init_arg_in_subclass_mode_gets_the_suggestion(user_module, capsys):
    args = ["fit", "--model.class_path", "cli_user_task.Regression", "--model.init_args.hiden", "3"]
    with pytest.raises(SystemExit):
        cli(args=args)
    err = capsys.readouterr().err
    assert "hiden" in err and "did you mean 'hidden'?" in err, err


def test_validate_and_test_take_the_ckpt_path(tmp_path):
    common = ["--trainer.default_root_dir", str(tmp_path / "runs"), *QUIET]
    fitted = cli(Regression, Data, args=["fit", "--trainer.max_epochs", "1", *common])
    (ckpt,) = glob.glob(os.path.join(fitted.trainer.log_dir, "**", "*.ckpt"), recursive=True)
    for subcommand in ("validate", "test"):
        run = cli(Regression, Data, args=[subcommand, "--ckpt_path", ckpt, *common])
        assert run.subcommand == subcommand
        (metrics,) = run.result
        assert metrics and all(isinstance(v, float) for v in metrics.values())
        saved = yaml.safe_load(_read(os.path.join(run.trainer.log_dir, "config.yaml")))
        assert saved["ckpt_path"] == ckpt and saved["seed_everything"] == 0
        assert "seed" not in saved
    with pytest.raises(SystemExit):
        cli(Regression, Data, args=["validate", "--seed", "1", *common])  # --seed_everything


def test_a_resumed_fit_keeps_the_config_of_the_run_it_continues(tmp_path):
    common = ["--trainer.default_root_dir", str(tmp_path / "runs"), *QUIET]
    first = cli(Regression, Data, args=["fit", "--trainer.max_epochs", "1", *common])
    saved = os.path.join(first.trainer.log_dir, "config.yaml")
    (ckpt,) = glob.glob(os.path.join(first.trainer.log_dir, "**", "*.ckpt"), recursive=True)
    before = _read(saved)
    args = ["fit", "--trainer.max_epochs", "2", "--ckpt_path", ckpt, *common]
    with pytest.warns(UserWarning, match="exists and holds another config"):
        resumed = cli(Regression, Data, args=args)
    assert resumed.trainer.log_dir == first.trainer.log_dir  # the checkpoint's run folder
    assert resumed.result.progress.epoch == 2 and _read(saved) == before


def test_environment_flags_apply_under_explicit_values(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PURESTEP_TRAINER_MAX_EPOCHS", "4")
    monkeypatch.setenv("PURESTEP_TRAINER_ENABLE_PROGRESS_BAR", "no")
    built = cli(Regression, Data, args=[], run=False)
    assert built.trainer.config.max_epochs == 4 and built.trainer.enable_progress_bar is False
    assert built.subcommand is None and built.result is None
    assert not glob.glob("**/config.yaml", recursive=True)  # run=False saves nothing
    config = _write(tmp_path / "c.yaml", "trainer:\n  max_epochs: 2\n")
    assert (
        cli(Regression, Data, args=["--config", config], run=False).trainer.config.max_epochs == 2
    )
    explicit = cli(Regression, Data, args=["--trainer.max_epochs", "1"], run=False)
    assert explicit.trainer.config.max_epochs == 1
    defaults = cli(Regression, Data, args=[], run=False, trainer_defaults={"max_epochs": 9})
    assert defaults.trainer.config.max_epochs == 4  # the environment beats code defaults
    with pytest.raises(SystemExit):
        cli(Regression, Data, args=["fit", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["max_epochs"] == 4


def test_trainer_callbacks_and_logger_take_class_paths(tmp_path):
    config = _write(
        tmp_path / "c.yaml",
        f"""
        trainer:
          callbacks:
            - class_path: purestep.loops.callbacks.EarlyStopping
              init_args:
                monitor: val_loss
                patience: 1
            - class_path: purestep.loops.callbacks.ProgressBar
              init_args:
                refresh_rate: 5
          logger:
            class_path: purestep.loops.loggers.CSVLogger
            init_args:
              save_dir: {tmp_path / "csv"}
        """,
    )
    built = cli(Regression, Data, args=["--config", config], run=False)
    stopping = [cb for cb in built.trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert len(stopping) == 1 and type(built.trainer.logger).__name__ == "CSVLogger"
    assert built.trainer.progress_bar_callback.refresh_rate == 5  # an observer, not a callback
    assert built.trainer.log_dir.startswith(str(tmp_path / "csv"))


def test_python_m_purestep_runs_a_task_named_by_class_path(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "cli_user_task.py").write_text(USER_MODULE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")]),
    }
    root = tmp_path / "runs"
    args = [
        "fit",
        "--model.class_path",
        "cli_user_task.Regression",
        "--model.init_args.hidden",
        "3",
        "--data.class_path",
        "cli_user_task.Data",
        "--trainer.max_epochs",
        "1",
        "--trainer.default_root_dir",
        str(root),
        *QUIET,
    ]
    result = subprocess.run(
        [sys.executable, "-m", "purestep", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (saved,) = glob.glob(str(root / "**" / "config.yaml"), recursive=True)
    config = yaml.safe_load(_read(saved))
    assert config["model"] == {
        "class_path": "cli_user_task.Regression",
        "init_args": {"hidden": 3, "lr": 0.1},
    }
    assert config["data"]["class_path"] == "cli_user_task.Data"
    assert glob.glob(str(root / "**" / "*.ckpt"), recursive=True)


def test_without_the_extra_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # import jsonargparse fails
    with pytest.raises(ImportError, match=re.escape('pip install "purestep[cli]"')):
        cli(Regression, Data, args=[], run=False)


_SAME_FUNCTION = """
import importlib.util, inspect, sys, types
import purestep, purestep.loops
import purestep.loops.command_line as module
assert isinstance(cli, types.FunctionType), type(cli)
assert cli is module.cli is purestep.cli is purestep.loops.cli
assert not isinstance(purestep.loops.cli, types.ModuleType)
parameters = inspect.signature(purestep.cli).parameters
assert list(parameters)[:2] == ["model_class", "datamodule_class"], list(parameters)
assert {"args", "run", "trainer_defaults"} <= set(parameters)
assert importlib.util.find_spec("purestep.loops.cli") is None  # no module of that name
print("ok")
"""

# How ``cli`` is reached first; ``_SAME_FUNCTION`` then checks it is the function everywhere.
_FIRST_IMPORTS = {
    "from purestep.loops": "from purestep.loops import cli\n",
    "the module first": "import purestep.loops.command_line\nfrom purestep.loops import cli\n",
    "purestep.cli": "import purestep\ncli = purestep.cli\n",
    "from purestep": "from purestep import cli\n",
}


@pytest.mark.parametrize("first", sorted(_FIRST_IMPORTS))
def test_cli_is_the_function_whatever_is_imported_first(tmp_path, first):
    probe = _FIRST_IMPORTS[first] + _SAME_FUNCTION
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_importing_purestep_does_not_import_jsonargparse(tmp_path):
    probe = (
        "import sys, purestep, purestep.loops\n"
        "from purestep import *\n"
        "assert callable(purestep.loops.cli) and callable(cli)\n"
        "assert 'jsonargparse' not in sys.modules, 'import purestep loaded jsonargparse'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "ok", out.stderr
    assert purestep.loops.cli is purestep.cli is cli
    assert "model_class" in inspect.signature(purestep.cli).parameters


def test_seed_everything_is_fits_seed_and_every_subcommand_takes_it(tmp_path, monkeypatch, capsys):
    seeds = []
    original = Trainer.fit

    def fit(self, *args, **kwargs):
        seeds.append(kwargs.get("seed"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "fit", fit)
    common = ["--trainer.default_root_dir", str(tmp_path / "runs"), *QUIET]
    args = ["fit", "--seed_everything", "3", "--trainer.max_steps", "1", *common]
    run = cli(Regression, Data, args=args)
    assert seeds == [3] and run.config.seed_everything == 3
    saved = os.path.join(run.trainer.log_dir, "config.yaml")
    assert yaml.safe_load(_read(saved))["seed_everything"] == 3
    # fit's resolved config is a config of every subcommand
    for subcommand in ("validate", "test", "predict"):
        with pytest.raises(SystemExit) as exit_info:
            cli(Regression, Data, args=[subcommand, "--config", saved, "--print_config"])
        assert exit_info.value.code in (0, None)
        assert yaml.safe_load(capsys.readouterr().out)["seed_everything"] == 3
    tested = cli(Regression, Data, args=["test", "--config", saved, "--ckpt_path", "last"])
    (metrics,) = tested.result
    assert metrics and seeds == [3]  # test ran no fit


def _readme_cli_blocks() -> dict[str, str]:
    """The blocks of the site's CLI page by their first line (``# train.py`` ...)."""
    section = _read(os.path.join(ROOT, "docs", "cli.md"))
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", section, re.S | re.M)
    return {b.splitlines()[0].strip(): b for b in blocks}


def _readme_commands(block: str) -> list[str]:
    """The commands of a shell block: comments dropped, continued lines joined."""
    text = re.sub(r"\\\n\s*", " ", block)
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_example_runs(tmp_path):
    """Every command of the site's CLI page, as written and in order, in a folder
    holding its train.py and run.yaml (``python`` is this interpreter)."""
    blocks = _readme_cli_blocks()
    (tmp_path / "train.py").write_text(blocks["# train.py"])
    (tmp_path / "run.yaml").write_text(blocks["# run.yaml"])
    commands = _readme_commands(blocks["# the commands"])
    assert len(commands) == 4 and commands[0].startswith("python train.py fit --config run.yaml")
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PURESTEP_TRAINER_")}
    env["PATH"] = path
    for command in commands:
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
        if "test" in shlex.split(command):
            assert "test_loss" in result.stdout + result.stderr, result.stdout + result.stderr
    full = yaml.safe_load((tmp_path / "full.yaml").read_text())
    assert full["trainer"]["max_epochs"] == 3 and full["model"]["hidden"] == 16
    assert "seed_everything" in full and "seed" not in full
    saved = sorted(glob.glob(str(tmp_path / "lightning_logs" / "*" / "config.yaml")))
    assert len(saved) == 3  # the two fits and the test, each in its own run folder
    first = yaml.safe_load(_read(saved[0]))
    assert first["trainer"]["max_epochs"] == 5 and first["model"]["lr"] == 0.05


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("max_epochs", "-5", "expected None, -1 (no limit) or an int >= 0"),
        ("precision", "7", "unknown precision"),
        ("gradient_clip_algorithm", "sideways", "gradient_clip_algorithm"),
    ],
)
def test_a_trainer_flag_value_it_refuses_is_a_parser_error(tmp_path, capsys, flag, value, reason):
    args = ["fit", f"--trainer.{flag}", value, "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        cli(Regression, Data, args=args)
    assert exit_info.value.code == 2  # argparse's usage error, no traceback
    err = capsys.readouterr().err
    assert f"error: --trainer.{flag}=" in err and reason in err, err
    assert "Traceback" not in err and not list(tmp_path.rglob("config.yaml"))


def test_without_a_model_class_the_error_says_how_to_name_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(args=["fit"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--model.class_path" in err and "--config" in err, err


class _FailingSetup(Data):
    def setup(self, stage):
        raise RuntimeError("no data here")


class _FailingStep(Regression):
    def training_step(self, apply, batch):
        raise RuntimeError("the first step fails")


def test_the_config_is_written_when_the_run_starts_not_before(tmp_path):
    """Lightning's SaveConfigCallback writes the config in its ``setup`` hook: a run refused
    before it starts (here: the data module's setup fails) leaves no config.yaml; one that
    started and then failed (its first step) keeps the record of what ran."""
    common = ["--trainer.default_root_dir", str(tmp_path), "--trainer.max_epochs", "1", *QUIET]
    with pytest.raises(RuntimeError, match="no data here"):
        cli(Regression, _FailingSetup, args=["fit", *common])
    assert not list(tmp_path.rglob("config.yaml"))
    with pytest.raises(RuntimeError, match="the first step fails"):
        cli(_FailingStep, Data, args=["fit", *common])
    (saved,) = tmp_path.rglob("config.yaml")
    assert yaml.safe_load(saved.read_text())["trainer"]["max_epochs"] == 1


def test_importing_the_command_line_leaves_the_heavy_modules_unloaded(tmp_path):
    """``python -m purestep fit --help`` pays for the parser, not for the loggers' libraries,
    the hardware strategies, the loops or the tuner (they load when a run needs them)."""
    heavy = [
        "jsonargparse",
        "tensorboardX",
        "mlflow",
        "wandb",
        "rich",
        "purestep.hardware",
        "purestep.loops.loggers",
        "purestep.loops.fit",
        "purestep.loops.trainer_fit",
        "purestep.loops.tuning",
        "purestep.loops.resume",
    ]
    probe = (
        "import sys\n"
        "import purestep.loops.command_line\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
