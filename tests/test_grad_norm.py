"""track_grad_norm: p-norms of the gradients the optimizer uses, under Lightning's names."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Task, Trainer
from purestep.engine import optim
from purestep.loops.callbacks import Callback
from purestep.loops.events import NOTHING
from purestep.loops.loggers import MemoryLogger


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class Grabber(Callback):
    name = "grabber"

    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, state, ctx):
        self.grads.append({n: g.clone() for n, g in ctx.outputs.grads.items()})
        return state, NOTHING


def _fit(p, opt=None, task=None, **kw):
    grab, logger = Grabber(), MemoryLogger()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    trainer = Trainer(
        max_epochs=1,
        track_grad_norm=p,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=logger,
        callbacks=[grab],
        **kw,
    )
    if task is not None:
        trainer.fit(task, train_dataloaders=_loader())
    else:
        trainer.fit(
            net,
            lambda apply, b: F.mse_loss(apply(b[0]), b[1]),
            opt or optim.sgd(0.1),
            _loader(),
        )
    return grab.grads, [row for _, row in logger.metrics]


@pytest.mark.parametrize("p, name", [(2, "2.0"), (1.5, "1.5"), ("inf", "inf")])
def test_norms_of_the_gradients_the_optimizer_uses(p, name):
    grads, rows = _fit(p)
    assert len(rows) == len(grads) == 3
    order = float(p)
    for g, row in zip(grads, rows):
        for n, t in g.items():
            assert row[f"grad_{name}_norm/{n}"] == pytest.approx(
                float(torch.linalg.vector_norm(t, order)), rel=1e-6
            )
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(t, order) for t in g.values()]), order
        )
        assert row[f"grad_{name}_norm_total"] == pytest.approx(float(total), rel=1e-6)


def test_norms_are_taken_before_clipping():
    grads, rows = _fit(2, gradient_clip_val=1e-4)
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in grads[0].values()))
    assert norm > 1e-3
    assert rows[0]["grad_2.0_norm_total"] == pytest.approx(norm, rel=1e-5)


def test_off_by_default_and_bad_values():
    _, rows = _fit(-1)
    assert not any(k.startswith("grad_") for row in rows for k in row)
    for bad in (0, -2, "two", True):
        with pytest.raises((TypeError, ValueError), match="track_grad_norm"):
            Trainer(track_grad_norm=bad)


class TwoOpt(Task):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)))

    def training_step(self, apply, batch, optimizer_idx):
        return F.mse_loss(apply(batch[0]), batch[1]) * (1 + optimizer_idx)

    def configure_optimizers(self):
        return [
            {"optimizer": optim.sgd(0.1), "params": "0"},
            {"optimizer": optim.sgd(0.1), "params": "2"},
        ]


def test_several_optimizers_each_log_their_parameters_and_one_total():
    grads, rows = _fit(2, task=TwoOpt())
    assert len(grads) == 6  # two optimizer steps a batch
    row = rows[0]
    names = {k for k in row if k.startswith("grad_2.0_norm/")}
    assert names == {f"grad_2.0_norm/{n}" for g in grads[:2] for n in g}
    total = math.sqrt(sum(float(t.pow(2).sum()) for g in grads[:2] for t in g.values()))
    assert row["grad_2.0_norm_total"] == pytest.approx(total, rel=1e-5)


def test_with_accumulation_the_norms_are_of_the_window_gradients():
    grads, rows = _fit(2, accumulate_grad_batches=3)  # one window: the three batches
    assert len(grads) == 1
    logged = [row for row in rows if "grad_2.0_norm_total" in row]
    assert len(logged) == 1
    total = math.sqrt(sum(float(t.pow(2).sum()) for t in grads[0].values()))
    assert logged[0]["grad_2.0_norm_total"] == pytest.approx(total, rel=1e-5)
