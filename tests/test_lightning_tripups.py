"""What a PyTorch Lightning user writes and expects to work: a DataModule or the loaders
passed positionally (``trainer.fit(model, dm)``, ``trainer.fit(model, train, val)``), and hooks
whose signature is wrong refused when the run starts, not an epoch later."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.engine.tree import assert_trees_equal
from purestep.loops import DataModule, Task, Trainer
from purestep.loops.callbacks import Callback, LambdaCallback
from purestep.loops.events import NOTHING


def _data(seed: int, n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (n,), generator=g))


def _loader(seed: int, n: int = 16) -> DataLoader:
    return DataLoader(_data(seed, n), batch_size=4)


class Classifier(Task):
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


class Data(DataModule):
    def train_dataloader(self):
        return _loader(1)

    def val_dataloader(self):
        return _loader(2, 8)

    def test_dataloader(self):
        return _loader(3, 8)

    def predict_dataloader(self):
        return _loader(4, 8)


def _trainer(**flags) -> Trainer:
    flags.setdefault("max_epochs", 2)
    for flag in ("enable_progress_bar", "enable_model_summary", "enable_checkpointing", "logger"):
        flags.setdefault(flag, False)
    return Trainer(**flags)


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


# --------------------------------------------------------------------------- positional data


def test_a_datamodule_passed_positionally_is_the_datamodule():
    by_keyword, positional = _trainer(), _trainer()
    want = by_keyword.fit(Classifier(), datamodule=Data())
    got = positional.fit(Classifier(), Data())
    assert_trees_equal(got.params, want.params)
    for fn in ("validate", "test"):
        assert getattr(positional, fn)(Classifier(), Data(), verbose=False) == getattr(
            by_keyword, fn
        )(Classifier(), datamodule=Data(), verbose=False)
    got_predictions = positional.predict(Classifier(), Data())
    assert_trees_equal(got_predictions, by_keyword.predict(Classifier(), datamodule=Data()))


def test_a_tasks_positional_arguments_are_its_train_and_val_loaders():
    seen = []

    class Counted(Classifier):
        def validation_step(self, apply, batch):
            seen.append(batch[0].shape[0])
            return _loss(apply, batch)

    want = _trainer().fit(Counted(), train_dataloaders=_loader(1), val_dataloaders=_loader(2, 8))
    by_keyword = list(seen)
    seen.clear()
    got = _trainer().fit(Counted(), _loader(1), _loader(2, 8))
    assert_trees_equal(got.params, want.params)
    assert seen == by_keyword and seen  # the second positional argument validated


def test_a_plain_module_keeps_loss_fn_and_optimizer_positional_and_takes_a_datamodule():
    want = _trainer().fit(Classifier().get_model(), _loss, optim.sgd(0.1), _loader(1))
    got = _trainer().fit(Classifier().get_model(), _loss, optim.sgd(0.1), Data())
    assert_trees_equal(got.params, want.params)  # Data's train_dataloader is _loader(1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.fit(Classifier(), Data(), datamodule=Data()), "two DataModules"),
        (lambda t: t.fit(Classifier(), Data(), _loader(2)), "brings its own val_dataloader"),
        (lambda t: t.fit(Classifier(), _loss), "got a loss function"),
        (lambda t: t.fit(Classifier(), _loader(1), optim.sgd(0.1)), "got an optimizer"),
        (lambda t: t.fit(Classifier(), _loader(1), train_dataloaders=_loader(1)), "both"),
        (lambda t: t.fit(Classifier(), loss_fn=_loss), "got a loss function"),
        (lambda t: t.fit(Classifier().get_model(), Data()), "datamodule=dm"),
        (lambda t: t.validate(Classifier(), Data(), datamodule=Data()), "two DataModules"),
        (lambda t: t.test(Classifier(), Data(), datamodule=Data()), "two DataModules"),
        (lambda t: t.predict(Classifier(), Data(), datamodule=Data()), "two DataModules"),
    ],
)
def test_bad_combinations_are_clear_errors(call, message):
    with pytest.raises(TypeError, match=message):
        call(_trainer())


# --------------------------------------------------------------------------- hook signatures


class LightningStyleTask(Classifier):
    def on_train_epoch_end(self):  # a LightningModule's hook: no arguments
        return None


class LightningStyleCallback(Callback):
    def on_train_epoch_end(self, trainer, pl_module):  # a Lightning Callback's hook
        return trainer, NOTHING


class TooFewArguments(Callback):
    def on_validation_end(self, state):
        return state, NOTHING


def _fit(trainer, task=None):
    return trainer.fit(task or Classifier(), _loader(1), _loader(2, 8))


@pytest.mark.parametrize(
    ("task", "callbacks", "found", "expected"),
    [
        (
            LightningStyleTask(),
            [],
            "LightningStyleTask.on_train_epoch_end(self)",
            "on_train_epoch_end(self, state, ctx)",
        ),
        (
            None,
            [LightningStyleCallback()],
            "LightningStyleCallback.on_train_epoch_end(self, trainer, pl_module) has a "
            "PyTorch Lightning callback's signature",
            "on_train_epoch_end(self, state, ctx)",
        ),
        (
            None,
            [TooFewArguments()],
            "TooFewArguments.on_validation_end(self, state)",
            "on_validation_end(self, state, ctx)",
        ),
        (
            None,
            [LambdaCallback(on_fit_end=lambda: None)],
            "LambdaCallback(on_fit_end=<lambda>)()",
            "on_fit_end(ctx)",
        ),
    ],
)
def test_a_hook_with_the_wrong_signature_is_refused_when_fit_starts(
    task, callbacks, found, expected
):
    seen = []

    class Watched(Classifier):
        def training_step(self, apply, batch):
            seen.append(1)
            return _loss(apply, batch)

    trainer = _trainer(callbacks=callbacks)
    with pytest.raises(TypeError) as err:
        _fit(trainer, task if task is not None else Watched())
    message = str(err.value)
    assert found in message and f"purestep calls {expected}" in message
    assert seen == []  # refused before the first step


def test_validate_test_and_predict_check_the_hooks_too():
    for fn in ("validate", "test", "predict"):
        trainer = _trainer(callbacks=[TooFewArguments()])
        with pytest.raises(TypeError, match=r"TooFewArguments\.on_validation_end\(self, state\)"):
            getattr(trainer, fn)(Classifier(), _loader(3, 8))
        with pytest.raises(TypeError, match=r"LightningStyleTask\.on_train_epoch_end\(self\)"):
            getattr(_trainer(), fn)(LightningStyleTask(), _loader(3, 8))


def test_task_hooks_of_other_shapes_are_checked_and_right_ones_pass():
    class BadSetup(Classifier):
        def setup(self):  # Lightning's is setup(self, stage)
            pass

    with pytest.raises(TypeError, match=r"BadSetup\.setup\(self\).*setup\(self, stage\)"):
        _fit(_trainer(), BadSetup())

    class Fine(Classifier):
        def init_state(self):
            return {"ends": 0}

        def on_train_epoch_end(self, state, ctx, *extra):
            return {"ends": state["ends"] + 1}, NOTHING

    class FineCallback(Callback):
        def on_train_epoch_end(self, state, ctx=None):
            return state, NOTHING

        def on_load_checkpoint(self, state, data, ctx):
            return state

    state = _fit(_trainer(callbacks=[FineCallback()]), Fine())
    assert state.callbacks["task"] == {"ends": 2}


def test_an_attribute_added_while_another_goes_is_still_reported():
    """The attribute watch's fast path (no name added or removed: look at the user's
    attributes only) must not miss a new attribute that came with a removed one."""
    from purestep.loops.lightning.attributes import AttributeWatch

    module = torch.nn.Linear(2, 2)
    module.log = lambda *args: None  # attached by the adapter, internal
    watch = AttributeWatch(module, torch.nn.Module)
    del module.__dict__["log"]
    module.outputs = []
    with pytest.warns(UserWarning, match=r"changed the Python attributes \['outputs'\]"):
        watch.check("training_step")
