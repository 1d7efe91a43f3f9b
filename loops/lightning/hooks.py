"""Lightning's hooks of a LightningModule, as the adapter calls them.

Which purestep loop event runs which module hook, with which of Lightning's arguments; how
to tell the real ``lightning.pytorch.LightningModule`` (never imported here) from
purestep's base class and whether a module overrides a hook; and the check, before a run
starts, that every overridden hook takes the arguments Lightning passes.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from ..task import lightning_classes
from .module import LightningModule as BaseModule

__all__ = [
    "DATALOADER_HOOKS",
    "EVENT_HOOKS",
    "INDEXED_HOOKS",
    "accepts",
    "base_of",
    "check_hooks",
    "is_lightning_module",
    "overrides",
]

DATALOADER_HOOKS = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")
# purestep event -> (the module's hook, its stage, what Lightning passes it)
EVENT_HOOKS: dict[str, tuple[str, str, Callable[[Any], tuple]]] = {}


def _add(event: str, stage: str, args: Callable[[Any], tuple] = lambda ctx: ()) -> None:
    EVENT_HOOKS[event] = (event, stage, args)


for _stage, _name in (
    ("train", "train"),
    ("validate", "validation"),
    ("test", "test"),
    ("predict", "predict"),
):
    _add(f"on_{_name}_start", _stage)
    _add(f"on_{_name}_end", _stage)
    _add(f"on_{_name}_epoch_start", _stage)
    _add(f"on_{_name}_epoch_end", _stage)
_add("on_before_optimizer_step", "train", lambda ctx: (None,))  # the optimizer: see _handler
_add("on_fit_start", "train")
_add("on_fit_end", "train")
_add("on_train_batch_start", "train", lambda ctx: (ctx.batch, ctx.batch_idx))
# the first argument of the batch-end hooks, outputs, is replaced by what the step returned
_add("on_train_batch_end", "train", lambda ctx: (ctx.outputs, ctx.batch, ctx.batch_idx))


#: The evaluation batch hooks, which also get ``dataloader_idx`` when the stage runs several
#: dataloaders (as the steps do).
INDEXED_HOOKS: set[str] = set()
for _name, _stage in (("validation", "validate"), ("test", "test"), ("predict", "predict")):
    _add(f"on_{_name}_batch_start", _stage, lambda ctx: (ctx.batch, ctx.batch_idx))
    _add(f"on_{_name}_batch_end", _stage, lambda ctx: (ctx.outputs, ctx.batch, ctx.batch_idx))
    INDEXED_HOOKS.update({f"on_{_name}_batch_start", f"on_{_name}_batch_end"})


#: The hooks of a module the Trainer calls, with the positional arguments Lightning passes.
_STEP_ARITY = {"training_step": 2, "validation_step": 2, "test_step": 2, "predict_step": 2}
#: Lightning's hooks this adapter does not call (the engine computes gradients and updates
#: in one pure step; there is no backward or zero_grad to hook into).
_NOT_CALLED = frozenset(
    {
        "on_before_backward",
        "on_after_backward",
        "on_before_zero_grad",
        "on_validation_model_eval",
        "on_validation_model_train",
        "on_test_model_eval",
        "on_test_model_train",
        "on_predict_model_eval",
        "optimizer_step",
        "optimizer_zero_grad",
        "lr_scheduler_step",
        "configure_gradient_clipping",
        "backward",
        "transfer_batch_to_device",
        "on_before_batch_transfer",
        "on_after_batch_transfer",
    }
)


def _lightning_bases() -> tuple[type, ...]:
    """The real ``LightningModule`` classes already imported (``task.lightning_classes``)."""
    return lightning_classes("LightningModule")


def is_lightning_module(obj: Any) -> bool:
    """Whether ``obj`` is a Lightning-style module: a ``purestep.LightningModule`` or a
    subclass instance of the real ``lightning.pytorch.LightningModule``."""
    return isinstance(obj, (BaseModule, *_lightning_bases()))


def base_of(module: nn.Module) -> type:
    """The Lightning base class ``module`` derives from (its hooks are the no-op defaults)."""
    for base in (BaseModule, *_lightning_bases()):
        if isinstance(module, base):
            return base
    raise TypeError(f"{type(module).__name__} is not a LightningModule")


def overrides(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s class defines ``name`` itself (not the base's default)."""
    base = base_of(module)
    mine = getattr(type(module), name, None)
    return mine is not None and mine is not getattr(base, name, None)


def accepts(fn: Callable, count: int) -> bool:
    """Whether ``fn`` can be called with ``count`` positional arguments."""
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    return True


def check_hooks(module: nn.Module) -> None:
    """Before anything runs: every step method and overridden hook takes the arguments
    Lightning passes (else a ``TypeError`` naming it), and overridden hooks this adapter
    never calls are reported."""
    name = type(module).__name__
    for hook, count in _STEP_ARITY.items():
        if (hook == "training_step" or overrides(module, hook)) and not accepts(
            getattr(module, hook), count
        ):
            raise TypeError(
                f"{name}.{hook}{inspect.signature(getattr(module, hook))} must take (batch, "
                "batch_idx) as Lightning calls it"
            )
    for event, (hook, _, args) in EVENT_HOOKS.items():
        if not overrides(module, hook):
            continue
        count = len(args(_ArgCount())) if event != "on_before_optimizer_step" else 1
        if not accepts(getattr(module, hook), count):
            raise TypeError(
                f"{name}.{hook}{inspect.signature(getattr(module, hook))}: Lightning calls it "
                f"with {count} argument(s) ({_SIGNATURES.get(hook, 'none')})"
            )
    ignored = sorted(h for h in _NOT_CALLED if overrides(module, h))
    if ignored:
        warnings.warn(
            f"{name} overrides {ignored}, which purestep.Trainer does not call (its steps compute "
            "gradients and update in one pure function): move that code to "
            "on_before_optimizer_step or training_step",
            UserWarning,
            stacklevel=3,
        )


class _ArgCount:
    """Stands in for a Context when counting a hook's arguments (one dataloader: the
    fewest arguments Lightning passes)."""

    batch = batch_idx = dataloader_idx = outputs = num_batches = None


_SIGNATURES = {
    "on_train_batch_start": "batch, batch_idx",
    "on_train_batch_end": "outputs, batch, batch_idx",
    "on_before_optimizer_step": "optimizer",
    **{
        f"on_{n}_batch_start": "batch, batch_idx[, dataloader_idx]"
        for n in ("validation", "test", "predict")
    },
    **{
        f"on_{n}_batch_end": "outputs, batch, batch_idx[, dataloader_idx]"
        for n in ("validation", "test", "predict")
    },
}
