"""Short runs on a private Trainer: what the tuner's sweeps and trials train with.

A trial is an ordinary ``fit`` on a second ``Trainer`` that shares the tuned trainer's
strategy and flags, with the changes the search needs (a step limit, no validation), no
loggers, no checkpointing (not even the preemption checkpoint a SIGTERM writes: a trial is
no run to resume, and its ``last.ckpt`` would be what the real ``fit(ckpt_path="last")``
picks up; the signal keeps its usual effect), no progress bar and only the search's own
callbacks. It starts
from the state the tuned trainer's ``fit`` would start from (the same seed, or the state
given) and its result is dropped: the tuned trainer keeps nothing from it, so there is
nothing to restore afterwards (Lightning saves and reloads a checkpoint around each search).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["trial_trainer"]

#: Trainer settings a trial runs with as the tuned trainer does (compiling, evaluation mode,
#: gradient checks change what a step costs).
_SHARED = ("benchmark", "inference_mode", "compile", "terminate_on_nan", "track_grad_norm")


def _plain_trainer_class(trainer: Any) -> type:
    """``purestep.loops.Trainer``, found on ``trainer``'s class rather than imported
    (``loops.trainer`` imports this package: an import back would close a circle)."""
    for cls in type(trainer).__mro__:
        if cls.__module__ == "purestep.loops.trainer" and cls.__qualname__ == "Trainer":
            return cls
    raise TypeError(f"the Tuner needs a purestep Trainer, got {type(trainer).__name__}")


def trial_trainer(trainer: Any, callbacks: Sequence[Any] = (), **flags: Any) -> Any:
    """A private ``Trainer`` like ``trainer``, its loop flags updated with ``flags``: a plain
    ``Trainer`` even when ``trainer`` is of a subclass (whose ``__init__`` may take other
    arguments, or add callbacks the trials must not run)."""
    inner = _plain_trainer_class(trainer)(
        strategy=trainer.strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        default_root_dir=trainer.default_root_dir,
        deterministic=trainer.deterministic,
        detect_anomaly=trainer.detect_anomaly,
        multiple_trainloader_mode=trainer.multiple_trainloader_mode,
        prepare_data_per_node=trainer.prepare_data_per_node,
        donate_state=trainer.donate_state,
        # no preemption checkpoint: a trial's state is no run to resume, and a last.ckpt
        # in the run folder would be what the real fit's ckpt_path="last" picks up
        preemption_signals=(),
    )
    for name in _SHARED:  # the run's other settings, as the tuned trainer holds them
        if hasattr(trainer, name):
            setattr(inner, name, getattr(trainer, name))
    config = trainer.config.with_flags(**flags)
    inner.config = config
    inner.checkpointing.config = config
    inner._printer = _quiet  # the loop's notes ("fit stopped: ...") would repeat per trial
    inner._clock = trainer._clock
    return inner


def _quiet(text: str) -> None:
    """Drops a trial's messages: the tuner says what each trial found."""
