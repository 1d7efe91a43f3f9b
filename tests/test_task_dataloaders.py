"""A Task may bring its own dataloaders (``train_dataloader``, ``val_dataloader``,
``test_dataloader``, ``predict_dataloader``), as a LightningModule does: ``fit(task)``,
``validate(task)``, ``test(task)`` and ``predict(task)`` then ask it for them, after its
``setup`` and without calling ``setup`` or ``prepare_data`` twice. Lightning's precedence
holds per kind of loader: the dataloaders passed to the call, else the DataModule's hook
when it defines it, else the Task's own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.loops import DataModule, Task, Trainer
from purestep.loops.trainer_data import loader_source

pytestmark = pytest.mark.timeout(120)


def _loader(seed: int, n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


class Plain(Task):
    """A task without dataloader hooks: the data is passed to each call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    def configure_optimizers(self):
        return optim.sgd(0.1)

    def training_step(self, apply, batch):
        x, y = batch
        return F.cross_entropy(apply(x), y)

    validation_step = test_step = training_step

    def predict_step(self, apply, batch):
        return apply(batch[0])

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")


class Owned(Plain):
    """The same task with its own dataloaders (each call records itself)."""

    def train_dataloader(self):
        self.calls.append("train_dataloader")
        return _loader(1)

    def val_dataloader(self):
        self.calls.append("val_dataloader")
        return _loader(2, 8)

    def test_dataloader(self):
        self.calls.append("test_dataloader")
        return _loader(3, 8)

    def predict_dataloader(self):
        self.calls.append("predict_dataloader")
        return _loader(4, 8)


class Refusing(Owned):
    """Its hooks must not be asked: something with precedence supplies the data."""

    def train_dataloader(self):
        raise AssertionError("the Task's train_dataloader was asked")

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


def _trainer(**flags) -> Trainer:
    flags.setdefault("max_epochs", 2)
    return Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **flags,
    )


def _equal(a, b) -> None:
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name


def _count(task: Plain, call: str) -> int:
    return task.calls.count(call)


@pytest.mark.bitwise
def test_fit_with_the_tasks_loaders_equals_passing_them():
    owned, mine_t = Owned(), _trainer()
    mine = mine_t.fit(owned, seed=7)
    theirs_t = _trainer()
    theirs = theirs_t.fit(
        Plain(), train_dataloaders=_loader(1), val_dataloaders=_loader(2, 8), seed=7
    )
    _equal(mine, theirs)
    assert mine.progress.step == theirs.progress.step == 8
    # validated on the Task's val loader: the same loss as on the passed one
    assert torch.equal(mine_t.callback_metrics["val_loss"], theirs_t.callback_metrics["val_loss"])
    # asked once each (no reload), after one prepare_data and one setup
    assert owned.calls[:2] == ["prepare_data", "setup:fit"]
    assert _count(owned, "train_dataloader") == _count(owned, "val_dataloader") == 1
    assert _count(owned, "setup:fit") == _count(owned, "prepare_data") == 1


def test_fit_validates_every_batch_of_the_tasks_val_loader():
    batches = []

    class Watching(Owned):
        def validation_step(self, apply, batch):
            batches.append(len(batch[0]))
            return super().validation_step(apply, batch)

    _trainer(max_epochs=2).fit(Watching())
    assert batches == [4, 4] * 2  # the 8 validation samples, each epoch


@pytest.mark.parametrize("every", [1, 2])
def test_reload_asks_the_task_again(every):
    owned = Owned()
    _trainer(max_epochs=4, reload_dataloaders_every_n_epochs=every).fit(owned)
    assert _count(owned, "train_dataloader") == 4 // every
    assert _count(owned, "val_dataloader") >= 4 // every
    assert _count(owned, "setup:fit") == _count(owned, "prepare_data") == 1


def test_validate_test_predict_use_the_tasks_hooks():
    t = _trainer()
    t.fit(Plain(), train_dataloaders=_loader(1))
    owned = Owned()
    for stage, getter, data in [
        ("validate", "val_dataloader", _loader(2, 8)),
        ("test", "test_dataloader", _loader(3, 8)),
    ]:
        mine = getattr(t, stage)(owned, verbose=False)
        theirs = getattr(t, stage)(Plain(), dataloaders=data, verbose=False)
        assert mine == theirs and mine
        assert owned.calls[-2:] == [f"setup:{stage}", getter]  # asked after setup
    mine = t.predict(owned)
    theirs = t.predict(Plain(), dataloaders=_loader(4, 8))
    assert len(mine) == len(theirs) == 2
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert owned.calls[-2:] == ["setup:predict", "predict_dataloader"]
    assert _count(owned, "prepare_data") == 3  # once per call, never twice


def test_passed_dataloaders_take_precedence():
    t = _trainer()
    state = t.fit(Refusing(), train_dataloaders=_loader(1), val_dataloaders=_loader(2, 8))
    assert state.progress.step == 8
    assert t.validate(Refusing(), dataloaders=_loader(2, 8), verbose=False)
    assert t.test(Refusing(), dataloaders=_loader(3, 8), verbose=False)
    assert len(t.predict(Refusing(), dataloaders=_loader(4, 8))) == 2


class Data(DataModule):
    """Defines training and test data only: validation comes from the Task's own hook."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self):
        return _loader(1)

    def test_dataloader(self):
        return _loader(3, 8)


class RefusingTrainAndTest(Owned):
    def train_dataloader(self):
        raise AssertionError("the Task's train_dataloader was asked")

    test_dataloader = train_dataloader


def test_a_datamodule_takes_precedence_per_hook():
    task, data = RefusingTrainAndTest(), Data()
    t = _trainer()
    t.fit(task, datamodule=data)
    # the DataModule's train loader, the Task's val loader (the DataModule defines none)
    assert _count(task, "val_dataloader") == 1
    assert data.calls == ["setup:fit"]
    assert t.test(task, datamodule=data, verbose=False)
    assert t.validate(task, datamodule=data, verbose=False)
    assert _count(task, "val_dataloader") == 2


def test_no_data_at_all_names_the_task_hooks():
    t = _trainer()
    with pytest.raises(ValueError, match=r"define train_dataloader\(\) on the Task"):
        t.fit(Plain())
    t.fit(Plain(), train_dataloaders=_loader(1))
    with pytest.raises(ValueError, match=r"define val_dataloader\(\) on the Task"):
        t.validate(Plain())
    with pytest.raises(ValueError, match=r"define test_dataloader\(\) on the Task"):
        t.test(Plain())
    with pytest.raises(ValueError, match=r"define predict_dataloader\(\) on the Task"):
        t.predict(Plain())


@settings(max_examples=40, deadline=None)
@given(passed=st.booleans(), module=st.sampled_from([None, "plain", "defines"]), own=st.booleans())
def test_precedence_is_passed_then_datamodule_then_task(passed, module, own):
    class M(DataModule):
        pass

    class D(DataModule):
        def val_dataloader(self):
            return "datamodule"

    class T(Plain):
        def val_dataloader(self):
            return "task"

    datamodule = {None: None, "plain": M(), "defines": D()}[module]
    task = T() if own else Plain()
    load = loader_source("passed" if passed else None, datamodule, task, "val_dataloader")
    expected = (
        "passed" if passed else "datamodule" if module == "defines" else "task" if own else None
    )
    assert (load() if load is not None else None) == expected
