"""tqdm progress bars for the loops: an observer of events, not a pure callback.

Drawing on a terminal is an effect, so the bar is not a ``Callback`` with state in the
training state: the driver calls ``on_event(event, ctx)`` after each event and the bar draws.
One training bar (``Epoch N``, reset every epoch, showing the progress-bar metrics from
``ctx.extra["progress_bar_metrics"]``), and a bar per validation, sanity-check, test and
predict run. Bars redraw every ``refresh_rate`` batches and at most every ``min_interval``
seconds; between redraws a batch costs a modulo and a clock read.
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

__all__ = ["ProgressBar"]

_EVAL_DESCRIPTIONS = {
    Stage.SANITY_CHECK: "Sanity Checking",
    Stage.VALIDATE: "Validation",
    Stage.TEST: "Testing",
    Stage.PREDICT: "Predicting",
}


def _total(num_batches: Any, dataloader_idx: int = 0) -> int | None:
    """A tqdm total from ``ctx.num_batches`` (per dataloader when a sequence; None if unknown)."""
    if isinstance(num_batches, (list, tuple)):
        num_batches = num_batches[dataloader_idx] if dataloader_idx < len(num_batches) else None
    if num_batches is None or (isinstance(num_batches, float) and math.isinf(num_batches)):
        return None
    return int(num_batches)


class ProgressBar:
    """Progress bars driven by loop events (``on_event(event, ctx)``).

    ``refresh_rate``: redraw every this many batches (``0`` disables the bars);
    ``min_interval``: at most one redraw per this many seconds (0: every due batch); ``leave``:
    keep each finished epoch's training bar on screen (else one bar is reused and the last
    epoch's stays); ``file``: where to draw (stderr by default). Only rank 0 draws.
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        file: IO[str] | None = None,
        min_interval: float = 0.1,
    ):
        if not isinstance(refresh_rate, int) or isinstance(refresh_rate, bool) or refresh_rate < 0:
            raise ValueError(f"ProgressBar(refresh_rate={refresh_rate!r}) must be an int >= 0")
        if not min_interval >= 0:
            raise ValueError(f"ProgressBar(min_interval={min_interval!r}) must be >= 0 seconds")
        self.refresh_rate = refresh_rate
        self.min_interval = float(min_interval)
        self._last_draw = -math.inf
        self.leave = leave
        self.file = file
        self.train_bar: tqdm | None = None
        self.eval_bar: tqdm | None = None
        self._eval_dataloader = 0
        self._handlers: dict[str, Callable[[Context], None]] = {
            "on_train_epoch_start": self._train_epoch_start,
            "on_train_batch_end": self._train_batch_end,
            "on_train_epoch_end": self._train_epoch_end,
            "on_train_end": self._train_end,
            "on_exception": self._close_all,
            "teardown": self._close_all,
        }
        for stage in ("validation", "test", "predict"):
            self._handlers[f"on_{stage}_start"] = self._eval_start
            self._handlers[f"on_{stage}_batch_end"] = self._eval_batch_end
            self._handlers[f"on_{stage}_end"] = self._eval_end

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
        if n % self.refresh_rate:
            return False
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
        total = _total(ctx.num_batches)
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

    def _eval_description(self, ctx: Context) -> str:
        description = _EVAL_DESCRIPTIONS.get(ctx.stage or Stage.VALIDATE, "Validation")
        several = isinstance(ctx.num_batches, (list, tuple)) and len(ctx.num_batches) > 1
        if several or ctx.dataloader_idx > 0:
            description += f" DataLoader {ctx.dataloader_idx}"
        return description

    def _eval_start(self, ctx: Context) -> None:
        # the bar is drawn at the first batch, when the number of batches is known
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    def _eval_batch_end(self, ctx: Context) -> None:
        bar = self.eval_bar
        if bar is None or ctx.dataloader_idx != self._eval_dataloader:
            self._eval_dataloader = ctx.dataloader_idx
            total = _total(ctx.num_batches, ctx.dataloader_idx)
            if bar is None:
                bar = self.eval_bar = self._bar(self._eval_description(ctx), total, leave=False)
            else:
                bar.reset(total=total)
                bar.set_description(self._eval_description(ctx), refresh=False)
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
