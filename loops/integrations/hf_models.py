"""Hugging Face ``transformers`` models trained by purestep's steps, and saved back.

A ``PreTrainedModel`` is an ``nn.Module`` like any other template: the engine binds the
state's tensors into it for each step (tied input/output embeddings included: GPT-2's
``lm_head.weight`` *is* ``transformer.wte.weight``, one tensor in the state, bound into
both slots), dropout draws from the step's key, and ``engine.to_module`` gives the trained
model back with its ties intact. What this module adds is what is particular to the
library:

* ``hf_loss(apply, batch)``: the loss function for dict batches (``input_ids``,
  ``attention_mask``, ``labels``, ``pixel_values``, ...): the model's own
  ``ModelOutput.loss``, with a clear error when the model computed none (no ``labels``);
* ``HFTask``: a ``Task`` whose steps are ``hf_loss`` (validation and test too) and whose
  prediction is the model's logits;
* ``block_classes(model)``: the model's repeated block classes (``GPT2Block``,
  ``BertLayer``, ...), read from its ``_no_split_modules``: the ``auto_wrap_policy`` of
  ``hardware.fsdp`` that makes one FSDP unit per block;
* ``save_pretrained(state, template, directory)``: ``to_module`` and the model's own
  ``save_pretrained``, so ``AutoModel...from_pretrained(directory)`` reads the trained
  weights.

**Gradient checkpointing** is the model's own: ``model.activation_checkpointing_enable()``
(``gradient_checkpointing_enable()`` before transformers 5), whose default
``use_reentrant=False`` is what ``torch.autograd.grad`` needs. The train step takes its
gradients while the state's tensors are bound and under the step's key, so each block's
recomputation runs on the state's weights and replays the step's dropout masks: the step is
bitwise the same as without checkpointing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from purestep.engine.export import to_module
from purestep.engine.state import TrainState
from purestep.loops.task import Task

__all__ = [
    "HFTask",
    "block_classes",
    "hf_loss",
    "save_pretrained",
]

#: The loss transformers uses for a model whose class name names none (its own default).
_FALLBACK_LOSS = "ForCausalLM"


def _call(apply: nn.Module, batch: Any, where: str) -> Any:
    """The model's output on a dict batch (a clear error for any other batch)."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{where} takes dict batches (input_ids, attention_mask, labels, ...) and calls "
            f"the model with them as keyword arguments; got a {type(batch).__name__}"
        )
    _resolve_loss_type(apply)
    config = getattr(apply, "config", None)
    if getattr(config, "use_cache", False) and "use_cache" not in batch:
        # a training step never reuses the key/value cache: do not build one
        return apply(**batch, use_cache=False)
    return apply(**batch)


def _resolve_loss_type(model: nn.Module) -> None:
    """Name the loss ``model`` falls back to when transformers cannot tell it from the class
    name (``GPT2LMHeadModel``: causal LM). Its fallback logs a warning on every call, and a
    logging call stops ``torch.compile`` from tracing the step as one graph."""
    if getattr(model, "loss_type", "") is None and hasattr(type(model), "loss_function"):
        model.loss_type = _FALLBACK_LOSS


def hf_loss(apply: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The loss a ``transformers`` model computes for ``batch`` (its ``ModelOutput.loss``).

    ``batch`` is a dict of the model's keyword arguments; it must hold ``labels`` (for a
    causal language model the labels are the ``input_ids``: the model shifts them). Only
    the loss is returned: the logits and hidden states stay out of the step's metrics.
    """
    out = _call(apply, batch, "hf_loss")
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise ValueError(
            f"{type(apply).__name__} returned no loss: a transformers model computes its loss "
            f"only when the batch has 'labels' (the batch has {sorted(batch)}); add them "
            "(a causal language model takes labels = input_ids), or write a loss function "
            "that computes the loss from the logits"
        )
    return loss


def _logits(apply: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The model's logits for ``batch`` (``HFTask``'s prediction)."""
    out = _call(apply, batch, "HFTask.predict_step")
    return out["logits"]


class HFTask(Task):
    """A ``Task`` for a ``transformers`` model: train, validate and test on ``hf_loss``,
    predict the logits. ``HFTask(model, optimizer)``; ``optimizer`` is an ``engine.optim``
    transform."""

    def __init__(
        self, model: nn.Module, optimizer: Any, hparams: dict[str, Any] | None = None
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"HFTask needs a transformers model, got {type(model).__name__}")
        super().__init__(model, hparams)
        self.optimizer = optimizer

    def configure_optimizers(self) -> Any:
        return self.optimizer

    def training_step(self, apply: nn.Module, batch: Any) -> Any:
        return hf_loss(apply, batch)

    def validation_step(self, apply: nn.Module, batch: Any) -> Any:
        return hf_loss(apply, batch)

    def test_step(self, apply: nn.Module, batch: Any) -> Any:
        return hf_loss(apply, batch)

    def predict_step(self, apply: nn.Module, batch: Any) -> Any:
        return _logits(apply, batch)


def block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of ``model``'s repeated blocks (those its ``_no_split_modules`` names,
    e.g. ``{GPT2Block}``): ``hardware.fsdp(auto_wrap_policy=block_classes(model))`` makes
    each block one FSDP unit, gathered while it runs."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(
            f"{type(model).__name__} names no block classes it contains (its "
            f"_no_split_modules is {sorted(names)}); pass auto_wrap_policy a set of module "
            "classes yourself"
        )
    return found


def save_pretrained(
    state: TrainState, template: nn.Module, directory: str | Path, **kwargs: Any
) -> nn.Module:
    """Write the state's weights as a ``transformers`` checkpoint folder; the trained model.

    ``template`` is the model the state was made from (it is not changed); the trained
    copy (``engine.to_module``: tied weights still one tensor) is saved with its own
    ``save_pretrained(directory, **kwargs)``, so ``from_pretrained(directory)`` loads it.
    """
    if not hasattr(template, "save_pretrained"):
        raise TypeError(
            f"save_pretrained needs a transformers model template, got {type(template).__name__}"
        )
    model = to_module(state, template)
    model.save_pretrained(str(directory), **kwargs)
    return model
