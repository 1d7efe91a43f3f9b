"""``Trainer(inference_mode=...)`` for evaluation and ``Trainer(benchmark=...)`` for cuDNN.

Evaluation, test and prediction steps run under ``torch.inference_mode()`` by default
(Lightning's default) and under ``torch.no_grad()`` with ``inference_mode=False``; either way
the run computes the same values, and a fit that validates stays bitwise what it was.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import engine
from purestep.engine import optim
from purestep.engine.tree import assert_trees_equal
from purestep.loops import Driver, Task, Trainer, predict
from purestep.loops.callbacks import EarlyStopping, LambdaCallback, ModelCheckpoint
from purestep.loops.loggers import MemoryLogger


def loader(n: int, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=batch_size)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class Classifier(Task):
    """Records the grad mode each evaluation step runs under."""

    def __init__(self) -> None:
        super().__init__()
        self.model = net()
        self.modes: list[tuple[bool, bool]] = []

    def training_step(self, apply, batch):
        x, y = batch
        return F.cross_entropy(apply(x), y)

    def validation_step(self, apply, batch):
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return self.training_step(apply, batch)

    test_step = validation_step

    def predict_step(self, apply, batch):
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return apply(batch[0])

    def configure_optimizers(self):
        return optim.adam(1e-2)


def trainer(**flags) -> Trainer:
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("logger", MemoryLogger())
    t = Trainer(**flags)
    t._printer = lambda s: None
    return t


@pytest.mark.parametrize("mode", [True, False])
def test_evaluation_runs_under_inference_mode_or_no_grad(mode):
    task = Classifier()
    t = trainer(max_epochs=1, enable_checkpointing=False, inference_mode=mode)
    t.fit(task, train_dataloaders=loader(8), val_dataloaders=loader(8))
    t.validate(task, loader(8), verbose=False)
    t.test(task, loader(8), verbose=False)
    outputs = t.predict(task, loader(8))
    assert task.modes and all(m == (mode, False) for m in task.modes)
    for out in outputs:
        assert out.is_inference() is mode  # inference tensors exactly under inference mode
        assert not out.requires_grad
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()  # restored
    metric = t.callback_metrics["val_loss"]
    assert not metric.requires_grad


def test_the_plain_loops_take_the_flag_from_the_driver():
    model = net()
    state = engine.init(model, optim.sgd(0.1), seed=0)
    step = engine.predict_step(model, lambda apply, batch: apply(batch[0]))
    for mode in (True, False):
        _, outputs = predict(
            state, step, loader(8), driver=Driver(fn="predict", inference_mode=mode)
        )
        assert all(out.is_inference() is mode for out in outputs[0])


@pytest.mark.bitwise
def test_a_validating_fit_is_bitwise_the_same_either_way(tmp_path):
    def run(mode):
        cbs = [
            EarlyStopping(monitor="val_loss", patience=5),
            ModelCheckpoint(dirpath=tmp_path / str(mode), monitor="val_loss", save_top_k=2),
        ]
        t = trainer(max_epochs=3, callbacks=cbs, inference_mode=mode)
        return t.fit(Classifier(), train_dataloaders=loader(16), val_dataloaders=loader(8))

    on, off = run(True), run(False)
    for name, p in on.params.items():
        assert torch.equal(p, off.params[name]), name
    assert_trees_equal(on, off)


def test_benchmark_is_set_for_the_run_and_restored():
    seen: list[bool] = []
    probe = LambdaCallback(
        name="probe", on_train_start=lambda ctx: seen.append(torch.backends.cudnn.benchmark)
    )
    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        for flags, expected in (
            ({"benchmark": True}, True),
            ({"benchmark": False}, False),
            ({"benchmark": None}, False),  # left as it was
        ):
            seen.clear()
            t = trainer(max_epochs=1, enable_checkpointing=False, callbacks=[probe], **flags)
            t.fit(net(), Classifier().training_step, optim.sgd(0.1), loader(8))
            assert seen == [expected], flags
            assert torch.backends.cudnn.benchmark is False  # restored after the run
        torch.backends.cudnn.benchmark = True
        for flags, expected in (
            ({}, True),  # left as it was
            ({"deterministic": True}, False),  # Lightning: deterministic turns it off
            ({"deterministic": "warn"}, False),  # "warn" too (Lightning: any truthy value)
            ({"deterministic": False}, True),
        ):
            seen.clear()
            t = trainer(max_epochs=1, enable_checkpointing=False, callbacks=[probe], **flags)
            t.fit(net(), Classifier().training_step, optim.sgd(0.1), loader(8))
            assert seen == [expected], flags
            assert torch.backends.cudnn.benchmark is True  # restored after the run
    finally:
        torch.backends.cudnn.benchmark = before


def test_bad_flags_are_refused():
    with pytest.raises(TypeError, match="inference_mode must be a bool"):
        Trainer(inference_mode="yes", logger=False)
    with pytest.raises(TypeError, match="benchmark must be a bool or None"):
        Trainer(benchmark=1, logger=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(benchmark=True, deterministic=True, logger=False)
        Trainer(benchmark=True, deterministic="warn", logger=False)
    assert any("deterministic=True, benchmark" in str(w.message) for w in caught)
    assert any("deterministic='warn', benchmark" in str(w.message) for w in caught)
