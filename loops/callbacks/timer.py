"""Stop training after a time budget (Lightning's ``Timer`` / ``Trainer(max_time=...)``).

Time comes from ``ctx.elapsed``, the driver's training clock, which a resumed run restores
from the checkpoint's metadata; the callback never reads a clock and keeps no time in the
training state.
"""

from __future__ import annotations

import datetime
from typing import Any

from ..config import parse_duration
from ..events import NOTHING, Context, Requests, Stage
from .base import Callback

__all__ = ["Timer", "parse_duration"]  # parse_duration: loops.config's, re-exported

_STAGES = (Stage.TRAIN, Stage.SANITY_CHECK, Stage.VALIDATE, Stage.TEST, Stage.PREDICT)


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


class Timer(Callback):
    """Request a stop once training has run for ``duration``.

    Training time is ``ctx.elapsed``: the driver's clock, which starts at the training start
    (after the sanity check), includes validation inside fit, and includes the time restored
    from a checkpoint's metadata. Nothing time-related is kept in the training state — a
    clock reading is no function of the computation, and a resumed run must end with a
    state bitwise equal to an uninterrupted one. Checked at ``on_fit_start`` (a restored run
    whose budget is spent trains no epoch), and at ``on_train_batch_end``
    (``interval="step"``) or ``on_train_epoch_end`` (``interval="epoch"``). With ``verbose``
    the stop comes with a message. ``time_elapsed(stage)`` / ``time_remaining()`` read the
    times this process saw (evaluation stages timed by the driver's clock of their run).
    """

    def __init__(
        self,
        duration: Any = None,
        interval: str = "step",
        verbose: bool = True,
        name: str | None = None,
    ) -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer(interval={interval!r}) must be 'step' or 'epoch'")
        self.duration = parse_duration(duration, "duration", owner="Timer")
        self.interval = interval
        self.verbose = verbose
        if name is not None:
            self.name = name
        self._elapsed: dict[str, float] = {s: 0.0 for s in _STAGES}
        self._start: dict[str, float | None] = {s: None for s in _STAGES}

    # ----------------------------------------------------------------------- reading

    def time_elapsed(self, stage: str = Stage.TRAIN, ctx: Context | None = None) -> float:
        """Seconds spent in ``stage`` as of the last event seen, or live at ``ctx``."""
        if ctx is not None:
            if stage == Stage.TRAIN:
                return ctx.elapsed
            start = self._start.get(stage)
            if start is not None:
                return ctx.elapsed - start
        return self._elapsed[stage]

    def time_remaining(self, ctx: Context | None = None) -> float | None:
        """Seconds left of the training budget (``None`` without a duration)."""
        if self.duration is None:
            return None
        return self.duration - self.time_elapsed(Stage.TRAIN, ctx)

    # ----------------------------------------------------------------------- events

    def on_fit_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._elapsed[Stage.TRAIN] = ctx.elapsed
        return state, self._check(ctx.elapsed)

    def on_train_batch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._elapsed[Stage.TRAIN] = ctx.elapsed
        return state, self._check(ctx.elapsed) if self.interval == "step" else NOTHING

    def on_train_epoch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._elapsed[Stage.TRAIN] = ctx.elapsed
        return state, self._check(ctx.elapsed) if self.interval == "epoch" else NOTHING

    def on_train_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._elapsed[Stage.TRAIN] = ctx.elapsed
        return state, NOTHING

    def on_validation_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._start[ctx.stage or Stage.VALIDATE] = ctx.elapsed
        return state, NOTHING

    def on_validation_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._end(ctx.stage or Stage.VALIDATE, ctx)
        return state, NOTHING

    def on_test_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._start[Stage.TEST] = ctx.elapsed
        return state, NOTHING

    def on_test_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._end(Stage.TEST, ctx)
        return state, NOTHING

    def on_predict_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._start[Stage.PREDICT] = ctx.elapsed
        return state, NOTHING

    def on_predict_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        self._end(Stage.PREDICT, ctx)
        return state, NOTHING

    def _end(self, stage: str, ctx: Context) -> None:
        start = self._start.get(stage)
        if start is not None:
            self._elapsed[stage] = ctx.elapsed - start
            self._start[stage] = None

    def _check(self, elapsed: float) -> Requests:
        if self.duration is None or elapsed < self.duration:
            return NOTHING
        if not self.verbose:
            return Requests(stop=True)
        text = f"Time limit reached. Elapsed time is {_hms(elapsed)}. Signaling Trainer to stop."
        return Requests(stop=True, messages=(text,))
