"""A skipped step leaves the whole state as it was, BatchNorm statistics included.

A NaN batch under ``optim.skip_nonfinite`` (or a float16 overflow under the 16-mixed loss
scaler) skips the optimizer update; the running statistics that the batch's forward pass
wrote must be dropped too, or every later evaluation is NaN. In an accumulation window, a
micro-batch whose loss is not finite never updates the buffers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep import engine, hardware
from purestep.engine import optim, tree
from purestep.loops import Trainer
from tests.helpers import mlp

pytestmark = pytest.mark.bitwise


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _batch(seed, nan=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 8, generator=g)
    if nan:
        x[3, 2] = float("nan")
    return x, (x[:, 0] > 0).long()


def _copy(state):
    return tree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)


def _same_model_state(a, b):
    tree.assert_trees_equal(a.params, b.params)
    tree.assert_trees_equal(a.buffers, b.buffers)


def _eval_loss(net, state):
    return float(engine.eval_step(net, _loss)(state, _batch(99))["loss"])


@pytest.mark.parametrize("donate", [False, True])
def test_a_nan_batch_under_skip_nonfinite_leaves_params_and_buffers_bitwise(donate):
    net = mlp(batchnorm=True)
    opt = optim.skip_nonfinite(optim.adam(1e-2))
    state = engine.init(net, opt, seed=0)
    step = engine.train_step(net, _loss, opt, donate=donate)
    state, _ = step(state, _batch(1))
    before = _copy(state)
    state, out = step(state, _batch(2, nan=True))
    assert out.skipped and out.stepped
    _same_model_state(state, before)
    tree.assert_trees_equal(state.opt_state.inner_state, before.opt_state.inner_state)
    assert state.opt_state.skipped == 1
    assert math.isfinite(_eval_loss(net, state))
    state, out = step(state, _batch(3))  # and training goes on
    assert not out.skipped and torch.isfinite(state.buffers["1.running_mean"]).all()


def test_a_nan_micro_batch_of_an_accumulation_window_updates_no_buffer():
    net = mlp(batchnorm=True)
    opt = optim.skip_nonfinite(optim.sgd(0.1))
    state = engine.init(net, opt, seed=0)
    step = engine.train_step(net, _loss, opt, accumulate=2)
    before = _copy(state)
    state, _ = step(state, _batch(1, nan=True))  # the window stays open
    tree.assert_trees_equal(state.buffers, before.buffers)
    state, out = step(state, _batch(2))  # its step is skipped: the NaN gradients are in it
    assert out.skipped
    _same_model_state(state, before)
    assert math.isfinite(_eval_loss(net, state))


def test_the_16_mixed_loss_scalers_skip_leaves_the_buffers_too():
    net = mlp(batchnorm=True)
    strategy = hardware.single_device("cpu", "16-mixed")
    opt = optim.sgd(0.1)
    state = engine.init(net, opt, strategy=strategy)
    step = engine.train_step(net, _loss, opt, strategy=strategy)
    before = _copy(state)
    state, out = step(state, _batch(2, nan=True))
    assert out.skipped
    _same_model_state(state, before)


def test_a_trainer_run_through_a_nan_batch_validates_finite(tmp_path):
    x, y = zip(*(_batch(i, nan=i == 2) for i in range(6)))
    train = DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), batch_size=8)
    val = DataLoader(TensorDataset(*_batch(99)), batch_size=8)

    trainer = Trainer(
        max_epochs=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    net = mlp(batchnorm=True)
    opt = optim.skip_nonfinite(optim.adam(1e-2))
    state = trainer.fit(net, _loss, opt, train, val)
    assert state.opt_state.skipped == 1
    assert all(torch.isfinite(b.float()).all() for b in state.buffers.values())
    (metrics,) = trainer.validate(state, val, verbose=False)
    assert math.isfinite(float(metrics["val_loss"] if "val_loss" in metrics else metrics["loss"]))
