"""purestep inside Ray Train: the process group Ray formed, reports with checkpoints, resume.

Inside the training function of a ``ray.train.torch.TorchTrainer``, Ray has started one
worker process per rank, set the torchrun variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...) from its own context and formed the default process
group. ``Trainer(strategy="ddp")`` and ``hardware.ddp()`` adopt that group as it is (no
second rendezvous; purestep never destroys a group it did not form), so nothing here
touches the strategy. What this module adds:

* ``RayTrainReport``: hands metrics and a rank-0 purestep checkpoint to
  ``ray.train.report`` at each training epoch's end (or each validation), on every rank
  (Ray requires every worker to report, and the same number of times);
* ``ray_ckpt_path``: the ``ckpt_path`` for ``Trainer.fit`` that resumes from the checkpoint
  Ray hands a restarted worker group (``ray.train.get_checkpoint()``), or None for a fresh
  run.

**Why two halves.** The checkpoint must be the file ``fit(ckpt_path=...)`` resumes from
exactly: a state at a commit point (after the batch, or the epoch, has been fully
processed), written by the Trainer with its metadata. A pure callback, ``SaveForReport``,
asks the Trainer for that file at the report event (``Requests(save=...)``; the Trainer
writes it at the next commit point, and waits for an asynchronous write to finish). The
report itself is an effect, which pure callbacks may not perform, so an observer (a
``loops.profiling.Monitor``) notes the metrics at the report event and hands them to Ray
with the written file at the first event after that commit point (the next batch's or
epoch's start, or the end of training). ``RayTrainReport.callbacks()`` gives both; pass them
in ``Trainer(callbacks=[*report.callbacks(), ...])``, or pass ``ray_train_report()``.

**Exact resume.** With ``FailureConfig(max_failures=N)``, Ray restarts the whole worker
group after a worker dies and ``ray.train.get_checkpoint()`` gives the last reported
checkpoint; ``fit(ckpt_path=ray_ckpt_path())`` continues from it (data position, random
keys, optimizer and loop state), so the run ends bitwise equal to one never interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import ray.train

from purestep.loops.callbacks.base import Callback
from purestep.loops.events import NOTHING, Context, Requests, Stage
from purestep.loops.profiling.monitor import Monitor

__all__ = [
    "CHECKPOINT_FILE",
    "REPORT_EVENTS",
    "RayReporter",
    "RayTrainReport",
    "SaveForReport",
    "ckpt_path_from",
    "ray_ckpt_path",
    "ray_train_report",
]

#: The purestep checkpoint file inside each reported Ray checkpoint directory.
CHECKPOINT_FILE = "checkpoint.ckpt"

#: ``on=`` -> the loop event a report follows.
REPORT_EVENTS = {"epoch": "on_train_epoch_end", "validation": "on_validation_end"}

#: Events that come after the commit point following a report event (where the file the
#: report carries is on disk): the next epoch's or batch's start, the end of training.
_AFTER_COMMIT = frozenset({"on_train_epoch_start", "on_train_batch_start", "on_train_end"})

#: The folder (under the run folder) the checkpoint files are written to before Ray copies
#: them to its storage; each is deleted once reported.
STAGING_FOLDER = "ray_report"


def _check_on(on: str) -> str:
    if on not in REPORT_EVENTS:
        raise ValueError(f"on must be one of {sorted(REPORT_EVENTS)}, got {on!r}")
    return on


def _reports_here(event: str, on: str, ctx: Context) -> bool:
    """Whether ``event`` is a report event: ``on``'s event, during a fit, not the sanity
    check's validation."""
    return event == REPORT_EVENTS[on] and ctx.fn == "fit" and ctx.stage != Stage.SANITY_CHECK


def staging_folder(ctx: Context, name: str) -> str:
    """The folder a report's checkpoint is written to: one per report point of the run
    (epoch and global step), under the run folder (the same on every rank: the Trainer
    carries out rank 0's save requests on every rank)."""
    p = ctx.progress
    kind = "val" if ctx.stage == Stage.VALIDATE else "epoch"
    root = ctx.log_dir or os.getcwd()
    return os.path.join(root, STAGING_FOLDER, name, f"{kind}-epoch={p.epoch}-step={p.step}")


class SaveForReport(Callback):
    """The pure half of a report: at each report event, asks the Trainer to write the
    checkpoint the report will carry (written at the next commit point)."""

    def __init__(self, on: str = "epoch", name: str = "ray") -> None:
        self.on = _check_on(on)
        self.name = f"SaveForReport[{name}]"
        self._folder = name

    def _save(self, event: str, ctx: Context) -> Requests:
        if not _reports_here(event, self.on, ctx):
            return NOTHING
        return Requests(save=(os.path.join(staging_folder(ctx, self._folder), CHECKPOINT_FILE),))

    def on_train_epoch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, self._save("on_train_epoch_end", ctx)

    def on_validation_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, self._save("on_validation_end", ctx)


@dataclasses.dataclass(frozen=True)
class _Pending:
    metrics: dict[str, Any]
    folder: str


def _floats(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Reportable values: tensors of one element as Python floats, the rest left out."""
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        with contextlib.suppress(Exception):
            out[name] = float(value)
    return out


class RayReporter(Monitor):
    """The observer half of a report: notes the metrics at each report event and, once the
    checkpoint is written, calls ``send(metrics, folder, ctx)`` on every rank (subclasses
    say how: ``RayTrainReport``, and ``TuneReportCheckpoint`` for Ray Tune).

    ``metrics``: the names to report (default: every value the callbacks see, Lightning's
    ``callback_metrics``), or a mapping ``reported name -> metric name``. ``epoch`` and
    ``step`` (the global step) are always added.
    """

    def __init__(
        self,
        metrics: str | list[str] | Mapping[str, str] | None = None,
        on: str = "epoch",
        name: str = "ray",
    ) -> None:
        self.on = _check_on(on)
        if isinstance(metrics, str):
            metrics = [metrics]
        if metrics is not None and not isinstance(metrics, Mapping):
            metrics = {m: m for m in metrics}
        self.metrics: Mapping[str, str] | None = metrics
        self.name = name
        self.saver = SaveForReport(on, name)
        self.events = frozenset({"setup", REPORT_EVENTS[on], *_AFTER_COMMIT, "on_exception"})
        self._pending: list[_Pending] = []

    def callbacks(self) -> list[Any]:
        """Both halves, for ``Trainer(callbacks=[...])``: the pure ``SaveForReport`` and this
        observer."""
        return [self.saver, self]

    # ------------------------------------------------------------------ to override

    def check_session(self, ctx: Context) -> None:
        """Raise a RuntimeError saying what is wrong when the run is not in the session
        this reporter reports to."""

    def send(self, metrics: dict[str, Any], folder: str, ctx: Context) -> None:
        """Report ``metrics`` with the checkpoint in ``folder`` (rank 0's to send)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ events

    def on_event(self, event: str, ctx: Context) -> None:
        if event == "setup":
            self._pending = []
            if ctx.fn == "fit":
                self.check_session(ctx)
            return None
        if event == "on_exception":  # what was not reported is not: the run failed
            self._pending = []
            return None
        if _reports_here(event, self.on, ctx):
            self._pending.append(_Pending(self._selected(ctx), staging_folder(ctx, self.name)))
            return None
        # Under several processes a point inside an open accumulation window is no commit
        # point (the save waits for the next one): the same on every rank.
        if self._pending and (ctx.world_size == 1 or ctx.progress.micro_step == 0):
            pending, self._pending = self._pending, []
            for report in pending:
                staged = os.path.join(report.folder, CHECKPOINT_FILE)
                if ctx.rank == 0 and not os.path.exists(staged):
                    raise RuntimeError(
                        f"{type(self).__name__} found no checkpoint to report at {staged}: "
                        "pass report.callbacks() (SaveForReport and the reporter) to the "
                        "Trainer's callbacks, not the reporter alone"
                    )
                self.send(report.metrics, report.folder, ctx)
        return None

    def _selected(self, ctx: Context) -> dict[str, Any]:
        seen = _floats(ctx.metrics)
        if self.metrics is None:
            chosen = seen
        else:
            missing = sorted(m for m in self.metrics.values() if m not in seen)
            if missing:
                raise KeyError(
                    f"{type(self).__name__} reports {missing} but the run has not logged "
                    f"{'it' if len(missing) == 1 else 'them'} by {REPORT_EVENTS[self.on]}; "
                    f"logged: {sorted(seen)}"
                )
            chosen = {out: seen[m] for out, m in self.metrics.items()}
        return {**chosen, "epoch": ctx.progress.epoch, "step": ctx.progress.step}


def remove_staged(folder: str) -> None:
    """Delete a report's checkpoint folder once Ray has copied it to its storage, and the
    staging folders above it that this leaves empty."""
    shutil.rmtree(folder, ignore_errors=True)
    parent = os.path.dirname(folder)  # <run>/ray_report/<name>, then <run>/ray_report
    for _ in range(2):
        try:
            os.rmdir(parent)
        except OSError:  # not empty (another report's), or gone
            return
        parent = os.path.dirname(parent)


class RayTrainReport(RayReporter):
    """``ray.train.report(metrics, checkpoint=...)`` at each epoch's end (``on="epoch"``) or
    validation (``on="validation"``), on every rank, with rank 0's purestep checkpoint.

    Use it in the training function of a ``ray.train.torch.TorchTrainer`` with
    ``Trainer(strategy="ddp")`` (or ``hardware.ddp()``) and resume with
    ``fit(..., ckpt_path=ray_ckpt_path())``. Outside a Ray Train worker, or with a Trainer
    that runs fewer processes than Ray started, ``fit`` fails at its start with a
    RuntimeError saying so.
    """

    def check_session(self, ctx: Context) -> None:
        try:
            context = ray.train.get_context()
        except (RuntimeError, DeprecationWarning) as err:
            raise RuntimeError(
                "RayTrainReport reports to Ray Train, but this fit does not run in a Ray "
                "Train worker: call it inside the training function of a "
                "ray.train.torch.TorchTrainer (under Ray Tune, use TuneReportCheckpoint). "
                f"Ray said: {err}"
            ) from None
        workers = context.get_world_size()
        if workers != ctx.world_size or context.get_world_rank() != ctx.rank:
            raise RuntimeError(
                f"Ray Train started {workers} worker(s) and this is rank "
                f"{context.get_world_rank()}, but the Trainer runs as rank {ctx.rank} of "
                f"{ctx.world_size}: give the Trainer strategy='ddp' (or hardware.ddp()), "
                "which joins the process group Ray formed"
            )

    def send(self, metrics: dict[str, Any], folder: str, ctx: Context) -> None:
        checkpoint = None
        if ctx.rank == 0:
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint)
        if ctx.rank == 0:  # Ray has copied it to its storage
            remove_staged(folder)


def ray_train_report(
    metrics: str | list[str] | Mapping[str, str] | None = None,
    on: str = "epoch",
) -> list[Any]:
    """``RayTrainReport(metrics, on).callbacks()``: the two objects to pass to the
    Trainer's ``callbacks``."""
    return RayTrainReport(metrics, on).callbacks()


def ckpt_path_from(checkpoint: Any, where: str = "Ray") -> str | None:
    """The purestep checkpoint file inside a Ray ``Checkpoint`` (None for None): its own
    path on a local filesystem, else a local copy (``Checkpoint.to_directory``)."""
    if checkpoint is None:
        return None
    import pyarrow.fs

    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        folder = checkpoint.path
    else:
        folder = checkpoint.to_directory()
    path = os.path.join(folder, CHECKPOINT_FILE)
    if not os.path.exists(path):  # a file, or a sharded run's folder
        raise FileNotFoundError(
            f"the checkpoint {where} gave ({checkpoint.path}) holds no purestep checkpoint "
            f"file {CHECKPOINT_FILE!r}; it holds {sorted(os.listdir(folder))}. Was it "
            "reported by RayTrainReport / TuneReportCheckpoint?"
        )
    return path


def latest_checkpoint(get: Callable[[], Any], what: str) -> Any:
    """``get()`` (Ray's ``get_checkpoint``), its failure outside a session said plainly
    (``what``: where it may be called)."""
    try:
        return get()
    except (RuntimeError, DeprecationWarning) as err:
        raise RuntimeError(f"{what}; Ray said: {err}") from None


def ray_ckpt_path(checkpoint: Any = None) -> str | None:
    """The ``ckpt_path`` for ``Trainer.fit`` in a Ray Train worker: the purestep file of
    ``checkpoint`` (default ``ray.train.get_checkpoint()``, the latest reported one, given
    to a restarted worker group), or None when there is none (a fresh run)."""
    if checkpoint is None:
        checkpoint = latest_checkpoint(
            ray.train.get_checkpoint,
            "ray_ckpt_path() runs in a Ray Train worker, inside the training function of a "
            "ray.train.torch.TorchTrainer (in a Ray Tune trial, use tune_ckpt_path())",
        )
    return ckpt_path_from(checkpoint, "ray.train.get_checkpoint()")
