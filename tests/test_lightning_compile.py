"""A Lightning-style module under ``Trainer(compile=...)``: its step, ``self.log`` values
with Lightning's options included, traced as one graph, training what the eager step
trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import purestep
from purestep.engine import tree
from tests.lightning_models import QUIET


class Logging(purestep.LightningModule):
    """Logs per step and per epoch (``Logged`` values and ``LightningMean`` epoch means)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = (self.layer(x) - 1).pow(2).mean()
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("peak", loss.detach(), on_epoch=True, reduce_fx="max")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(compile: object) -> tuple[dict, dict]:
    purestep.seed_everything(0)
    model = Logging()
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(2))
    trainer = purestep.Trainer(max_epochs=2, compile=compile, **QUIET)
    trainer.fit(model, DataLoader(TensorDataset(x), batch_size=4))
    return dict(model.state_dict()), {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_a_lightning_module_compiles_with_its_logged_values():
    """``aot_eager`` runs the traced graph on torch's own kernels: the weights and the logged
    values equal the eager run's (a stated tolerance of 1e-6, as the traced backward may
    order its sums differently)."""
    eager_weights, eager_metrics = _fit(False)
    weights, metrics = _fit({"backend": "aot_eager"})
    assert tree.trees_equal(weights, eager_weights) or all(
        torch.allclose(weights[k], eager_weights[k], atol=1e-6) for k in weights
    )
    assert set(metrics) == set(eager_metrics)
    assert {"train_loss_step", "train_loss_epoch", "peak_epoch"} <= set(metrics)
    assert metrics == pytest.approx(eager_metrics, abs=1e-6)
