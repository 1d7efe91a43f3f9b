"""purestep inside Ray Tune: a trial reports metrics and checkpoints, and resumes exactly.

A Tune function trainable runs a ``Trainer.fit`` with ``TuneReportCheckpoint`` among its
callbacks: at each training epoch's end (or each validation) the callback hands the metrics
and the purestep checkpoint of that point to ``ray.tune.report`` (each call is one of the
trial's ``training_iteration`` s, what schedulers such as ``ASHAScheduler`` count and compare).
A trial that Tune restarts (``FailureConfig(max_failures=N)`` after a crash, a paused PBT
trial, ``Tuner.restore`` of an interrupted experiment) gets its last reported checkpoint
back from ``ray.tune.get_checkpoint()``; ``fit(ckpt_path=tune_ckpt_path())`` resumes from
it exactly (data position, random keys, optimizer and loop state), so the trial ends bitwise
equal to one never interrupted.

How the report waits for its checkpoint, and why it comes in two halves (a pure callback
that asks for the file, an observer that reports it), is ``ray_train``'s: see there.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import ray.tune

from purestep.loops.events import Context

from .ray_train import RayReporter, ckpt_path_from, latest_checkpoint, remove_staged

__all__ = ["TuneReportCheckpoint", "tune_ckpt_path", "tune_report"]


def _trial_id() -> str | None:
    """This process's Tune trial, None outside a Tune trial (Ray warns there; quietly)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ray.tune.get_context().get_trial_id()


class TuneReportCheckpoint(RayReporter):
    """``ray.tune.report(metrics, checkpoint=...)`` at each epoch's end (``on="epoch"``) or
    validation (``on="validation"``) of a fit, with the purestep checkpoint of that point.

    ``metrics``: the names to report (default: every value the callbacks see), or a
    mapping ``reported name -> metric name``; ``epoch`` and ``step`` are always added. Pass
    ``report.callbacks()`` (or ``tune_report(...)``) to the Trainer's ``callbacks``. Outside
    a Tune trial ``fit`` fails at its start with a RuntimeError saying so.
    """

    def __init__(
        self,
        metrics: str | list[str] | Mapping[str, str] | None = None,
        on: str = "epoch",
        name: str = "tune",
    ) -> None:
        super().__init__(metrics, on, name)

    def check_session(self, ctx: Context) -> None:
        if _trial_id() is None:
            raise RuntimeError(
                "TuneReportCheckpoint reports to Ray Tune, but this fit does not run in a "
                "Tune trial: call it inside the function given to ray.tune.Tuner (in a "
                "Ray Train worker, use RayTrainReport)"
            )
        if ctx.world_size != 1:
            raise RuntimeError(
                f"TuneReportCheckpoint reports one process's trial, but this fit runs "
                f"{ctx.world_size} processes: to tune a data-parallel run, give Tune a "
                "ray.train.torch.TorchTrainer whose workers use RayTrainReport"
            )

    def send(self, metrics: dict[str, Any], folder: str, ctx: Context) -> None:
        try:
            ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(folder))
        finally:  # copied to the trial's storage by then; a stopped trial leaves by SystemExit
            remove_staged(folder)


def tune_report(
    metrics: str | list[str] | Mapping[str, str] | None = None,
    on: str = "epoch",
) -> list[Any]:
    """``TuneReportCheckpoint(metrics, on).callbacks()``: the two objects to pass to the
    Trainer's ``callbacks``."""
    return TuneReportCheckpoint(metrics, on).callbacks()


def tune_ckpt_path(checkpoint: Any = None) -> str | None:
    """The ``ckpt_path`` for ``Trainer.fit`` in a Tune trial: the purestep file of
    ``checkpoint`` (default ``ray.tune.get_checkpoint()``, the trial's last reported one,
    given to a restarted trial), or None when there is none (a fresh trial)."""
    if checkpoint is None:
        if _trial_id() is None:
            raise RuntimeError(
                "tune_ckpt_path() reads the checkpoint Ray Tune gives a restarted trial: "
                "call it inside the function given to ray.tune.Tuner"
            )
        checkpoint = latest_checkpoint(
            ray.tune.get_checkpoint, "tune_ckpt_path() runs inside a Ray Tune trial"
        )
    return ckpt_path_from(checkpoint, "ray.tune.get_checkpoint()")
