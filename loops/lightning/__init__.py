"""Lightning-style modules under ``purestep.Trainer``: bring a LightningModule unchanged.

``LightningModule`` is purestep's base class with Lightning's module API (for projects that
drop the ``lightning`` dependency); a subclass of the real
``lightning.pytorch.LightningModule`` works the same way. The Trainer wraps either in a
``LightningTask`` (``adapt``): the steps run bound to the state's tensors, ``self.log``
values are the steps' metrics, hooks keep Lightning's signatures, and ``self.trainer`` is a
read-only ``TrainerView``. Nothing here imports ``lightning``.
"""

from __future__ import annotations

from .hooks import is_lightning_module
from .logging import LogBuffer
from .module import AttributeDict, LightningModule, load_from_checkpoint
from .optimizers import convert_optimizers
from .task import LightningTask, adapt
from .trainer_view import TrainerView

__all__ = [
    "AttributeDict",
    "LightningModule",
    "LightningTask",
    "LogBuffer",
    "TrainerView",
    "adapt",
    "convert_optimizers",
    "is_lightning_module",
    "load_from_checkpoint",
]
