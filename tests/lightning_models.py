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
