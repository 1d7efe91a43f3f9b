"""``purestep.LightningModule``: Lightning's module API without the ``lightning`` package.

Code written against ``lightning.pytorch.LightningModule`` runs on this base class
unchanged (change the import): ``training_step(self, batch, batch_idx)`` and the other step
methods, ``self(x)`` and attribute submodules, ``self.log`` / ``self.log_dict``,
``self.trainer``, ``self.current_epoch``, ``self.global_step``, ``self.device``,
``self.hparams`` with ``save_hyperparameters()``, ``configure_optimizers`` returning torch
optimizers and schedulers, and Lightning's hooks with Lightning's signatures (all no-ops
here, so a subclass overrides the ones it needs). The Trainer runs it through
``LightningTask``, bound to the state's tensors; a subclass of the real
``lightning.pytorch.LightningModule`` is run the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from purestep.engine import checkpoint as ck

from ..task import recorded_hyperparameters

__all__ = ["AttributeDict", "LightningModule", "load_from_checkpoint"]


class AttributeDict(dict):
    """A dict whose keys read as attributes (Lightning's ``self.hparams.lr``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"hparams has no {name!r} (it has {sorted(self)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


class LightningModule(nn.Module):
    """The base class of Lightning-style modules for ``purestep.Trainer`` (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trainer: Any = None
        self._hparams = AttributeDict()
        self._automatic_optimization = True
        self.example_input_array: Any = None

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles leave the trainer behind
        state = dict(self.__dict__)
        state["_trainer"] = None
        for attached in ("log", "log_dict"):
            state.pop(attached, None)
        return state

    # ------------------------------------------------------------------ the trainer

    @property
    def trainer(self) -> Any:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__qualname__} is not attached to a `Trainer`.")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Any) -> None:
        for child in self.children():
            if isinstance(child, LightningModule):
                child.trainer = trainer
        self._trainer = trainer

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        return self.trainer.global_step if self._trainer is not None else 0

    @property
    def automatic_optimization(self) -> bool:
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        for tensor in self.parameters():
            return tensor.dtype
        return torch.get_default_dtype()

    # ------------------------------------------------------------------ logging

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``self.log`` (``loops.lightning.logging``); outside a run it warns and
        does nothing, as Lightning's does without a trainer."""
        warnings.warn(
            f"self.log({name!r}, ...) was called, but {type(self).__name__} is not being run "
            "by a purestep.Trainer",
            stacklevel=2,
        )

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the global-zero process only, as Lightning's ``self.print``."""
        if self._trainer is None or self.trainer.is_global_zero:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ hyper-parameters

    @property
    def hparams(self) -> AttributeDict:
        return self._hparams

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: Sequence[str] | str | None = None,
        frame: Any = None,
        logger: bool = True,
    ) -> None:
        """Record the calling ``__init__``'s arguments in ``self.hparams`` (Lightning's
        rules: names given keep only those, one dict is taken as it is, ``ignore`` leaves
        names out, modules are left out). Values must be plain data, as checkpoints keep
        them; anything else is a ``TypeError`` naming it."""
        import inspect

        found = recorded_hyperparameters(self, frame or inspect.currentframe(), args, ignore)
        self._hparams = AttributeDict(found)

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: str, map_location: Any = None, **overrides: Any
    ) -> Any:
        """A module rebuilt from a purestep checkpoint, as Lightning's classmethod does
        (``load_from_checkpoint`` of this module, which also serves subclasses of the real
        ``lightning.pytorch.LightningModule``)."""
        return load_from_checkpoint(cls, checkpoint_path, map_location=map_location, **overrides)

    # ------------------------------------------------------------------ what users override

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward()")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define training_step")

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Lightning's default: the module on the batch."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define configure_optimizers() (e.g. return "
            "torch.optim.Adam(self.parameters(), lr=1e-3))"
        )

    def configure_callbacks(self) -> Any:
        return []

    def configure_model(self) -> None:
        """Build layers lazily (called at the start of every stage; make it idempotent)."""

    def prepare_data(self) -> None:
        """Download or write data once per node (before ``setup``)."""

    def setup(self, stage: str) -> None:
        """Called before a stage runs ("fit", "validate", "test", "predict")."""

    def teardown(self, stage: str) -> None:
        """Called after a stage ran."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add plain data to ``checkpoint`` (a dict this module's entries are kept in)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Receive what ``on_save_checkpoint`` put in ``checkpoint``."""


def load_from_checkpoint(
    cls: type, checkpoint_path: str, *, map_location: Any = None, **overrides: Any
) -> Any:
    """``cls(**saved hparams, **overrides)`` with a purestep checkpoint's weights: the saved
    hyper-parameters its ``__init__`` takes, then ``on_load_checkpoint`` with what
    ``on_save_checkpoint`` stored, then the parameters and buffers (names and shapes must
    match, or a ``CheckpointError`` says what differs). ``cls`` is the caller's: nothing in
    the file names code to run. Works for ``purestep.LightningModule`` subclasses and for
    subclasses of the real ``lightning.pytorch.LightningModule``, whose own classmethod
    reads Lightning's format only."""
    from ..task import HOOKS_KEY, _init_kwargs

    location = "cpu" if map_location is None else map_location
    loaded, meta = ck.load_payload(
        ck.read(checkpoint_path, map_location=location), url=checkpoint_path
    )
    hparams = meta.get("hparams") or {}
    if not isinstance(hparams, dict):
        raise ck.CheckpointError(f"{checkpoint_path}: its hparams are not a dict")
    ck.check_plain(hparams, "metadata['hparams']", url=checkpoint_path)
    module = cls(**_init_kwargs(cls, hparams, overrides))
    hooks = ck.check_plain(meta.get(HOOKS_KEY) or {}, "hooks", url=checkpoint_path)
    if isinstance(hooks, dict) and isinstance(hooks.get("task"), dict):
        module.on_load_checkpoint(dict(hooks["task"]))
    return ck.files.module_from(
        loaded, module, url=checkpoint_path, to_template=map_location is None
    )


def _noop(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


#: Lightning's loop hooks of a LightningModule (no-ops on the base, overridden by users).
MODULE_HOOKS = (
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
)
for _hook in MODULE_HOOKS:
    setattr(LightningModule, _hook, _noop)
