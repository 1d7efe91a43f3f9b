"""The Trainer's tuning flags (Lightning 1.5's ``auto_lr_find`` / ``auto_scale_batch_size``)
and ``Trainer.tune``, which runs what they ask for."""

from __future__ import annotations

from typing import Any

__all__ = ["check_auto_flags", "tune"]

_BATCH_MODES = ("power", "binsearch")


def check_auto_flags(auto_lr_find: Any, auto_scale_batch_size: Any) -> tuple[Any, Any]:
    """The flags as ``tune`` reads them: ``auto_lr_find`` False, True or the name of the
    learning-rate attribute; ``auto_scale_batch_size`` False, True ("power"), "power" or
    "binsearch". Anything else is refused."""
    if not isinstance(auto_lr_find, (bool, str)) or auto_lr_find == "":
        raise TypeError(
            "auto_lr_find must be a bool or the name of the task's learning-rate attribute, "
            f"got {auto_lr_find!r}"
        )
    if isinstance(auto_scale_batch_size, str):
        if auto_scale_batch_size not in _BATCH_MODES:
            raise ValueError(
                "auto_scale_batch_size must be a bool, 'power' or 'binsearch', got "
                f"{auto_scale_batch_size!r}"
            )
    elif not isinstance(auto_scale_batch_size, bool):
        raise TypeError(
            "auto_scale_batch_size must be a bool, 'power' or 'binsearch', got "
            f"{auto_scale_batch_size!r}"
        )
    return auto_lr_find, auto_scale_batch_size


def tune(
    trainer: Any,
    model: Any,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    *,
    datamodule: Any = None,
    state: Any = None,
    seed: int | None = None,
    scale_batch_size_kwargs: dict[str, Any] | None = None,
    lr_find_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What ``Trainer.tune`` does (see there)."""
    from .tuner import Tuner

    tuner = Tuner(trainer)
    out: dict[str, Any] = {}
    common = {"datamodule": datamodule, "state": state, "seed": seed}
    if trainer.auto_scale_batch_size:
        kwargs = dict(scale_batch_size_kwargs or {})
        if isinstance(trainer.auto_scale_batch_size, str):
            kwargs.setdefault("mode", trainer.auto_scale_batch_size)
        out["scale_batch_size"] = tuner.scale_batch_size(
            model, train_dataloaders, val_dataloaders, **common, **kwargs
        )
    if trainer.auto_lr_find:
        kwargs = dict(lr_find_kwargs or {})
        if isinstance(trainer.auto_lr_find, str):
            kwargs.setdefault("attr_name", trainer.auto_lr_find)
        out["lr_find"] = tuner.lr_find(
            model, train_dataloaders, val_dataloaders, **common, **kwargs
        )
    return out
