"""``Task`` and ``DataModule``: Lightning's shapes for users who prefer classes to functions.

A ``Task`` bundles a module template, its step functions and its optimizer. The steps have
the engine's signature ``fn(apply, batch)`` (``apply`` is the module bound to the state's
tensors) and return a loss, ``(loss, metrics)`` or a dict — they are pure, so the Trainer can
checkpoint, resume and replay them. ``setup(stage)`` / ``teardown(stage)`` are ordinary
methods (download data, build the model). Loop-event handlers (``on_train_epoch_end`` and
the rest) follow the pure callback contract and keep their state under the key ``"task"``.

``Task.wrap(model, loss_fn, optimizer)`` makes a Task out of plain functions, which is what
``Trainer.fit(model, loss_fn, optimizer, ...)`` does: validation and test then use the same
loss function.

A ``DataModule`` groups data preparation and the dataloaders (``prepare_data``, ``setup``,
``train_dataloader``, ``val_dataloader``, ``test_dataloader``, ``predict_dataloader``,
``teardown``), as in Lightning.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from purestep.engine import user_errors

from .callbacks.base import Callback
from .events import EVENTS

__all__ = ["DataModule", "Task", "task_callback"]

StepFn = Callable[[nn.Module, Any], Any]

#: The step methods a Task defines, checked against Lightning's signature.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def default_predict(apply: nn.Module, batch: Any) -> Any:
    """``apply(batch)``, or ``apply(batch[0])`` for ``(inputs, targets)`` batches."""
    if isinstance(batch, (tuple, list)) and batch:
        return apply(batch[0])
    return apply(batch)


class Task:
    """Model + step functions + optimizer + hooks. Subclass it, or use ``Task.wrap``.

    Override ``training_step`` (required), ``validation_step`` / ``test_step`` (validation
    and test run only when defined), ``predict_step`` (default: the model on the inputs),
    ``configure_optimizers`` (an ``engine.optim`` transform), ``configure_model`` (the
    template, if not given to ``__init__``), ``setup`` / ``teardown``. ``hparams`` are logged
    as hyper-parameters at fit start.

    The step methods take ``(self, apply, batch)``; a subclass that defines one Lightning's
    way, ``(self, batch, batch_idx)``, is refused with a ``TypeError`` when it is defined.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in STEP_METHODS:
            attr = cls.__dict__.get(name)
            if isinstance(attr, staticmethod):
                user_errors.check_signature(attr.__func__, name)
            elif isinstance(attr, classmethod):
                user_errors.check_signature(attr.__func__, name, method=True)
            elif inspect.isfunction(attr):  # bound to the instance: skip ``self``
                user_errors.check_signature(attr, name, method=True)
            elif callable(attr):  # a partial or callable object is called as it is
                user_errors.check_signature(attr, name)

    def __init__(self, model: nn.Module | None = None, hparams: dict[str, Any] | None = None):
        self.model = model
        self.hparams = dict(hparams or {})

    # ------------------------------------------------------------------ what users override

    def configure_model(self) -> nn.Module:
        """The module template (called when none was given to ``__init__``)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no model: pass one to Task(model=...) or override "
            "configure_model()"
        )

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must override configure_optimizers() and return an "
            "engine.optim transform (e.g. optim.adamw(1e-3))"
        )

    def training_step(self, apply: nn.Module, batch: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must override training_step")

    def validation_step(self, apply: nn.Module, batch: Any) -> Any:
        raise NotImplementedError

    def test_step(self, apply: nn.Module, batch: Any) -> Any:
        raise NotImplementedError

    def predict_step(self, apply: nn.Module, batch: Any) -> Any:
        return default_predict(apply, batch)

    def setup(self, stage: str) -> None:
        """Called before a stage runs ("fit", "validate", "test", "predict")."""

    def teardown(self, stage: str) -> None:
        """Called after a stage ran."""

    # ------------------------------------------------------------------ what the Trainer uses

    def get_model(self) -> nn.Module:
        if self.model is None:
            self.model = self.configure_model()
        if not isinstance(self.model, nn.Module):
            raise TypeError(
                f"the task's model must be an nn.Module, got {type(self.model).__name__}"
            )
        return self.model

    def has(self, method: str) -> bool:
        """Whether the task defines ``method`` (validation and test are optional)."""
        return getattr(type(self), method) is not getattr(Task, method)

    @classmethod
    def wrap(
        cls,
        model: nn.Module,
        loss_fn: StepFn,
        optimizer: Any,
        *,
        val_fn: StepFn | None = None,
        test_fn: StepFn | None = None,
        predict_fn: StepFn | None = None,
        hparams: dict[str, Any] | None = None,
    ) -> Task:
        """A Task from plain functions (validation and test default to ``loss_fn``)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a function (apply, batch) -> loss, got {loss_fn!r}")
        for what, fn in (
            ("loss_fn", loss_fn),
            ("val_fn", val_fn),
            ("test_fn", test_fn),
            ("predict_fn", predict_fn),
        ):
            if fn is not None:
                user_errors.check_signature(fn, what)
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                "optimizer must be an engine.optim transform (e.g. optim.adamw(1e-3)), "
                f"got {type(optimizer).__name__}"
            )
        return _FunctionTask(model, loss_fn, optimizer, val_fn, test_fn, predict_fn, hparams)


class _FunctionTask(Task):
    """The step methods are the user's functions themselves (instance attributes), so the
    steps call them directly and an error's note names them, not a wrapper."""

    def __init__(self, model, loss_fn, optimizer, val_fn, test_fn, predict_fn, hparams):
        super().__init__(model, hparams)
        self._optimizer = optimizer
        self.training_step = loss_fn
        self.validation_step = val_fn or loss_fn
        self.test_step = test_fn or self.validation_step
        self.predict_step = predict_fn or default_predict

    def has(self, method: str) -> bool:
        return True

    def configure_optimizers(self):
        return self._optimizer


def task_callback(task: Task) -> Callback:
    """The task's loop-event handlers presented to the loops as one pure callback ("task").

    Only the events the task defines are handled (the loops skip the rest); its state comes
    from ``task.init_state()`` when defined.
    """
    handled = [
        e for e in EVENTS if e not in ("setup", "teardown") and callable(getattr(task, e, None))
    ]

    def forward(event: str) -> Callable[..., Any]:
        def handler(self: Callback, state: Any, ctx: Any) -> Any:
            return getattr(task, event)(state, ctx)

        handler.__name__ = event
        return handler

    def init(self: Callback) -> Any:
        make = getattr(task, "init_state", None)
        return make() if callable(make) else {}

    namespace: dict[str, Any] = {"name": "task", "init": init}
    namespace.update({e: forward(e) for e in handled})
    return type("TaskHooks", (Callback,), namespace)()


class DataModule:
    """Data preparation and loaders in one place (Lightning's LightningDataModule shape)."""

    def prepare_data(self) -> None:
        """Download or write data once (called before ``setup``)."""

    def setup(self, stage: str) -> None:
        """Build datasets for ``stage`` ("fit", "validate", "test", "predict")."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` built."""

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no train_dataloader()")

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None
