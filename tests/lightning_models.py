"""Lightning-style modules the Lightning-parity and kill-and-resume tests train.

Each is plain Lightning code: Lightning's own demo modules, and modules written the way the
Lightning docs write them (``self.log``, ``configure_optimizers`` with torch optimizers and
schedulers). ``base`` chooses the base class: the real ``lightning.pytorch.LightningModule``
or ``purestep.LightningModule`` (the same code with the import changed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def base_class(base: str) -> type:
    if base == "lightning":
        import lightning.pytorch as pl

        return pl.LightningModule
    from purestep import LightningModule

    return LightningModule


def autoencoder_class(base: str) -> type:
    """An autoencoder that logs per step and per epoch, in training and validation."""

    class LitAutoEncoder(base_class(base)):
        def __init__(self, hidden: int = 16, lr: float = 1e-2):
            super().__init__()
            self.save_hyperparameters()
            self.encoder = nn.Sequential(nn.Linear(12, hidden), nn.ReLU(), nn.Linear(hidden, 4))
            self.decoder = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 12))

        def forward(self, x):
            return self.decoder(self.encoder(x))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            loss = F.mse_loss(self(x), x)
            self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
            self.log("code_norm", self.encoder(x).norm(dim=1).mean())
            return loss

        def validation_step(self, batch, batch_idx):
            (x,) = batch
            self.log("val_loss", F.mse_loss(self(x), x))

        def on_validation_epoch_end(self):
            self.log("val_epoch_marker", float(self.current_epoch))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    return LitAutoEncoder


def one_cycle_class(base: str) -> type:
    """A classifier with torch's AdamW and a OneCycleLR stepped every batch."""

    class OneCycleClassifier(base_class(base)):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return {"loss": loss}

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)
            total = self.trainer.estimated_stepping_batches
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return OneCycleClassifier


def gan_class(base: str) -> type:
    """A GAN with manual optimization, as Lightning's docs write one: the discriminator,
    then the generator, each toggled, zeroed, backpropagated and stepped by hand."""

    class ManualGAN(base_class(base)):
        def __init__(self, noise: int = 4):
            super().__init__()
            self.automatic_optimization = False
            self.noise = noise
            self.generator = nn.Sequential(nn.Linear(noise, 16), nn.ReLU(), nn.Linear(16, 2))
            self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            (real,) = batch
            g_opt, d_opt = self.optimizers()
            # noise from the batch's position: the two trainers' global streams differ
            g = torch.Generator().manual_seed(1000 * self.current_epoch + batch_idx)
            z = torch.randn(real.shape[0], self.noise, generator=g)
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

            self.toggle_optimizer(d_opt)
            fake = self.generator(z).detach()
            d_loss = F.binary_cross_entropy_with_logits(
                self.discriminator(real), ones
            ) + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
            d_opt.zero_grad()
            self.manual_backward(d_loss)
            self.clip_gradients(d_opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            d_opt.step()
            self.untoggle_optimizer(d_opt)

            self.toggle_optimizer(g_opt)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
            g_opt.zero_grad()
            self.manual_backward(g_loss)
            g_opt.step()
            self.untoggle_optimizer(g_opt)
            self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

        def configure_optimizers(self):
            g = torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
            d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
            return [g, d]

    return ManualGAN


def metrics_class(base: str) -> type:
    """A classifier that keeps torchmetrics objects as attributes and logs them."""
    import torchmetrics

    class Agreement(torchmetrics.Metric):
        """A user's own metric: the share of predictions equal to the target."""

        def __init__(self):
            super().__init__()
            self.add_state("hits", default=torch.tensor(0), dist_reduce_fx="sum")
            self.add_state("seen", default=torch.tensor(0), dist_reduce_fx="sum")
            self.add_state("worst", default=torch.tensor(0.0), dist_reduce_fx="max")

        def update(self, logits, target):
            self.hits += (logits.argmax(-1) == target).sum()
            self.seen += target.numel()
            self.worst = torch.maximum(self.worst, F.cross_entropy(logits, target).detach())

        def compute(self):
            return self.hits.float() / self.seen + 0.0 * self.worst

    class MetricClassifier(base_class(base)):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
            self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.val_f1 = torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro")
            self.val_mse = torchmetrics.MeanSquaredError()
            self.val_agreement = Agreement()
            self.test_metrics = torchmetrics.MetricCollection(
                {"precision": torchmetrics.Precision(task="multiclass", num_classes=3)},
                prefix="test_",
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.train_acc(logits, y)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            loss = F.cross_entropy(logits, y)
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.val_acc.update(logits, y)
            self.val_f1(logits, y)
            self.val_mse(logits.softmax(-1)[:, 0], (y == 0).float())
            self.log("val_acc", self.val_acc, prog_bar=True)
            self.val_agreement(logits, y)
            self.log_dict(
                {"val_f1": self.val_f1, "val_mse": self.val_mse, "val_agree": self.val_agreement}
            )

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.test_metrics.update(self.net(x), y)
            self.log_dict(self.test_metrics)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=2e-2)

    return MetricClassifier


def tensors(n: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def build(name: str, base: str = "lightning") -> tuple[nn.Module, dict[str, Any]]:
    """``(module, fit keyword arguments)`` for a model name; the caller seeds first."""
    if name == "demo":
        from lightning.pytorch.demos.boring_classes import DemoModel, RandomDataset

        data = RandomDataset(32, 64)
        return DemoModel(), {"train_dataloaders": DataLoader(data, batch_size=8)}
    if name == "boring":
        from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

        # its StepLR; its dataloader hooks make new random data at each call, at a different
        # point of the two trainers' setups: both get the same loaders instead
        loaders = [DataLoader(RandomDataset(32, 64)) for _ in range(2)]
        return BoringModel(), {"train_dataloaders": loaders[0], "val_dataloaders": loaders[1]}
    if name == "transformer":
        from lightning.pytorch.demos.transformer import LightningTransformer

        class SyntheticTokens(LightningTransformer):
            def prepare_data(self):  # the demo downloads WikiText-2: synthetic tokens here
                pass

        model = SyntheticTokens(vocab_size=40)
        for module in model.modules():  # the two trainers draw dropout masks differently
            if isinstance(module, nn.Dropout):
                module.p = 0.0
            if isinstance(module, nn.MultiheadAttention):
                module.dropout = 0.0
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 40, (24, 9), generator=g)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        return model, {"train_dataloaders": DataLoader(data, batch_size=4)}
    x, y = tensors()
    if name == "autoencoder":
        loader = DataLoader(TensorDataset(x), batch_size=8, shuffle=False)
        val = DataLoader(TensorDataset(x[:20]), batch_size=10)
        return autoencoder_class(base)(), {"train_dataloaders": loader, "val_dataloaders": val}
    if name == "metrics":
        loader = DataLoader(TensorDataset(x, y), batch_size=7)  # a short last batch
        val = DataLoader(TensorDataset(x[:30], y[:30]), batch_size=8)
        return metrics_class(base)(), {"train_dataloaders": loader, "val_dataloaders": val}
    if name == "gan":
        ring = torch.stack([torch.cos(x[:, 0] * 3), torch.sin(x[:, 0] * 3)], dim=1)
        return gan_class(base)(), {
            "train_dataloaders": DataLoader(TensorDataset(ring), batch_size=8)
        }
    if name == "onecycle":
        loader = DataLoader(TensorDataset(x, y), batch_size=6)
        return one_cycle_class(base)(), {"train_dataloaders": loader}
    raise ValueError(f"no model {name!r}")


#: Trainer flags both trainers get: nothing but the training itself.
QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
#: max_epochs per model
EPOCHS = {
    "demo": 2,
    "boring": 2,
    "transformer": 2,
    "autoencoder": 3,
    "onecycle": 3,
    "gan": 2,
    "metrics": 3,
}


# ---------------------------------------------------------------------- manual schedulers


def manual_scheduled_class(base: str, kind: str) -> type:
    """Manual optimization stepping its schedulers by hand, as Lightning 2's docs do:
    ``"last_batch"`` a StepLR stepped at each epoch's last batch in training_step;
    ``"every_n"`` a LambdaLR stepped every 2 batches; ``"epoch_end"`` a CosineAnnealingLR
    stepped in on_train_epoch_end; ``"plateau"`` a ReduceLROnPlateau stepped there with a
    logged metric; ``"unstepped"`` a StepLR never stepped (the loop must not step it);
    ``"gan"`` two optimizers with a scheduler each (the generator's StepLR at epoch end, the
    discriminator's OneCycleLR, which cycles Adam's betas[0], every batch)."""
    lr_scheduler = torch.optim.lr_scheduler

    class ManualScheduled(base_class(base)):
        def __init__(self, total_steps: int = 0):
            super().__init__()
            self.automatic_optimization = False
            self.total_steps = total_steps
            if kind == "gan":
                self.generator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
                self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
            else:
                self.net = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))

        def training_step(self, batch, batch_idx):
            if kind == "gan":
                return self._gan_step(batch, batch_idx)
            x, y = batch
            opt, sch = self.optimizers(), self.lr_schedulers()
            loss = F.cross_entropy(self.net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.log("loss", loss)
            self.log("lr", sch.get_last_lr()[0])
            if kind == "last_batch" and batch_idx + 1 == self.trainer.num_training_batches:
                sch.step()
            if kind == "every_n" and (batch_idx + 1) % 2 == 0:
                sch.step()

        def _gan_step(self, batch, batch_idx):
            (real,) = batch
            g_opt, d_opt = self.optimizers()
            _, d_sch = self.lr_schedulers()
            g = torch.Generator().manual_seed(1000 * self.current_epoch + batch_idx)
            z = torch.randn(real.shape[0], 4, generator=g)
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
            self.toggle_optimizer(d_opt)
            fake = self.generator(z).detach()
            d_loss = F.binary_cross_entropy_with_logits(
                self.discriminator(real), ones
            ) + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
            d_opt.zero_grad()
            self.manual_backward(d_loss)
            d_opt.step()
            d_sch.step()
            self.untoggle_optimizer(d_opt)
            self.toggle_optimizer(g_opt)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
            g_opt.zero_grad()
            self.manual_backward(g_loss)
            g_opt.step()
            self.untoggle_optimizer(g_opt)
            self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

        def on_train_epoch_end(self):
            if kind == "gan":
                g_sch, _ = self.lr_schedulers()
                g_sch.step()
                return
            sch = self.lr_schedulers()
            if isinstance(sch, lr_scheduler.ReduceLROnPlateau):  # as Lightning's docs write it
                sch.step(self.trainer.callback_metrics["loss"])
            elif kind == "epoch_end":
                sch.step()

        def configure_optimizers(self):
            if kind == "gan":
                g = torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
                d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-3)
                d_sch = lr_scheduler.OneCycleLR(d, max_lr=1e-2, total_steps=self.total_steps)
                return [g, d], [lr_scheduler.StepLR(g, step_size=1, gamma=0.7), d_sch]
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            if kind in ("last_batch", "unstepped"):
                return [opt], [lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]
            if kind == "every_n":
                sch = lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}
            if kind == "epoch_end":
                return [opt], [lr_scheduler.CosineAnnealingLR(opt, T_max=3)]
            plateau = lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "loss"}}

    return ManualScheduled


#: max_epochs of the manual-scheduler models (one kind's epochs: MANUAL_EPOCHS)
MANUAL_EPOCHS = 3


def build_manual_scheduled(kind: str, base: str = "lightning") -> tuple[nn.Module, dict[str, Any]]:
    """``(module, fit keyword arguments)`` of ``manual_scheduled_class(base, kind)``: 5
    batches an epoch, the last one short; the caller seeds first."""
    x, y = tensors(36)
    if kind == "gan":
        ring = torch.stack([torch.cos(x[:, 0] * 3), torch.sin(x[:, 0] * 3)], dim=1)
        loader = DataLoader(TensorDataset(ring), batch_size=8)
        return manual_scheduled_class(base, kind)(total_steps=MANUAL_EPOCHS * len(loader) + 1), {
            "train_dataloaders": loader
        }
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    return manual_scheduled_class(base, kind)(), {"train_dataloaders": loader}


#: the manual-scheduler kinds, and their names in EPOCHS ("manual_<kind>")
MANUAL_KINDS = ("last_batch", "every_n", "epoch_end", "plateau", "unstepped", "gan")
EPOCHS.update({f"manual_{kind}": MANUAL_EPOCHS for kind in MANUAL_KINDS})


# ---------------------------------------------------------------------- metrics in hooks


def hook_metrics_class(base: str) -> type:
    """A classifier written the way the torchmetrics and Lightning docs write metrics that
    are updated in the steps and computed in the epoch hooks: ``update`` / ``forward`` in
    the steps without logging; ``compute()``, ``self.log`` and ``reset()`` in the epoch-end
    hooks; a MetricCollection through ``log_dict(collection.compute())``; a metric logged
    per step and as an object at the epoch's end (Lightning's docs); and a metric that is
    never reset (it accumulates over every epoch)."""
    import torchmetrics

    class HookMetricClassifier(base_class(base)):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
            self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.train_f1 = torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro")
            self.seen_mse = torchmetrics.MeanSquaredError()  # never reset
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.val_mse = torchmetrics.MeanSquaredError()
            self.val_metrics = torchmetrics.MetricCollection(
                {
                    "precision": torchmetrics.Precision(task="multiclass", num_classes=3),
                    "recall": torchmetrics.Recall(task="multiclass", num_classes=3),
                },
                prefix="val_",
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.train_acc(logits, y)  # forward, not logged
            self.train_f1(logits, y)
            self.log("train_f1_step", self.train_f1)  # the batch value (Lightning's docs)
            self.seen_mse.update(logits.softmax(-1)[:, 0], (y == 0).float())
            loss = F.cross_entropy(logits, y)
            self.log("loss", loss)
            return loss

        def on_train_epoch_end(self):
            self.log("train_acc_epoch", self.train_acc.compute())
            self.train_acc.reset()
            self.log("train_f1_epoch", self.train_f1)  # compute(), then reset by the trainer
            self.log("seen_mse", self.seen_mse.compute())

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.val_acc.update(logits, y)
            self.val_mse.update(logits.softmax(-1)[:, 0], (y == 0).float())
            self.val_metrics.update(logits, y)

        def on_validation_epoch_end(self):
            self.log("val_acc", self.val_acc.compute(), prog_bar=True)
            self.log("val_mse", self.val_mse.compute())
            self.log_dict(self.val_metrics.compute())
            self.val_acc.reset()
            self.val_mse.reset()
            self.val_metrics.reset()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=2e-2)

    return HookMetricClassifier


def build_hook_metrics(base: str = "lightning") -> tuple[nn.Module, dict[str, Any]]:
    """``(hook_metrics_class(base)(), fit keyword arguments)``: 7 training batches an epoch
    (the last one short), 4 validation batches; the caller seeds first."""
    x, y = tensors()
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    val = DataLoader(TensorDataset(x[:30], y[:30]), batch_size=8)
    return hook_metrics_class(base)(), {"train_dataloaders": loader, "val_dataloaders": val}


EPOCHS["hook_metrics"] = 3
