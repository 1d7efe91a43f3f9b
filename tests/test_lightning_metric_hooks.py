"""torchmetrics objects updated in the steps and computed, logged and reset in the hooks, the
way the Lightning and torchmetrics docs write them, under ``purestep.Trainer``.

The metrics' states live in the TrainState (``loops.lightning.metric_states``): the values
equal Lightning's own Trainer on the same module, data and weights and torchmetrics' own in a
plain loop, bitwise; a run stopped mid-epoch and resumed from its checkpoint ends in the
same state; a metric never reset accumulates over epochs and evaluations as in torchmetrics.
Tiny models, a few seconds in all (the 2-rank run is in tests/test_lightning_ddp.py).
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import purestep
from purestep.loops import lightning as lightning_adapter
from purestep.loops.callbacks import LambdaCallback, ModelCheckpoint
from purestep.loops.loggers import MemoryLogger
from tests.helpers import digest
from tests.lightning_models import base_class, build_hook_metrics, tensors

pl = pytest.importorskip("lightning.pytorch")
torchmetrics = pytest.importorskip("torchmetrics")

QUIET = {"enable_progress_bar": False, "enable_model_summary": False}
HOOK_LOGGED = (
    "train_acc_epoch",
    "train_f1_epoch",
    "seen_mse",
    "val_acc",
    "val_mse",
    "val_precision",
    "val_recall",
)


class _Rows(pl.loggers.Logger):
    """Lightning's side of a ``MemoryLogger``: every row logged."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({k: float(v) for k, v in metrics.items()})


def _history(rows: list[dict[str, float]], names: tuple[str, ...]) -> dict[str, list[float]]:
    found: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        for name in names:
            if name in row:
                found[name].append(row[name])
    return dict(found)


def _lightning_fit(model: nn.Module, data: dict, folder, epochs: int = 3, **flags) -> Any:
    rows = _Rows()
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        default_root_dir=folder,
        num_sanity_val_steps=0,
        logger=rows,
        enable_checkpointing=False,
        **QUIET,
        **flags,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its tips and data-loader worker advice
        trainer.fit(model, **data)
    return trainer, rows.rows


def _purestep_fit(model: nn.Module, data: dict, folder, epochs: int = 3, **flags) -> Any:
    flags.setdefault("num_sanity_val_steps", 0)
    flags.setdefault("enable_checkpointing", False)
    logger = MemoryLogger()
    trainer = purestep.Trainer(
        max_epochs=epochs, default_root_dir=folder, logger=logger, **QUIET, **flags
    )
    state = trainer.fit(model, **data)
    return trainer, state, [values for _, values in logger.metrics]


def _equal(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name].float(), value.float()), (name, ours[name], value)


# ---------------------------------------------------------------------- the docs' pattern


@pytest.mark.bitwise
def test_hook_computed_metrics_equal_lightnings_own_trainer(tmp_path):
    purestep.seed_everything(0)
    model, data = build_hook_metrics("lightning")
    reference = copy.deepcopy(model)
    lightning_trainer, theirs = _lightning_fit(reference, data, tmp_path / "lightning")
    trainer, state, ours = _purestep_fit(model, data, tmp_path / "purestep")
    for name, value in dict(reference.named_parameters()).items():
        assert torch.equal(state.params[name], value), name
    _equal(trainer.callback_metrics, lightning_trainer.callback_metrics)
    # every epoch's value, and the metric never reset accumulating over all three
    assert _history(ours, HOOK_LOGGED) == _history(theirs, HOOK_LOGGED)
    assert len(_history(ours, ("seen_mse",))["seen_mse"]) == 3
    # what stays in the state: the never-reset metric's states; the others were reset
    loop = state.loop
    assert sorted(n for n in loop.train_epoch if n.startswith("torchmetrics/")) == [
        "torchmetrics/seen_mse"
    ]
    assert trainer.logged_metrics.keys() >= set(HOOK_LOGGED)


def _by_hand(net: nn.Module, data: dict, epochs: int = 3) -> dict[str, list[float]]:
    """The module's code driven by a plain loop and torch's Adam: torchmetrics' own values."""
    tm = torchmetrics
    opt = torch.optim.Adam(net.parameters(), lr=2e-2)
    train_acc = tm.Accuracy(task="multiclass", num_classes=3)
    train_f1 = tm.F1Score(task="multiclass", num_classes=3, average="macro")
    seen_mse, val_mse = tm.MeanSquaredError(), tm.MeanSquaredError()
    val_acc = tm.Accuracy(task="multiclass", num_classes=3)
    val_metrics = tm.MetricCollection(
        {
            "precision": tm.Precision(task="multiclass", num_classes=3),
            "recall": tm.Recall(task="multiclass", num_classes=3),
        },
        prefix="val_",
    )
    history: dict[str, list[float]] = defaultdict(list)
    for _ in range(epochs):
        for x, y in data["train_dataloaders"]:
            logits = net(x)
            train_acc(logits, y)
            train_f1(logits, y)
            seen_mse.update(logits.softmax(-1)[:, 0], (y == 0).float())
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            for x, y in data["val_dataloaders"]:
                logits = net(x)
                val_acc.update(logits, y)
                val_mse.update(logits.softmax(-1)[:, 0], (y == 0).float())
                val_metrics.update(logits, y)
        for name, metric in (("val_acc", val_acc), ("val_mse", val_mse)):
            history[name].append(float(metric.compute()))
            metric.reset()
        for name, value in val_metrics.compute().items():
            history[name].append(float(value))
        val_metrics.reset()
        for name, metric in (("train_acc_epoch", train_acc), ("train_f1_epoch", train_f1)):
            history[name].append(float(metric.compute()))
            metric.reset()
        history["seen_mse"].append(float(seen_mse.compute()))  # never reset
    return dict(history)


@pytest.mark.bitwise
def test_hook_computed_metrics_equal_torchmetrics_in_a_plain_loop(tmp_path):
    purestep.seed_everything(0)
    model, data = build_hook_metrics("purestep")
    net = copy.deepcopy(model.net)
    _, _, ours = _purestep_fit(model, data, tmp_path)
    want = _by_hand(net, data)
    assert _history(ours, HOOK_LOGGED) == want
    # never reset: epoch 2 counts every epoch's updates, as torchmetrics does
    seen = want["seen_mse"]
    assert len(set(seen)) == 3


# ---------------------------------------------------------------------- resume


def _fit_checkpointed(folder, stopper, make_model, data, ckpt_path):
    """``(trainer, state)`` of a 3-epoch fit that checkpoints ``last.ckpt`` after every step
    into ``folder``, with ``stopper`` (a callback that may raise KeyboardInterrupt)."""
    checkpoints = ModelCheckpoint(
        dirpath=str(folder), every_n_train_steps=1, save_top_k=0, save_last=True
    )
    trainer = purestep.Trainer(
        max_epochs=3,
        default_root_dir=folder,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[stopper, checkpoints],
        **QUIET,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Detected KeyboardInterrupt" and the like
        state = trainer.fit(make_model(), **data, ckpt_path=ckpt_path)
    return trainer, state


@pytest.mark.bitwise
@pytest.mark.parametrize("stop_after", [3, 7, 10])
def test_a_run_stopped_mid_epoch_resumes_to_the_same_state_and_values(tmp_path, stop_after):
    """Stopped after batch 3 (mid epoch 0), 7 (the end of epoch 0: after its resets) or 10
    (mid epoch 1, the never-reset metric half-way), resumed from the last checkpoint."""

    def run(folder, stop=None, ckpt_path=None):
        purestep.seed_everything(0)
        model, data = build_hook_metrics("purestep")
        seen = [0]

        def maybe_stop(ctx):
            seen[0] += 1
            if seen[0] == stop:
                raise KeyboardInterrupt

        stopper = LambdaCallback(name="stopper", on_train_batch_end=maybe_stop)
        return _fit_checkpointed(tmp_path / folder, stopper, lambda: model, data, ckpt_path)

    whole_trainer, whole = run("whole")
    _, stopped = run("stopped", stop=stop_after)
    assert stopped.progress.total_batches < whole.progress.total_batches
    resumed_trainer, resumed = run("stopped", ckpt_path=str(tmp_path / "stopped" / "last.ckpt"))
    _equal(resumed_trainer.callback_metrics, whole_trainer.callback_metrics)
    assert digest(resumed) == digest(whole)  # the kept metric states included


# ---------------------------------------------------------------------- never reset


def _counting_class(base: str, reset_val_at: int | None = None) -> type:
    class Counting(base_class(base)):
        """Counts the samples seen with metrics that are never reset (``reset_val_at``:
        the validation counter is reset once, at that epoch's end)."""

        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(12, 3)
            self.seen = torchmetrics.SumMetric()
            self.val_seen = torchmetrics.SumMetric()
            self.best = torchmetrics.MaxMetric()

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.update(torch.tensor(float(len(x))))
            loss = F.cross_entropy(self.layer(x), y)
            self.best.update(loss.detach())
            return loss

        def validation_step(self, batch, batch_idx):
            self.val_seen.update(torch.tensor(float(len(batch[0]))))

        def on_validation_epoch_end(self):
            self.log("val_seen", self.val_seen.compute())
            if self.current_epoch == reset_val_at:
                self.val_seen.reset()

        def on_train_epoch_end(self):
            self.log("seen", self.seen.compute())
            self.log("best", self.best.compute())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Counting


def _counting_data() -> dict:
    x, y = tensors(20)
    return {
        "train_dataloaders": DataLoader(TensorDataset(x, y), batch_size=6),
        "val_dataloaders": DataLoader(TensorDataset(x[:10], y[:10]), batch_size=4),
    }


@pytest.mark.bitwise
def test_a_metric_never_reset_accumulates_over_epochs_and_evaluations_as_in_torchmetrics(
    tmp_path,
):
    purestep.seed_everything(0)
    model = _counting_class("lightning", reset_val_at=1)()
    reference = copy.deepcopy(model)
    _, theirs = _lightning_fit(reference, _counting_data(), tmp_path / "l", epochs=4)
    _, state, ours = _purestep_fit(model, _counting_data(), tmp_path / "p", epochs=4)
    names = ("seen", "val_seen", "best")
    assert _history(ours, names) == _history(theirs, names)
    # 20 samples an epoch, 10 an evaluation; the evaluation counter reset after epoch 1
    assert _history(ours, names)["seen"] == [20.0, 40.0, 60.0, 80.0]
    assert _history(ours, names)["val_seen"] == [10.0, 20.0, 10.0, 20.0]
    kept = state.loop.train_epoch["torchmetrics/seen"]
    assert float(kept.states["sum_value"]) == 80.0 and int(kept.updates) == 16
    # the sanity check leaves no trace (Lightning would count its batches in val_seen)
    purestep.seed_everything(0)
    _, _, checked = _purestep_fit(
        _counting_class("purestep", reset_val_at=1)(),
        _counting_data(),
        tmp_path / "s",
        epochs=4,
        num_sanity_val_steps=2,
    )
    assert _history(checked, names) == _history(ours, names)


# ---------------------------------------------------------------------- other patterns


def _patterns_class(base: str) -> type:
    class Patterns(base_class(base)):
        """Reset in a step, a window computed and reset in on_train_batch_end, an update in
        on_validation_batch_end with what the step returned, a metric object logged at the
        validation's end, a train metric computed during validation."""

        def __init__(self):
            super().__init__()
            self.net = nn.Linear(12, 3)
            self.since_3 = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.window = torchmetrics.MeanSquaredError()
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.val_err = torchmetrics.MeanAbsoluteError()

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            if batch_idx == 3:
                self.since_3.reset()  # in the step: the batches before it are gone
            self.since_3.update(logits, y)
            self.window.update(logits.softmax(-1)[:, 0], (y == 0).float())
            return F.cross_entropy(logits, y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx % 2 == 1:
                self.log("window_mse", self.window.compute())
                self.window.reset()

        def validation_step(self, batch, batch_idx):
            return self.net(batch[0])

        def on_validation_batch_end(self, outputs, batch, batch_idx):
            self.val_acc.update(outputs, batch[1])
            self.val_err.update(outputs.softmax(-1)[:, 0], (batch[1] == 0).float())

        def on_validation_epoch_end(self):
            self.log("val_acc", self.val_acc)  # compute() now, reset after the epoch
            self.log("val_err", self.val_err.compute())
            self.log("since_3_during_val", self.since_3.compute())  # the train epoch so far

        def on_train_epoch_end(self):
            self.log("since_3", self.since_3.compute())
            self.since_3.reset()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    return Patterns


@pytest.mark.bitwise
def test_resets_in_steps_and_batch_hooks_and_updates_in_hooks_equal_lightnings(tmp_path):
    purestep.seed_everything(0)
    model = _patterns_class("lightning")()
    reference = copy.deepcopy(model)
    x, y = tensors(40)
    data = {
        "train_dataloaders": DataLoader(TensorDataset(x, y), batch_size=6),
        "val_dataloaders": DataLoader(TensorDataset(x[:20], y[:20]), batch_size=8),
    }
    flags = {"val_check_interval": 4, "log_every_n_steps": 1}
    lightning_trainer, theirs = _lightning_fit(reference, data, tmp_path / "l", epochs=2, **flags)
    trainer, _, ours = _purestep_fit(model, data, tmp_path / "p", epochs=2, **flags)
    _equal(trainer.callback_metrics, lightning_trainer.callback_metrics)
    names = ("window_mse", "val_acc", "val_err", "since_3", "since_3_during_val")
    ours, theirs = _history(ours, names), _history(theirs, names)
    # Lightning writes a batch hook's value again at each later step until it changes
    logged = theirs["window_mse"]
    theirs["window_mse"] = [v for i, v in enumerate(logged) if i == 0 or logged[i - 1] != v]
    assert ours == theirs
    assert len(ours["window_mse"]) == 6 and len(ours["val_acc"]) == 2


# ---------------------------------------------------------------------- refused


def _refused_class(where: str) -> type:
    class Refused(purestep.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(12, 3)
            self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.layer(x)
            self.acc.update(logits, y)
            if where == "step":
                self.log("acc", self.acc.compute())
            return F.cross_entropy(logits, y)

        def on_before_optimizer_step(self, optimizer):
            if where == "before_optimizer_step":
                self.acc.compute()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if where == "batch_end":
                self.log("acc", self.acc)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Refused


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("step", r"training_step called acc.compute\(\).*value = self.acc\(preds, target\)"),
        ("before_optimizer_step", r"acc.compute\(\) in on_before_optimizer_step"),
        ("batch_end", r"self.log\('acc', metric\) in on_train_batch_end"),
    ],
)
def test_what_cannot_give_torchmetrics_value_is_refused_naming_the_way(tmp_path, where, message):
    x, y = tensors(12)
    trainer = purestep.Trainer(
        max_epochs=1, default_root_dir=tmp_path, logger=False, enable_checkpointing=False, **QUIET
    )
    with pytest.raises(NotImplementedError, match=message):
        trainer.fit(_refused_class(where)(), DataLoader(TensorDataset(x, y), batch_size=4))


def test_a_step_s_metric_values_are_pure_functions_of_the_state():
    """What a step returns for its metrics (the batch's states as a kept value) depends on
    the batch only, so running a step twice gives the same."""
    purestep.seed_everything(0)
    model, data = build_hook_metrics("purestep")
    task = lightning_adapter.LightningTask(model)
    x, y = next(iter(data["train_dataloaders"]))
    first = dict(task._eval_step("validation_step", model, (x, y)))
    second = dict(task._eval_step("validation_step", model, (x, y)))
    assert sorted(first) == sorted(second)
    for name in first:
        if name.startswith("torchmetrics/"):
            a, b = first[name].value, second[name].value
            assert a.ops == b.ops and all(torch.equal(a.states[n], b.states[n]) for n in a.states)


# ---------------------------------------------------------------------- logged from a step


def _logged_late_class(base: str, seen: dict[str, list[float]]) -> type:
    class LoggedLate(base_class(base)):
        """Metrics logged from a step that is not its stage's first of the epoch: ``odd`` on
        the odd training batches only, ``second`` for the second validation dataloader only,
        ``cut`` logged at batch 0, reset in on_train_batch_end at batch 2 and updated (not
        logged) after. Lightning resets each at its stage's epoch end; ``seen`` records
        what compute() gives in the hooks around it."""

        def __init__(self):
            super().__init__()
            self.net = nn.Linear(12, 3)
            self.odd = torchmetrics.SumMetric()
            self.second = torchmetrics.SumMetric()
            self.cut = torchmetrics.SumMetric()

        def training_step(self, batch, batch_idx):
            x, y = batch
            n = torch.tensor(float(len(x)))
            if batch_idx % 2 == 1:
                self.odd.update(n)
                self.log("odd", self.odd, on_step=False, on_epoch=True)
            self.cut.update(n + batch_idx)
            if batch_idx == 0:
                self.log("cut", self.cut, on_step=False, on_epoch=True)
            return F.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.cut.reset()

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            if dataloader_idx == 1:
                self.second.update(torch.tensor(float(len(batch[0]))))
                self.log(
                    "second", self.second, on_step=False, on_epoch=True, add_dataloader_idx=False
                )

        def _seen(self, name: str, metric: Any) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # compute() before any update()
                seen[name].append(float(metric.compute()))

        def on_train_epoch_start(self):
            self._seen("odd_at_start", self.odd)
            self._seen("cut_at_start", self.cut)

        def on_train_epoch_end(self):
            self._seen("odd", self.odd)
            self._seen("cut", self.cut)

        def on_validation_epoch_start(self):
            self._seen("second_at_start", self.second)

        def on_validation_epoch_end(self):
            self._seen("second", self.second)

        def on_validation_end(self):
            self._seen("second_at_end", self.second)  # Lightning resets it after this hook

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LoggedLate


def _logged_late_data() -> dict:
    x, y = tensors(24)
    return {
        "train_dataloaders": DataLoader(TensorDataset(x, y), batch_size=6),
        "val_dataloaders": [
            DataLoader(TensorDataset(x[:8], y[:8]), batch_size=4),
            DataLoader(TensorDataset(x[:10], y[:10]), batch_size=4),
        ],
    }


@pytest.mark.bitwise
def test_a_metric_logged_from_a_step_is_reset_at_its_stage_s_epoch_end_as_in_lightning(
    tmp_path,
):
    """Not inferred from batch 0: a logged metric the stage's first batch never touches is
    reset too, after on_train_epoch_end (an evaluation's: after on_validation_end), and one
    reset in a hook and updated after is reset at the epoch's end all the same."""
    theirs: dict[str, list[float]] = defaultdict(list)
    ours: dict[str, list[float]] = defaultdict(list)
    purestep.seed_everything(0)
    reference = _logged_late_class("lightning", theirs)()
    model = _logged_late_class("lightning", ours)()
    model.load_state_dict(reference.state_dict())
    lightning_trainer, _ = _lightning_fit(reference, _logged_late_data(), tmp_path / "l")
    trainer, state, _ = _purestep_fit(model, _logged_late_data(), tmp_path / "p")
    assert dict(ours) == dict(theirs)
    # 4 batches of 6 an epoch (2 odd ones); 10 samples in the second validation loader
    assert ours["odd"] == [12.0, 12.0, 12.0] and ours["odd_at_start"] == [0.0, 0.0, 0.0]
    assert ours["second"] == ours["second_at_end"] == [10.0, 10.0, 10.0]
    assert ours["second_at_start"] == [0.0, 0.0, 0.0]
    assert ours["cut"] == [9.0, 9.0, 9.0] and ours["cut_at_start"] == [0.0, 0.0, 0.0]
    assert torch.equal(trainer.callback_metrics["odd"], lightning_trainer.callback_metrics["odd"])
    assert not [n for n in state.loop.train_epoch if n.startswith("torchmetrics/")]


@pytest.mark.bitwise
@pytest.mark.parametrize("stop", ["epoch_end", "mid_epoch"])
def test_a_run_resumed_after_a_logged_metric_s_epoch_end_computes_the_same(tmp_path, stop):
    """Stopped at epoch 1's start (the checkpoint of epoch 0's end: after the logged
    metrics' reset) or at its second batch, resumed from the last checkpoint."""

    def run(folder, seen, stop=None, ckpt_path=None):
        purestep.seed_everything(0)
        batches = [0]

        def at_epoch_start(ctx):
            if stop == "epoch_end" and ctx.state.progress.epoch == 1:
                raise KeyboardInterrupt

        def at_batch_end(ctx):
            batches[0] += 1
            if stop == "mid_epoch" and batches[0] == 6:
                raise KeyboardInterrupt

        stopper = LambdaCallback(
            name="stopper", on_train_epoch_start=at_epoch_start, on_train_batch_end=at_batch_end
        )
        return _fit_checkpointed(
            tmp_path / folder,
            stopper,
            lambda: _logged_late_class("purestep", seen)(),
            _logged_late_data(),
            ckpt_path,
        )

    whole_seen: dict[str, list[float]] = defaultdict(list)
    whole_trainer, whole = run("whole", whole_seen)
    _, stopped = run("stopped", defaultdict(list), stop=stop)
    assert stopped.progress.total_batches < whole.progress.total_batches
    seen: dict[str, list[float]] = defaultdict(list)
    ckpt = str(tmp_path / "stopped" / "last.ckpt")
    resumed_trainer, resumed = run("stopped", seen, ckpt_path=ckpt)
    assert seen["odd"] and seen["second"] and seen["cut"]
    for name, values in seen.items():  # the resumed epochs' values, as uninterrupted
        assert values == whole_seen[name][-len(values) :], name
    _equal(resumed_trainer.callback_metrics, whole_trainer.callback_metrics)
    assert digest(resumed) == digest(whole)


# ---------------------------------------------------------------------- loaded lazily


def _hooked(hook: str = "on_train_batch_end") -> tuple[Any, dict[str, Any], Any]:
    """``(module, metrics, ctx)``: a module's metrics with kept states from one step, and
    the context a hook on it gets."""
    from types import SimpleNamespace

    from purestep.loops import loop_state
    from purestep.loops.lightning import metric_states

    purestep.seed_everything(0)
    module, _ = build_hook_metrics("purestep")
    metrics = metric_states.register(module)
    x, y = tensors(8)
    metric_states.start_step(metrics, "training_step")
    logits = module.net(x)
    for path, metric in metrics.items():
        if "mse" in path:
            metric.update(logits.softmax(-1)[:, 0], (y == 0).float())
        else:
            metric.update(logits, y)
    out = metric_states.end_step(module, metrics, set())
    acc = {name: entry.value for name, entry in out.items()}
    state = SimpleNamespace(loop=loop_state.LoopState(train_epoch=acc))
    return module, metrics, SimpleNamespace(state=state, world_size=1)


def test_a_hook_loads_only_the_metrics_it_uses_and_gives_them_back_as_they_were():
    from purestep.loops.lightning import metric_states

    module, metrics, ctx = _hooked()
    classes = {path: type(m) for path, m in metrics.items()}
    before = {path: dict(metric_states._states(m)) for path, m in metrics.items()}
    kept = ctx.state.loop.train_epoch
    with metric_states.in_hook(metrics, ctx, "on_train_batch_end") as hooked:
        list(module.parameters())  # hashes every submodule: no load for that
        assert isinstance(module.train_acc, torchmetrics.classification.MulticlassAccuracy)
        assert not hooked.saved
        tp = module.train_acc.tp  # a state read directly: the kept one
        seen = float(module.seen_mse.compute())
    assert sorted(hooked.saved) == ["seen_mse", "train_acc"]
    assert torch.equal(tp, kept["torchmetrics/train_acc"].states["tp"])
    assert seen == float(kept["torchmetrics/seen_mse"].compute())
    assert hooked.finish({}) == ({}, {})  # read only: nothing changed
    for path, metric in metrics.items():  # every metric's class and own states back
        assert type(metric) is classes[path]
        now = metric_states._states(metric)
        assert all(now[n] is before[path][n] for n in now), path


def test_a_lazily_loaded_metric_resets_updates_and_copies_as_an_eagerly_loaded_one():
    from purestep.loops.lightning import metric_states

    module, metrics, ctx = _hooked()
    kept = ctx.state.loop.train_epoch
    with metric_states.in_hook(metrics, ctx, "on_train_epoch_end") as hooked:
        module.train_acc.reset()  # its first use: writes the update count before a state
        module.seen_mse.update(torch.ones(2), torch.zeros(2))
        twin = copy.deepcopy(module.train_f1)  # a copy holds the kept states
        assert type(twin) is type(module.train_f1) is torchmetrics.classification.MulticlassF1Score
        assert torch.equal(twin.tp, kept["torchmetrics/train_f1"].states["tp"])
        assert twin._update_count == int(kept["torchmetrics/train_f1"].updates)
    _, changes = hooked.finish({})
    assert changes["torchmetrics/train_acc"] is None  # reset: nothing kept
    mse = changes["torchmetrics/seen_mse"]
    old = kept["torchmetrics/seen_mse"]
    assert int(mse.updates) == int(old.updates) + 1
    assert float(mse.states["total"]) == float(old.states["total"]) + 2
    assert "torchmetrics/train_f1" not in changes  # copied only
