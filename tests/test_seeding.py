"""``seed_everything``: Lightning's meaning, and one seed fixing a whole run in one process
(the model built before fit, the model ``configure_model`` builds, fit's default seed, the
command line)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities import seed as lightning_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import DataModule, Task, Trainer, engine, optim, seed_everything
from purestep.engine import rng, tree
from purestep.loops import seeding


def _draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_it_seeds_torch_numpy_and_random_as_lightning_does():
    assert seed_everything(123) == 123
    ours = _draws()
    lightning_seed.seed_everything(123, verbose=False)
    assert _draws() == ours
    assert os.environ["PURESTEP_GLOBAL_SEED"] == "123"
    assert os.environ["PURESTEP_SEED_WORKERS"] == "0"
    seed_everything(5, workers=True)
    assert os.environ["PURESTEP_SEED_WORKERS"] == "1"


def test_no_seed_takes_the_recorded_one_then_lightnings_then_zero(monkeypatch):
    monkeypatch.delenv("PURESTEP_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with pytest.warns(UserWarning, match="seed set to 0"):
        assert seed_everything() == 0
    os.environ.pop("PURESTEP_GLOBAL_SEED")
    monkeypatch.setenv("PL_GLOBAL_SEED", "17")  # a process Lightning's tooling started
    assert seed_everything() == 17
    monkeypatch.setenv("PURESTEP_GLOBAL_SEED", "9")  # ours wins
    assert seed_everything() == 9 and seeding.reset_seed() == 9
    first = _draws()
    seeding.reset_seed()
    assert _draws() == first


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "seven", True, None])
def test_a_bad_seed_is_refused(bad, monkeypatch):
    if bad is None:  # a malformed recorded seed names its variable
        monkeypatch.setenv("PURESTEP_GLOBAL_SEED", "seven")
        with pytest.raises(ValueError, match="PURESTEP_GLOBAL_SEED"):
            seed_everything()
        return
    error = TypeError if isinstance(bad, (bool, float)) else ValueError
    with pytest.raises(error, match="seed"):
        seed_everything(bad)
    assert seed_everything(np.int64(7)) == 7  # numpy integers are integers
    assert seed_everything("8") == 8  # and so is an integer's text, as in Lightning


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


class Classifier(Task):
    """A task whose module is built in ``__init__`` (from torch's global generator)."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 3)))

    def training_step(self, apply, batch):
        x, y = batch
        return F.cross_entropy(apply(x), y)

    def configure_optimizers(self):
        return optim.adam(1e-2)


class LazyClassifier(Classifier):
    """The same task whose module ``configure_model`` builds when fit asks for it."""

    def __init__(self) -> None:
        Task.__init__(self)

    def configure_model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 3))


def _fit(task: Task, **kwargs) -> engine.TrainState:
    trainer = Trainer(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return trainer.fit(task, train_dataloaders=_data(), **kwargs)


@pytest.mark.bitwise
def test_seeding_before_the_task_is_built_repeats_the_run_in_one_process():
    seed_everything(3)
    first = _fit(Classifier())
    torch.rand(5)  # whatever ran in between
    seed_everything(3)
    again = _fit(Classifier())
    assert tree.trees_equal(first, again)
    # and fit's seed came from seed_everything: the run key is the key of 3
    assert first.rng == rng.key(3)
    # without seeding, the second task is built from where the generator got to
    assert not tree.trees_equal(_fit(Classifier()).params, first.params)


@pytest.mark.bitwise
def test_fit_builds_a_configure_model_template_under_its_seed():
    torch.manual_seed(0)
    first = _fit(LazyClassifier(), seed=4)
    torch.manual_seed(1)  # the global generator does not matter
    before = torch.get_rng_state()
    again = _fit(LazyClassifier(), seed=4)
    assert tree.trees_equal(first, again)
    assert torch.equal(torch.get_rng_state(), before)  # and is left as it was
    other = _fit(LazyClassifier(), seed=5)
    assert not torch.equal(other.params["0.weight"], first.params["0.weight"])


def test_an_explicit_fit_seed_wins_over_the_recorded_one():
    seed_everything(11)
    assert _fit(LazyClassifier(), seed=2).rng == rng.key(2)
    assert _fit(LazyClassifier()).rng == rng.key(11)
    os.environ.pop("PURESTEP_GLOBAL_SEED")
    assert _fit(LazyClassifier()).rng == rng.key(0)  # nothing recorded: 0, as before


class EagerRegression(Task):
    """A CLI task that builds its module in ``__init__``, as most Lightning modules do."""

    def __init__(self, hidden: int = 8, lr: float = 0.05):
        super().__init__(nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3)))
        self.lr = lr

    training_step = Classifier.training_step
    validation_step = Classifier.training_step

    def configure_optimizers(self):
        return optim.sgd(self.lr)


class Loaders(DataModule):
    def train_dataloader(self):
        return _data()

    val_dataloader = train_dataloader


def test_the_command_line_run_twice_gives_the_same_metrics(tmp_path):
    pytest.importorskip("jsonargparse")
    from purestep.loops.command_line import cli

    def run(folder: str) -> dict:
        args = ["fit", "--seed_everything", "6", "--trainer.max_epochs", "2"]
        args += ["--trainer.default_root_dir", str(tmp_path / folder)]
        args += ["--trainer.enable_progress_bar", "false", "--trainer.logger", "false"]
        done = cli(EagerRegression, Loaders, args=args)
        return {k: float(v) for k, v in done.trainer.callback_metrics.items()}

    first = run("a")
    torch.rand(5)  # whatever ran in between
    assert first and run("b") == first
