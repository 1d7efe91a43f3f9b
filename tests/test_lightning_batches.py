"""Where a Lightning-style module's steps and batch hooks are: the batch index and the
dataloader index they get, and what a step or hook may do to the batches (return None to
skip one, return -1 from ``on_train_batch_start`` to end the epoch), each compared with
Lightning's own Trainer on the same module, weights and data."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import purestep
from purestep.engine import tree
from tests.lightning_models import QUIET, base_class

pl = pytest.importorskip("lightning.pytorch")
# the modules record what they see in a Python attribute (the warning about it is tested in
# tests/test_lightning_module.py)
pytestmark = pytest.mark.filterwarnings("ignore:.*changed the Python attributes:UserWarning")


def _data(n: int = 12, batch: int = 4, seed: int = 3) -> DataLoader:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x), batch_size=batch)


def _both(make: type, fit: dict[str, Any], flags: dict[str, Any], tmp_path) -> tuple:
    """``(lightning's module and trainer, purestep's module and trainer)`` after fitting two
    modules with the same initial weights on the same data."""
    purestep.seed_everything(0)
    theirs = make()
    ours = make()
    ours.load_state_dict(theirs.state_dict())
    lightning_trainer = pl.Trainer(
        accelerator="cpu", default_root_dir=tmp_path / "l", **QUIET, **flags
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_trainer.fit(theirs, **fit)
    trainer = purestep.Trainer(default_root_dir=tmp_path / "p", **QUIET, **flags)
    trainer.fit(ours, **fit)
    return (theirs, lightning_trainer), (ours, trainer)


def _recorder(base: str) -> type:
    class Recorder(base_class(base)):
        """Records the indexes its evaluation steps and batch hooks get."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)
            self.seen: list[tuple] = []

        def training_step(self, batch, batch_idx):
            (x,) = batch
            self.seen.append(("training_step", batch_idx, self.trainer.is_last_batch))
            return self.layer(x).pow(2).mean()

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            (x,) = batch
            self.seen.append(("validation_step", batch_idx, dataloader_idx))
            self.log("val_loss", self.layer(x).pow(2).mean())

        def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
            self.seen.append(("on_validation_batch_start", batch_idx, dataloader_idx))

        def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
            self.seen.append(("on_validation_batch_end", batch_idx, dataloader_idx))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Recorder


@pytest.mark.bitwise
def test_several_validation_loaders_pass_the_dataloader_index(tmp_path):
    """Two validation dataloaders of different lengths: the steps and the batch hooks get
    Lightning's (batch_idx, dataloader_idx), and the epoch values are named and valued as
    Lightning's (``val_loss/dataloader_idx_<k>``)."""
    fit = {"train_dataloaders": _data(), "val_dataloaders": [_data(6, 3, 4), _data(8, 2, 5)]}
    flags = {"max_epochs": 1, "num_sanity_val_steps": 0}
    (theirs, lt), (ours, pt) = _both(_recorder("lightning"), fit, flags, tmp_path)
    assert ours.seen == theirs.seen
    assert ("validation_step", 3, 1) in ours.seen  # the second loader's last batch
    assert ("training_step", 2, True) in ours.seen  # self.trainer.is_last_batch
    expected = {k: float(v) for k, v in lt.callback_metrics.items()}
    assert {k: float(v) for k, v in pt.callback_metrics.items()} == expected
    assert set(expected) == {"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"}
    assert tree.trees_equal(dict(ours.state_dict()), dict(theirs.state_dict()))


def test_one_validation_loader_passes_no_dataloader_index(tmp_path):
    """With one dataloader Lightning passes no ``dataloader_idx``: a step that does not take
    one works."""

    class Plain(_recorder("purestep")):
        def validation_step(self, batch, batch_idx):
            (x,) = batch
            self.seen.append(("validation_step", batch_idx))
            self.log("val_loss", self.layer(x).pow(2).mean())

    model = Plain()
    trainer = purestep.Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET)
    trainer.fit(model, _data(), _data(6, 3))
    assert [s for s in model.seen if s[0] == "validation_step"] == [
        ("validation_step", 0),
        ("validation_step", 1),
    ]
    assert model.seen[:3] == [("training_step", i, i == 2) for i in range(3)]


def _skipping(base: str, skip: tuple[int, ...]) -> type:
    class Skipping(base_class(base)):
        """Returns None (skips the batch) at the batch indexes ``skip``; logs before."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            loss = (self.layer(x) - 1).pow(2).mean()
            self.log("seen", float(batch_idx), on_epoch=True, reduce_fx="max")
            return None if batch_idx in skip else loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    return Skipping


@pytest.mark.bitwise
@pytest.mark.parametrize(
    ("accumulate", "skip"),
    [(1, (1, 4)), (2, (1, 4, 5)), (3, (0, 1, 2, 4))],
    ids=["every-batch", "partial-and-whole-windows", "first-window-whole"],
)
def test_training_step_returning_none_skips_the_batch(tmp_path, accumulate, skip):
    """``training_step`` returning None: no gradient from that batch, the window steps with
    what the others gave (none at all: no update, Adam's step count unchanged), the global
    step counts on; the weights, the optimizer step and the logged values are Lightning's."""
    fit = {"train_dataloaders": _data(24, 4)}
    flags = {"max_epochs": 2, "accumulate_grad_batches": accumulate}
    (theirs, lt), (ours, pt) = _both(_skipping("lightning", skip), fit, flags, tmp_path)
    assert tree.trees_equal(dict(ours.state_dict()), dict(theirs.state_dict()))
    assert pt.global_step == lt.global_step == 2 * -(-6 // accumulate)
    steps = [int(s["step"]) for s in lt.optimizers[0].state_dict()["state"].values()]
    assert steps and all(n < pt.global_step for n in steps)  # whole windows did not step
    assert {k: float(v) for k, v in pt.callback_metrics.items()} == {
        k: float(v) for k, v in lt.callback_metrics.items()
    }


@pytest.mark.parametrize("at", [0, 2], ids=["first-batch", "after-the-graph-ran"])
def test_a_skipped_batch_is_refused_where_it_cannot_be_honoured(tmp_path, at):
    """Under ``compile=True`` the step is traced, and a skipped batch has no gradient graph:
    the error says what skipping needs instead of failing in the compiler (also once the
    traced graph has run), and a validation step cannot skip."""
    model = _skipping("purestep", (at,))()
    trainer = purestep.Trainer(max_epochs=1, compile={"backend": "eager"}, **QUIET)
    with pytest.raises(ValueError, match="skipped its batch") as caught:
        trainer.fit(model, _data(16, 4))
    assert "dynamo" not in str(caught.value)


# ---------------------------------------------------------------------- the engine's step


@pytest.mark.bitwise
@pytest.mark.parametrize("grad", ["autograd", "func"])
def test_an_engine_loss_function_returning_none_skips_its_batch(grad):
    """The engine's own step: a loss function returning ``engine.SKIP`` (or ``(SKIP,
    metrics)``) makes no update and reports no loss; the state equals one that never saw
    that batch, except for the counters. The functional-gradient form cannot skip and says
    so, and a loss function returning None (a forgotten ``return``) is an error."""
    from purestep import engine
    from purestep.engine import optim

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    skipped = {id(batches[1]), id(batches[2])}

    def loss_fn(apply, x):
        loss = apply(x).pow(2).mean()
        if id(x) in skipped:
            return (engine.SKIP, {"seen": loss.detach()}) if id(x) == id(batches[2]) else SKIP
        return loss

    def plain(apply, x):
        return apply(x).pow(2).mean()

    SKIP = engine.SKIP
    forgetful = engine.train_step(model, lambda apply, x: None, optim.adam(0.1), grad=grad)
    with pytest.raises(TypeError, match="must return a scalar loss tensor"):
        forgetful(engine.init(model, optim.adam(0.1)), batches[0])
    step = engine.train_step(model, loss_fn, optim.adam(0.1), grad=grad)
    reference = engine.train_step(model, plain, optim.adam(0.1))
    state = ref = engine.init(model, optim.adam(0.1))
    if grad == "func":
        with pytest.raises(ValueError, match="skipped its batch"):
            for x in batches:
                state, _ = step(state, x)
        return
    outs = []
    for x in batches:
        state, out = step(state, x)
        outs.append(out)
        if id(x) not in skipped:
            ref, _ = reference(ref, x)
    assert tree.trees_equal(state.params, ref.params)
    assert tree.trees_equal(state.opt_state, ref.opt_state)
    assert state.progress.step == 4 and ref.progress.step == 2
    assert [o.loss is None for o in outs] == [False, True, True, False]
    assert [o.skipped for o in outs] == [False, True, True, False]
    assert set(outs[2].metrics) == {"seen"}


def _ending(base: str) -> type:
    class Ending(_recorder(base)):
        """``on_train_batch_start`` returns -1 at batch 3 of epoch 0 and batch 1 of epoch 2."""

        def on_train_batch_start(self, batch, batch_idx):
            self.seen.append(("on_train_batch_start", self.current_epoch, batch_idx))
            if (self.current_epoch, batch_idx) == (0, 3):
                return -1
            if (self.current_epoch, batch_idx) == (2, 1):
                return torch.tensor(-1)  # Lightning compares with ==: a tensor works too
            return None

        def on_train_epoch_end(self):
            self.seen.append(("on_train_epoch_end", self.current_epoch, self.global_step))

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=0.05)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    return Ending


@pytest.mark.bitwise
@pytest.mark.parametrize("accumulate", [1, 2])
def test_on_train_batch_start_returning_minus_one_ends_the_epoch(tmp_path, accumulate):
    """-1 from ``on_train_batch_start``: that batch and the rest of the epoch are skipped,
    the epoch ends (its hooks and its epoch scheduler run, its end-of-epoch validation does
    not, an open accumulation window is dropped), and the next epoch starts as usual:
    the hooks seen, the global step and the weights are Lightning's."""
    fit = {"train_dataloaders": _data(24, 4), "val_dataloaders": _data(6, 3)}
    flags = {"max_epochs": 3, "num_sanity_val_steps": 0, "accumulate_grad_batches": accumulate}
    (theirs, lt), (ours, pt) = _both(_ending("lightning"), fit, flags, tmp_path)
    assert ours.seen == theirs.seen
    assert ("on_train_batch_start", 0, 4) not in ours.seen
    # epochs 0 and 2 ended early: only epoch 1 validated (two batches)
    assert sum(s[0] == "validation_step" for s in ours.seen) == 2
    assert pt.global_step == lt.global_step
    assert tree.trees_equal(dict(ours.state_dict()), dict(theirs.state_dict()))


# ---------------------------------------------------------------------- the loop's request


def test_an_end_epoch_request_from_a_callback_ends_the_epoch_and_is_refused_elsewhere():
    """``Requests(end_epoch=True)`` is the loop's own form of -1: a callback asking at batch
    2 of every epoch trains two batches per epoch; asked at another event it is an error
    naming the event to ask at (and leaves nothing behind for the next run)."""
    from purestep.loops import Requests
    from purestep.loops.callbacks import LambdaCallback

    def at_two(ctx):
        return Requests(end_epoch=True) if ctx.batch_idx == 2 else None

    def loss(apply, batch):
        (x,) = batch
        return apply(x).pow(2).mean()

    trainer = purestep.Trainer(
        max_epochs=3, callbacks=[LambdaCallback(on_train_batch_start=at_two)], **QUIET
    )
    state = trainer.fit(nn.Linear(4, 2), loss, purestep.engine.optim.sgd(0.1), _data(24, 4))
    assert state.progress.step == 6 and state.progress.epoch == 3

    def always(ctx):
        return Requests(end_epoch=True)

    for event in ("on_train_epoch_start", "on_train_batch_end"):
        trainer = purestep.Trainer(max_epochs=2, callbacks=[LambdaCallback(**{event: always})])
        with pytest.raises(ValueError, match=f"came from {event}.*on_train_batch_start only"):
            trainer.fit(nn.Linear(4, 2), loss, purestep.engine.optim.sgd(0.1), _data(8, 4))
        trainer.callbacks = []  # the same trainer again: nothing of the refused request left
        state = trainer.fit(nn.Linear(4, 2), loss, purestep.engine.optim.sgd(0.1), _data(8, 4))
        assert state.progress.step == 4

    def in_validation(ctx):
        return Requests(end_epoch=True)

    trainer = purestep.Trainer(
        max_epochs=1,
        num_sanity_val_steps=0,
        callbacks=[LambdaCallback(on_validation_batch_start=in_validation)],
        **QUIET,
    )
    with pytest.raises(ValueError, match="ask for it at on_train_batch_start"):
        trainer.fit(nn.Linear(4, 2), loss, purestep.engine.optim.sgd(0.1), _data(8, 4), _data(4, 4))


def test_is_last_batch_is_the_training_loops_as_in_lightning(tmp_path):
    """``self.trainer.is_last_batch`` on unsized training data (known by looking ahead), and
    during a validation inside the epoch (the training loop's flag, as in Lightning)."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            return iter([(torch.randn(4, generator=g),) for _ in range(10)])

    class Flags(_recorder("lightning")):
        def training_step(self, batch, batch_idx):
            self.seen.append(("training_step", batch_idx, self.trainer.is_last_batch))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.seen.append(("validation_is_last", self.trainer.is_last_batch))
            return super().validation_step(batch, batch_idx)

    fit = {
        "train_dataloaders": DataLoader(Stream(), batch_size=4),
        "val_dataloaders": _data(6, 3),
    }
    flags = {"max_epochs": 1, "num_sanity_val_steps": 0, "val_check_interval": 2}
    (theirs, _), (ours, _) = _both(Flags, fit, flags, tmp_path)
    assert ours.seen == theirs.seen
    assert ("training_step", 2, True) in ours.seen
