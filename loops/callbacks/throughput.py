"""Throughput: batches, samples and items per second, over a window of recent batches.

``Throughput`` is the arithmetic (Lightning's ``lightning.fabric.utilities.throughput.
Throughput`` semantics): it is fed running totals — elapsed seconds, batches, samples, and
optionally items and FLOPs — and ``compute()`` gives the totals (``time``, ``batches``,
``samples``, ``lengths`` / ``items``) and, once ``window_size`` readings are in, the rates over
the window: ``device/batches_per_sec``, ``device/samples_per_sec``, ``device/items_per_sec``,
``device/flops_per_sec``, ``device/mfu``, and with several processes the whole job's
``batches_per_sec``, ``samples_per_sec``, ``items_per_sec``, ``flops_per_sec`` (the per-device
figure times the world size).

``ThroughputMonitor`` measures the loops with it: a ``Monitor`` (an observer: clock readings
are effects and stay out of the ``TrainState``), logged under ``<stage>/<name>``
(``train/device/samples_per_sec``, ``validate/...``, ``test/...``, ``predict/...``). Training
is measured from ``on_train_start``, each batch at ``on_train_batch_end`` and logged at the
batches that close an optimizer step when ``log_every_n_steps`` says so, at the logger step;
the time spent validating is taken out of the training clock. Evaluation and prediction are
measured from their start event and logged every ``log_every_n_steps`` batches at that
stage's running batch count. The sanity check is not measured. On CUDA the clock is read
after ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from purestep.engine.step import batch_size as _batch_size

from .. import schedule
from ..events import Context, Stage
from ..profiling.monitor import Monitor

__all__ = ["Throughput", "ThroughputMonitor"]


class _Window:
    """The last ``maxlen`` readings of a running total, refused if it goes backwards."""

    def __init__(self, name: str, maxlen: int) -> None:
        self.name = name
        self.values: deque[float] = deque(maxlen=maxlen)

    def append(self, value: float) -> None:
        if self.values and value < self.values[-1]:
            raise ValueError(
                f"Throughput: {self.name} is a running total and must not decrease, got "
                f"{value} after {self.values[-1]}"
            )
        self.values.append(value)

    @property
    def full(self) -> bool:
        return len(self.values) == self.values.maxlen

    def delta(self) -> float:
        return self.values[-1] - self.values[0]


class Throughput:
    """Rates over the last ``window_size`` updates (see the module docstring).

    ``available_flops``: one device's peak FLOP/s (for ``device/mfu``); ``world_size``:
    processes in the job (the job-wide rates appear when it is above 1); ``separator``:
    between ``device`` and a name.
    """

    def __init__(
        self,
        available_flops: float | None = None,
        world_size: int = 1,
        window_size: int = 100,
        separator: str = "/",
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 2:
            raise ValueError(
                f"window_size must be an int >= 2 (a rate needs two readings), got {window_size!r}"
            )
        self.available_flops = available_flops
        self.world_size = world_size
        self.window_size = window_size
        self.separator = separator
        self.reset()

    def reset(self) -> None:
        n = self.window_size
        self._time = _Window("time", n)
        self._batches = _Window("batches", n)
        self._samples = _Window("samples", n)
        self._lengths = _Window("lengths", n)
        self._items = _Window("items", n)
        self._flops: deque[float] = deque(maxlen=n)

    @property
    def last_time(self) -> float | None:
        """The latest elapsed time fed in (None before any update)."""
        return self._time.values[-1] if self._time.values else None

    def update(
        self,
        *,
        time: float,
        batches: int,
        samples: int,
        lengths: int | None = None,
        items: int | None = None,
        flops: float | None = None,
    ) -> None:
        """One reading: running totals of elapsed ``time`` (seconds), ``batches``,
        ``samples``, and optionally ``lengths`` (items per sample, summed over batches:
        Lightning's ``length_fn``) or ``items`` (items seen), and this batch's ``flops``."""
        self._time.append(float(time))
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            self._lengths.append(lengths)
        if items is not None:
            self._items.append(items)
        if flops is not None:
            self._flops.append(flops * self.world_size)  # the whole job's

    def compute(self) -> dict[str, float]:
        """The totals, and the rates once the window is full."""
        d = f"device{self.separator}"
        out: dict[str, float] = {}
        if not self._time.values:
            return out
        out["time"] = self._time.values[-1]
        out["batches"] = self._batches.values[-1]
        out["samples"] = self._samples.values[-1]
        if self._lengths.values:
            out["lengths"] = self._lengths.values[-1]
        if self._items.values:
            out["items"] = self._items.values[-1]
        several = self.world_size > 1
        dt = self._time.delta()
        if self._time.full and dt > 0:
            batches = self._batches.delta()
            samples_per_sec = self._samples.delta() / dt
            out[d + "batches_per_sec"] = batches / dt
            out[d + "samples_per_sec"] = samples_per_sec
            if several:
                out["batches_per_sec"] = batches / dt * self.world_size
                out["samples_per_sec"] = samples_per_sec * self.world_size
            items_per_sec = None
            if self._lengths.full and batches > 0:
                items_per_sec = samples_per_sec * self._lengths.delta() / batches
            elif self._items.full:
                items_per_sec = self._items.delta() / dt
            if items_per_sec is not None:
                out[d + "items_per_sec"] = items_per_sec
                if several:
                    out["items_per_sec"] = items_per_sec * self.world_size
        if len(self._flops) == self._flops.maxlen and self._time.full and dt > 0:
            # the first batch's FLOPs were spent before the window's first reading
            flops_per_sec = (sum(self._flops) - self._flops[0]) / dt
            if several:
                out["flops_per_sec"] = flops_per_sec
            out[d + "flops_per_sec"] = flops_per_sec / self.world_size
            if self.available_flops:
                out[d + "mfu"] = flops_per_sec / self.world_size / self.available_flops
        return out


class _Stage:
    """One stage's clock origin, totals and window."""

    def __init__(self, throughput: Throughput, began: float) -> None:
        self.throughput = throughput
        self.began = began
        self.last: float | None = None  # the clock at the latest reading
        self.batches = 0
        self.samples = 0
        self.lengths = 0
        self.items = 0


_STARTS = {
    "on_train_start": Stage.TRAIN,
    "on_validation_start": Stage.VALIDATE,
    "on_test_start": Stage.TEST,
    "on_predict_start": Stage.PREDICT,
}
_BATCH_ENDS = {
    "on_train_batch_end": Stage.TRAIN,
    "on_validation_batch_end": Stage.VALIDATE,
    "on_test_batch_end": Stage.TEST,
    "on_predict_batch_end": Stage.PREDICT,
}


class ThroughputMonitor(Monitor):
    """Log throughput while the loops run (see the module docstring).

    ``batch_size_fn(batch) -> int``: samples in a batch (default: the size of the batch's
    first tensor's first dimension, as the loops count samples). ``length_fn(batch) ->
    int``: items per sample (Lightning's: ``items_per_sec`` is samples per second times the
    average length); or ``items_fn(batch) -> int``: the items in the batch (e.g. the
    non-padding tokens: ``items_per_sec`` is items over time). ``flops_per_batch``: a number
    or a function of the batch (FLOPs per batch per device, e.g. from
    ``torch.utils.flop_counter``); ``available_flops``: one device's peak FLOP/s, for
    ``device/mfu``. ``window_size`` (>= 2, default 100) and ``separator`` as
    ``Throughput``; ``clock``: the time source in seconds (inject a fake one in tests).
    """

    events = frozenset({"setup", *_STARTS, *_BATCH_ENDS, "on_validation_end"})

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        *,
        items_fn: Callable[[Any], int] | None = None,
        flops_per_batch: float | Callable[[Any], float] | None = None,
        available_flops: float | None = None,
        window_size: int = 100,
        separator: str = "/",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        for name, fn in (
            ("batch_size_fn", batch_size_fn),
            ("length_fn", length_fn),
            ("items_fn", items_fn),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function of the batch, got {fn!r}")
        if length_fn is not None and items_fn is not None:
            raise ValueError(
                "pass length_fn (items per sample) or items_fn (items per batch), not both"
            )
        Throughput(window_size=window_size)  # check the window now, not at the first run
        self.batch_size_fn = batch_size_fn or _batch_size
        self.length_fn = length_fn
        self.items_fn = items_fn
        self.flops_per_batch = flops_per_batch
        self.available_flops = available_flops
        self.window_size = window_size
        self.separator = separator
        self.clock = clock
        self._stages: dict[str, _Stage] = {}
        self._counts: dict[str, int] = {}  # evaluation batches per stage in this run
        self._world_size = 1
        self._sync: torch.device | None = None

    def _now(self) -> float:
        if self._sync is not None:
            torch.cuda.synchronize(self._sync)
        return self.clock()

    def on_event(self, event: str, ctx: Context) -> Any:
        if event == "setup":
            self._stages = {}
            self._counts = {}
            self._world_size = ctx.world_size
            self._sync = _cuda_device(ctx)
            return None
        if ctx.stage == Stage.SANITY_CHECK:
            return None
        stage = _STARTS.get(event)
        if stage is not None:
            self._start(stage, ctx)
            return None
        stage = _BATCH_ENDS.get(event)
        if stage is not None:
            return self._batch_end(stage, ctx)
        if event == "on_validation_end" and ctx.fn == "fit":
            train, val = self._stages.get(Stage.TRAIN), self._stages.get(Stage.VALIDATE)
            if train and val and train.last is not None and val.last is not None:
                # validation is not training: from the last training reading to the last
                # validation reading, the training clock stands still (Lightning's rule)
                train.began += val.last - train.last
        return None

    def _start(self, stage: str, ctx: Context) -> None:
        now = self._now()
        throughput = Throughput(
            available_flops=self.available_flops,
            world_size=self._world_size,
            window_size=self.window_size,
            separator=self.separator,
        )
        self._stages[stage] = _Stage(throughput, now)

    def _batch_end(self, stage: str, ctx: Context) -> Any:
        s = self._stages.get(stage)
        if s is None:  # a loop that did not announce the start: begin here
            self._start(stage, ctx)
            s = self._stages[stage]
        batch = ctx.batch
        s.last = now = self._now()
        elapsed = now - s.began
        with torch.inference_mode():  # the user's functions must not build graphs here
            s.samples += int(self.batch_size_fn(batch))
            s.batches += 1
            if self.length_fn is not None:
                s.lengths += int(self.length_fn(batch))
            if self.items_fn is not None:
                s.items += int(self.items_fn(batch))
            flops = self.flops_per_batch
            if callable(flops):
                flops = flops(batch)
        s.throughput.update(
            time=elapsed,
            batches=s.batches,
            samples=s.samples,
            lengths=s.lengths if self.length_fn is not None else None,
            items=s.items if self.items_fn is not None else None,
            flops=None if flops is None else float(flops),
        )
        config = ctx.config
        if stage == Stage.TRAIN:
            stepped = bool(getattr(ctx.outputs, "stepped", True))
            if not stepped:  # measure whole optimizer steps, as Lightning does
                return None
            batches_that_stepped = ctx.progress.step - 1
            if config is not None and not schedule.should_log_step(
                config, batches_that_stepped, ctx.should_stop
            ):
                return None
            return self._named(stage, s)
        count = self._counts[stage] = self._counts.get(stage, 0) + 1
        every = getattr(config, "log_every_n_steps", 1) if config is not None else 1
        if every == 0 or (count % every != 0 and not ctx.is_last_batch):
            return None
        return self._named(stage, s), count

    def _named(self, stage: str, s: _Stage) -> dict[str, float]:
        sep = self.separator
        return {f"{stage}{sep}{k}": float(v) for k, v in s.throughput.compute().items()}


def _cuda_device(ctx: Context) -> torch.device | None:
    """The CUDA device the state lives on (the clock then waits for it), else None."""
    params = getattr(ctx.state, "params", None) or {}
    for p in params.values():
        if isinstance(p, torch.Tensor) and p.device.type == "cuda":
            return p.device
    return None
