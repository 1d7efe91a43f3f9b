"""Optuna inside purestep: a pruning callback and run folders that survive a restarted study.

``OptunaPruning(trial, monitor="val_loss")`` does for ``Trainer.fit`` what
``optuna_integration.PyTorchLightningPruningCallback`` does for Lightning's Trainer: at
every validation end of a fit (the sanity check excepted) it reports the monitored value to
the trial at ``step = current epoch`` and raises ``optuna.TrialPruned`` when
``trial.should_prune()``. Under DDP rank 0 alone reports and decides; the stop is requested
and agreed by every rank (the Trainer agrees stop requests), and ``check_pruned()`` after
``fit`` raises ``TrialPruned`` on rank 0, as the Lightning callback's ``check_pruned`` does.

Differences from the Lightning callback (on purpose):

* a monitor missing from the validation's values is an error (``strict=True``, the
  default) naming the values that are there; ``strict=False`` warns and skips, as the
  Lightning callback always does;
* only ``fit`` reports: a standalone ``Trainer.validate`` does not (Lightning's callback
  reports it at the trainer's current epoch);
* the reported ``(epoch, value)`` pairs are kept in the callback's state, which checkpoints
  hold: a run resumed from a checkpoint by a *new* trial (a retried one, see
  ``trial_run_dir``) reports the history it restored before training on, so the new trial's
  intermediate values are the ones an uninterrupted trial would have.

Talking to the trial is this callback's effect (the decision depends on other trials in the
storage, outside the training state); everything that influences the run's future (what
was reported) stays in the state.

A study that is killed and restarted continues where it was with an ``RDBStorage`` with a
heartbeat and ``RetryHeartbeatStaleTrialCallback`` (``RetryFailedTrialCallback`` before
optuna 4.9): the restarted process marks the stale trial failed and queues a retry with the
same parameters. ``trial_run_dir(trial, root)`` names the run folder by the *original*
trial's number, so the retry finds its predecessor's checkpoints and
``Trainer.fit(..., ckpt_path="last")`` resumes from the last of them (``resume_path``).
"""

from __future__ import annotations

import numbers
import os
import warnings
from typing import Any

import optuna
import torch
from optuna.storages import RetryHeartbeatStaleTrialCallback

from purestep.engine.state import TrainState

from ..callbacks.base import Callback
from ..events import NOTHING, Context, Requests, Stage

__all__ = ["OptunaPruning", "original_trial_number", "resume_path", "trial_run_dir"]


def _check_trial(trial: Any) -> None:
    if not isinstance(trial, optuna.trial.Trial):
        raise TypeError(
            f"OptunaPruning needs the optuna.trial.Trial the objective received, got "
            f"{type(trial).__name__}"
        )


class OptunaPruning(Callback):
    """Report ``monitor`` to ``trial`` at each validation end; prune when Optuna says so.

    ``strict``: a missing monitor is a ``RuntimeError`` (else a warning, as
    ``optuna_integration``'s callback). The state holds ``steps`` and ``values`` (what was
    reported) and ``pruned_epoch`` (-1 while not pruned).
    """

    monitoring = True

    def __init__(
        self,
        trial: optuna.trial.Trial,
        monitor: str = "val_loss",
        *,
        strict: bool = True,
        name: str | None = None,
    ) -> None:
        _check_trial(trial)
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"OptunaPruning(monitor=...) must be a metric name, got {monitor!r}")
        self.trial = trial
        self.monitor = monitor
        self.strict = bool(strict)
        if name is not None:
            self.name = name

    def init(self) -> dict[str, Any]:
        return {"steps": (), "values": (), "pruned_epoch": -1}

    # ----------------------------------------------------------------------- events

    def on_train_start(self, state: dict[str, Any], ctx: Context) -> tuple[Any, Requests]:
        """A resumed run tells a new trial what its predecessor reported (see module doc)."""
        if ctx.rank == 0 and state["steps"]:
            known = self.trial.storage.get_trial(self.trial._trial_id).intermediate_values
            for step, value in zip(state["steps"], state["values"]):
                if step not in known:
                    self.trial.report(value, step=step)
        return state, NOTHING

    def on_validation_end(self, state: dict[str, Any], ctx: Context) -> tuple[Any, Requests]:
        if ctx.fn != "fit" or ctx.stage == Stage.SANITY_CHECK:
            return state, NOTHING
        if self.monitor not in ctx.metrics:
            message = (
                f"The metric '{self.monitor}' is not in the evaluation logs for pruning. "
                f"Logged: {sorted(ctx.metrics) or 'nothing'}. Please make sure you set the "
                "correct metric name (OptunaPruning(monitor=...))."
            )
            if self.strict:
                raise RuntimeError(message)
            warnings.warn(message, stacklevel=2)
            return state, NOTHING
        value = _scalar(ctx.metrics[self.monitor], self.monitor)
        epoch = ctx.epoch
        new = {**state, "steps": (*state["steps"], epoch), "values": (*state["values"], value)}
        if ctx.rank != 0:  # under DDP rank 0 reports and decides; every rank agrees the stop
            return new, NOTHING
        self.trial.report(value, step=epoch)
        if not self.trial.should_prune():
            return new, NOTHING
        if ctx.world_size == 1:
            raise optuna.TrialPruned(f"Trial was pruned at epoch {epoch}.")
        return {**new, "pruned_epoch": epoch}, Requests(stop=True)

    def check_pruned(self, state: Any) -> None:
        """After a DDP ``fit``: raise ``TrialPruned`` if rank 0 pruned the trial.

        ``state``: the ``TrainState`` fit returned (or this callback's own state)."""
        own = state.callbacks.get(self.key) if isinstance(state, TrainState) else state
        if isinstance(own, dict) and own.get("pruned_epoch", -1) >= 0:
            raise optuna.TrialPruned(f"Trial was pruned at epoch {own['pruned_epoch']}.")


def _scalar(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"OptunaPruning monitors {name!r}, a tensor of shape {tuple(value.shape)}; "
                "it needs one value (under an ensemble, use loops.integrations.sweep())"
            )
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"OptunaPruning monitors {name!r}, which is a {type(value).__name__}")


# --------------------------------------------------------------------------- run folders


def original_trial_number(trial: Any) -> int:
    """The number of the trial this one retries (its own number if it retries none).

    ``trial``: a live ``Trial`` or a ``FrozenTrial`` (a chain of retries gives the first)."""
    if isinstance(trial, optuna.trial.Trial):  # a live trial: its record in the storage
        trial = trial.storage.get_trial(trial._trial_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        number = RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)
    return trial.number if number is None else int(number)


def trial_run_dir(trial: Any, root: str | os.PathLike[str]) -> str:
    """``<root>/trial_<n>``: the run folder of ``trial``, ``n`` its original number.

    A retried trial gets the folder of the trial it retries, so it finds the checkpoints its
    predecessor wrote. Use it as the Trainer's ``default_root_dir``.
    """
    return os.path.join(os.fspath(root), f"trial_{original_trial_number(trial)}")


def resume_path(trial: Any, root: str | os.PathLike[str]) -> str | None:
    """``"last"`` when ``trial``'s run folder holds a checkpoint to resume from, else None.

    Pass it as ``Trainer.fit(..., ckpt_path=resume_path(trial, root))`` with
    ``default_root_dir=trial_run_dir(trial, root)``: a retried trial resumes from the last
    checkpoint of the trial it retries; a new one starts fresh."""
    folder = trial_run_dir(trial, root)
    for _, _, files in os.walk(folder):
        if any(f.endswith(".ckpt") for f in files):
            return "last"
    return None
