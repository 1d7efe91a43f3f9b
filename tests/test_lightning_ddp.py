"""torchmetrics states of a Lightning-style module under DDP: each rank updates its shard's
states, the epoch value merges both ranks' states with each state's ``dist_reduce_fx``, and
equals torchmetrics over the whole data set on one process; so does ``compute()`` in an
epoch hook of a metric the steps update without logging (tests/test_lightning_metric_hooks.py
has the rest). 2 gloo ranks, about 10 s."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from purestep import hardware
from tests.lightning_models import QUIET, hook_metrics_class, metrics_class, tensors

pytest.importorskip("torchmetrics")
pytestmark = pytest.mark.timeout(180)


def _val() -> TensorDataset:
    x, y = tensors(48)
    return TensorDataset(x[:32], y[:32])  # 16 a rank: no sample padded in twice


def _resumed_mid_epoch(folder: str, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The metrics model for 2 epochs, whole and stopped after 5 steps (mid epoch 1, its
    epoch means and metric states half-way on each rank) then resumed: callback_metrics of
    both runs."""
    import purestep
    from purestep.loops.callbacks import ModelCheckpoint

    out = {}
    for name, flags, ckpt in (
        ("whole", {}, None),
        ("stopped", {"max_steps": 5}, None),
        ("resumed", {}, "last"),
    ):
        purestep.seed_everything(0)
        run = f"{folder}/{'whole' if name == 'whole' else 'cut'}"
        saver = ModelCheckpoint(dirpath=run, save_last=True, save_top_k=0, every_n_train_steps=1)
        trainer = purestep.Trainer(
            max_epochs=2,
            strategy=hardware.ddp(),
            num_sanity_val_steps=0,
            default_root_dir=run,
            callbacks=[saver],
            **{**QUIET, "enable_checkpointing": True},
            **flags,
        )
        trainer.fit(
            metrics_class("purestep")(),
            DataLoader(TensorDataset(x, y), batch_size=6),
            DataLoader(_val(), batch_size=8),
            ckpt_path=ckpt,
        )
        out[name] = {k: v.clone() for k, v in trainer.callback_metrics.items()}
    return out


def _rank_main(rank: int, folder: str) -> dict:
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
    # metrics updated in the steps, computed and reset in the epoch hooks
    hooked = hook_metrics_class("purestep")()
    hook_trainer = purestep.Trainer(
        max_epochs=1, strategy=hardware.ddp(), num_sanity_val_steps=0, **QUIET
    )
    hook_trainer.fit(
        hooked,
        DataLoader(TensorDataset(x, y), batch_size=6),
        DataLoader(_val(), batch_size=8),
    )
    # -1 from one rank's on_train_batch_start ends every rank's epoch (no collective
    # mismatch), and a skipped batch under DDP is refused on every rank alike
    ending = _ending_on_rank_zero()
    end_trainer = purestep.Trainer(max_epochs=2, strategy=hardware.ddp(), **QUIET)
    end_trainer.fit(ending, DataLoader(TensorDataset(x, y), batch_size=6))
    skipping = _ending_on_rank_zero(skip=True)
    with pytest.raises(ValueError, match="skipped its batch"):
        purestep.Trainer(max_epochs=1, strategy=hardware.ddp(), **QUIET).fit(
            skipping, DataLoader(TensorDataset(x, y), batch_size=6)
        )
    resumed = _resumed_mid_epoch(folder, x, y)
    return {
        "resumed": resumed,
        "end_steps": end_trainer.global_step,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "val_acc": trainer.callback_metrics["val_acc"].clone(),
        "val_f1": trainer.callback_metrics["val_f1"].clone(),
        "hooked": {k: v.detach().clone() for k, v in hooked.state_dict().items()},
        "hook_values": {k: v.clone() for k, v in hook_trainer.callback_metrics.items()},
    }


def _ending_on_rank_zero(skip: bool = False):
    import purestep

    class Ending(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(12, 3)

        def on_train_batch_start(self, batch, batch_idx):
            return -1 if self.trainer.global_rank == 0 and batch_idx == 1 else None

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.layer(x), y)
            return None if skip else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Ending()


def test_epoch_values_merge_both_ranks_states_as_torchmetrics_would(tmp_path):
    import torchmetrics

    first, second = hardware.launch(_rank_main, 2, str(tmp_path), max_seconds=150, timeout=30)
    # resumed mid-epoch, each rank from its own accumulators: the epoch values are the
    # uninterrupted run's bitwise (rank 0's on both ranks would count its half twice)
    for result in (first, second):
        whole, resumed = result["resumed"]["whole"], result["resumed"]["resumed"]
        assert whole.keys() == resumed.keys() and "train_acc_epoch" in whole
        for name in whole:
            assert torch.equal(resumed[name], whole[name]), name
    assert first["end_steps"] == second["end_steps"] == 2  # one batch an epoch, both ranks
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
    # compute() in on_validation_epoch_end: both ranks' states, as torchmetrics syncs them
    assert first["hook_values"].keys() == second["hook_values"].keys()
    for name, value in first["hook_values"].items():
        if name not in ("loss", "train_f1_step"):  # per-step values are each rank's own
            assert torch.equal(value, second["hook_values"][name]), name
    hooked = hook_metrics_class("purestep")()
    hooked.load_state_dict(first["hooked"])
    with torch.no_grad():
        logits = hooked.net(x)
    for name, metric in (
        ("val_acc", torchmetrics.Accuracy(task="multiclass", num_classes=3)),
        ("val_precision", torchmetrics.Precision(task="multiclass", num_classes=3)),
        ("val_recall", torchmetrics.Recall(task="multiclass", num_classes=3)),
    ):
        metric.update(logits, y)
        assert torch.equal(first["hook_values"][name], metric.compute()), name
    mse = torchmetrics.MeanSquaredError()
    mse.update(logits.softmax(-1)[:, 0], (y == 0).float())  # a float sum: merged in another order
    assert torch.allclose(first["hook_values"]["val_mse"], mse.compute(), rtol=1e-6, atol=0)
