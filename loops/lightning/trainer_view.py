"""``self.trainer`` of a Lightning-style module: a read-only view of the running Trainer.

The counters a step may read (``current_epoch``, ``global_step``, the stage flags) are those
of the state the loop is processing, recorded by the adapter at each event, so a step that
reads them stays a function of the state (a resumed run sees what the uninterrupted one
saw). Everything else is the ``purestep.Trainer``'s own attribute of the same name
(Lightning's: ``max_epochs``, ``max_steps``, ``estimated_stepping_batches``,
``num_training_batches``, ``world_size``, ``global_rank``, ``is_global_zero``, ``logger``,
``loggers``, ``callback_metrics``, ``log_dir``, ...). Setting an attribute is refused,
except Lightning's ``self.trainer.should_stop = True``, which becomes a stop request.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TrainerView"]

_STAGE_FLAGS = {
    "training": ("train",),
    "validating": ("validate",),
    "testing": ("test",),
    "predicting": ("predict",),
    "sanity_checking": ("sanity_check",),
}


class TrainerView:
    """What a module's ``self.trainer`` returns while the purestep Trainer runs it."""

    __slots__ = ("_trainer", "epoch", "live", "stage", "step", "stop_requested")

    def __init__(self, trainer: Any, *, live: bool = False) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "epoch", 0)
        object.__setattr__(self, "step", 0)
        object.__setattr__(self, "stage", None)
        object.__setattr__(self, "stop_requested", False)
        #: read the counters from the trainer's latest state at each access, not from the
        #: last ``observe`` (a data module's view: its hooks run between the loop's steps)
        object.__setattr__(self, "live", live)

    def observe(self, progress: Any, stage: str | None) -> None:
        """Record the state's counters and the stage at an event (the adapter calls it)."""
        object.__setattr__(self, "epoch", int(progress.epoch))
        object.__setattr__(self, "step", int(progress.step))
        object.__setattr__(self, "stage", stage)

    def observe_latest(self) -> None:
        """Record the counters of the trainer's latest state (before a dataloader hook:
        a reload at an epoch's start sees that epoch, as in Lightning)."""
        trainer = self._trainer
        object.__setattr__(self, "epoch", int(trainer.current_epoch))
        object.__setattr__(self, "step", int(trainer.global_step))

    def take_stop(self) -> bool:
        """Whether ``should_stop = True`` was set since the last call."""
        asked = self.stop_requested
        object.__setattr__(self, "stop_requested", False)
        return asked

    @property
    def current_epoch(self) -> int:
        return int(self._trainer.current_epoch) if self.live else self.epoch

    @property
    def global_step(self) -> int:
        return int(self._trainer.global_step) if self.live else self.step

    @property
    def is_last_batch(self) -> bool:
        """Whether the training batch the loop is at is its epoch's last (Lightning's: the
        training loop's, during a validation inside it too; True once a -1 ended it)."""
        driver = getattr(self._trainer, "_driver", None)
        position = getattr(driver, "train_position", None)
        return position is not None and position.is_last

    @property
    def lightning_module(self) -> Any:
        task = getattr(self._trainer, "_task", None)
        return getattr(task, "module", None)

    @property
    def should_stop(self) -> bool:
        return self.stop_requested or bool(getattr(self._trainer, "should_stop", False))

    def __getattr__(self, name: str) -> Any:
        for flag, stages in _STAGE_FLAGS.items():
            if name == flag:
                stage = self._trainer.stage if self.live else self.stage
                return stage in stages
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(self._trainer, name)
        except AttributeError:
            config = getattr(self._trainer, "config", None)
            if config is not None and hasattr(config, name):  # max_epochs, max_steps, ...
                return getattr(config, name)
            raise AttributeError(
                f"self.trainer has no attribute {name!r} under purestep.Trainer (the Trainer "
                "offers Lightning's public properties; see the 'Coming from Lightning' guide)"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "should_stop":
            if value:
                object.__setattr__(self, "stop_requested", True)
            return
        raise AttributeError(
            f"self.trainer.{name} is read-only under purestep.Trainer: the run is configured by "
            "the Trainer's flags and changed through callbacks' requests"
        )

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        epoch, step = self.current_epoch, self.global_step
        return f"TrainerView({self._trainer!r}, epoch={epoch}, step={step})"
