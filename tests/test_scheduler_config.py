"""Lightning's scheduler dict in the Trainer, and hyper-parameter requests from callbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Task, Trainer
from purestep.engine import optim
from purestep.loops.callbacks import Callback, LearningRateMonitor
from purestep.loops.events import NOTHING, Requests
from purestep.loops.loggers import MemoryLogger

inject = optim.inject_hyperparams


def _loader(n=16, batch_size=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


class Recorder(Callback):
    """Records the injected lr each optimizer step uses (read before the update)."""

    name = "recorder"

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, state, ctx):
        lrs = optim.injected_values(ctx.state.opt_state, "lr")
        self.seen.append((ctx.progress.epoch, ctx.progress.step, lrs))
        return state, NOTHING


class Reg(Task):
    def __init__(self, optimizers, validate=False):
        torch.manual_seed(0)
        super().__init__(nn.Linear(3, 1))
        self.optimizers = optimizers
        self.validate = validate

    def training_step(self, apply, batch, optimizer_idx=None):
        x, y = batch
        return F.mse_loss(apply(x), y)

    def validation_step(self, apply, batch):
        x, y = batch
        return {"loss": F.mse_loss(apply(x), y), "val_metric": torch.tensor(1.0)}

    def has(self, method):
        return method != "validation_step" or self.validate

    def configure_optimizers(self):
        return self.optimizers


def _fit(opts, *, epochs=3, callbacks=(), validate=False, val=None, ckpt_path=None, **kw):
    rec = Recorder()
    logger = MemoryLogger()
    trainer = Trainer(
        max_epochs=epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=logger,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        callbacks=[rec, *callbacks],
        **kw,
    )
    state = trainer.fit(
        Reg(opts, validate), train_dataloaders=_loader(), val_dataloaders=val, ckpt_path=ckpt_path
    )
    return state, rec.seen, logger


def test_epoch_interval_is_a_pure_function_of_the_epoch():
    sched = optim.schedules.step(0.1, 1, 0.5)
    opts = {"optimizer": inject(optim.sgd)(lr=0.1), "lr_scheduler": {"scheduler": sched}}
    _, seen, _ = _fit(opts)
    assert [lr for _, _, (lr,) in seen] == [sched(e) for e in range(3) for _ in range(4)]


def test_epoch_interval_with_frequency():
    sched = optim.schedules.step(0.1, 1, 0.5)
    opts = {
        "optimizer": inject(optim.sgd)(lr=0.1),
        "lr_scheduler": {"scheduler": sched, "interval": "epoch", "frequency": 2},
    }
    _, seen, _ = _fit(opts, epochs=4)
    assert [lr for e, _, (lr,) in seen] == [sched(e // 2) for e in range(4) for _ in range(4)]


def test_step_interval_counts_optimizer_steps():
    sched = optim.schedules.linear(0.1, 0.0, 10)
    opts = {
        "optimizer": inject(optim.sgd)(lr=0.1),
        "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2},
    }
    _, seen, _ = _fit(opts, epochs=2, accumulate_grad_batches=2)
    assert [lr for _, _, (lr,) in seen] == [sched(k // 2) for k in range(4)]


def test_a_resumed_epoch_schedule_sets_what_the_uninterrupted_run_had(tmp_path):
    from purestep.loops.callbacks import ModelCheckpoint

    sched = optim.schedules.step(0.1, 1, 0.5)

    def opts():
        return {"optimizer": inject(optim.sgd)(lr=0.1), "lr_scheduler": sched}

    full, _, _ = _fit(opts())
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_last=True)
    trainer = Trainer(
        max_epochs=3,
        max_steps=6,
        enable_progress_bar=False,
        logger=MemoryLogger(),
        enable_model_summary=False,
        callbacks=[ckpt],
    )
    trainer.fit(Reg(opts()), train_dataloaders=_loader())
    resumed, seen, _ = _fit(opts(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert [lr for _, _, (lr,) in seen] == [0.05, 0.05] + [0.025] * 4
    assert torch.equal(resumed.params["weight"], full.params["weight"])


def test_plateau_in_the_trainer_follows_the_monitored_metric():
    plateau = optim.ReduceLROnPlateau(mode="max", patience=0, factor=0.5)
    opts = {
        "optimizer": inject(optim.sgd)(lr=0.1),
        "lr_scheduler": {"scheduler": plateau, "monitor": "val_metric"},
    }
    state, seen, _ = _fit(opts, validate=True, val=_loader(8), epochs=4)
    # val_metric stays 1.0: no improvement after the first epoch, so each epoch halves
    assert [lr for _, _, (lr,) in seen[::4]] == [0.1, 0.1, 0.05, 0.025]
    counters = state.extra["lr_schedulers"]["0"]
    assert counters.best == 1.0 and counters.last_epoch == 4


def test_plateau_strict_and_not():
    plateau = optim.ReduceLROnPlateau()
    opts = {
        "optimizer": inject(optim.sgd)(lr=0.1),
        "lr_scheduler": {"scheduler": plateau, "monitor": "nope"},
    }
    with pytest.raises(RuntimeError, match="conditioned on metric 'nope' which is not available"):
        _fit(opts, epochs=1)
    opts["lr_scheduler"]["strict"] = False
    _, seen, _ = _fit(opts, epochs=2)
    assert all(lr == 0.1 for _, _, (lr,) in seen)


@pytest.mark.parametrize(
    "scheduler, match",
    [
        ({"scheduler": optim.ReduceLROnPlateau()}, "needs the metric to watch"),
        ({"scheduler": optim.schedules.constant(0.1), "interval": "batch"}, "interval"),
        ({"scheduler": optim.schedules.constant(0.1), "frequency": 0}, "frequency"),
        ({"scheduler": optim.schedules.constant(0.1), "every": 1}, "unknown scheduler keys"),
        ({"scheduler": 3}, "must be a schedule"),
    ],
)
def test_bad_scheduler_configs(scheduler, match):
    opts = {"optimizer": inject(optim.sgd)(lr=0.1), "lr_scheduler": scheduler}
    with pytest.raises((TypeError, ValueError), match=match):
        _fit(opts, epochs=1)


def test_a_scheduler_needs_an_injected_learning_rate():
    opts = {"optimizer": optim.sgd(0.1), "lr_scheduler": optim.schedules.constant(0.1)}
    with pytest.raises(ValueError, match="inject_hyperparams"):
        _fit(opts, epochs=1)


class HalveWhenAsked(Callback):
    """A user's metric-driven rule: halve the rate at every epoch end, through a request."""

    name = "halve"

    def init(self):
        return {"epochs": 0}

    def on_train_epoch_end(self, state, ctx):
        (lr,) = optim.injected_values(ctx.state.opt_state, "lr")
        return {"epochs": state["epochs"] + 1}, Requests(hyperparams={"lr": lr / 2})


def test_a_callback_requests_a_hyperparameter_change():
    opts = inject(optim.sgd)(lr=0.1)
    state, seen, _ = _fit(opts, callbacks=[HalveWhenAsked()])
    assert [lr for _, _, (lr,) in seen[::4]] == [0.1, 0.05, 0.025]
    assert optim.injected_values(state.opt_state, "lr") == [0.0125]
    assert state.callbacks["halve"] == {"epochs": 3}


def test_requests_merge_hyperparams():
    merged = Requests(hyperparams={"lr": 1.0}) | Requests(hyperparams={"d/lr": 2.0})
    assert dict(merged.hyperparams) == {"lr": 1.0, "d/lr": 2.0} and bool(merged)


def test_lr_monitor_logs_the_rate_each_step_uses():
    """A new user's check: halving per epoch, 4 steps an epoch; step 4 trains at 0.05 and
    its row must say 0.05 (it once said 0.1, the previous epoch's)."""
    sched = optim.schedules.step(0.1, 1, 0.5)
    opts = {"optimizer": inject(optim.sgd)(lr=0.1, momentum=0.9), "lr_scheduler": sched}
    _, seen, logger = _fit(opts, callbacks=[LearningRateMonitor(log_momentum=True)])
    logged = {step: row["lr-SGD"] for step, row in logger.metrics if "lr-SGD" in row}
    used = {step: lr for _, step, (lr,) in seen}
    assert logged[4] == pytest.approx(0.05, rel=1e-7) and used[4] == 0.05
    epoch_rows = [row for step, row in logger.metrics if "lr-SGD" in row]
    assert all(row["lr-SGD-momentum"] == pytest.approx(0.9, rel=1e-7) for row in epoch_rows)
    for step in used:  # loggers keep float32
        assert logged[step] == pytest.approx(used[step], rel=1e-7), step


def test_lr_monitor_with_a_schedule_injected_into_the_optimizer():
    sched = optim.schedules.step(0.1, 4, 0.5)  # by optimizer steps: 4 a epoch
    opts = inject(optim.sgd)(lr=sched)
    _, _, logger = _fit(opts, callbacks=[LearningRateMonitor(logging_interval="step")])
    logged = {step: row["lr-SGD"] for step, row in logger.metrics if "lr-SGD" in row}
    assert logged == pytest.approx({k: sched(k) for k in range(12)}, rel=1e-7)


def test_lr_monitor_names_several_optimizers_and_groups():
    net_opts = [
        {
            "optimizer": inject(optim.adam)(lr=1e-3),
            "params": "weight",
            "lr_scheduler": {"scheduler": optim.schedules.constant(1e-3), "name": "my_lr"},
        },
        {
            "optimizer": optim.partition(
                {"x": inject(optim.sgd)(lr=0.1), "y": inject(optim.sgd)(lr=0.2)},
                lambda n, t: "x",
            ),
            "params": "bias",
        },
    ]
    _, _, logger = _fit(net_opts, epochs=1, callbacks=[LearningRateMonitor()])
    names = {k for _, row in logger.metrics for k in row if k.startswith(("lr-", "my_"))}
    assert names == {"my_lr", "lr-SGD/x", "lr-SGD/y"}


def test_lr_monitor_uses_the_scheduler_name_of_one_named_optimizer(capsys):
    opts = {
        "optimizer": inject(optim.sgd)(lr=0.1),
        "name": "gen",
        "lr_scheduler": {"scheduler": optim.schedules.constant(0.1), "name": "my_lr"},
    }
    _, _, logger = _fit(opts, epochs=1, callbacks=[LearningRateMonitor(log_momentum=True)])
    names = {k for _, row in logger.metrics for k in row if k.startswith(("lr-", "my_"))}
    assert names == {"my_lr"}
    said = capsys.readouterr()
    assert "my_lr has no injected momentum" in said.out + said.err  # named so there too


def test_a_step_plateau_steps_only_with_its_optimizers_updates():
    """With frequencies its optimizer trains every other batch: the plateau steps with those
    updates only (Lightning steps the active optimizers' schedulers), not after every batch."""
    plateau = optim.ReduceLROnPlateau(patience=100)
    opts = [
        {
            "optimizer": inject(optim.sgd)(lr=0.1),
            "params": "weight",
            "frequency": 1,
            "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "train_loss"},
        },
        {"optimizer": optim.sgd(0.1), "params": "bias", "frequency": 1},
    ]
    state, _, _ = _fit(opts, epochs=2)
    assert state.opt_state.steps == {"0": 4, "1": 4}
    assert state.extra["lr_schedulers"]["0"].last_epoch == 4
