"""What a ``Trainer`` tells about its runs: Lightning's read-only trainer attributes.

The epoch, step, values callbacks see and stop request of the latest state; the loggers and
run folder; the callbacks of each kind; the batch counts of the current (or last) run after
the ``limit_*`` flags; the process ranks; the best checkpoint's path. ``Trainer`` inherits
them (``TrainerProperties``); they read its ``_loop``, ``_driver``, ``train_state``,
``callbacks``, ``strategy`` and ``config``, and change nothing.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from purestep.engine.state import TrainState

from . import loop_state, schedule
from .callbacks import EarlyStopping, ModelCheckpoint, ProgressBarBase
from .events import Stage
from .trainer_run import TrainerStatus, local_log_dir

__all__ = ["TrainerProperties"]


class TrainerProperties:
    """The read-only attributes of a ``Trainer`` (see the module docstring)."""

    @property
    def stage(self) -> str | None:
        """What the running loop does ("train", "sanity_check", "validate", ...), else None."""
        return self._driver.stage if self._driver is not None else None

    @property
    def interrupted(self) -> bool:
        return self.status == TrainerStatus.INTERRUPTED

    @property
    def _latest(self) -> TrainState | None:
        if self._loop is not None and self._loop.state is not None:
            return self._loop.state
        return self.train_state

    @property
    def current_epoch(self) -> int:
        state = self._latest
        return state.progress.epoch if state is not None else 0

    @property
    def global_step(self) -> int:
        state = self._latest
        return state.progress.step if state is not None else 0

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest values callbacks see (Lightning's ``callback_metrics``)."""
        state = self._latest
        loop = _loop_of(state)
        return dict(loop.callback_metrics) if loop is not None else {}

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        if self._driver is None:
            return {}
        return {k: float(v) for k, v in self._driver.progress_bar_metrics.items()}

    @property
    def should_stop(self) -> bool:
        state = self._latest
        loop = _loop_of(state)
        return loop.should_stop if loop is not None else False

    @property
    def loggers(self) -> list[Any]:
        """The loggers (Lightning's ``trainer.loggers``); empty for a run that leaves the
        default logger out (an evaluation of a checkpoint before the default logger has a
        run folder: ``trainer_run.run_logs``), as with ``logger=False``, until the next
        run starts."""
        return [] if getattr(self, "_skips_loggers", False) else self._loggers

    @loggers.setter
    def loggers(self, loggers: Any) -> None:
        self._loggers = list(loggers)

    @property
    def logger(self) -> Any:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        """The run folder: after a run, the one that run named its files after (rank 0's,
        on every process, as checkpoint paths are); before any run, this process's first
        logger's run folder, else ``default_root_dir``."""
        if self._driver is not None and self._driver.log_dir is not None:
            return self._driver.log_dir
        return local_log_dir(self)

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_primary

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps the configured fit will take (needs a fit in progress or done)."""
        if self._loop is None or self._loop.num_train is None:
            ahead = getattr(self, "_train_ahead", None)
            if ahead is None:
                raise RuntimeError("estimated_stepping_batches needs the training data: call fit()")
            # fit is setting up (configure_optimizers): count the loader it will train on
            from .data import length
            from .trainer_data import train_data

            data = train_data(
                ahead.peek(),
                0,
                strategy=self.strategy,
                mode=self.multiple_trainloader_mode,
                config=self.config,
            )
            return schedule.estimated_stepping_batches(
                self.config, schedule.train_batches(self.config, length(data))
            )
        return schedule.estimated_stepping_batches(self.config, self._loop.num_train)

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first ``ModelCheckpoint`` among the callbacks (None without one)."""
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        """Every ``ModelCheckpoint`` among the callbacks, in order."""
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        """The first ``EarlyStopping`` among the callbacks (None without one)."""
        return next((cb for cb in self.callbacks if isinstance(cb, EarlyStopping)), None)

    @property
    def early_stopping_callbacks(self) -> list[EarlyStopping]:
        """Every ``EarlyStopping`` among the callbacks, in order."""
        return [cb for cb in self.callbacks if isinstance(cb, EarlyStopping)]

    @property
    def progress_bar_callback(self) -> ProgressBarBase | None:
        """The progress bar the runs draw with: the one passed in ``callbacks``, else the
        default ``ProgressBar``; None with ``enable_progress_bar=False``. It is an observer,
        not one of the pure callbacks, so it is not in ``trainer.callbacks``."""
        return self._progress_bar

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every metric the current (or last) run sent to the loggers
        (Lightning's ``logged_metrics``; kept with or without loggers, on every rank)."""
        return dict(getattr(self._driver, "logged_metrics", {}))

    # ------------------------------------------------------------------ batch counts

    @property
    def num_training_batches(self) -> int | float:
        """Training batches per epoch of the current (or last) fit, after
        ``limit_train_batches`` (``math.inf`` for data of unknown length, and before fit)."""
        if self._loop is None or self._loop.num_train is None:
            return math.inf
        return self._loop.num_train

    @property
    def num_val_batches(self) -> list[int | float]:
        """Validation batches per dataloader, after ``limit_val_batches``: those of the
        current (or last) fit while ``trainer.fn == "fit"``, else of the last ``validate``
        (``[]`` before any validation data was loaded)."""
        if self.fn == "fit" and self._loop is not None and self._loop.val_max:
            return list(self._loop.val_max)
        return list(self._num_batches.get("validation", []))

    @property
    def num_test_batches(self) -> list[int | float]:
        """Test batches per dataloader of the last ``test``, after ``limit_test_batches``."""
        return list(self._num_batches.get("test", []))

    @property
    def num_predict_batches(self) -> list[int | float]:
        """Predict batches per dataloader of the last ``predict``, after
        ``limit_predict_batches``."""
        return list(self._num_batches.get("predict", []))

    @property
    def num_sanity_val_steps(self) -> int | float:
        """The sanity check's batches per validation dataloader at most, as computed:
        ``num_sanity_val_steps=-1`` is ``math.inf``, and ``fast_dev_run`` makes it 0."""
        return self.config.num_sanity_val_steps

    @property
    def num_sanity_val_batches(self) -> list[int | float]:
        """Batches per dataloader the last fit's sanity check ran (``[]`` if it ran none)."""
        return list(self._num_batches.get(Stage.SANITY_CHECK, []))

    # ------------------------------------------------------------------ process ranks

    @property
    def world_size(self) -> int:
        """How many processes run this training (all nodes together)."""
        return getattr(self.strategy, "world_size", 1)

    @property
    def global_rank(self) -> int:
        """This process's index among all processes (0 ... ``world_size - 1``)."""
        return getattr(self.strategy, "rank", 0)

    @property
    def local_rank(self) -> int:
        """This process's index among the processes of its node (``LOCAL_RANK``)."""
        return getattr(self.strategy, "local_rank", 0)

    @property
    def node_rank(self) -> int:
        """The index of this process's node: ``NODE_RANK``, else torchrun's ``GROUP_RANK``,
        else SLURM's ``SLURM_NODEID`` (0 for a single process)."""
        if self.world_size == 1:
            return 0
        for var in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID"):
            text = os.environ.get(var)
            if text:
                try:
                    return int(text)
                except ValueError:
                    raise ValueError(f"{var}={text!r} is not an integer") from None
        return 0

    @property
    def best_model_path(self) -> str:
        """The checkpoint callback's best path after fit ("" before any save), absolute, in
        the run folder of ``log_dir`` (the same on every process); what
        ``checkpoint_callback.best_model_path`` shows after this trainer's run."""
        cb, state = self.checkpoint_callback, self._latest
        if cb is None or state is None:
            return ""
        name = state.callbacks.get(cb.key, {}).get("best_model_path", "")
        return cb.shown_path(name, self.log_dir)


def _loop_of(state: TrainState | None) -> Any:
    """The loop state of the trainer's latest state (None before any run)."""
    return loop_state.ready(state).loop if state is not None else None
