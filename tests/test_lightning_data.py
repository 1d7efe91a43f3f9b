"""A real ``lightning.pytorch.LightningDataModule`` runs under ``purestep.Trainer``
unchanged: the same hooks called, the same data, the same weights and metrics as
Lightning's own Trainer, its ``state_dict`` in the checkpoints."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import purestep
from purestep.engine import tree
from tests.lightning_models import QUIET

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore:.*changed the Python attributes:UserWarning")


class Points(pl.LightningDataModule):
    """Random points built in ``setup``; records the hooks called and what ``self.trainer``
    showed there; keeps a counter in its ``state_dict``."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.calls: list[tuple] = []
        self.restored: dict | None = None

    def prepare_data(self) -> None:
        self.calls.append(("prepare_data",))

    def setup(self, stage: str) -> None:
        self.calls.append(("setup", stage, self.trainer.max_epochs))
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(20, 4, generator=g)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:8]), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[8:]), batch_size=6)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:6]), batch_size=3)

    def teardown(self, stage: str) -> None:
        self.calls.append(("teardown", stage))

    def state_dict(self) -> dict:
        return {"batch_size": self.hparams.batch_size, "saved": True}

    def load_state_dict(self, state_dict: dict) -> None:
        self.restored = dict(state_dict)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = (self(x) - x.sum(1, keepdim=True)).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", (self(x) - x.sum(1, keepdim=True)).pow(2).mean())

    def test_step(self, batch, batch_idx):
        (x,) = batch
        self.log("test_loss", (self(x) - x.sum(1, keepdim=True)).pow(2).mean())

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        (x,) = batch
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _metrics(trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.bitwise
def test_a_lightning_datamodule_runs_as_in_lightning(tmp_path):
    """fit / validate / test / predict with the DataModule passed positionally and by name:
    the hooks, the weights, the metrics and the predictions are Lightning's."""
    purestep.seed_everything(0)
    theirs, ours = Regressor(), Regressor()
    ours.load_state_dict(theirs.state_dict())
    their_data, our_data = Points(), Points()
    flags = {"max_epochs": 2, "num_sanity_val_steps": 0}
    lightning_trainer = pl.Trainer(
        accelerator="cpu", default_root_dir=tmp_path / "l", **QUIET, **flags
    )
    trainer = purestep.Trainer(default_root_dir=tmp_path / "p", **QUIET, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_trainer.fit(theirs, their_data)
        their_fit = _metrics(lightning_trainer)
        their_test = lightning_trainer.test(theirs, datamodule=their_data, verbose=False)
        their_predictions = lightning_trainer.predict(theirs, their_data)
    trainer.fit(ours, our_data)
    assert tree.trees_equal(dict(ours.state_dict()), dict(theirs.state_dict()))
    assert _metrics(trainer) == their_fit
    our_test = trainer.test(ours, datamodule=our_data, verbose=False)
    assert our_test == their_test
    our_predictions = trainer.predict(ours, our_data)
    assert all(torch.equal(a, b) for a, b in zip(our_predictions, their_predictions))
    assert our_data.calls == their_data.calls
    assert ("setup", "fit", 2) in our_data.calls  # self.trainer in setup


def test_a_lightning_datamodule_state_is_checkpointed_and_restored(tmp_path):
    """``state_dict()`` goes into the checkpoints and ``load_state_dict`` gets it back when a
    run starts from one, as Lightning does; hooks the Trainer never calls are reported."""
    trainer = purestep.Trainer(
        max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False, logger=False
    )
    trainer.fit(Regressor(), Points())
    resumed_data = Points()
    trainer = purestep.Trainer(
        max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False, logger=False
    )
    trainer.fit(Regressor(), resumed_data, ckpt_path="last")
    assert resumed_data.restored == {"batch_size": 4, "saved": True}

    class Moving(Points):
        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            return batch

    with pytest.warns(UserWarning, match=r"overrides \['transfer_batch_to_device'\]"):
        purestep.Trainer(max_epochs=1, **QUIET).fit(Regressor(), datamodule=Moving())


def test_something_else_as_the_datamodule_is_refused():
    with pytest.raises(TypeError, match="purestep's or a LightningDataModule"):
        purestep.Trainer(max_epochs=1, **QUIET).fit(Regressor(), datamodule=object())


def _sized(base, limit: int) -> type:
    class Sized(base):
        """Its own train_dataloader() reads ``hparams.batch_size``; batches over ``limit``
        samples fail as CUDA's allocator says it."""

        def __init__(self, batch_size: int = 2) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(4, 1)

        def train_dataloader(self) -> DataLoader:
            x = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
            return DataLoader(TensorDataset(x), batch_size=self.hparams.batch_size)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            if len(x) > limit:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Sized


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_scale_batch_size_of_a_module_with_its_own_train_dataloader(mode):
    """``Tuner.scale_batch_size`` on a LightningModule whose own ``train_dataloader()``
    reads ``self.hparams.batch_size`` (no datamodule): the size Lightning's tuner settles
    on, written into the module's hparams."""
    from lightning.pytorch.tuner import Tuner as LightningTuner

    from purestep.loops.tuning import Tuner

    options = {"mode": mode, "steps_per_trial": 1, "max_trials": 6}
    theirs = _sized(pl.LightningModule, 11)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_trainer = pl.Trainer(max_epochs=1, accelerator="cpu", **QUIET)
        expected = LightningTuner(lightning_trainer).scale_batch_size(theirs, **options)
    for base in (pl.LightningModule, purestep.LightningModule):
        ours = _sized(base, 11)()
        found = Tuner(purestep.Trainer(max_epochs=1, **QUIET)).scale_batch_size(ours, **options)
        assert found == expected == ours.hparams.batch_size
    assert 2 < expected <= 11  # it grew, and what it settled on fits


@pytest.mark.bitwise
def test_dataloaders_reloaded_each_epoch_see_that_epoch(tmp_path):
    """``reload_dataloaders_every_n_epochs=1`` with a curriculum that sizes the data by
    ``self.trainer.current_epoch``: the LightningDataModule's and the module's own
    ``train_dataloader()`` see Lightning's counters at each reload, so the same data is
    trained and the weights are Lightning's."""

    class Curriculum(Points):
        def train_dataloader(self):
            epoch = self.trainer.current_epoch
            self.calls.append(("train_dataloader", epoch, self.trainer.global_step))
            return DataLoader(TensorDataset(self.x[: 4 * (epoch + 1)]), batch_size=4)

    class OwnCurriculum(Regressor):
        def __init__(self):
            super().__init__()
            self.x = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
            self.calls: list[tuple] = []

        def train_dataloader(self):
            epoch = self.trainer.current_epoch
            self.calls.append(("train_dataloader", epoch, self.trainer.global_step))
            return DataLoader(TensorDataset(self.x[: 4 * (epoch + 1)]), batch_size=4)

    flags = {"max_epochs": 3, "reload_dataloaders_every_n_epochs": 1, "limit_val_batches": 0}
    for make_data in (Curriculum, None):
        purestep.seed_everything(0)
        theirs = OwnCurriculum() if make_data is None else Regressor()
        ours = OwnCurriculum() if make_data is None else Regressor()
        ours.load_state_dict(theirs.state_dict())
        their_data = make_data() if make_data else None
        our_data = make_data() if make_data else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lightning_trainer = pl.Trainer(
                accelerator="cpu", default_root_dir=tmp_path / "l", **QUIET, **flags
            )
            lightning_trainer.fit(theirs, datamodule=their_data)
        trainer = purestep.Trainer(default_root_dir=tmp_path / "p", **QUIET, **flags)
        trainer.fit(ours, datamodule=our_data)
        recorded = (our_data or ours).calls, (their_data or theirs).calls
        assert (
            [c for c in recorded[0] if c[0] == "train_dataloader"]
            == [c for c in recorded[1] if c[0] == "train_dataloader"]
            == [("train_dataloader", 0, 0), ("train_dataloader", 1, 1), ("train_dataloader", 2, 3)]
        )
        assert trainer.global_step == lightning_trainer.global_step == 6
        assert tree.trees_equal(dict(ours.state_dict()), dict(theirs.state_dict()))


def test_a_datamodule_from_datasets_trains():
    """``LightningDataModule.from_datasets`` installs its loaders as instance attributes."""
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(3))
    data = pl.LightningDataModule.from_datasets(
        train_dataset=TensorDataset(x), val_dataset=TensorDataset(x[:4]), batch_size=4
    )
    trainer = purestep.Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET)
    trainer.fit(Regressor(), data)
    assert trainer.global_step == 3 and "val_loss" in trainer.callback_metrics
