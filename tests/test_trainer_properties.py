"""The Trainer's read-only properties from Lightning 1.5: logged metrics, the callbacks of a
kind, batch counts per stage, and the process ranks (one process here; two ranks in
tests/test_prepare_data.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.loops import Trainer
from purestep.loops.callbacks import EarlyStopping, ModelCheckpoint
from purestep.loops.loggers import MemoryLogger
from tests.helpers import mlp


def _loader(n_batches: int, batch_size: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    n = n_batches * batch_size
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size)


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _trainer(**flags) -> Trainer:
    flags.setdefault("logger", False)
    flags.setdefault("enable_checkpointing", False)
    flags.setdefault("max_epochs", 1)
    return Trainer(enable_progress_bar=False, enable_model_summary=False, **flags)


def _fit(trainer: Trainer, train=None, val=None):
    train = _loader(8) if train is None else train
    return trainer.fit(mlp(), _loss, optim.sgd(0.1), train, val)


def test_logged_metrics_are_the_latest_values_sent_to_the_loggers():
    logger = MemoryLogger()
    t = _trainer(logger=logger, log_every_n_steps=1, max_epochs=2)
    assert t.logged_metrics == {}
    _fit(t, val=_loader(2, seed=1))
    logged = t.logged_metrics
    assert set(logged) == {"train_loss", "val_loss"}  # not the "epoch" the rows carry
    assert all(isinstance(v, torch.Tensor) for v in logged.values())
    last = {}
    for _, row in logger.metrics:
        last.update(row)
    for name, value in logged.items():
        assert float(value) == pytest.approx(last[name])
    logged["val_loss"] = torch.tensor(0.0)  # a copy: the trainer's view does not change
    assert float(t.logged_metrics["val_loss"]) == pytest.approx(last["val_loss"])
    t.test(dataloaders=_loader(2, seed=2), fn=_loss, verbose=False)
    assert set(t.logged_metrics) == {"test_loss"}  # each run logs anew


def test_logged_metrics_without_a_logger():
    t = _trainer(logger=False, log_every_n_steps=1)
    _fit(t)
    assert set(t.logged_metrics) == {"train_loss"}


def test_checkpoint_and_early_stopping_callbacks():
    best = ModelCheckpoint(monitor="val_loss")
    last = ModelCheckpoint(save_last=True)
    stop, other = EarlyStopping(monitor="val_loss"), EarlyStopping(monitor="train_loss")
    t = _trainer(enable_checkpointing=True, callbacks=[stop, best, other, last])
    assert t.checkpoint_callbacks == [best, last] and t.checkpoint_callback is best
    assert t.early_stopping_callbacks == [stop, other] and t.early_stopping_callback is stop
    default = _trainer(enable_checkpointing=True)
    assert len(default.checkpoint_callbacks) == 1
    assert default.checkpoint_callbacks[0] is default.checkpoint_callback
    assert default.early_stopping_callback is None and default.early_stopping_callbacks == []
    assert _trainer(enable_checkpointing=False).checkpoint_callbacks == []


def test_batch_counts_before_any_run():
    t = _trainer()
    assert t.num_training_batches == math.inf
    assert t.num_val_batches == t.num_test_batches == t.num_predict_batches == []
    assert t.num_sanity_val_batches == []


def test_batch_counts_of_fit_follow_the_limits():
    t = _trainer(limit_train_batches=5, limit_val_batches=3)
    _fit(t, val=[_loader(4, seed=1), _loader(2, seed=2)])
    assert t.num_training_batches == 5
    assert t.num_val_batches == [3, 2]
    assert t.num_sanity_val_batches == [2, 2]  # min(num_sanity_val_steps=2, batches)
    fraction = _trainer(limit_train_batches=0.5, num_sanity_val_steps=1)
    _fit(fraction, val=_loader(4, seed=1))
    assert fraction.num_training_batches == 4 and fraction.num_val_batches == [4]
    assert fraction.num_sanity_val_batches == [1]


def test_batch_counts_of_validate_test_and_predict():
    t = _trainer(limit_test_batches=2)
    t.validate(mlp(), dataloaders=[_loader(3), _loader(5)], fn=_loss, verbose=False)
    assert t.num_val_batches == [3, 5]
    t.test(mlp(), dataloaders=_loader(6), fn=_loss, verbose=False)
    assert t.num_test_batches == [2]
    t.predict(mlp(), dataloaders=[_loader(1), _loader(4)])
    assert t.num_predict_batches == [1, 4]
    assert t.num_val_batches == [3, 5]  # a later run of another kind keeps them
    t.validate(mlp(), dataloaders=_loader(2), fn=_loss, verbose=False)
    assert t.num_val_batches == [2]


def test_num_sanity_val_steps_as_computed():
    assert _trainer().num_sanity_val_steps == 2
    assert _trainer(num_sanity_val_steps=-1).num_sanity_val_steps == math.inf
    assert _trainer(num_sanity_val_steps=5).num_sanity_val_steps == 5
    assert _trainer(fast_dev_run=True).num_sanity_val_steps == 0


def test_ranks_of_a_single_process(monkeypatch):
    monkeypatch.setenv("NODE_RANK", "3")  # a leftover variable: one process is node 0
    t = _trainer()
    assert (t.world_size, t.global_rank, t.local_rank, t.node_rank) == (1, 0, 0, 0)
    assert t.is_global_zero


@pytest.mark.parametrize(
    "name",
    [
        "logged_metrics",
        "checkpoint_callbacks",
        "early_stopping_callback",
        "early_stopping_callbacks",
        "progress_bar_callback",
        "num_training_batches",
        "num_val_batches",
        "num_test_batches",
        "num_predict_batches",
        "num_sanity_val_steps",
        "num_sanity_val_batches",
        "local_rank",
        "node_rank",
        "world_size",
        "global_rank",
    ],
)
def test_the_properties_are_read_only(name):
    with pytest.raises(AttributeError):
        setattr(_trainer(), name, 1)
