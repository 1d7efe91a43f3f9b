"""``PyTorchProfiler``: ``torch.profiler`` over the run, our actions labelled.

Every action the loops time becomes a ``torch.profiler.record_function`` range, so the
trace shows ``training_step``, ``[Callback]ModelCheckpoint.on_train_batch_end``,
``[FitLoop].train_dataloader_next``... around torch's own operators. The profiler follows a
``torch.profiler.schedule`` (default: wait 1, warm up 1, record 3 steps, once), advanced by
the run's step action: ``training_step`` under fit, ``validation_step`` / ``test_step`` /
``predict_step`` under validate / test / predict. Each recorded cycle is exported by
``torch.profiler.tensorboard_trace_handler`` into the report folder as
``<stage>-<filename>[-<rank>].<time_ns>.pt.trace.json``: TensorBoard's profiler plugin
(``torch-tb-profiler``) lists it when TensorBoard is pointed at the folder above it (e.g. the
logger's root, where each version folder is a run), and chrome://tracing (or Perfetto) opens
the same JSON file. ``summary()`` is ``key_averages().table(...)`` of the recorded steps.
"""

from __future__ import annotations

import glob
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .base import Profiler

__all__ = ["SORT_KEYS", "STEP_ACTIONS", "PyTorchProfiler"]

#: The action whose end advances the schedule, per stage.
STEP_ACTIONS = {
    "fit": "training_step",
    "validate": "validation_step",
    "test": "test_step",
    "predict": "predict_step",
}
_DEFAULT_SCHEDULE = {"wait": 1, "warmup": 1, "active": 3, "repeat": 1}
#: What ``sort_by_key`` may name (``key_averages().table(sort_by=...)``'s columns).
SORT_KEYS = frozenset(
    f"{self_}{device}_{what}"
    for self_ in ("", "self_")
    for device in ("cpu", "cuda", "device")
    for what in ("time", "time_total", "memory_usage")
    if (self_, what) != ("self_", "time")
) | {"count"}


class PyTorchProfiler(Profiler):
    """``torch.profiler`` with our actions labelled (see the module docstring).

    ``schedule``: a ``torch.profiler.schedule(...)`` callable or a dict of its arguments
    (``wait``, ``warmup``, ``active``, ``repeat``, ``skip_first``; those not given are the
    default's: wait 1, warmup 1, active 3, repeat 1); ``export_to_chrome``:
    write the trace files (``use_gzip`` compresses them); ``row_limit`` / ``sort_by_key`` /
    ``group_by_input_shapes``: the summary table; other keywords (``record_shapes``,
    ``profile_memory``, ``with_stack``, ``activities``, ...) go to ``torch.profiler.profile``.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        *,
        schedule: Callable[[int], Any] | Mapping[str, int] | None = None,
        export_to_chrome: bool = True,
        use_gzip: bool = False,
        row_limit: int = 20,
        sort_by_key: str | None = None,
        group_by_input_shapes: bool = False,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        if schedule is None:
            schedule = dict(_DEFAULT_SCHEDULE)
        if isinstance(schedule, Mapping):
            try:
                schedule = torch.profiler.schedule(**{**_DEFAULT_SCHEDULE, **schedule})
            except TypeError as e:
                raise ValueError(
                    f"schedule={dict(schedule)!r}: not torch.profiler.schedule's arguments "
                    f"(wait, warmup, active, repeat, skip_first): {e}"
                ) from None
        if not callable(schedule):
            raise TypeError(
                f"schedule must be a dict or torch.profiler.schedule(...), got {schedule!r}"
            )
        if sort_by_key is not None and sort_by_key not in SORT_KEYS:
            raise ValueError(
                f"sort_by_key={sort_by_key!r} is not a column of the summary table; one of "
                f"{', '.join(sorted(SORT_KEYS))}"
            )
        for bad in ("schedule", "on_trace_ready"):
            profiler_kwargs.pop(bad, None)
        if "group_by_input_shape" in profiler_kwargs:
            raise TypeError("pass group_by_input_shapes=...")
        if group_by_input_shapes:
            profiler_kwargs.setdefault("record_shapes", True)
        if "acc_events" in inspect.signature(torch.profiler.profile).parameters:
            profiler_kwargs.setdefault("acc_events", True)  # the summary covers every cycle
        self.schedule = schedule
        self.export_to_chrome = export_to_chrome
        self.use_gzip = use_gzip
        self.row_limit = row_limit
        self.sort_by_key = sort_by_key
        self.group_by_input_shapes = group_by_input_shapes
        self.profiler_kwargs = profiler_kwargs
        self.profiler: torch.profiler.profile | None = None
        self._ranges: dict[str, Any] = {}
        self._step_action: str | None = None
        self._events: Any = None
        self.steps = 0

    # ---------------------------------------------------------------- lifecycle

    def setup(self, *args: Any, **kwargs: Any) -> None:
        """Start ``torch.profiler`` for a run (a new one per run)."""
        super().setup(*args, **kwargs)
        self._close()
        self._events = None
        self.steps = 0
        self._step_action = STEP_ACTIONS.get(self._stage or "", "training_step")
        on_trace_ready = None
        folder = self.output_dir()
        if self.export_to_chrome and folder is not None:
            # the folder made without following a planted link (the trace files in it are
            # written by torch.profiler itself)
            from ..loggers.run_files import make_folder  # on use: it imports the loggers

            folder = os.path.abspath(folder)
            make_folder(self.report_base(os.path.join(folder, "trace")), folder)
            on_trace_ready = torch.profiler.tensorboard_trace_handler(
                folder, worker_name=self.prepare_filename(extension=""), use_gzip=self.use_gzip
            )
        self.profiler = torch.profiler.profile(
            schedule=self.schedule, on_trace_ready=on_trace_ready, **self.profiler_kwargs
        )
        self.profiler.__enter__()

    def _close(self) -> None:
        """End open ranges and the profiler (flushing a cycle that is recording)."""
        for rf in reversed(list(self._ranges.values())):
            rf.__exit__(None, None, None)
        self._ranges.clear()
        prof, self.profiler = self.profiler, None
        if prof is not None:
            prof.__exit__(None, None, None)
            inner = getattr(prof, "profiler", None)
            if inner is not None and getattr(inner, "function_events", None) is not None:
                self._events = inner.function_events

    def teardown(self, stage: str | None = None) -> None:
        self._close()

    # ---------------------------------------------------------------- actions

    def start(self, action: str) -> None:
        if action in self._ranges:
            raise ValueError(f"Attempted to start {action} which has already started.")
        rf = torch.profiler.record_function(action)
        rf.__enter__()
        self._ranges[action] = rf

    def stop(self, action: str) -> None:
        rf = self._ranges.pop(action, None)
        if rf is None:
            raise ValueError(
                f"Attempting to stop recording an action ({action}) which was never started."
            )
        rf.__exit__(None, None, None)
        if action == self._step_action and self.profiler is not None:
            self.profiler.step()
            self.steps += 1

    # ---------------------------------------------------------------- reports

    def trace_files(self) -> list[str]:
        """The trace files this profiler's runs wrote in its folder, oldest first."""
        folder = self.output_dir()
        if folder is None:
            return []
        stem = glob.escape(os.path.join(folder, self.prepare_filename(extension="")))
        found = glob.glob(stem + ".*.pt.trace.json") + glob.glob(stem + ".*.pt.trace.json.gz")
        return sorted(found, key=os.path.getmtime)

    def summary(self) -> str:
        self._close()  # the report is the end of the run's profiling
        if self._events is None:
            return (
                f"PyTorchProfiler: no step reached the schedule's recording phase "
                f"({self.steps} {self._step_action or 'step'} call(s)); nothing recorded"
            )
        sort_by = self.sort_by_key or (
            "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        )
        averages = self._events.key_averages(group_by_input_shapes=self.group_by_input_shapes)
        table = averages.table(sort_by=sort_by, row_limit=self.row_limit)
        return f"PyTorchProfiler ({self._stage or 'run'}), the recorded steps:\n{table}"
