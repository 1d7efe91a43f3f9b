"""Stop training after a time budget (Lightning's ``Timer`` / ``Trainer(max_time=...)``).

Time comes from ``ctx.elapsed`` (the driver's clock); the callback never reads a clock.
Training time is the training time restored from the state plus the driver-clock seconds
since this run's ``on_train_start``, so a resumed run continues its budget whether or not
the driver's clock itself restarts at zero. The state records the time of every stage
(``time_elapsed``), so it is saved in checkpoints with the rest of the run.
"""

from __future__ import annotations

import datetime
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

from ..events import NOTHING, Context, Requests, Stage
from .base import Callback

__all__ = ["Timer", "parse_duration"]

_STAGES = (Stage.TRAIN, Stage.SANITY_CHECK, Stage.VALIDATE, Stage.TEST, Stage.PREDICT)
_DURATION = re.compile(r"^(\d+):(\d\d):(\d\d):(\d\d)$")


def parse_duration(duration: Any) -> float | None:
    """``duration`` in seconds: ``"DD:HH:MM:SS"``, a dict of ``timedelta`` arguments, a
    ``timedelta`` or a number of seconds; ``None`` means no limit."""
    if duration is None:
        return None
    if isinstance(duration, str):
        match = _DURATION.match(duration.strip())
        if match is None:
            raise ValueError(
                f"Timer(duration={duration!r}) is not a valid duration: expected a string "
                "DD:HH:MM:SS (days, then two digits each for hours, minutes and seconds)"
            )
        days, hours, minutes, seconds = (int(g) for g in match.groups())
        return datetime.timedelta(
            days=days, hours=hours, minutes=minutes, seconds=seconds
        ).total_seconds()
    if isinstance(duration, Mapping):
        try:
            duration = datetime.timedelta(**duration)
        except TypeError as err:
            raise ValueError(
                f"Timer(duration={dict(duration)!r}) is not a valid duration: the dict must "
                f"hold datetime.timedelta arguments (days, hours, minutes, seconds, ...): {err}"
            ) from None
    if isinstance(duration, datetime.timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, numbers.Real) and not isinstance(duration, bool):
        seconds = float(duration)
    else:
        raise TypeError(
            "Timer(duration=...) must be a 'DD:HH:MM:SS' string, a dict of timedelta arguments, "
            f"a timedelta or a number of seconds, got {type(duration).__name__}"
        )
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(
            f"Timer(duration={duration!r}) must be a finite, non-negative duration "
            "(use duration=None for no limit)"
        )
    return seconds


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


class Timer(Callback):
    """Request a stop once training has run for ``duration``.

    Checked at ``on_fit_start`` (a restored run whose budget is spent trains no epoch), and
    at ``on_train_batch_end`` (``interval="step"``) or ``on_train_epoch_end``
    (``interval="epoch"``). With ``verbose`` the stop comes with a message. Read the times
    with ``time_elapsed(state, stage)`` and ``time_remaining(state, stage)``.
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
        self.duration = parse_duration(duration)
        self.interval = interval
        self.verbose = verbose
        if name is not None:
            self.name = name

    def init(self) -> dict[str, Any]:
        """``time_elapsed``: seconds per stage (train: the whole run's, including restored
        time; others: the latest run of that stage); ``start``: the driver-clock reading at
        the start of each stage's current run; ``offset``: training time before this run."""
        return {
            "time_elapsed": {s: 0.0 for s in _STAGES},
            "start": {s: None for s in _STAGES},
            "offset": 0.0,
        }

    # ----------------------------------------------------------------------- reading

    def time_elapsed(
        self, state: Any, stage: str = Stage.TRAIN, ctx: Context | None = None
    ) -> float:
        """Seconds spent in ``stage``: as of the last event the timer saw, or live at ``ctx``."""
        if ctx is not None and stage == Stage.TRAIN:
            return _train_time(state, ctx)
        if ctx is not None and state["start"].get(stage) is not None:
            return ctx.elapsed - state["start"][stage]
        return state["time_elapsed"][stage]

    def time_remaining(
        self, state: Any, stage: str = Stage.TRAIN, ctx: Context | None = None
    ) -> float | None:
        """Seconds left of the budget (``None`` without a duration)."""
        if self.duration is None:
            return None
        return self.duration - self.time_elapsed(state, stage, ctx)

    # ----------------------------------------------------------------------- events

    def on_fit_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        state = {
            "time_elapsed": state["time_elapsed"],
            "start": {s: None for s in _STAGES},
            "offset": state["time_elapsed"][Stage.TRAIN],
        }
        return state, self._check(state["offset"])

    def on_train_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        start = {**state["start"], Stage.TRAIN: ctx.elapsed}
        return {**state, "start": start, "offset": state["time_elapsed"][Stage.TRAIN]}, NOTHING

    def on_train_batch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        state, elapsed = _record_train(state, ctx)
        return state, self._check(elapsed) if self.interval == "step" else NOTHING

    def on_train_epoch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        state, elapsed = _record_train(state, ctx)
        return state, self._check(elapsed) if self.interval == "epoch" else NOTHING

    def on_train_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        state, _ = _record_train(state, ctx)
        return {**state, "start": {**state["start"], Stage.TRAIN: None}}, NOTHING

    def on_validation_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return _start(state, ctx, ctx.stage or Stage.VALIDATE), NOTHING

    def on_validation_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        state = _end(state, ctx, ctx.stage or Stage.VALIDATE)
        if ctx.fn == "fit" and state["start"][Stage.TRAIN] is not None:
            state, _ = _record_train(state, ctx)
        return state, NOTHING

    def on_test_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return _start(state, ctx, Stage.TEST), NOTHING

    def on_test_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return _end(state, ctx, Stage.TEST), NOTHING

    def on_predict_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return _start(state, ctx, Stage.PREDICT), NOTHING

    def on_predict_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return _end(state, ctx, Stage.PREDICT), NOTHING

    def _check(self, elapsed: float) -> Requests:
        if self.duration is None or elapsed < self.duration:
            return NOTHING
        if not self.verbose:
            return Requests(stop=True)
        text = f"Time limit reached. Elapsed time is {_hms(elapsed)}. Signaling Trainer to stop."
        return Requests(stop=True, messages=(text,))


def _train_time(state: Any, ctx: Context) -> float:
    """Restored training time plus driver-clock seconds since this run's training start."""
    start = state["start"][Stage.TRAIN]
    return state["offset"] + ctx.elapsed - (start if start is not None else 0.0)


def _record_train(state: Any, ctx: Context) -> tuple[Any, float]:
    elapsed = _train_time(state, ctx)
    return {**state, "time_elapsed": {**state["time_elapsed"], Stage.TRAIN: elapsed}}, elapsed


def _start(state: Any, ctx: Context, stage: str) -> Any:
    return {**state, "start": {**state["start"], stage: ctx.elapsed}}


def _end(state: Any, ctx: Context, stage: str) -> Any:
    start = state["start"].get(stage)
    if start is None:
        return state
    return {
        **state,
        "time_elapsed": {**state["time_elapsed"], stage: ctx.elapsed - start},
        "start": {**state["start"], stage: None},
    }
