"""Lightning-style modules run unchanged under ``purestep.Trainer``: the same weights as
Lightning's own Trainer, bitwise, and a SIGKILLed run resumes bit-exactly.

Both trainers start from the same initial weights (a deep copy) and read the same batches
in the same order (no shuffling); torch's optimizers run the same arithmetic on both sides
(purestep's ``from_torch`` steps the torch class itself), so the final weights agree
bitwise. A module with dropout is compared with dropout off: the two trainers draw their
masks from different streams by design (purestep's from the state's key).
"""

from __future__ import annotations

import copy
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import purestep
from purestep.engine import tree
from tests.helpers import ROOT, run_job
from tests.lightning_models import EPOCHS, QUIET, base_class, build

pl = pytest.importorskip("lightning.pytorch")

JOB = ROOT / "tests" / "lightning_job.py"


def _lightning_fit(model: nn.Module, name: str, data: dict, folder) -> Any:
    """Lightning's own Trainer on ``model`` (no sanity check: purestep's is off too)."""
    trainer = pl.Trainer(
        max_epochs=EPOCHS[name],
        accelerator="cpu",
        devices=1,
        default_root_dir=folder,
        num_sanity_val_steps=0,
        **QUIET,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its tips and data-loader worker advice
        trainer.fit(model, **data)
    return trainer


def _pair(name: str, base: str = "lightning") -> tuple[nn.Module, nn.Module, dict]:
    """``(module, a copy with the same weights, the fit data)``."""
    purestep.seed_everything(0)
    model, data = build(name, base)
    return model, copy.deepcopy(model), data


def _purestep_fit(model: nn.Module, name: str, data: dict, folder, **flags) -> Any:
    trainer = purestep.Trainer(
        max_epochs=EPOCHS[name], default_root_dir=folder, num_sanity_val_steps=0, **QUIET, **flags
    )
    return trainer, trainer.fit(model, **data)


@pytest.mark.bitwise
@pytest.mark.parametrize(
    "name", ["demo", "boring", "autoencoder", "transformer", "gan", "onecycle", "metrics"]
)
def test_weights_equal_lightnings_own_trainer(name, tmp_path):
    model, reference, data = _pair(name)
    lightning_trainer = _lightning_fit(reference, name, data, tmp_path / "lightning")
    trainer, state = _purestep_fit(model, name, data, tmp_path / "purestep")
    want = dict(reference.named_parameters())
    assert sorted(state.params) == sorted(want)
    for key, value in want.items():
        assert torch.equal(state.params[key], value), key
        # the module holds the trained weights after fit, as Lightning's does
        assert torch.equal(dict(model.named_parameters())[key], value), key
    if name in ("autoencoder", "metrics"):  # what self.log gave the monitors, name by name
        ours = {k: float(v) for k, v in trainer.callback_metrics.items()}
        theirs = {k: float(v) for k, v in lightning_trainer.callback_metrics.items()}
        assert ours == theirs


@pytest.mark.bitwise
def test_the_same_code_on_purestep_s_base_class_trains_the_same_weights(tmp_path):
    lightning_model, _, data = _pair("autoencoder", "lightning")
    own_model, _, _ = _pair("autoencoder", "purestep")
    assert not isinstance(own_model, pl.LightningModule)
    own_model.load_state_dict(lightning_model.state_dict())
    theirs, a = _purestep_fit(lightning_model, "autoencoder", data, tmp_path / "a")
    ours, b = _purestep_fit(own_model, "autoencoder", data, tmp_path / "b")
    assert tree.trees_equal(a.params, b.params)
    assert ours.callback_metrics.keys() == theirs.callback_metrics.keys()
    assert own_model.hparams.hidden == 16 and own_model.hparams == {"hidden": 16, "lr": 1e-2}
    assert ours.checkpointing is not None  # the hparams reach checkpoints as a Task's do


@pytest.mark.parametrize(
    "name", ["demo", "autoencoder", "transformer", "gan", "onecycle", "metrics"]
)
def test_a_sigkilled_run_resumes_bitwise(name, tmp_path):
    folder = tmp_path / "killed"
    with ThreadPoolExecutor(2) as pool:  # the uninterrupted run and the killed one at once
        whole, killed = pool.map(
            lambda args: run_job(JOB, *args),
            [(tmp_path / "whole", "--model", name), (folder, "--model", name, "--kill", "5")],
        )
    assert whole.returncode == 0, whole.stderr[-3000:]
    want = whole.stdout.strip().splitlines()[-1]
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_job(JOB, folder, "--model", name, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored the training state" in resumed.stderr
    assert want.startswith("digest=") and resumed.stdout.strip().splitlines()[-1] == want


def _recorder_class(base: str, seen: list) -> type:
    """A module that records what its hooks and steps see (into ``seen``, outside itself)."""

    class Recorder(base_class(base)):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            seen.append(("training_step", self.current_epoch, self.global_step, batch_idx))
            loss = self(x).pow(2).mean()
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            (x,) = batch
            seen.append(("validation_step", self.current_epoch, self.global_step, batch_idx))
            self.log("val_loss", self(x).pow(2).mean(), prog_bar=True)

        def test_step(self, batch, batch_idx):
            (x,) = batch
            self.log("test_loss", self(x).pow(2).mean())

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            (x,) = batch
            return self(x)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    for hook in (
        "on_fit_start",
        "on_train_start",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_train_end",
        "on_fit_end",
    ):

        def record(self, hook=hook):
            seen.append((hook, self.current_epoch, self.global_step, None))

        setattr(Recorder, hook, record)

    def on_train_batch_start(self, batch, batch_idx):
        seen.append(("on_train_batch_start", self.current_epoch, self.global_step, batch_idx))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        seen.append(("on_train_batch_end", self.current_epoch, self.global_step, batch_idx))

    Recorder.on_train_batch_start = on_train_batch_start
    Recorder.on_train_batch_end = on_train_batch_end
    return Recorder


def _points() -> tuple[DataLoader, DataLoader]:
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(x), batch_size=4), DataLoader(
        TensorDataset(x[:6]), batch_size=3
    )


@pytest.mark.bitwise
def test_hooks_and_counters_are_lightnings(tmp_path):
    theirs: list = []
    ours: list = []
    train, val = _points()
    purestep.seed_everything(0)
    reference = _recorder_class("lightning", theirs)()
    model = _recorder_class("lightning", ours)()
    model.load_state_dict(reference.state_dict())
    flags = {"max_epochs": 2, "num_sanity_val_steps": 0, "log_every_n_steps": 1}
    lightning_trainer = pl.Trainer(
        accelerator="cpu", default_root_dir=tmp_path / "l", **QUIET, **flags
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_trainer.fit(reference, train, val)
    trainer = purestep.Trainer(default_root_dir=tmp_path / "p", **QUIET, **flags)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    assert ours == theirs  # the same hooks, in the same order, seeing the same counters
    assert tree.trees_equal(dict(model.state_dict()), dict(reference.state_dict()))
    assert {k: float(v) for k, v in trainer.callback_metrics.items()} == {
        k: float(v) for k, v in lightning_trainer.callback_metrics.items()
    }
    # after fit the module evaluates its trained weights, as in Lightning
    (ours_test,) = trainer.test(model, dataloaders=val, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (theirs_test,) = lightning_trainer.test(reference, dataloaders=val, verbose=False)
    assert ours_test == theirs_test
    predictions = trainer.predict(model, dataloaders=val)
    assert torch.equal(torch.cat(predictions), reference(val.dataset.tensors[0]).detach())


def test_attributes_a_step_changes_are_reported_once(tmp_path):
    class Counting(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.losses = []
            self.calls = 0

        def training_step(self, batch, batch_idx):
            (x,) = batch
            loss = self.layer(x).pow(2).mean()
            self.losses.append(float(loss.detach()))
            self.calls += 1
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    train, _ = _points()
    trainer = purestep.Trainer(max_epochs=2, default_root_dir=tmp_path, **QUIET)
    with pytest.warns(
        UserWarning, match=r"training_step changed the Python attributes \['calls', 'losses'\]"
    ) as caught:
        trainer.fit(Counting(), train_dataloaders=train)
    reports = [str(w.message) for w in caught if "Python attributes" in str(w.message)]
    assert len(reports) == 1 and "on_save_checkpoint" in reports[0]


def test_what_is_not_supported_yet_says_so(tmp_path):
    class Skipping(purestep.LightningModule):  # a batch skipped: tests/test_lightning_batches.py
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class ManualSchedulers(Skipping):  # self.lr_schedulers() works (its own test file)
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            self.lr_schedulers().step(batch_idx)  # torch's deprecated epoch argument

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    with pytest.raises(NotImplementedError, match=r"sch.step\(epoch\)"):
        purestep.Trainer(default_root_dir=tmp_path, **QUIET).fit(
            ManualSchedulers(), train_dataloaders=_points()[0]
        )


def test_self_log_checks_its_arguments_as_lightning_does():
    from purestep.loops.lightning import LogBuffer

    logs = LogBuffer()
    with pytest.raises(RuntimeError, match="outside a hook"):
        logs.log("x", 1.0)
    logs.open("on_train_start")
    with pytest.raises(RuntimeError, match="cannot be called from on_train_start"):
        logs.log("x", 1.0)
    logs.open("training_step", torch.zeros(5, 2))
    with pytest.raises(ValueError, match="one-element"):
        logs.log("x", torch.ones(3))
    logs.log("x", torch.tensor(2.0), on_epoch=True)
    with pytest.raises(ValueError, match="twice"):
        logs.log("x", 3.0)
    logs.open("on_train_epoch_end")
    with pytest.raises(ValueError, match="no step to log at"):
        logs.log("y", 1.0, on_step=True)
    with pytest.warns(UserWarning, match="not being run"):
        purestep.LightningModule().log("z", 1.0)


def test_the_trainer_view_is_read_only_but_takes_should_stop(tmp_path):
    class Stopper(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            with pytest.raises(AttributeError, match="read-only"):
                self.trainer.max_epochs = 9
            (x,) = batch
            return self.layer(x).pow(2).mean()

        def on_train_epoch_end(self):
            if self.current_epoch == 1:
                self.trainer.should_stop = True

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = purestep.Trainer(max_epochs=5, default_root_dir=tmp_path, **QUIET)
    state = trainer.fit(Stopper(), train_dataloaders=_points()[0])
    assert state.progress.epoch == 2


def test_a_hook_with_a_wrong_signature_fails_before_training(tmp_path):
    class Wrong(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def on_train_epoch_end(self, outputs):  # Lightning 1.x's signature
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = purestep.Trainer(default_root_dir=tmp_path, **QUIET)
    with pytest.raises(TypeError, match=r"Wrong.on_train_epoch_end\(outputs\).*0 argument"):
        trainer.fit(Wrong(), train_dataloaders=_points()[0])
    assert trainer.global_step == 0

    class OldStep(Wrong):
        def training_step(self, batch):
            return self.layer(batch[0]).sum()

        on_train_epoch_end = purestep.LightningModule.on_train_epoch_end

    with pytest.raises(TypeError, match="must take \\(batch, batch_idx\\)"):
        trainer.fit(OldStep(), train_dataloaders=_points()[0])

    class Backward(OldStep):
        training_step = Wrong.training_step

        def on_after_backward(self):
            pass

    with pytest.warns(
        UserWarning, match=r"\['on_after_backward'\], which purestep.Trainer does not call"
    ):
        purestep.Trainer(default_root_dir=tmp_path, max_steps=1, **QUIET).fit(
            Backward(), train_dataloaders=_points()[0]
        )


@pytest.mark.bitwise
def test_on_before_optimizer_step_sees_the_gradients_as_in_lightning(tmp_path):
    from lightning.pytorch.utilities import grad_norm

    class Norms(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def on_before_optimizer_step(self, optimizer):
            assert isinstance(optimizer, torch.optim.Adam)
            self.log_dict(grad_norm(self.layer, norm_type=2))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    purestep.seed_everything(0)
    model = Norms()
    reference = copy.deepcopy(model)
    train = _points()[0]
    flags = {"max_epochs": 1, "log_every_n_steps": 1}
    lightning_trainer = pl.Trainer(
        accelerator="cpu", default_root_dir=tmp_path / "l", **QUIET, **flags
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_trainer.fit(reference, train)
    trainer = purestep.Trainer(default_root_dir=tmp_path / "p", **QUIET, **flags)
    trainer.fit(model, train_dataloaders=train)
    ours = {k: float(v) for k, v in trainer.callback_metrics.items()}
    theirs = {k: float(v) for k, v in lightning_trainer.callback_metrics.items()}
    assert ours == theirs and "grad_2.0_norm_total" in ours
    assert all(p.grad is None for p in model.parameters())  # lent for the hook only


def test_checkpoint_hooks_callbacks_and_load_from_checkpoint(tmp_path):
    from purestep.loops.callbacks import EarlyStopping, ModelCheckpoint

    class WithState(purestep.LightningModule):
        def __init__(self, width: int = 3):
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(4, width)
            self.tag = "fresh"

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.layer(batch[0]).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def configure_callbacks(self):
            return [ModelCheckpoint(monitor="val_loss", save_top_k=1), EarlyStopping("val_loss")]

        def on_save_checkpoint(self, checkpoint):
            checkpoint["tag"] = "saved"

        def on_load_checkpoint(self, checkpoint):
            self.tag = checkpoint["tag"]

    train, val = _points()
    model = WithState(width=2)
    trainer = purestep.Trainer(
        max_epochs=3, default_root_dir=tmp_path, enable_progress_bar=False, logger=False
    )
    state = trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    saved = sorted(tmp_path.glob("**/*.ckpt"))
    assert saved, "configure_callbacks' ModelCheckpoint wrote nothing"
    restored = WithState.load_from_checkpoint(str(saved[-1]))
    assert restored.hparams == {"width": 2} and restored.tag == "saved"
    assert restored.layer.out_features == 2
    assert isinstance(restored, WithState)
    loaded = purestep.checkpoint.load(str(saved[-1]))[0]
    assert tree.trees_equal(dict(restored.state_dict()), loaded.params)
    assert state.progress.epoch == 3
    # a subclass of the real LightningModule reads a purestep checkpoint the same way
    from purestep.loops.lightning import load_from_checkpoint
    from tests.lightning_models import autoencoder_class

    Auto = autoencoder_class("lightning")
    auto = Auto(hidden=5)
    path = str(tmp_path / "auto.ckpt")
    purestep.checkpoint.save(
        purestep.init(auto, purestep.optim.sgd(0.1)), path, metadata={"hparams": {"hidden": 5}}
    )
    again = load_from_checkpoint(Auto, path)
    assert isinstance(again, Auto) and again.hparams.hidden == 5
    assert tree.trees_equal(dict(again.state_dict()), dict(auto.state_dict()))


@pytest.mark.bitwise
def test_torchmetrics_values_are_torchmetrics_own_and_lightnings(tmp_path):
    import torchmetrics

    model, reference, data = _pair("metrics")
    lightning_trainer = _lightning_fit(reference, "metrics", data, tmp_path / "lightning")
    trainer, _ = _purestep_fit(model, "metrics", data, tmp_path / "purestep")
    ours = trainer.callback_metrics
    assert {"train_acc_step", "train_acc_epoch", "val_acc", "val_f1", "val_mse"} <= set(ours)
    # the last validation ran on the final weights: torchmetrics over the whole set by hand
    x, y = data["val_dataloaders"].dataset.tensors
    by_hand = torchmetrics.Accuracy(task="multiclass", num_classes=3)
    for i in range(0, len(x), 8):
        by_hand.update(model.net(x[i : i + 8]), y[i : i + 8])
    assert torch.equal(ours["val_acc"], by_hand.compute())
    assert torch.equal(ours["val_agree"], ours["val_acc"])  # the user's Metric subclass
    # the epoch's updates, not the last batch's: a different number here
    assert not torch.equal(ours["train_acc_epoch"], ours["train_acc_step"])
    # test: a MetricCollection logged with log_dict, as Lightning names it
    (theirs_test,) = lightning_trainer.test(reference, data["val_dataloaders"], verbose=False)
    (ours_test,) = trainer.test(model, data["val_dataloaders"], verbose=False)
    assert ours_test == theirs_test and "test_precision" in ours_test


def test_a_metric_computed_in_a_hook_sees_the_epoch_s_updates_and_list_states_are_refused(
    tmp_path,
):
    import torchmetrics

    class HookCompute(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 3)
            self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            logits = self.layer(x)
            self.acc.update(logits, logits.argmax(-1))
            return logits.pow(2).mean()

        def on_train_epoch_end(self):
            self.log("acc", self.acc.compute())  # every update agrees: 1 (tests/
            self.acc.reset()  # test_lightning_metric_hooks.py checks the numbers)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = purestep.Trainer(default_root_dir=tmp_path, max_epochs=1, **QUIET)
    trainer.fit(HookCompute(), train_dataloaders=_points()[0])
    assert float(trainer.callback_metrics["acc"]) == 1.0

    class ListState(HookCompute):
        def __init__(self):
            super().__init__()
            self.auroc = torchmetrics.AUROC(task="binary")

        on_train_epoch_end = purestep.LightningModule.on_train_epoch_end

    with pytest.raises(TypeError, match="AUROC's state .* is a list"):
        purestep.Trainer(default_root_dir=tmp_path, **QUIET).fit(
            ListState(), train_dataloaders=_points()[0]
        )


def test_configure_optimizers_may_read_the_stepping_batches_without_a_second_dataloader_call(
    tmp_path,
):
    calls = []
    train, _ = _points()

    class Scheduled(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def train_dataloader(self):
            calls.append(len(calls))
            return train

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            steps = self.trainer.estimated_stepping_batches
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer = purestep.Trainer(max_epochs=2, default_root_dir=tmp_path, **QUIET)
    trainer.fit(Scheduled())
    assert calls == [0]  # asked once, as without the early look
    assert trainer.estimated_stepping_batches == 2 * len(train)
    calls.clear()
    again = purestep.Trainer(
        max_epochs=2, reload_dataloaders_every_n_epochs=1, default_root_dir=tmp_path, **QUIET
    )
    again.fit(Scheduled())
    assert calls == [0, 1]  # and once per reload


def test_what_a_reviewer_tripped_on(tmp_path):
    seen = {}

    class Lazy(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = None  # built in configure_model: no attribute warning for it

        def configure_model(self):
            if self.layer is None:
                self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            seen["max_epochs"] = self.trainer.max_epochs
            return self.layer(batch[0]).pow(2).mean()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen["loss"] = outputs["loss"]  # Lightning's dict

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.layer(batch[0]).pow(2).mean())

        def configure_optimizers(self):
            return purestep.optim.sgd(0.1)  # an engine transform (a NamedTuple) as it is

    train, val = _points()
    model = Lazy()
    model.configure_model()
    trainer = purestep.Trainer(max_epochs=2, default_root_dir=tmp_path, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no attribute warning, no other warning
        trainer.fit(model, train, val)
    assert seen["max_epochs"] == 2 and isinstance(seen["loss"], torch.Tensor)
    # evaluating the fitted module without passing it still runs its self.log
    (results,) = trainer.validate(dataloaders=val, verbose=False)
    assert set(results) == {"val_loss"}
    with pytest.warns(UserWarning, match="not being run"):
        model.log("x", 1.0)  # and afterwards the module's own log is back

    class TwoAutomatic(Lazy):
        def configure_optimizers(self):
            return [
                torch.optim.SGD([self.layer.weight], 0.1),
                torch.optim.SGD([self.layer.bias], 0.1),
            ]

    twice = TwoAutomatic()
    twice.configure_model()
    with pytest.raises(ValueError, match="several optimizers need manual optimization"):
        purestep.Trainer(default_root_dir=tmp_path, **QUIET).fit(twice, train)

    class Stepping(Lazy):
        def optimizer_step(self, *args, **kwargs):
            pass

    with pytest.warns(UserWarning, match=r"\['optimizer_step'\], which purestep.Trainer does not"):
        from purestep.loops.lightning import LightningTask

        LightningTask(Stepping())  # reported when the adapter is made, before any run


class _Accumulating(pl.LightningModule):
    """Manual optimization accumulating over two batches, as Lightning's docs show, with a
    log before and after the optimizer step and the step's hook."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("before_step", loss)
        self.manual_backward(loss)
        if (batch_idx + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()
        self.log("after_step", loss + 1)

    def on_before_optimizer_step(self, optimizer):
        self.log("lr_seen", optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


@pytest.mark.bitwise
def test_manual_gradients_accumulate_across_batches_as_in_lightning(tmp_path):
    purestep.seed_everything(0)
    x, y = torch.randn(20, 3), torch.randn(20, 1)
    data = DataLoader(TensorDataset(x, y), batch_size=4)  # 5 batches: one left open
    model = _Accumulating()
    reference = copy.deepcopy(model)
    flags = {"max_epochs": 2, "num_sanity_val_steps": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", default_root_dir=tmp_path / "l", **QUIET, **flags).fit(
            reference, data
        )
    trainer = purestep.Trainer(default_root_dir=tmp_path / "p", **QUIET, **flags)
    state = trainer.fit(model, data)
    for name, value in reference.named_parameters():
        assert torch.equal(state.params[name], value), name
    assert {"before_step", "after_step", "lr_seen"} <= set(trainer.callback_metrics)
    # the open window's gradient (the 5th batch's) is in the state, for a resume to carry on
    assert "lightning_manual_grads" in state.extra


def test_a_hook_that_writes_the_weights_in_place_is_refused(tmp_path):
    class Clamping(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            with torch.no_grad():
                for p in self.parameters():
                    p.clamp_(-0.01, 0.01)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Clamping()
    with pytest.raises(RuntimeError, match="on_train_batch_end wrote the module's parameters"):
        purestep.Trainer(default_root_dir=tmp_path, **QUIET).fit(model, _points()[0])
    with pytest.warns(UserWarning, match="not being run"):
        model.log("x", 1.0)  # a failed fit gives the module its own log back too


def test_batch_end_hooks_get_what_the_step_returned_and_metrics_stay_per_module(tmp_path):
    import torchmetrics

    seen = []

    class Returning(purestep.LightningModule):
        def __init__(self, average):
            super().__init__()
            self.layer = nn.Linear(4, 3)
            self.precision_ = torchmetrics.Precision(
                task="multiclass", num_classes=3, average=average
            )

        def training_step(self, batch, batch_idx):
            return {"loss": self.layer(batch[0]).pow(2).mean(), "n": batch_idx}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.append(outputs["n"])

        def validation_step(self, batch, batch_idx):
            logits = self.layer(batch[0])
            self.precision_(logits, logits.argmax(-1).flip(0))
            self.log("p", self.precision_)
            return logits

        def on_validation_batch_end(self, outputs, batch, batch_idx):
            seen.append(tuple(outputs.shape))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    train, val = _points()
    trainer = purestep.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET)
    macro, micro = Returning("macro"), Returning("micro")
    micro.load_state_dict(macro.state_dict(), strict=False)
    trainer.fit(macro, train)
    assert seen == [0, 1, 2]
    first = trainer.validate(macro, val, verbose=False)
    trainer.validate(micro, val, verbose=False)
    assert trainer.validate(macro, val, verbose=False) == first  # its own metric object
    assert seen[3:5] == [(3, 3), (3, 3)]


@pytest.mark.bitwise
def test_lr_find_on_a_lightning_module_is_lightnings_tuner(tmp_path):
    from lightning.pytorch.demos.boring_classes import DemoModel, RandomDataset
    from lightning.pytorch.tuner import Tuner as LightningTuner

    from purestep.loops.tuning import Tuner

    purestep.seed_everything(0)
    theirs = DemoModel()
    ours = copy.deepcopy(theirs)
    data = DataLoader(RandomDataset(32, 640), batch_size=8)
    sweep = {"num_training": 20, "min_lr": 1e-4}
    flags = {"max_epochs": 1, "accelerator": "cpu", "default_root_dir": tmp_path / "l", **QUIET}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = LightningTuner(pl.Trainer(**flags)).lr_find(theirs, data, **sweep)
    trainer = purestep.Trainer(max_epochs=1, default_root_dir=tmp_path / "p", **QUIET)
    found = Tuner(trainer).lr_find(ours, data, **sweep)
    assert found.results == expected.results
    # update_attr wrote the suggestion where Lightning's does: the module's learning_rate
    assert ours.learning_rate == theirs.learning_rate == expected.suggestion()
