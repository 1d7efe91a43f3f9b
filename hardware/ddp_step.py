"""The train step under ``hardware.ddp``: gradients reduced in buckets during the backward pass.

Kept apart from the strategy (``hardware.ddp``) because it is the step's concern alone: where
the window's gradients are reduced (``hardware.grad_buckets``) and when.
"""

from __future__ import annotations

from typing import Any

import torch

from purestep.engine.gradients import scalar_gradients
from purestep.engine.step import TrainStep

from .grad_buckets import BucketedReduction, BucketLayout

__all__ = ["DDPTrainStep"]


class DDPTrainStep(TrainStep):
    """``engine.TrainStep`` under DDP.

    On the micro-batch that closes an accumulation window the gradients are reduced in
    buckets while the backward pass runs (``hardware.grad_buckets``): a hook on every
    trainable parameter's leaf copies its gradient, plus the window's earlier sum, into its
    bucket, and each full bucket's all-reduce (or the strategy's ``comm_hook``) is launched
    at once; the step waits for them all before the optimizer update. Micro-batches that
    leave the window open accumulate locally (torch's ``no_sync``). With
    ``DDP.overlap=False``, under ``grad="func"`` and in compiled gradient graphs the buckets
    are filled and reduced after the backward pass instead (same layout, same arithmetic).

    After every call the new buffers pass through ``DDP.sync_step_buffers``, the
    ``buffers=`` policy. Note that the default policy ("broadcast") sends every buffer on
    every micro-batch, constant ones (masks, rotary tables) included, and hands the step new
    buffer tensors each call.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layout: BucketLayout | None = None
        self._reduction: BucketedReduction | None = None
        self._reduced_now = False
        self._param_names: dict[int, str] = {}

    def backward(self, state: Any, batch: Any, *, end_window: bool | None = None) -> Any:
        strategy = self.strategy
        if strategy.world_size == 1 or not hasattr(strategy, "bucket_cap_mb"):
            return super().backward(state, batch, end_window=end_window)
        _, micro, close = self._window(state.progress, end_window)
        if close:
            strategy._ready()  # as DDP.all_reduce does: forms a released per-run group again
            trainable = self._trainable(state.params)
            if self._layout is None:
                self._layout = BucketLayout.of(trainable, strategy.bucket_cap_mb)
            acc = state.grad_accum if micro > 0 and state.grad_accum else None
            self._reduction = BucketedReduction(
                self._layout,
                trainable,
                acc,
                hook=strategy.comm_hook,
                hook_state=strategy.comm_state,
                timeout=strategy.timeout,
            )
            # grad="func" takes its gradients outside autograd's leaf hooks (its first call's
            # unused-parameter probe runs an autograd pass whose gradients must not count)
            overlap = strategy.overlap and self.grad == "autograd"
            self._param_names = {id(t): n for n, t in trainable.items()} if overlap else {}
        reduction = self._reduction
        try:
            return super().backward(state, batch, end_window=end_window)
        except BaseException as exc:
            if reduction is not None and reduction.launched and not reduction.finished:
                # this rank's buckets went out, its peers' matching ones may not have: a
                # retried call would pair its collectives with the peers' next step
                _note(
                    exc,
                    "purestep: this rank had launched gradient all-reduces when the step "
                    "failed, so the ranks are out of step: do not call the step again in "
                    "this process group (restart the run, e.g. from its last checkpoint)",
                )
            raise
        finally:
            if reduction is not None:
                reduction.release()  # the buffers belong to the returned gradients now
            self._reduction, self._reduced_now, self._param_names = None, False, {}

    def _take_gradients(self, loss: torch.Tensor, inputs: tuple) -> tuple:  # type: ignore[override]
        # Only the step's own backward pass fills buckets: a torch.autograd.grad that the loss
        # function runs over the parameters (a gradient penalty, SAM, an inner MAML step)
        # fires the same leaf hooks with other gradients.
        reduction = self._reduction
        if reduction is None:
            return scalar_gradients(loss, inputs)
        reduction.armed = True
        try:
            return scalar_gradients(loss, inputs)
        finally:
            reduction.armed = False

    def _leaf(self, p: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        leaf = p.detach().requires_grad_()
        name = self._param_names.get(id(p))
        if name is not None and self._reduction is not None:
            self._reduction.watch(name, leaf)
        return leaf

    def _accumulated(self, state: Any, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        reduction = self._reduction
        if reduction is None or not grads:
            return super()._accumulated(state, grads)
        self._reduced_now = True
        return reduction.finish(grads)  # the window's sum is folded in by the buckets

    def _reduced(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._reduced_now:
            return grads
        return super()._reduced(grads)


def _note(exc: BaseException, text: str) -> None:
    """Add ``text`` to ``exc``'s report (Python 3.11's notes; the message itself before)."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
