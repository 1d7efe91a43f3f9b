"""Where a tuned value lives: Lightning's ``lightning_hasattr`` / ``lightning_setattr``.

A learning rate or batch size is looked up, in order, as an attribute of the task, a key of
``task.hparams``, an attribute of the datamodule, a key of ``datamodule.hparams``. Setting
it writes every place that holds it (as Lightning does), so a ``configure_optimizers`` or a
``train_dataloader`` reading any of them sees the new value.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["find_attr", "get_attr", "has_attr", "set_attr"]


def _holders(name: str, owners: tuple[Any, ...]) -> list[tuple[Any, bool]]:
    """``(holder, is_mapping)`` for every place holding ``name``, in lookup order."""
    found: list[tuple[Any, bool]] = []
    for owner in _expanded(owners):
        if owner is None:
            continue
        if name != "hparams" and hasattr(owner, name) and not callable(getattr(owner, name)):
            found.append((owner, False))
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, Mapping) and name in hparams:
            found.append((hparams, True))
    return found


def _expanded(owners: tuple[Any, ...]) -> list[Any]:
    """The owners, with a Lightning-style module's task standing also for its module (its
    ``self.learning_rate`` and ``self.hparams`` are where Lightning's tuner writes)."""
    from ..lightning import LightningTask

    out = []
    for owner in owners:
        if isinstance(owner, LightningTask):
            out.append(owner.module)
        out.append(owner)
    return out


def has_attr(name: str, *owners: Any) -> bool:
    """Whether the task or datamodule (``owners``) holds ``name`` (attribute or hparams)."""
    return bool(_holders(name, owners))


def get_attr(name: str, *owners: Any) -> Any:
    """The value of ``name`` from its first holder (``AttributeError`` when none has it)."""
    holders = _holders(name, owners)
    if not holders:
        raise AttributeError(name)
    holder, mapping = holders[0]
    return holder[name] if mapping else getattr(holder, name)


def set_attr(name: str, value: Any, *owners: Any) -> None:
    """Write ``value`` to every holder of ``name`` (``AttributeError`` when none has it)."""
    holders = _holders(name, owners)
    if not holders:
        raise AttributeError(name)
    for holder, mapping in holders:
        if mapping:
            if not isinstance(holder, MutableMapping):
                raise TypeError(
                    f"cannot set {name!r}: its hparams ({type(holder).__name__}) are read-only"
                )
            holder[name] = value
        else:
            setattr(holder, name, value)


def find_attr(candidates: tuple[str, ...], *owners: Any) -> str | None:
    """The first of ``candidates`` some owner holds, else None."""
    return next((name for name in candidates if has_attr(name, *owners)), None)
