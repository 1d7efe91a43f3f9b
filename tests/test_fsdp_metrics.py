"""FSDP with the Trainer's in-place updates and a loss function that returns metrics: the
check that no metric shares storage with a parameter reads each DTensor's local shard (a
DTensor has no storage of its own; asking it failed at the first step). 2 gloo ranks, ~8 s."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep import hardware, optim
from purestep.loops import Trainer

pytestmark = pytest.mark.timeout(180)


def _loss(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def _rank_main(rank: int) -> float:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    trainer = Trainer(
        strategy="fsdp",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)
    state = trainer.fit(net, _loss, optim.adam(1e-2), data)
    assert trainer.donate_state and state.progress.step == 4
    return float(trainer.callback_metrics["train_acc"])


def test_a_donating_fsdp_fit_reports_its_step_metrics():
    first, second = hardware.launch(_rank_main, 2, max_seconds=150, timeout=30)
    assert 0.0 <= first <= 1.0 and 0.0 <= second <= 1.0  # each rank's own last batch
