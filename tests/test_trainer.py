"""The Trainer facade: API shapes, Lightning's flags end to end, logging, failures and
determinism. Tiny models and data; progress bar and model summary off unless tested."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import engine
from purestep.engine import metrics, optim
from purestep.engine.state import TrainState
from purestep.engine.tree import assert_trees_equal, trees_equal
from purestep.loops import DataModule, Task, Trainer, log
from purestep.loops.callbacks import Callback, EarlyStopping, LambdaCallback, Timer
from purestep.loops.events import EVENTS, NOTHING, Requests
from purestep.loops.loggers import MemoryLogger

# --------------------------------------------------------------------------- helpers


def data(n, seed=0, features=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g)


def loader(n, batch_size=4, seed=0, shuffle=False):
    return DataLoader(TensorDataset(*data(n, seed)), batch_size=batch_size, shuffle=shuffle)


def net(dropout=0.0):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(8, 3))


def loss_fn(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": metrics.Accuracy.of(logits, y)}


def trainer(**flags):
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("logger", MemoryLogger())
    return Trainer(**flags)


class Recorder:
    def __init__(self, name="recorder"):
        self.events = []
        self.callback = LambdaCallback(name=name, **{e: self._record(e) for e in EVENTS})

    def _record(self, event):
        def handler(ctx):
            self.events.append((event, ctx.stage, ctx.batch_idx, ctx.dataloader_idx, ctx.batch))

        return handler

    def names(self):
        return [e[0] for e in self.events]

    def batches(self, event):
        return [e[4] for e in self.events if e[0] == event]


def raise_at(batch_idx, exc):
    def handler(ctx):
        if ctx.batch_idx == batch_idx:
            raise exc

    return LambdaCallback(name="raiser", on_train_batch_end=handler)


# --------------------------------------------------------------------------- fit API


def test_fit_plain_pieces_returns_a_train_state():
    t = trainer(max_epochs=2)
    assert t.status == "initializing"
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(12), loader(8))
    assert isinstance(state, TrainState)
    assert (state.progress.epoch, state.progress.step) == (2, 6)
    assert t.status == "finished" and t.stage is None and not t.interrupted
    assert (t.current_epoch, t.global_step) == (2, 6)
    assert t.train_state is state
    assert t.estimated_stepping_batches == 6


def test_fit_does_not_mutate_the_template():
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer(max_epochs=1).fit(model, loss_fn, optim.sgd(0.5), loader(8))
    assert trees_equal(dict(model.state_dict()), before)


class Classifier(Task):
    """A Task subclass recording its setup/teardown stages and an event handler's calls."""

    def __init__(self):
        super().__init__(hparams={"lr": 0.1})
        self.stages = []

    def configure_model(self):
        return net()

    def configure_optimizers(self):
        return optim.sgd(self.hparams["lr"])

    def training_step(self, apply, batch):
        return loss_fn(apply, batch)

    def validation_step(self, apply, batch):
        return loss_fn(apply, batch)

    def test_step(self, apply, batch):
        return loss_fn(apply, batch)

    def setup(self, stage):
        self.stages.append(("setup", stage))

    def teardown(self, stage):
        self.stages.append(("teardown", stage))

    def init_state(self):
        return {"epochs_seen": 0}

    def on_train_epoch_end(self, state, ctx):
        assert isinstance(ctx.state, TrainState) and ctx.fn == "fit"
        return {"epochs_seen": state["epochs_seen"] + 1}, Requests(log={"seen": 1.0})


class CountingData(DataModule):
    def __init__(self):
        self.calls = []

    def prepare_data(self):
        self.calls.append("prepare")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")

    def train_dataloader(self):
        self.calls.append("train")
        return loader(8)

    def val_dataloader(self):
        self.calls.append("val")
        return loader(4)

    def test_dataloader(self):
        self.calls.append("test")
        return loader(4)

    def predict_dataloader(self):
        self.calls.append("predict")
        return loader(4)


def test_fit_task_with_datamodule_and_hooks():
    task, dm = Classifier(), CountingData()
    logger = MemoryLogger()
    t = trainer(max_epochs=2, logger=logger)
    state = t.fit(task, datamodule=dm)
    assert task.stages == [("setup", "fit"), ("teardown", "fit")]
    assert dm.calls == ["prepare", "setup:fit", "val", "train", "teardown:fit"]
    assert state.callbacks["task"] == {"epochs_seen": 2}
    assert [s for s, row in logger.metrics if "seen" in row] == [1, 3]
    assert logger.hyperparams == {"lr": 0.1}
    results = t.test(datamodule=dm)
    assert task.stages[-2:] == [("setup", "test"), ("teardown", "test")]
    assert dm.calls[-4:] == ["prepare", "setup:test", "test", "teardown:test"]
    assert list(results[0]) == ["test_loss", "test_acc"]


def test_fit_refuses_mixed_arguments():
    t = trainer(max_epochs=1)
    with pytest.raises(TypeError, match="brings its own steps"):
        t.fit(Classifier(), loss_fn, optim.sgd(0.1))
    with pytest.raises(TypeError, match="needs a\\s+loss function"):
        t.fit(net())
    assert t.status == "interrupted" and t.fn == "fit"
    with pytest.raises(TypeError, match="expected a Task or an nn.Module"):
        t.fit("model")
    with pytest.raises(TypeError, match="not both"):
        t.fit(Classifier(), train_dataloaders=loader(4), datamodule=CountingData())
    with pytest.raises(ValueError, match="needs training data"):
        t.fit(Classifier())


@pytest.mark.parametrize(
    ("every", "check_every", "epochs", "expected"),
    [
        # notes §7: n=1, validation every 2nd epoch, 4 epochs: val at sanity, ep1, ep3
        (1, 2, 4, ["val", "train", "train", "val", "train", "train", "val"]),
        (0, 1, 3, ["val", "train"]),
        (1, 1, 3, ["val", "train", "train", "val", "train", "val"]),
        (2, 1, 4, ["val", "train", "train", "val"]),
    ],
)
def test_reload_dataloaders_every_n_epochs(every, check_every, epochs, expected):
    dm = CountingData()
    t = trainer(
        max_epochs=epochs,
        reload_dataloaders_every_n_epochs=every,
        check_val_every_n_epoch=check_every,
    )
    t.fit(Classifier(), datamodule=dm)
    assert [c for c in dm.calls if c in ("train", "val")] == expected


def test_limit_train_batches_zero_never_asks_for_training_data():
    dm = CountingData()
    rec = Recorder()
    t = trainer(max_epochs=2, limit_train_batches=0, callbacks=[rec.callback])
    state = t.fit(Classifier(), datamodule=dm)
    assert "train" not in dm.calls and state.progress.step == 0
    assert "on_sanity_check_end" in rec.names() and "on_train_start" not in rec.names()


# --------------------------------------------------------------------------- evaluate / predict


def test_validate_and_test_signatures_and_values():
    t = trainer(max_epochs=1)
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    x, y = data(6, seed=3)
    dl = DataLoader(TensorDataset(x, y), batch_size=4)  # batches of 4 and 2
    by_state = t.validate(state, dl, verbose=False)
    by_default = t.validate(dataloaders=dl, verbose=False)
    task = Task.wrap(net(), loss_fn, optim.sgd(0.1))
    by_task = t.validate(task, dl, state=state, verbose=False)
    by_module = t.test(net(), dl, fn=loss_fn, state=state, verbose=False)
    assert by_state == by_default == by_task
    assert list(by_module[0]) == ["test_loss", "test_acc"]
    # epoch values: batch-size weighted mean of the loss, exact accuracy over all samples
    evaluate = engine.eval_step(net(), loss_fn)
    outs = [evaluate(state, (x[:4], y[:4])), evaluate(state, (x[4:], y[4:]))]
    loss = (outs[0]["loss"].double() * 4 + outs[1]["loss"].double() * 2) / 6
    correct = sum(float(o["acc"].compute()) * n for o, n in zip(outs, (4, 2)))
    assert by_state[0]["val_loss"] == pytest.approx(float(loss), rel=1e-6)
    assert by_state[0]["val_acc"] == pytest.approx(correct / 6, abs=1e-7)
    assert by_module[0]["test_loss"] == by_state[0]["val_loss"]


def test_validate_several_dataloaders_suffixes_and_returns_one_dict_each():
    logger = MemoryLogger()
    t = trainer(max_epochs=1, logger=logger)
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    results = t.validate(state, [loader(4, seed=1), loader(8, seed=2)], verbose=False)
    assert [sorted(r) for r in results] == [
        ["val_acc/dataloader_idx_0", "val_loss/dataloader_idx_0"],
        ["val_acc/dataloader_idx_1", "val_loss/dataloader_idx_1"],
    ]
    single = t.validate(state, loader(8, seed=2), verbose=False)
    assert single[0]["val_loss"] == results[1]["val_loss/dataloader_idx_1"]
    step, row = logger.metrics[-1]
    assert step == state.progress.step and row["epoch"] == 1
    assert set(row) == {"val_loss", "val_acc", "epoch"}


def test_validate_errors():
    t = trainer(max_epochs=1)
    with pytest.raises(ValueError, match="call fit\\(\\) first"):
        t.validate(dataloaders=loader(4))
    with pytest.raises(TypeError, match="needs fn="):
        t.validate(net(), loader(4))

    class NoVal(Task):
        def training_step(self, apply, batch):
            return loss_fn(apply, batch)

        def configure_optimizers(self):
            return optim.sgd(0.1)

    with pytest.raises(NotImplementedError, match="validation_step"):
        t.validate(NoVal(net()), loader(4))
    with pytest.raises(ValueError, match="needs data"):
        t.test(net(), None, fn=loss_fn)


def test_predict_shapes():
    t = trainer(max_epochs=1)
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    one = t.predict(state, loader(10))
    assert isinstance(one, list) and [p.shape for p in one] == [(4, 3), (4, 3), (2, 3)]
    two = t.predict(state, [loader(4), loader(8)])
    assert [len(p) for p in two] == [1, 2]
    assert torch.equal(two[0][0], one[0])
    model = net()
    plain = t.predict(model, loader(4), state=state)  # module(inputs) by default
    assert torch.equal(plain[0], one[0])
    doubled = t.predict(model, loader(4), state=state, fn=lambda apply, b: apply(b[0]) * 2)
    assert torch.equal(doubled[0], one[0] * 2)
    assert t.predict(state, loader(4), return_predictions=False) is None
    assert t.status == "finished"


def test_predict_with_limit_and_datamodule():
    dm = CountingData()
    t = trainer(limit_predict_batches=1)
    out = t.predict(net(), datamodule=dm, fn=lambda apply, b: apply(b[0]))
    assert len(out) == 1
    assert dm.calls == ["prepare", "setup:predict", "predict", "teardown:predict"]


# --------------------------------------------------------------------------- event order


def test_validate_test_predict_event_order_with_task_handlers_last():
    order = []

    class Hooked(Classifier):
        def on_validation_start(self, state, ctx):
            order.append("task")
            return state, NOTHING

    rec = Recorder()
    user = LambdaCallback(name="user", on_validation_start=lambda ctx: order.append("user"))
    t = trainer(callbacks=[rec.callback, user])
    task = Hooked()
    state = engine.init(task.get_model(), optim.sgd(0.1))
    t.validate(task, loader(8), state=state, verbose=False)
    assert rec.names() == [
        "setup",
        "on_validation_start",
        "on_validation_epoch_start",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_validation_epoch_end",
        "on_validation_end",
        "teardown",
    ]
    assert order == ["user", "task"]
    rec.events.clear()
    t.test(task, loader(4), state=state, verbose=False)
    assert rec.names() == [
        "setup",
        "on_test_start",
        "on_test_epoch_start",
        "on_test_batch_start",
        "on_test_batch_end",
        "on_test_epoch_end",
        "on_test_end",
        "teardown",
    ]
    rec.events.clear()
    t.predict(task, [loader(4), loader(4)], state=state)
    assert rec.names() == [
        "setup",
        "on_predict_start",
        "on_predict_epoch_start",
        "on_predict_batch_start",
        "on_predict_batch_end",
        "on_predict_batch_start",
        "on_predict_batch_end",
        "on_predict_epoch_end",
        "on_predict_end",
        "teardown",
    ]
    assert [e[3] for e in rec.events if e[0] == "on_predict_batch_end"] == [0, 1]


# --------------------------------------------------------------------------- failures


def test_ctrl_c_interrupts_gracefully_and_returns_the_latest_state():
    logger = MemoryLogger()
    seen = []
    on_exc = LambdaCallback(name="exc", on_exception=lambda ctx: seen.append(ctx.exception))
    t = trainer(max_epochs=3, logger=logger, callbacks=[raise_at(3, KeyboardInterrupt), on_exc])
    t._printer = lambda s: None
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(24))
    assert isinstance(state, TrainState) and state.progress.step == 4
    assert len(seen) == 1 and isinstance(seen[0], KeyboardInterrupt)
    assert t.status == "interrupted" and t.interrupted and t.stage == "train"
    assert logger.status == "interrupted"


def test_other_exceptions_propagate_after_on_exception():
    logger = MemoryLogger()
    seen = []
    on_exc = LambdaCallback(name="exc", on_exception=lambda ctx: seen.append(ctx.stage))
    t = trainer(max_epochs=3, logger=logger, callbacks=[raise_at(1, ValueError("bad")), on_exc])
    with pytest.raises(ValueError, match="bad"):
        t.fit(net(), loss_fn, optim.sgd(0.1), loader(24))
    assert seen == ["train"]
    assert t.status == "interrupted" and t.stage is None
    assert logger.status == "failed"
    assert t.train_state.progress.step == 2


def test_ctrl_c_in_validate_returns_empty_results():
    def interrupt(ctx):
        raise KeyboardInterrupt

    logger = MemoryLogger()
    cb = LambdaCallback(name="k", on_validation_batch_end=interrupt)
    t = trainer(callbacks=[cb], logger=logger)
    t._printer = lambda s: None
    assert t.validate(net(), loader(8), fn=loss_fn, verbose=False) == []
    assert t.status == "interrupted" and logger.status == "interrupted"


# --------------------------------------------------------------------------- debugging flags


@pytest.mark.parametrize("n", [1, 3])
def test_fast_dev_run_runs_n_batches_of_each_stage_without_loggers(n):
    rec = Recorder()
    t = Trainer(
        fast_dev_run=n,
        max_epochs=5,
        callbacks=[rec.callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=MemoryLogger(),
    )
    assert t.loggers == []
    t._printer = lambda s: None
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(40), loader(40))
    names = rec.names()
    assert names.count("on_train_batch_end") == n and state.progress.step == n
    assert names.count("on_validation_batch_end") == n  # no sanity check
    assert "on_sanity_check_start" not in names and names.count("on_train_epoch_end") == 1
    rec.events.clear()
    t.test(state, loader(40), verbose=False)
    assert rec.names().count("on_test_batch_end") == n
    rec.events.clear()
    assert len(t.predict(state, loader(40))) == n


def test_overfit_batches_reads_the_same_first_batches_every_epoch():
    rec = Recorder()
    t = trainer(max_epochs=3, overfit_batches=2, callbacks=[rec.callback], num_sanity_val_steps=0)
    t.fit(net(), loss_fn, optim.sgd(0.1), loader(20, shuffle=True), loader(20, shuffle=True))
    train = rec.batches("on_train_batch_end")
    x, y = data(20)
    assert len(train) == 6
    for i, (bx, by) in enumerate(train):
        j = i % 2
        assert torch.equal(bx, x[4 * j : 4 * j + 4]) and torch.equal(by, y[4 * j : 4 * j + 4])
    val = rec.batches("on_validation_batch_end")
    assert len(val) == 6 and torch.equal(val[1][0], x[4:8])


@pytest.mark.parametrize(
    ("flags", "train", "val", "test"),
    [
        ({"limit_train_batches": 2, "limit_val_batches": 1, "limit_test_batches": 3}, 2, 1, 3),
        (
            {"limit_train_batches": 0.5, "limit_val_batches": 0.25, "limit_test_batches": 0.5},
            2,
            1,
            2,
        ),
        ({"limit_train_batches": 1.0}, 5, 4, 4),
    ],
)
def test_limit_batches(flags, train, val, test):
    rec = Recorder()
    t = trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[rec.callback], **flags)
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(20), loader(16))
    assert rec.names().count("on_train_batch_end") == train
    assert rec.names().count("on_validation_batch_end") == val
    rec.events.clear()
    t.test(state, loader(16), verbose=False)
    assert rec.names().count("on_test_batch_end") == test


def test_limit_fraction_below_one_batch_is_an_error():
    t = trainer(max_epochs=1, limit_train_batches=0.1)
    with pytest.raises(ValueError, match="limit_train_batches"):
        t.fit(net(), loss_fn, optim.sgd(0.1), loader(20))


@pytest.mark.parametrize(
    ("mode", "length", "b_indices"),
    [
        ("max_size_cycle", 3, [0, 1, 0]),
        ("min_size", 2, [0, 1]),
        ("max_size", 3, [0, 1, None]),
    ],
)
def test_multiple_train_loaders(mode, length, b_indices):
    rec = Recorder()
    a, b = data(12, seed=1), data(8, seed=2)

    def multi_loss(apply, batch):
        parts = [loss_fn(apply, batch[k])[0] for k in ("a", "b") if batch[k] is not None]
        return sum(parts)

    t = trainer(max_epochs=1, multiple_trainloader_mode=mode, callbacks=[rec.callback])
    loaders = {
        "a": DataLoader(TensorDataset(*a), batch_size=4),
        "b": DataLoader(TensorDataset(*b), batch_size=4),
    }
    state = t.fit(net(), multi_loss, optim.sgd(0.1), loaders)
    seen = rec.batches("on_train_batch_end")
    assert len(seen) == length and state.progress.step == length
    for i, (batch, j) in enumerate(zip(seen, b_indices)):
        assert torch.equal(batch["a"][0], a[0][4 * i : 4 * i + 4])
        if j is None:
            assert batch["b"] is None
        else:
            assert torch.equal(batch["b"][0], b[0][4 * j : 4 * j + 4])


# --------------------------------------------------------------------------- numerics


def _torch_run(model, dl, lr, clip):
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=True)
    for x, y in dl:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        clip(model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize(
    ("algorithm", "clip"),
    [
        ("norm", lambda ps: torch.nn.utils.clip_grad_norm_(list(ps), 0.05)),
        ("value", lambda ps: torch.nn.utils.clip_grad_value_(list(ps), 0.01)),
    ],
)
@pytest.mark.bitwise
def test_gradient_clipping_equals_torch_bitwise(algorithm, clip):
    value = 0.05 if algorithm == "norm" else 0.01
    t = trainer(max_epochs=1, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    state = t.fit(net(), lambda a, b: loss_fn(a, b)[0], optim.sgd(0.3), loader(16))
    expected = _torch_run(net(), loader(16), 0.3, clip)
    assert_trees_equal(state.params, expected)
    unclipped = _torch_run(net(), loader(16), 0.3, lambda ps: None)
    assert not trees_equal(unclipped, expected)  # the clipping mattered


def test_precision_flags_reach_the_strategy():
    t = trainer(precision="64-true", max_epochs=1)
    assert t.strategy.precision.name == "64-true"
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert all(p.dtype == torch.float64 for p in state.params.values())
    assert trainer(precision="bf16-mixed").strategy.precision.name == "bf16-mixed"
    assert trainer(precision=64).strategy.precision.name == "64-true"
    assert trainer().strategy.precision.name == "32-true"
    with pytest.raises(ValueError, match="unknown precision"):
        trainer(precision="8-true")


def test_deterministic_and_detect_anomaly_are_restored_after_fit():
    seen = []
    probe = LambdaCallback(
        name="probe",
        on_train_start=lambda ctx: seen.append(
            (torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled())
        ),
    )
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled())
    t = trainer(max_epochs=1, deterministic=True, detect_anomaly=True, callbacks=[probe])
    t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert seen == [(True, True)]
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled()) == before
    t = trainer(max_epochs=1, deterministic=True, callbacks=[raise_at(0, RuntimeError("x"))])
    with pytest.raises(RuntimeError):
        t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert torch.are_deterministic_algorithms_enabled() == before[0]


@pytest.mark.bitwise
def test_same_seed_same_run_bitwise_different_seed_differs(tmp_path):
    def run(seed, folder):
        logger = MemoryLogger()
        t = trainer(
            max_epochs=2, logger=logger, log_every_n_steps=1, default_root_dir=tmp_path / folder
        )
        state = t.fit(
            net(dropout=0.5),
            loss_fn,
            optim.adam(1e-2),
            loader(24, shuffle=True),
            loader(8),
            seed=seed,
        )
        return state, logger.metrics

    a, logs_a = run(0, "a")
    b, logs_b = run(0, "b")
    c, _ = run(1, "c")
    # the checkpoint callback's paths name each run's own folder
    a = a.replace(callbacks={k: v for k, v in a.callbacks.items() if k != "ModelCheckpoint"})
    b = b.replace(callbacks={k: v for k, v in b.callbacks.items() if k != "ModelCheckpoint"})
    assert_trees_equal(a, b)
    assert logs_a == logs_b and len(logs_a) > 0
    assert not trees_equal(a.params, c.params)


# --------------------------------------------------------------------------- stopping


class ConstantValidation(Classifier):
    """Validation reports a constant ``val_c``, so early stopping's decisions are known."""

    def validation_step(self, apply, batch):
        return {"c": torch.tensor(1.0)}


def test_min_epochs_overrides_early_stopping():
    # notes §4.4: a stop requested at step 2 of epoch 0 with min_epochs=2 runs epochs 0
    # and 1 fully. Validation every 2 batches; the threshold stops at the first check.
    rec = Recorder()
    stopper = EarlyStopping("val_c", stopping_threshold=2.0)
    t = trainer(
        max_epochs=5,
        min_epochs=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
        callbacks=[rec.callback, stopper],
    )
    state = t.fit(ConstantValidation(), train_dataloaders=loader(16), val_dataloaders=loader(4))
    assert rec.names().count("on_train_batch_end") == 8
    assert (state.progress.epoch, state.progress.step) == (2, 8)
    assert state.callbacks["EarlyStopping"]["stopping_reason"] == 1
    assert t.should_stop


def test_min_steps_overrides_early_stopping_then_validates_at_once():
    # notes §4.4: 4 batches per epoch, stop requested at the end of epoch 1, min_steps=10:
    # epoch 2 ends after batch idx 1 (global step 10) with an immediate validation.
    rec = Recorder()
    stopper = EarlyStopping("val_c", patience=1)
    t = trainer(
        max_epochs=5, min_steps=10, num_sanity_val_steps=0, callbacks=[rec.callback, stopper]
    )
    state = t.fit(ConstantValidation(), train_dataloaders=loader(16), val_dataloaders=loader(4))
    assert state.progress.step == 10
    tail = [e[0] for e in rec.events if e[0] in ("on_train_batch_end", "on_validation_start")]
    assert tail[-3:] == ["on_train_batch_end", "on_train_batch_end", "on_validation_start"]
    assert rec.names().count("on_validation_start") == 3  # epochs 0, 1 and the early one


# --------------------------------------------------------------------------- time


def test_max_time_with_a_fake_clock():
    now = [0.0]
    tick = LambdaCallback(
        name="tick", on_train_batch_start=lambda ctx: now.__setitem__(0, now[0] + 10)
    )
    rec = Recorder()
    t = trainer(max_time={"seconds": 25}, callbacks=[tick, rec.callback])
    t._clock = lambda: now[0]
    t._printer = lambda s: None
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(40))
    assert state.progress.step == 3 and rec.names().count("on_train_batch_end") == 3
    assert t.should_stop


def test_max_time_with_a_timer_callback_already_present():
    messages = []
    t = trainer(max_time="00:00:00:01", max_epochs=1, callbacks=[Timer(duration=None)])
    t._printer = messages.append
    t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert any("Ignoring Trainer(max_time=...)" in m for m in messages)


# --------------------------------------------------------------------------- logging


def test_forked_names_weighted_epoch_means_and_exact_accuracy():
    logger = MemoryLogger()
    x = torch.arange(10, dtype=torch.float32).reshape(10, 1).repeat(1, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 1, 2])

    def fn(apply, batch):
        bx, by = batch
        logits = apply(bx)
        return F.cross_entropy(logits, by), {
            "xm": log(bx[:, 0].mean(), on_step=True, on_epoch=True),
            "acc": log(metrics.Accuracy.of(logits, by), on_step=False, on_epoch=True),
        }

    t = trainer(max_epochs=1, logger=logger, log_every_n_steps=1, num_sanity_val_steps=0)
    dl = DataLoader(TensorDataset(x, y), batch_size=4)  # batches of 4, 4, 2
    state = t.fit(net(), fn, optim.sgd(0.0), dl, dl)
    step_rows = [row for _, row in logger.metrics if "train_xm_step" in row]
    assert [r["train_xm_step"] for r in step_rows] == [1.5, 5.5, 8.5]
    epoch_row = next(row for _, row in logger.metrics if "train_xm_epoch" in row)
    assert epoch_row["train_xm_epoch"] == 4.5  # weighted by batch size (not 5.1666)
    logits = engine.eval_step(net(), lambda a, b: {"l": a(b[0])})(state, (x, y))["l"]
    exact = float((logits.argmax(-1) == y).float().mean())
    assert epoch_row["train_acc"] == pytest.approx(exact, abs=1e-7)
    val_row = next(row for _, row in logger.metrics if "val_loss" in row)
    assert val_row["val_xm_epoch"] == 4.5 and "val_xm_step" not in val_row
    cm = t.callback_metrics
    assert {"train_loss", "train_xm", "train_xm_step", "train_xm_epoch"} <= set(cm)
    assert float(cm["train_xm"]) == 4.5 and float(cm["train_xm_step"]) == 8.5
    assert {"val_xm", "val_xm_epoch", "val_loss", "val_acc"} <= set(cm)
    assert "val_xm_step" not in cm
    assert set(t.progress_bar_metrics) == {"train_loss", "val_loss"}


def test_eval_step_rows_use_a_per_dataloader_counter():
    logger = MemoryLogger()

    def fn(apply, batch):
        x, y = batch
        return F.cross_entropy(apply(x), y), {"s": log(x.sum(), on_step=True)}

    t = trainer(max_epochs=2, logger=logger, log_every_n_steps=100, num_sanity_val_steps=2)
    t.fit(net(), fn, optim.sgd(0.1), loader(8), [loader(12), loader(8)])
    rows = [(s, sorted(r)) for s, r in logger.metrics if any("val_s_step" in k for k in r)]
    assert rows == [
        (0, ["val_s_step/dataloader_idx_0"]),
        (1, ["val_s_step/dataloader_idx_0"]),
        (2, ["val_s_step/dataloader_idx_0"]),
        (0, ["val_s_step/dataloader_idx_1"]),
        (1, ["val_s_step/dataloader_idx_1"]),
        (3, ["val_s_step/dataloader_idx_0"]),
        (4, ["val_s_step/dataloader_idx_0"]),
        (5, ["val_s_step/dataloader_idx_0"]),
        (2, ["val_s_step/dataloader_idx_1"]),
        (3, ["val_s_step/dataloader_idx_1"]),
    ]
    epoch_rows = [r for _, r in logger.metrics if "val_loss/dataloader_idx_0" in r]
    assert len(epoch_rows) == 2 and "val_s_epoch/dataloader_idx_1" in epoch_rows[0]


def test_model_summary_and_startup_messages_are_shown():
    messages = []
    t = Trainer(enable_progress_bar=False, logger=False, max_steps=1)
    t._printer = messages.append
    t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert any("Trainable params" in m for m in messages)
    assert any("max_steps=1 reached" in m for m in messages)


# --------------------------------------------------------------------------- flags


def test_unknown_and_bad_flags_give_clear_errors():
    with pytest.raises(TypeError, match="did you mean `max_epochs`"):
        Trainer(max_epoch=3)
    with pytest.raises(ValueError, match="multiple_trainloader_mode"):
        Trainer(multiple_trainloader_mode="sequential")
    with pytest.raises(ValueError, match="deterministic"):
        Trainer(deterministic="yes")
    with pytest.raises(ValueError, match="val_check_interval"):
        Trainer(val_check_interval=1.5)
    with pytest.raises(ValueError, match="accelerator"):
        Trainer(accelerator="tpu")
    with pytest.raises(TypeError, match="not a callback"):
        Trainer(callbacks=[object()])
    with pytest.raises(TypeError, match="enable_progress_bar"):
        Trainer(enable_progress_bar="no")
    with pytest.raises(ValueError, match="several devices"):
        Trainer(devices=2, accelerator="cpu")
    with pytest.raises(ValueError, match="conflicts"):
        from purestep import hardware

        Trainer(strategy=hardware.single_device("cpu", "32-true"), precision="64-true")


class Counter(Callback):
    def init(self):
        return 0

    def on_train_batch_end(self, state, ctx):
        return state + 1, NOTHING


def test_callback_states_live_in_the_returned_state():
    t = trainer(max_epochs=2, callbacks=[Counter()])
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert state.callbacks["Counter"] == 4


def test_validation_data_without_validation_step_is_reported():
    messages = []

    class TrainOnly(Task):
        def training_step(self, apply, batch):
            return loss_fn(apply, batch)

        def configure_optimizers(self):
            return optim.sgd(0.1)

    rec = Recorder()
    t = trainer(max_epochs=1, callbacks=[rec.callback])
    t._printer = messages.append
    t.fit(TrainOnly(net()), train_dataloaders=loader(8), val_dataloaders=loader(8))
    assert any("defines no validation_step" in m for m in messages)
    assert not any("validation" in n for n in rec.names())


def test_progress_bar_runs_through_every_stage(capsys):
    t = Trainer(max_epochs=2, logger=False, enable_model_summary=False, val_check_interval=0.5)
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(16), [loader(8), loader(4)])
    t.validate(state, loader(8), verbose=False)
    t.predict(state, loader(8))
    assert t.status == "finished"
    err = capsys.readouterr().err
    assert "Epoch 1" in err and "Sanity Checking" in err and "Predicting" in err


def test_import_loops_is_light_and_every_module_imports_first_without_cycles():
    import subprocess
    import sys

    code = """
import importlib, pkgutil, sys
import torch  # shared: only our modules are re-imported below
import purestep
assert "hypothesis" not in sys.modules, "import purestep pulled in hypothesis"
names = [m.name for m in pkgutil.walk_packages(purestep.__path__, "purestep.")]
names = [n for n in names if n != "purestep.loops.testing"]
assert "purestep.loops.callbacks.base" in names and "purestep.engine.step" in names
assert "purestep.hardware.ddp" in names
for name in names:
    for loaded in [m for m in sys.modules if m == "purestep" or m.startswith("purestep.")]:
        del sys.modules[loaded]
    importlib.import_module(name)
print(len(names))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 20


def test_mid_epoch_validation_checkpoints_at_every_validation_end(tmp_path):
    from purestep.loops.callbacks import ModelCheckpoint

    cb = ModelCheckpoint(save_top_k=-1)
    t = trainer(max_epochs=1, val_check_interval=0.5, callbacks=[cb], default_root_dir=tmp_path)
    t.fit(net(), loss_fn, optim.sgd(0.1), loader(64), loader(8))  # 16 batches of 4
    names = sorted(p.name for p in tmp_path.rglob("*.ckpt"))
    assert names == ["epoch=0-step=16.ckpt", "epoch=0-step=8.ckpt"]


def test_the_sanity_check_leaves_callback_states_alone():
    seen = LambdaCallback(name="seen", on_validation_end=lambda ctx: None)

    class Counter(Callback):
        def init(self):
            return {"validations": 0}

        def on_validation_end(self, state, ctx):
            return {"validations": state["validations"] + 1}, NOTHING

    t = trainer(max_epochs=2, callbacks=[Counter(), seen], enable_checkpointing=False)
    state = t.fit(net(), loss_fn, optim.sgd(0.1), loader(16), loader(8))
    assert state.callbacks["Counter"]["validations"] == 2  # not 3: the sanity check left no trace


def test_fit_without_training_data_fails_before_anything_runs():
    rec = Recorder()
    t = trainer(callbacks=[rec.callback])
    with pytest.raises(ValueError, match="fit needs training data"):
        t.fit(net(), loss_fn, optim.sgd(0.1), None, loader(8))
    assert rec.names() == []


def test_deterministic_sets_the_cublas_workspace_unless_the_user_did(monkeypatch):
    """As Lightning: deterministic cuBLAS matmuls need ``CUBLAS_WORKSPACE_CONFIG``; the
    Trainer sets ``:4096:8`` when it is unset and leaves a user's value alone."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    trainer(max_epochs=1, deterministic=False).fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    trainer(max_epochs=1, deterministic=True).fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    trainer(max_epochs=1, deterministic="warn").fit(net(), loss_fn, optim.sgd(0.1), loader(8))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
