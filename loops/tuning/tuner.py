"""``Tuner(trainer)``: Lightning's tuner over a purestep ``Trainer``.

``Tuner(trainer).lr_find(task, ...)`` and ``Tuner(trainer).scale_batch_size(task, ...)``
take the arguments ``trainer.fit`` takes (the task, or a plain module with ``loss_fn`` and
``optimizer``; the data; ``state`` / ``seed``) plus Lightning's search arguments. Both run
their trials on a private trainer and drop the results, so ``trainer`` and the state are
exactly as they were: the next ``trainer.fit`` starts from the same state it would have
started from without the search, with only the tuned attribute changed.
"""

from __future__ import annotations

from typing import Any

from ..config import LoopConfig
from .batch_size import scale_batch_size as _scale_batch_size
from .lr_finder import LRFinder
from .lr_finder import lr_find as _lr_find

__all__ = ["Tuner"]


class Tuner:
    """The learning-rate finder and the batch-size scaler for ``trainer``."""

    def __init__(self, trainer: Any) -> None:
        # a purestep Trainer is the one whose flags are a LoopConfig (the Trainer module
        # imports this one, so the class itself is not looked up here)
        if not isinstance(getattr(trainer, "config", None), LoopConfig):
            raise TypeError(f"Tuner needs a purestep Trainer, got {type(trainer).__name__}")
        self._trainer = trainer

    def lr_find(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        *,
        datamodule: Any = None,
        method: str = "fit",
        loss_fn: Any = None,
        optimizer: Any = None,
        state: Any = None,
        seed: int | None = None,
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> LRFinder | None:
        """The learning-rate range test (``loops.tuning.lr_finder``); an ``LRFinder`` with
        ``results``, ``suggestion()`` and ``plot()``. ``update_attr`` sets the task's
        learning rate to the suggestion."""
        _check_method(method)
        return _lr_find(
            self._trainer,
            model,
            train_dataloaders,
            val_dataloaders,
            datamodule=datamodule,
            loss_fn=loss_fn,
            optimizer=optimizer,
            state=state,
            seed=seed,
            min_lr=min_lr,
            max_lr=max_lr,
            num_training=num_training,
            mode=mode,
            early_stop_threshold=early_stop_threshold,
            update_attr=update_attr,
            attr_name=attr_name,
        )

    def scale_batch_size(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        *,
        datamodule: Any = None,
        method: str = "fit",
        state: Any = None,
        seed: int | None = None,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
    ) -> int | None:
        """The largest batch size that fits (``loops.tuning.batch_size``), also written to
        the ``batch_arg_name`` attribute."""
        _check_method(method)
        return _scale_batch_size(
            self._trainer,
            model,
            train_dataloaders,
            val_dataloaders,
            datamodule=datamodule,
            state=state,
            seed=seed,
            mode=mode,
            steps_per_trial=steps_per_trial,
            init_val=init_val,
            max_trials=max_trials,
            batch_arg_name=batch_arg_name,
        )


def _check_method(method: str) -> None:
    if method != "fit":
        raise ValueError(f"method={method!r}: this tuner searches for fit only (method='fit')")
