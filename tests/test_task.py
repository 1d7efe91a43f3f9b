"""loops.task: Task, Task.wrap, task_callback and DataModule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from purestep import engine
from purestep.engine import optim
from purestep.loops.callbacks import init_states
from purestep.loops.events import NOTHING, Context, Requests, dispatch
from purestep.loops.task import DataModule, Task, task_callback


def loss_fn(apply, batch):
    x, y = batch
    return F.mse_loss(apply(x), y)


def test_wrap_checks_its_arguments():
    net = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        Task.wrap("net", loss_fn, optim.sgd(0.1))
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        Task.wrap(net, None, optim.sgd(0.1))
    with pytest.raises(TypeError, match="engine.optim transform"):
        Task.wrap(net, loss_fn, torch.optim.SGD(net.parameters(), lr=0.1))


def test_wrap_uses_the_loss_for_validation_and_test_unless_given():
    net = nn.Linear(2, 1)
    task = Task.wrap(net, loss_fn, optim.sgd(0.1), val_fn=lambda a, b: "val")
    batch = (torch.ones(1, 2), torch.ones(1, 1))
    assert task.validation_step(net, batch) == "val"
    assert task.test_step(net, batch) == "val"
    assert torch.equal(task.training_step(net, batch), loss_fn(net, batch))
    assert torch.equal(task.predict_step(net, batch), net(batch[0]))
    assert task.has("validation_step") and task.get_model() is net


class Minimal(Task):
    def training_step(self, apply, batch):
        return loss_fn(apply, batch)


def test_task_subclass_defaults_and_errors():
    task = Minimal()
    assert task.has("training_step") and not task.has("validation_step")
    with pytest.raises(NotImplementedError, match="configure_model"):
        task.get_model()
    with pytest.raises(NotImplementedError, match="configure_optimizers"):
        task.configure_optimizers()
    with pytest.raises(NotImplementedError, match="training_step"):
        Task().training_step(None, None)

    class BadModel(Minimal):
        def configure_model(self):
            return "not a module"

    with pytest.raises(TypeError, match="must be an nn.Module"):
        BadModel().get_model()

    class Built(Minimal):
        def configure_model(self):
            return nn.Linear(2, 1)

    task = Built()
    assert task.get_model() is task.get_model()  # built once


class WithHandlers(Minimal):
    def init_state(self):
        return {"n": 0}

    def on_train_batch_end(self, state, ctx):
        return {"n": state["n"] + 1}, Requests(log={"n": float(state["n"] + 1)})


def test_task_callback_handles_only_the_events_the_task_defines():
    cb = task_callback(WithHandlers(nn.Linear(2, 1)))
    assert cb.key == "task" and cb.init() == {"n": 0}
    net = nn.Linear(2, 1)
    state = init_states([cb], engine.init(net, optim.sgd(0.1)))
    ctx = Context(stage="train", fn="fit", state=state)
    state, requests = dispatch("on_train_batch_end", [cb], state, ctx)
    assert state.callbacks["task"] == {"n": 1} and requests.log == {"n": 1.0}
    assert dispatch("on_train_epoch_end", [cb], state, ctx) == (state, NOTHING)
    plain = task_callback(Minimal(net))
    assert plain.init() == {}
    from purestep.loops.events import handles as _overrides

    assert not any(_overrides(plain, e) for e in ("setup", "teardown", "on_train_start"))


def test_datamodule_defaults():
    dm = DataModule()
    dm.prepare_data()
    dm.setup("fit")
    dm.teardown("fit")
    assert dm.val_dataloader() is None and dm.test_dataloader() is None
    assert dm.predict_dataloader() is None
    with pytest.raises(NotImplementedError, match="train_dataloader"):
        dm.train_dataloader()
