"""tqdm progress bars for the loops: an observer of events, not a pure callback.

Drawing on a terminal is an effect, so the bar is not a ``Callback`` with state in the
training state: the driver calls ``on_event(event, ctx)`` after each event and the bar draws.
One training bar (``Epoch N``, reset every epoch, showing the progress-bar metrics from
``ctx.extra["progress_bar_metrics"]``), and a bar per validation, sanity-check, test and
predict run. Bars redraw every ``refresh_rate`` batches (and on the last one: Lightning's
rule); the default bar (``ProgressBar()``, no rate given) redraws at every batch but at most
every ``min_interval`` (0.1) seconds, while an explicit rate, ``refresh_rate=1`` included,
redraws exactly every that many batches. Between redraws a batch costs a modulo (and a clock
read when throttled).

``ProgressBarBase`` is what the Trainer recognises in ``callbacks=[...]`` and uses instead of
its default bar (``ProgressBar`` here, ``RichProgressBar`` in ``rich_progress``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from torch import Tensor
from tqdm import tqdm

from ..events import Context, Stage

__all__ = ["ProgressBar", "ProgressBarBase"]

_EVAL_DESCRIPTIONS = {
    Stage.SANITY_CHECK: "Sanity Checking",
    Stage.VALIDATE: "Validation",
    Stage.TEST: "Testing",
    Stage.PREDICT: "Predicting",
}


def total_batches(num_batches: Any, dataloader_idx: int = 0) -> int | None:
    """A tqdm total from ``ctx.num_batches`` (per dataloader when a sequence; None if unknown)."""
    if isinstance(num_batches, (list, tuple)):
        num_batches = num_batches[dataloader_idx] if dataloader_idx < len(num_batches) else None
    if num_batches is None or (isinstance(num_batches, float) and math.isinf(num_batches)):
        return None
    return int(num_batches)


def _check_refresh_rate(owner: str, refresh_rate: Any) -> int:
    if not isinstance(refresh_rate, int) or isinstance(refresh_rate, bool) or refresh_rate < 0:
        raise ValueError(f"{owner}(refresh_rate={refresh_rate!r}) must be an int >= 0")
    return refresh_rate


def several_dataloaders(ctx: Context) -> bool:
    """Whether an evaluation start event announces several dataloaders."""
    return isinstance(ctx.num_batches, (list, tuple)) and len(ctx.num_batches) > 1


def eval_description(ctx: Context, several: bool = False) -> str:
    """An evaluation bar's title: "Validation", "Sanity Checking", "Testing", "Predicting",
    with " DataLoader i" when there are several dataloaders."""
    description = _EVAL_DESCRIPTIONS.get(ctx.stage or Stage.VALIDATE, "Validation")
    if several or several_dataloaders(ctx) or ctx.dataloader_idx > 0:
        description += f" DataLoader {ctx.dataloader_idx}"
    return description


class ProgressBarBase:
    """An event observer that draws progress (``on_event(event, ctx)``), not a callback.

    A subclass fills ``handlers()`` (event name -> method taking the context). The Trainer
    accepts a ``ProgressBarBase`` in ``callbacks=[...]`` and uses it instead of its default
    bar (``trainer.progress_bar_callback``). ``refresh_rate``: update every this many batches
    (and on the last one), ``0`` disables drawing. Only rank 0 draws.
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        self.refresh_rate = _check_refresh_rate(type(self).__name__, refresh_rate)
        self._handlers: dict[str, Callable[[Context], None]] = dict(self.handlers())

    def handlers(self) -> dict[str, Callable[[Context], None]]:
        """The events this bar draws on, with what it does there."""
        return {}

    @property
    def enabled(self) -> bool:
        return self.refresh_rate > 0

    @property
    def events(self) -> frozenset[str]:
        """The events this bar draws on (the driver builds no context for the others)."""
        return frozenset(self._handlers)

    def on_event(self, event: str, ctx: Context) -> None:
        """Draw what ``event`` changes (events it does not show are ignored)."""
        if not self.enabled or ctx.rank != 0:
            return
        handler = self._handlers.get(event)
        if handler is not None:
            handler(ctx)

    def should_update(self, n: int, total: int | None) -> bool:
        """Lightning's rule: every ``refresh_rate`` batches, and at the last one."""
        return n == total or n % self.refresh_rate == 0


class ProgressBar(ProgressBarBase):
    """tqdm progress bars driven by loop events (``on_event(event, ctx)``).

    ``refresh_rate``: redraw every this many batches and at the last (``0`` disables the
    bars); not given (None), every batch but throttled by ``min_interval``. ``min_interval``:
    at most one redraw per this many seconds besides the last batch (0: every due batch).
    Its default is 0.1 s when no ``refresh_rate`` is given and 0 when one is, so an explicit
    rate, ``refresh_rate=1`` included, redraws exactly every ``refresh_rate`` batches, as in
    Lightning (pass ``min_interval`` as well to throttle it); ``leave``: keep each
    finished epoch's training bar on screen (else one bar is reused and the last epoch's
    stays); ``file``: where to draw (stderr by default). Only rank 0 draws.
    """

    def __init__(
        self,
        refresh_rate: int | None = None,
        leave: bool = False,
        file: IO[str] | None = None,
        min_interval: float | None = None,
    ):
        super().__init__(1 if refresh_rate is None else refresh_rate)
        if min_interval is None:  # only the default bar (no rate given) is throttled
            min_interval = 0.1 if refresh_rate is None else 0.0
        if not min_interval >= 0:
            raise ValueError(f"ProgressBar(min_interval={min_interval!r}) must be >= 0 seconds")
        self.min_interval = float(min_interval)
        self._last_draw = -math.inf
        self.leave = leave
        self.file = file
        self.train_bar: tqdm | None = None
        self.eval_bar: tqdm | None = None
        self._eval_dataloader = 0
        self._several = False  # whether the running evaluation has several dataloaders

    def handlers(self) -> dict[str, Callable[[Context], None]]:
        handlers: dict[str, Callable[[Context], None]] = {
            "on_train_epoch_start": self._train_epoch_start,
            "on_train_batch_end": self._train_batch_end,
            "on_train_epoch_end": self._train_epoch_end,
            "on_train_end": self._train_end,
            "on_exception": self._close_all,
            "teardown": self._close_all,
        }
        for stage in ("validation", "test", "predict"):
            handlers[f"on_{stage}_start"] = self._eval_start
            handlers[f"on_{stage}_batch_end"] = self._eval_batch_end
            handlers[f"on_{stage}_end"] = self._eval_end
        return handlers

    # ----------------------------------------------------------------------- helpers

    def _bar(self, description: str, total: int | None, leave: bool, initial: int = 0) -> tqdm:
        return tqdm(
            desc=description,
            total=total,
            initial=initial,
            leave=leave,
            file=self.file if self.file is not None else sys.stderr,
            dynamic_ncols=self.file is None,
            smoothing=0,
        )

    def _due(self, n: int, total: int | None) -> bool:
        """Redraw every ``refresh_rate`` batches, at most every ``min_interval`` seconds
        (always on the last batch)."""
        if n == total:
            return True
        if not self.should_update(n, total):
            return False
        if not self.min_interval:
            return True
        now = time.monotonic()
        if now - self._last_draw < self.min_interval:
            return False
        self._last_draw = now
        return True

    @staticmethod
    def _show_metrics(bar: tqdm, ctx: Context) -> None:
        metrics = ctx.extra.get("progress_bar_metrics")
        if metrics:
            shown = {k: float(v) if isinstance(v, Tensor) else v for k, v in metrics.items()}
            bar.set_postfix(shown, refresh=False)

    @staticmethod
    def _move(bar: tqdm, n: int) -> None:
        bar.n = n
        bar.refresh()

    # ----------------------------------------------------------------------- training

    def _train_epoch_start(self, ctx: Context) -> None:
        total = total_batches(ctx.num_batches)
        description = f"Epoch {ctx.epoch}"
        initial = ctx.progress.batch_in_epoch
        if self.train_bar is not None and not self.leave:
            bar = self.train_bar
            bar.reset(total=total)
            bar.set_description(description, refresh=False)
            bar.n = initial
            bar.refresh()
            return
        if self.train_bar is not None:
            self.train_bar.close()
        self.train_bar = self._bar(description, total, leave=True, initial=initial)

    def _train_batch_end(self, ctx: Context) -> None:
        bar = self.train_bar
        if bar is None:
            return
        n = ctx.batch_idx + 1 if ctx.batch_idx is not None else bar.n + 1
        if self._due(n, bar.total) or ctx.is_last_batch:
            self._show_metrics(bar, ctx)
            self._move(bar, n)

    def _train_epoch_end(self, ctx: Context) -> None:
        if self.train_bar is not None:
            self._show_metrics(self.train_bar, ctx)
            self.train_bar.refresh()

    def _train_end(self, ctx: Context) -> None:
        if self.train_bar is not None:
            self.train_bar.close()
            self.train_bar = None

    # ----------------------------------------------------------------------- evaluation

    def _eval_start(self, ctx: Context) -> None:
        # the bar is drawn at the first batch, when the number of batches is known
        self._several = several_dataloaders(ctx)
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    def _eval_batch_end(self, ctx: Context) -> None:
        bar = self.eval_bar
        if bar is None or ctx.dataloader_idx != self._eval_dataloader:
            self._eval_dataloader = ctx.dataloader_idx
            total = total_batches(ctx.num_batches, ctx.dataloader_idx)
            title = eval_description(ctx, self._several)
            if bar is None:
                bar = self.eval_bar = self._bar(title, total, leave=False)
            else:
                bar.reset(total=total)
                bar.set_description(title, refresh=False)
        n = ctx.batch_idx + 1 if ctx.batch_idx is not None else bar.n + 1
        if self._due(n, bar.total) or ctx.is_last_batch:
            self._move(bar, n)

    def _eval_end(self, ctx: Context) -> None:
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None
        if self.train_bar is not None and ctx.stage == Stage.VALIDATE and ctx.fn == "fit":
            self._show_metrics(self.train_bar, ctx)
            self.train_bar.refresh()

    def _close_all(self, ctx: Context) -> None:
        for bar in (self.eval_bar, self.train_bar):
            if bar is not None:
                bar.close()
        self.eval_bar = self.train_bar = None
