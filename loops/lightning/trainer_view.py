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

    __slots__ = ("_trainer", "epoch", "global_step", "stage", "stop_requested")

    def __init__(self, trainer: Any) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "epoch", 0)
        object.__setattr__(self, "global_step", 0)
        object.__setattr__(self, "stage", None)
        object.__setattr__(self, "stop_requested", False)

    def observe(self, progress: Any, stage: str | None) -> None:
        """Record the state's counters and the stage at an event (the adapter calls it)."""
        object.__setattr__(self, "epoch", int(progress.epoch))
        object.__setattr__(self, "global_step", int(progress.step))
        object.__setattr__(self, "stage", stage)

    def take_stop(self) -> bool:
        """Whether ``should_stop = True`` was set since the last call."""
        asked = self.stop_requested
        object.__setattr__(self, "stop_requested", False)
        return asked

    @property
    def current_epoch(self) -> int:
        return self.epoch

    @property
    def is_last_batch(self) -> bool:
        """Whether the batch the loop is at is its epoch's (or its dataloader's) last."""
        driver = getattr(self._trainer, "_driver", None)
        position = driver.position if driver is not None else None
        return position is not None and position.batch_idx + 1 == position.num_batches

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
                return self.stage in stages
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
        return f"TrainerView({self._trainer!r}, epoch={self.epoch}, step={self.global_step})"
