"""``self.lr_schedulers()`` in Lightning's manual optimization: the module steps its
schedulers (in training_step or a hook), the loop steps none, and the weights are Lightning
2's own Trainer's, bitwise; a run stopped after a checkpoint resumes bit-exactly.

Both trainers start from the same weights and read the same batches in the same order (as
in ``test_lightning_module``); a torch scheduler runs as its exact pure translation, its
count in the task's state (``TrainState.callbacks["task"]["lr_schedulers"]``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import purestep
from purestep.loops.callbacks import LambdaCallback, ModelCheckpoint
from tests.helpers import digest
from tests.lightning_models import (
    MANUAL_EPOCHS,
    MANUAL_KINDS,
    QUIET,
    base_class,
    build_manual_scheduled,
    tensors,
)
from tests.test_lightning_module import _lightning_fit, _purestep_fit

pl = pytest.importorskip("lightning.pytorch")
lr_scheduler = torch.optim.lr_scheduler


def _pair(kind: str) -> tuple[nn.Module, nn.Module, dict]:
    purestep.seed_everything(0)
    model, data = build_manual_scheduled(kind)
    return model, copy.deepcopy(model), data


@pytest.mark.bitwise
@pytest.mark.parametrize("kind", MANUAL_KINDS)
def test_weights_equal_lightnings_own_trainer(kind, tmp_path):
    model, reference, data = _pair(kind)
    name = f"manual_{kind}"
    theirs = _lightning_fit(reference, name, data, tmp_path / "lightning")
    ours, state = _purestep_fit(model, name, data, tmp_path / "purestep")
    for key, value in reference.named_parameters():
        assert torch.equal(state.params[key], value), key
    seen = {k: float(v) for k, v in ours.callback_metrics.items()}
    assert seen == {k: float(v) for k, v in theirs.callback_metrics.items()}
    counters = state.callbacks["task"].get("lr_schedulers", {})
    if kind == "unstepped":  # Lightning's rule: the loop steps no scheduler itself
        assert counters == {} and seen["lr"] == pytest.approx(0.1)
    elif kind == "gan":  # StepLR once per epoch, OneCycleLR once per batch
        assert counters == {"0": MANUAL_EPOCHS, "1": 5 * MANUAL_EPOCHS}
    elif kind == "plateau":
        assert counters["0"].last_epoch == MANUAL_EPOCHS and seen["lr"] < 0.1
    else:
        assert counters["0"] == {"every_n": 2 * MANUAL_EPOCHS}.get(kind, MANUAL_EPOCHS)


def _recorder_class(seen: list) -> type:
    """Steps a MultiStepLR in on_train_batch_end every other batch, and records what
    training_step reads of it and of the optimizer (into ``seen``, outside the module)."""

    class Recorder(base_class("lightning")):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = nn.Linear(12, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt, sch = self.optimizers(), self.lr_schedulers()
            seen.append(
                (
                    sch.last_epoch,
                    sch.get_last_lr(),
                    opt.param_groups[0]["lr"],
                    sch.optimizer.param_groups[1]["lr"],
                    sch.milestones == {2: 1, 4: 1},
                    isinstance(sch, lr_scheduler.MultiStepLR),
                )
            )
            loss = F.cross_entropy(self.net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx % 2 == 1:
                self.lr_schedulers().step()

        def configure_optimizers(self):
            opt = torch.optim.SGD(
                [{"params": [self.net.weight]}, {"params": [self.net.bias], "lr": 0.3}], lr=0.1
            )
            return [opt], [lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)]

    return Recorder


@pytest.mark.bitwise
def test_what_a_step_reads_of_its_scheduler_and_optimizer_is_lightnings(tmp_path):
    x, y = tensors(40)
    data = {"train_dataloaders": DataLoader(TensorDataset(x, y), batch_size=8)}
    ours, theirs = [], []
    purestep.seed_everything(0)
    model = _recorder_class(ours)()
    reference = _recorder_class(theirs)()
    reference.load_state_dict(model.state_dict())
    _lightning_fit(reference, "manual_epoch_end", data, tmp_path / "lightning")
    _, state = _purestep_fit(model, "manual_epoch_end", data, tmp_path / "purestep")
    assert ours == theirs and len(ours) == 5 * MANUAL_EPOCHS
    assert ours[-1][1] == [0.025, 0.075]  # past both milestones, per param group
    for key, value in reference.named_parameters():
        assert torch.equal(state.params[key], value), key


@pytest.mark.bitwise
def test_a_run_stopped_after_a_checkpoint_resumes_bitwise(tmp_path):
    """The GAN's schedulers: one stepped in a hook at each epoch end, one in every
    training_step. Stopped in the second epoch (after the hook stepped), resumed from the
    last checkpoint, it ends where the uninterrupted run ends."""
    model, _, data = _pair("gan")
    fresh = [copy.deepcopy(model) for _ in range(2)]
    flags = dict(max_epochs=MANUAL_EPOCHS, num_sanity_val_steps=0, logger=False)
    flags.update(enable_progress_bar=False, enable_model_summary=False)
    whole = purestep.Trainer(default_root_dir=tmp_path / "whole", **flags).fit(model, **data)

    class Stop(Exception):
        pass

    batches = [0]

    def stop(ctx):
        batches[0] += 1
        if batches[0] == 8:  # epoch 1, batch 2: the checkpoint of batch 1 is the last
            raise Stop

    def trainer(*callbacks):
        every_step = ModelCheckpoint(every_n_train_steps=1, save_top_k=0, save_last=True)
        return purestep.Trainer(
            default_root_dir=tmp_path / "stopped", callbacks=[*callbacks, every_step], **flags
        )

    with pytest.raises(Stop):
        trainer(LambdaCallback(name="stop", on_train_batch_end=stop)).fit(fresh[0], **data)
    batches[0] = 0
    count = LambdaCallback(
        name="count", on_train_batch_end=lambda ctx: batches.__setitem__(0, batches[0] + 1)
    )
    resumed = trainer(count).fit(fresh[1], **data, ckpt_path="last")
    assert batches[0] == 15 - 7  # it went on from the checkpoint of the 7th batch
    assert resumed.callbacks["task"]["lr_schedulers"] == {"0": MANUAL_EPOCHS, "1": 15}
    for key in ("params", "opt_state", "buffers"):
        assert digest(getattr(resumed, key)) == digest(getattr(whole, key)), key
    assert resumed.callbacks["task"] == whole.callbacks["task"]


class _Scheduled(purestep.LightningModule):
    """A manual module whose training_step does what ``action`` says to its scheduler."""

    def __init__(self, action, scheduled=True):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(12, 3)
        self.action = action
        self.scheduled = scheduled

    def training_step(self, batch, batch_idx):
        if self.action is not None:
            self.action(self)

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        if self.action is None:
            self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return ([opt], [lr_scheduler.StepLR(opt, 1)]) if self.scheduled else opt


def _fit(module, tmp_path, **flags):
    x, y = tensors(16)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    trainer = purestep.Trainer(default_root_dir=tmp_path, max_epochs=1, **QUIET, **flags)
    return trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)


def test_what_is_not_supported_says_the_way_out(tmp_path):
    def none(module):
        assert module.lr_schedulers() is None

    _fit(_Scheduled(none, scheduled=False), tmp_path, num_sanity_val_steps=0)
    refused = [
        (lambda m: m.lr_schedulers().step(3), NotImplementedError, r"sch.step\(epoch\)"),
        (lambda m: m.lr_schedulers().state_dict(), NotImplementedError, "TrainState"),
        (lambda m: m.lr_schedulers().get_lr(), AttributeError, "get_last_lr"),
        (lambda m: m.optimizers().param_groups[0].update(lr=1.0), TypeError, "LambdaLR"),
    ]
    for action, error, match in refused:
        with pytest.raises(error, match=match):
            _fit(_Scheduled(action), tmp_path, num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match="sanity_checking"):  # a step in the sanity check
        _fit(_Scheduled(None), tmp_path, num_sanity_val_steps=1)
    kept = _Scheduled(lambda m: m.lr_schedulers().step())
    own = kept.lr_schedulers = lambda: None  # a module's own attribute stays its own
    state = _fit(kept, tmp_path, num_sanity_val_steps=0)
    assert kept.lr_schedulers is own and state.callbacks["task"]["lr_schedulers"] == {"0": 2}
