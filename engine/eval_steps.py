"""The eval and predict steps: the state's module run without gradients, in eval mode.

``EvalStep`` returns metrics (the loss under ``"loss"``), ``PredictStep`` whatever its
function returns, detached. Both bind the state's tensors uncopied, scope the global RNG to
a key derived from the state, the step count, the batch's index and the rank, and check
afterwards that the forward pass wrote neither parameters nor buffers in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import rng, user_errors
from .bind import Binder
from .loss_output import SKIP_UNSUPPORTED, _detach, detached, split_output
from .purity import check_unchanged
from .state import TrainState
from .strategy import Local, Strategy, step_generators
from .tree import map

__all__ = ["EvalStep", "NoGradStep", "PredictStep"]


class NoGradStep:
    """Shared machinery of the eval and predict steps: bind, eval mode, no grad, scoped RNG,
    and the check that the forward pass left the state's parameters and buffers alone."""

    purpose = rng.Purpose.EVAL
    #: The step's name in the signature check and in the note added to an exception ``fn``
    #: raises.
    _stage = "eval_step"

    def __init__(
        self,
        model: nn.Module,
        fn: Callable[[nn.Module, Any], Any],
        strategy: Strategy | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        user_errors.check_signature(fn, f"{self._stage.split()[0]} fn")
        self.model = model
        self.fn = fn
        self.strategy = strategy if strategy is not None else Local()
        self.binder = Binder(model)
        self._rng_generators = rng.default_generators()  # until the first call: see _run
        self._checked = False

    def _check(self, state: TrainState) -> None:
        """Validate the first state this step sees."""
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a TrainState, got {type(state).__name__}")
        self.binder.check(state.params, state.buffers)

    def _forward(self, params: dict, buffers: dict, batch: Any) -> Any:
        """``fn`` on the template bound to ``params`` and ``buffers`` in eval mode."""
        with self.binder.bind(params, buffers, False) as apply, self.strategy.precision.autocast():
            try:
                return self.fn(apply, batch)
            except Exception as exc:
                user_errors.annotate(exc, self.fn, self._stage, batch)
                raise

    def _run(self, state: TrainState, batch: Any, index: int) -> Any:
        if not self._checked:
            self._check(state)
            self._rng_generators = step_generators(self.strategy, state.params.values())
            self._checked = True
        strategy = self.strategy
        batch = strategy.precision.convert_input(strategy.place(batch))
        key = rng.fold_in(state.rng, self.purpose, state.progress.step, index, strategy.rank)
        params, buffers = state.params, state.buffers
        param_versions = [p._version for p in params.values()]
        buffer_versions = [b._version for b in buffers.values()]
        with rng.scope(key, generators=self._rng_generators), torch.no_grad():
            out = self._forward(params, buffers, batch)
        check_unchanged(params, param_versions, buffers, buffer_versions)
        return out


class EvalStep(NoGradStep):
    """``step(state, batch, index=0) -> dict[str, Tensor]``: metrics, ``"loss"`` included."""

    purpose = rng.Purpose.EVAL

    def __call__(self, state: TrainState, batch: Any, *, index: int = 0) -> dict[str, Any]:
        out = self._run(state, batch, index)
        if isinstance(out, dict) and "loss" not in out:
            return detached(out)
        loss, metrics = split_output(out, "eval fn")
        if loss is None:
            raise ValueError(SKIP_UNSUPPORTED)
        return {"loss": loss.detach(), **detached(metrics)}


class PredictStep(NoGradStep):
    """``step(state, batch, index=0) -> whatever fn returns`` (tensors detached)."""

    purpose = rng.Purpose.PREDICT
    _stage = "predict_step"

    def __call__(self, state: TrainState, batch: Any, *, index: int = 0) -> Any:
        return map(_detach, self._run(state, batch, index))


def _default_predict(apply: nn.Module, batch: Any) -> Any:
    return apply(batch)
