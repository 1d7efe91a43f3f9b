"""terminate_on_nan: stop at the first non-finite loss or gradient, before the update."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Trainer
from purestep.engine import checkpoint, optim
from purestep.loops.callbacks import ModelCheckpoint
from purestep.loops.fit import NonFiniteLossError


def _loader(bad_batch: int | None):
    x = torch.randn(24, 3, generator=torch.Generator().manual_seed(0))
    if bad_batch is not None:
        x[bad_batch * 4] = float("nan")
    return DataLoader(TensorDataset(x), batch_size=4)


def _mse(apply, batch):
    return apply(batch[0]).pow(2).mean()


def _sqrt(apply, batch):
    # finite loss (0), but the gradient of sqrt at 0 is inf: only the gradient check sees it
    out = apply(batch[0]).pow(2).mean()
    return torch.sqrt(out * 0.0)


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("loss_fn, match", [(_mse, "the loss"), (_sqrt, "the gradients of")])
def test_stops_before_the_update_with_the_last_checkpoint_intact(tmp_path, loss_fn, match, donate):
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_last=True)
    trainer = Trainer(
        max_epochs=1,
        terminate_on_nan=True,
        donate_state=donate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt],
    )
    bad = 3 if loss_fn is _mse else 0
    with pytest.raises(NonFiniteLossError, match=match) as caught:
        trainer.fit(net, loss_fn, optim.adam(1e-2), _loader(bad if loss_fn is _mse else None))
    assert f"batch {bad}" in str(caught.value)
    assert "before the optimizer update" in str(caught.value)
    state = trainer.train_state
    assert state is not None and state.progress.step == bad
    assert all(bool(torch.isfinite(p).all()) for p in state.params.values())
    if bad:
        saved, _ = checkpoint.load(str(tmp_path / "last.ckpt"))
        assert saved.progress.step == bad
        for n, p in saved.params.items():
            assert torch.equal(p, state.params[n])


def test_off_by_default_nan_flows_through():
    torch.manual_seed(0)
    trainer = Trainer(
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    state = trainer.fit(nn.Linear(3, 1), _mse, optim.sgd(0.1), _loader(1))
    assert not bool(torch.isfinite(state.params["weight"]).all())
    with pytest.raises(TypeError, match="terminate_on_nan"):
        Trainer(terminate_on_nan=1)


def test_several_optimizers_stop_at_the_first_non_finite_loss(tmp_path):
    from purestep import Task

    class Two(Task):
        def __init__(self):
            torch.manual_seed(0)
            super().__init__(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)))

        def training_step(self, apply, batch, optimizer_idx):
            return _mse(apply, batch)

        def configure_optimizers(self):
            return [
                {"optimizer": optim.sgd(0.1), "params": "0"},
                {"optimizer": optim.sgd(0.1), "params": "1"},
            ]

    trainer = Trainer(
        max_epochs=1,
        terminate_on_nan=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accumulate_grad_batches=2,
    )
    with pytest.raises(NonFiniteLossError, match="batch 3"):
        trainer.fit(Two(), train_dataloaders=_loader(3))  # inside an accumulation window
    state = trainer.train_state
    assert state.opt_state.steps == {"0": 1, "1": 1}
    assert all(bool(torch.isfinite(p).all()) for p in state.params.values())


def test_a_float16_loss_scaler_overflow_is_not_a_nan_stop():
    """The scaler's first steps overflow float16 (scale 2**16) and are skipped, as without
    the flag; only a non-finite loss, or gradients of a step that would be applied, stop."""
    torch.manual_seed(0)
    trainer = Trainer(
        max_epochs=1,
        precision="16-mixed",
        terminate_on_nan=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )

    def big(apply, batch):  # finite loss, whose scaled float16 gradients overflow
        return apply(batch[0]).float().pow(2).mean() * 1e3

    state = trainer.fit(nn.Linear(3, 1), big, optim.sgd(0.0), _loader(None))
    assert float(state.precision.scale) < 2.0**16  # overflows happened and were skipped
    assert state.progress.step == 6
