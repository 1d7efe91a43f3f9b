"""ProgressBar: what the bars show, drawn into a StringIO."""

from __future__ import annotations

import io
import types
from collections.abc import Mapping

import pytest
import torch
from torch import nn

from purestep import engine
from purestep.engine import optim
from purestep.engine.state import Progress
from purestep.loops.callbacks import ProgressBar, progress_bar
from purestep.loops.events import Context


def _state(epoch=0, batch_in_epoch=0):
    state = engine.init(nn.Linear(2, 1), optim.sgd(0.1))
    return state.replace(progress=Progress(epoch=epoch, batch_in_epoch=batch_in_epoch))


def _ctx(stage="train", fn="fit", state=None, **kw):
    return Context(stage=stage, fn=fn, state=state or _state(), **kw)


def train_epoch(bar, epoch, n, metrics=None, **kw):
    extra = {"progress_bar_metrics": metrics if metrics is not None else {}}
    state = _state(epoch)
    bar.on_event("on_train_epoch_start", _ctx(state=state, num_batches=n, extra=extra, **kw))
    for i in range(n):
        ctx = _ctx(
            state=state, batch_idx=i, num_batches=n, is_last_batch=i == n - 1, extra=extra, **kw
        )
        bar.on_event("on_train_batch_start", ctx)
        bar.on_event("on_train_batch_end", ctx)
    bar.on_event("on_train_epoch_end", _ctx(state=state, num_batches=n, extra=extra, **kw))


def test_train_bar_shows_epoch_counts_and_metrics():
    out = io.StringIO()
    bar = ProgressBar(file=out, min_interval=0)
    train_epoch(bar, 3, 4, {"loss": 0.25, "acc": torch.tensor(0.5)})
    text = out.getvalue()
    assert "Epoch 3" in text and "4/4" in text
    assert "loss=0.25" in text and "acc=0.5" in text
    bar.on_event("on_train_end", _ctx())
    assert bar.train_bar is None


def test_refresh_rate_limits_redraws_and_metric_formatting():
    class Counting(Mapping):
        def __init__(self):
            self.reads = 0

        def __getitem__(self, key):
            return {"loss": 1.5}[key]

        def __len__(self):
            return 1

        def __iter__(self):
            self.reads += 1
            return iter(["loss"])

    metrics = Counting()
    out = io.StringIO()
    bar = ProgressBar(refresh_rate=3, file=out, min_interval=0)
    train_epoch(bar, 0, 7, metrics)
    text = out.getvalue()
    assert "3/7" in text and "6/7" in text and "7/7" in text  # every 3rd and the last batch
    assert "1/7" not in text and "2/7" not in text and "4/7" not in text
    # metrics are read on the three refreshed batches and at the epoch end only
    assert metrics.reads == 4


def test_min_interval_throttles_redraws_but_always_draws_the_last_batch():
    out = io.StringIO()
    bar = ProgressBar(file=out, min_interval=3600)
    train_epoch(bar, 0, 7, {"loss": 1.0})
    text = out.getvalue()
    assert "1/7" in text and "7/7" in text  # the first due batch and the last
    assert not any(f"{n}/7" in text for n in range(2, 7))


def test_validation_and_sanity_bars():
    out = io.StringIO()
    bar = ProgressBar(file=out, min_interval=0)
    for stage, title in [("sanity_check", "Sanity Checking"), ("validate", "Validation")]:
        bar.on_event("on_validation_start", _ctx(stage=stage))
        for i in range(3):
            ctx = _ctx(stage=stage, batch_idx=i, num_batches=3, is_last_batch=i == 2)
            bar.on_event("on_validation_batch_end", ctx)
        assert bar.eval_bar is not None
        bar.on_event("on_validation_end", _ctx(stage=stage))
        assert bar.eval_bar is None
        assert title in out.getvalue() and "3/3" in out.getvalue()


def test_second_dataloader_resets_the_bar():
    out = io.StringIO()
    bar = ProgressBar(file=out, min_interval=0)
    bar.on_event("on_validation_start", _ctx(stage="validate"))
    for dl, n in [(0, 2), (1, 5)]:
        for i in range(n):
            ctx = _ctx(stage="validate", batch_idx=i, dataloader_idx=dl, num_batches=n)
            bar.on_event("on_validation_batch_end", ctx)
    assert "Validation DataLoader 1" in out.getvalue() and "5/5" in out.getvalue()


@pytest.mark.parametrize(
    ("prefix", "stage", "title"),
    [("test", "test", "Testing"), ("predict", "predict", "Predicting")],
)
def test_test_and_predict_bars(prefix, stage, title):
    out = io.StringIO()
    bar = ProgressBar(file=out, min_interval=0)
    bar.on_event(f"on_{prefix}_start", _ctx(stage=stage, fn=stage))
    for i in range(2):
        ctx = _ctx(stage=stage, fn=stage, batch_idx=i, num_batches=2, is_last_batch=i == 1)
        bar.on_event(f"on_{prefix}_batch_end", ctx)
    bar.on_event(f"on_{prefix}_end", _ctx(stage=stage, fn=stage))
    assert title in out.getvalue() and "2/2" in out.getvalue()


def test_validation_metrics_reach_the_train_bar():
    out = io.StringIO()
    bar = ProgressBar(file=out, min_interval=0)
    bar.on_event("on_train_epoch_start", _ctx(num_batches=2))
    bar.on_event("on_validation_start", _ctx(stage="validate"))
    extra = {"progress_bar_metrics": {"val_loss": 0.125}}
    bar.on_event("on_validation_end", _ctx(stage="validate", extra=extra))
    assert "val_loss=0.125" in out.getvalue()


def test_leave_keeps_one_bar_per_epoch():
    kept, reused = ProgressBar(leave=True, file=io.StringIO()), ProgressBar(file=io.StringIO())
    first = {}
    for bar in (kept, reused):
        train_epoch(bar, 0, 2)
        first[id(bar)] = bar.train_bar
        train_epoch(bar, 1, 2)
    assert kept.train_bar is not first[id(kept)]
    assert reused.train_bar is first[id(reused)]
    assert "Epoch 1" in reused.file.getvalue()


def test_resumed_epoch_starts_at_its_data_position():
    out = io.StringIO()
    bar = ProgressBar(file=out, min_interval=0)
    bar.on_event("on_train_epoch_start", _ctx(state=_state(0, 3), num_batches=5))
    assert bar.train_bar.n == 3


def test_unknown_total_and_ignored_events():
    out = io.StringIO()
    bar = ProgressBar(file=out, min_interval=0)
    bar.on_event("on_train_epoch_start", _ctx(num_batches=float("inf")))
    bar.on_event("on_train_batch_end", _ctx(batch_idx=0, num_batches=float("inf")))
    bar.on_event("on_before_optimizer_step", _ctx())  # not drawn
    assert bar.train_bar.total is None and "1it" in out.getvalue()


def test_disabled_and_other_ranks_draw_nothing():
    quiet = [(ProgressBar(refresh_rate=0, file=io.StringIO()), {})]
    quiet.append((ProgressBar(file=io.StringIO()), {"rank": 1}))
    for bar, kw in quiet:
        train_epoch(bar, 0, 3, **kw)
        assert bar.file.getvalue() == "" and bar.train_bar is None


def test_teardown_and_exception_close_the_bars():
    bar = ProgressBar(file=io.StringIO())
    bar.on_event("on_train_epoch_start", _ctx(num_batches=2))
    bar.on_event("on_exception", _ctx())
    assert bar.train_bar is None and bar.eval_bar is None


def test_bad_refresh_rate():
    with pytest.raises(ValueError, match="refresh_rate"):
        ProgressBar(refresh_rate=-1)


# a clock that stands still: every batch comes within any min_interval of the last redraw
_STOPPED_CLOCK = types.SimpleNamespace(monotonic=lambda: 0.0)


@pytest.mark.parametrize("rate", [1, 2, 4])
def test_an_explicit_refresh_rate_redraws_exactly_every_n_batches(rate, monkeypatch):
    """Lightning's rule with no time throttle: an explicit rate, 1 included, is not limited
    by min_interval; only the default bar (no rate given) is."""
    monkeypatch.setattr(progress_bar, "time", _STOPPED_CLOCK)  # every batch within 0.1 s
    bar = ProgressBar(refresh_rate=rate, file=io.StringIO())
    assert bar.refresh_rate == rate and bar.min_interval == 0
    moves = []
    bar._move = lambda tqdm_bar, n: moves.append(n)
    train_epoch(bar, 0, 9)
    assert moves == [n for n in range(1, 10) if n % rate == 0 or n == 9]


def test_the_default_bar_redraws_every_batch_at_most_every_tenth_of_a_second(monkeypatch):
    monkeypatch.setattr(progress_bar, "time", _STOPPED_CLOCK)
    bar = ProgressBar(file=io.StringIO())
    assert bar.refresh_rate == 1 and bar.min_interval == pytest.approx(0.1)
    moves = []
    bar._move = lambda tqdm_bar, n: moves.append(n)
    train_epoch(bar, 0, 9)
    assert moves == [1, 9]  # the first, then the clock stood still until the last
    throttled = ProgressBar(refresh_rate=1, min_interval=0.5)  # asked for explicitly
    assert throttled.min_interval == 0.5


# --------------------------------------------------------------------------- in the Trainer


class _Counting(ProgressBar):
    """Records every redraw of a bar: (its title, the batches it shows)."""

    def __init__(self, **kw):
        super().__init__(file=io.StringIO(), **kw)
        self.moves = []

    def _move(self, bar, n):
        self.moves.append((bar.desc, n))
        super()._move(bar, n)


def _fit_with(callbacks, *, epochs=1, **flags):
    from torch.utils.data import DataLoader, TensorDataset

    from purestep.loops import Trainer
    from tests.helpers import loss_fn, mlp

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
    flags.setdefault("num_sanity_val_steps", 0)
    trainer = Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **flags,
    )
    train, val = DataLoader(data, batch_size=4), DataLoader(data, batch_size=8)
    trainer.fit(mlp(), loss_fn, optim.sgd(0.1), train, val)
    return trainer, (train, val)


@pytest.mark.parametrize(("rate", "train", "val"), [(1, 8, 4), (3, 3, 2), (8, 1, 1)])
def test_refresh_rate_in_callbacks_sets_how_often_the_bar_updates(rate, train, val):
    bar = _Counting(refresh_rate=rate, min_interval=0)
    trainer, _ = _fit_with([bar])
    assert trainer.progress_bar_callback is bar and bar not in trainer.callbacks
    shown = [n for title, n in bar.moves if title == "Epoch 0"]
    validated = [n for title, n in bar.moves if title == "Validation"]
    assert len(shown) == train and len(validated) == val
    assert shown[-1] == 8 and validated[-1] == 4  # the last batch is always drawn
    assert all(n % rate == 0 or n == 8 for n in shown)
    assert "Epoch 0" in bar.file.getvalue()


def test_the_default_bar_and_a_disabled_one():
    from purestep.loops import Trainer

    assert isinstance(Trainer(logger=False).progress_bar_callback, ProgressBar)
    assert Trainer(logger=False, enable_progress_bar=False).progress_bar_callback is None
    quiet = _Counting(refresh_rate=0)
    _fit_with([quiet])
    assert quiet.moves == [] and quiet.file.getvalue() == ""


def test_bad_progress_bar_combinations():
    from purestep.loops import Trainer
    from purestep.loops.callbacks import RichProgressBar

    with pytest.raises(ValueError, match=r"enable_progress_bar=False\) but a ProgressBar"):
        Trainer(logger=False, enable_progress_bar=False, callbacks=[ProgressBar()])
    with pytest.raises(ValueError, match=r"2 progress bars \(ProgressBar, RichProgressBar\)"):
        Trainer(logger=False, callbacks=[ProgressBar(), RichProgressBar()])
    with pytest.raises(TypeError, match="not a callback"):
        Trainer(logger=False, callbacks=[object()])
    with pytest.raises(ValueError, match="refresh_rate"):
        RichProgressBar(refresh_rate=1.5)
    with pytest.raises(ValueError, match="console or console_kwargs"):
        RichProgressBar(console=object(), console_kwargs={"width": 80})


# --------------------------------------------------------------------------- rich


def _console():
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)


def test_rich_bar_renders_every_stage_through_the_trainer():
    from purestep.loops.callbacks import RichProgressBar

    bar = RichProgressBar(refresh_rate=4, console=_console())
    trainer, (train, val) = _fit_with([bar], epochs=2, num_sanity_val_steps=1)
    trainer.validate(dataloaders=val, verbose=False)
    trainer.test(dataloaders=val, verbose=False)
    trainer.predict(dataloaders=[val, train])
    text = bar.console.file.getvalue()
    for title in ("Sanity Checking", "Epoch 0", "Epoch 1", "Validation", "Testing"):
        assert title in text, title
    assert "Predicting DataLoader 0" in text and "Predicting DataLoader 1" in text
    assert "4/8" in text and "8/8" in text and "3/8" not in text  # every 4th batch, and the last
    assert "train_loss" in text  # the progress-bar metrics beside the training task
    assert bar.progress is None  # each run's live display is stopped at its end


def test_rich_bar_by_events_leave_ranks_and_teardown():
    from purestep.loops.callbacks import RichProgressBar

    kept = RichProgressBar(leave=True, console=_console())
    train_epoch(kept, 0, 2, {"loss": torch.tensor(0.25)})
    train_epoch(kept, 1, 2)
    assert len(kept.progress.tasks) == 2  # one task per epoch stays
    assert "loss: 0.25" in kept.console.file.getvalue()
    kept.on_event("on_exception", _ctx())
    assert kept.progress is None
    other = RichProgressBar(console=_console())
    train_epoch(other, 0, 3, rank=1)
    assert other.progress is None and other.console.file.getvalue() == ""


def test_rich_bar_without_rich_says_how_to_install_it(monkeypatch):
    import sys

    from purestep.loops.callbacks import RichProgressBar

    monkeypatch.setitem(sys.modules, "rich.progress", None)
    with pytest.raises(ModuleNotFoundError, match=r"purestep\[rich\]"):
        RichProgressBar()
