"""torchmetrics states of a Lightning-style module under DDP: each rank updates its shard's
states, the epoch value merges both ranks' states with each state's ``dist_reduce_fx``, and
equals torchmetrics over the whole data set on one process. 2 gloo ranks, about 10 s."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from purestep import hardware
from tests.lightning_models import QUIET, metrics_class, tensors

pytest.importorskip("torchmetrics")
pytestmark = pytest.mark.timeout(180)


def _val() -> TensorDataset:
    x, y = tensors(48)
    return TensorDataset(x[:32], y[:32])  # 16 a rank: no sample padded in twice


def _rank_main(rank: int) -> dict:
    import purestep

    purestep.seed_everything(0)
    model = metrics_class("purestep")()
    x, y = tensors(48)
    trainer = purestep.Trainer(
        max_epochs=2, strategy=hardware.ddp(), num_sanity_val_steps=0, **QUIET
    )
    trainer.fit(
        model,
        DataLoader(TensorDataset(x, y), batch_size=6),
        DataLoader(_val(), batch_size=8),
    )
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "val_acc": trainer.callback_metrics["val_acc"].clone(),
        "val_f1": trainer.callback_metrics["val_f1"].clone(),
    }


def test_epoch_values_merge_both_ranks_states_as_torchmetrics_would():
    import torchmetrics

    first, second = hardware.launch(_rank_main, 2, max_seconds=150, timeout=30)
    for key in first["params"]:
        assert torch.equal(first["params"][key], second["params"][key]), key
    assert torch.equal(first["val_acc"], second["val_acc"])
    model = metrics_class("purestep")()
    model.load_state_dict(first["params"])
    x, y = _val().tensors
    acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
    f1 = torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro")
    with torch.no_grad():
        logits = model.net(x)
    acc.update(logits, y)
    f1.update(logits, y)
    # the counts are integers: merged in any order they are exact
    assert torch.equal(first["val_acc"], acc.compute())
    assert torch.equal(first["val_f1"], f1.compute())
