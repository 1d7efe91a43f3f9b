"""What a loss function returns, read: the loss, its metrics, and ``SKIP``.

A loss function (and an eval or predict function) returns a scalar loss, a
``(loss, metrics)`` pair, or a dict with a ``"loss"`` key and metrics; ``SKIP`` skips its
batch. ``split_output`` reads any of these, ``detached`` cuts the metrics from the graph,
``loss_for_grad`` checks the loss and prepares it for the backward pass, and
``batch_size`` counts the samples a batch adds to ``Progress.samples``.
"""

from __future__ import annotations

from typing import Any

import torch

from .tree import leaves, map

__all__ = [
    "SKIP",
    "SKIP_UNSUPPORTED",
    "batch_size",
    "detached",
    "loss_for_grad",
    "split_output",
]

Tensor = torch.Tensor


class _Skip:
    """The type of ``SKIP`` (one instance: copies and pickles give ``SKIP`` itself)."""

    def __repr__(self) -> str:
        return "engine.SKIP"

    def __reduce__(self) -> str:
        return "SKIP"


#: What a loss function returns (alone, or as ``(SKIP, metrics)``) to skip its batch, as
#: Lightning's ``training_step`` returning None does: no gradient from it, and a window of
#: only skipped batches makes no update while the counters advance. An explicit value, so
#: a loss function that forgets its ``return`` is still an error, not a silent skip.
SKIP = _Skip()


def split_output(out: Any, where: str) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """``(loss, metrics)`` from what a loss function returned (``where`` names it in errors).

    ``SKIP`` (or ``(SKIP, metrics)``) gives a None loss: the batch is skipped
    (``loss_for_grad`` says where that is not supported)."""
    if isinstance(out, torch.Tensor):
        return out, {}
    if out is SKIP:
        return None, {}
    if isinstance(out, tuple) and len(out) == 2 and (out[0] is SKIP or isinstance(out[0], Tensor)):
        metrics = out[1]
        if not isinstance(metrics, dict):
            raise TypeError(f"{where}: the metrics of (loss, metrics) must be a dict")
        return (None if out[0] is SKIP else out[0]), metrics
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        metrics = {k: v for k, v in out.items() if k != "loss"}
        return out["loss"], metrics
    raise TypeError(
        f"{where} must return a scalar loss tensor, a (loss, metrics) pair or a dict with a "
        f"'loss' tensor; got {type(out).__name__}"
    )


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _detached_value(v: Any) -> Any:
    if type(v) is Tensor:  # the usual: a plain tensor, often detached already
        return v.detach() if v.requires_grad else v
    return v.detach() if isinstance(v, Tensor) else map(_detach, v)


def detached(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics with every tensor detached (values may be tensors or pytrees of tensors); a
    plain tensor that needs no gradient is kept as it is (it has no graph to cut)."""
    return {k: _detached_value(v) for k, v in metrics.items()}


def batch_size(batch: Any) -> int:
    """The size of the batch's first dimension (its first tensor's), or 1 if it has none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        first = batch[0]
        return first.shape[0] if first.dim() else 1
    for leaf in leaves(batch):
        if isinstance(leaf, torch.Tensor):
            return leaf.shape[0] if leaf.dim() else 1
    return 1


#: Why a skipped batch (a loss function returning None) is refused where it is.
SKIP_UNSUPPORTED = (
    "the loss function skipped its batch (engine.SKIP; a Lightning-style training_step "
    "returning None); only the single-process eager train step can skip (grad='autograd', "
    "no compile, no DDP/FSDP, no ensemble, no per-sample gradients, not an evaluation): "
    "return a loss, or filter the batch out of the data"
)


def loss_for_grad(loss: torch.Tensor | None, scale: float, divisor: int) -> torch.Tensor:
    """The tensor to differentiate: ``loss / divisor * scale``, after checking it is a scalar
    that depends on trainable parameters."""
    if loss is None:
        raise ValueError(SKIP_UNSUPPORTED)
    if loss.dim() != 0 and loss.numel() != 1:
        raise ValueError(f"the loss must be a scalar, got a tensor of shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        raise RuntimeError(
            "the loss does not depend on any trainable parameter (it has no grad_fn); "
            "did the loss function detach it or run under torch.no_grad()?"
        )
    if divisor != 1:
        loss = loss / divisor
    if scale != 1.0:
        loss = loss * scale
    return loss
