"""The step builders: ``train_step``, ``eval_step`` and ``predict_step``.

Each builds the eager step (``engine.step``, ``engine.eval_steps``), the one a strategy
provides (``strategy.build_train_step`` and its kin), or, with ``compile=``, the compiled
form (``engine.compile``). This is the one module that knows both the eager and the
compiled steps; neither imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from . import optim
from .compile import (
    CompiledEvalStep,
    CompiledPredictStep,
    CompiledTrainStep,
    compile_options,
    compiled,
)
from .differentiable import DifferentiableTrainStep, check_differentiable
from .eval_steps import EvalStep, PredictStep, _default_predict
from .state import Progress
from .step import LossFn, TrainStep
from .strategy import Strategy

__all__ = ["eval_step", "predict_step", "train_step"]


def train_step(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: optim.GradientTransformation,
    *,
    strategy: Strategy | None = None,
    accumulate: int | Callable[[Progress], int] = 1,
    donate: bool = False,
    grad: str = "autograd",
    allow_unused: bool = False,
    grad_norm: bool = True,
    compile: Any = False,
    differentiable: bool = False,
) -> TrainStep:
    """Build a pure train step ``step(state, batch) -> (new_state, StepOutput)``.

    ``accumulate``: micro-batches per optimizer step (an int, or a function of ``Progress``
    for a schedule); the loss is divided by it before the backward pass, as a hand-written
    accumulation loop does. ``donate``: the step may reuse the input state's storage (the
    input state is then consumed and must not be used again); saves memory and time.
    ``grad``: ``"autograd"`` (fast: ``torch.autograd.grad``) or ``"func"``
    (``torch.func.grad``, composable with ``vmap``). ``allow_unused``: treat the gradient of
    parameters the loss does not use as zero instead of raising (both ``grad`` modes).
    ``grad_norm``: report the global gradient norm in the output. ``compile``: True, a
    ``engine.compile.CompileOptions`` or a dict of its fields compiles the whole step
    (``engine.compile``); False (the default) runs it eagerly. ``differentiable``: the
    update keeps its autograd graph, so ``torch.autograd.grad`` through unrolled steps gives
    gradients with respect to the initial parameters and tensor hyper-parameters
    (``engine.differentiable``; refuses ``compile``, ``donate`` and strategies it cannot
    differentiate through, with a ``ValueError`` saying why).
    """
    options = compile_options(compile)
    settings = dict(
        accumulate=accumulate,
        donate=donate,
        grad=grad,
        allow_unused=allow_unused,
        grad_norm=grad_norm,
    )
    if differentiable is not False:
        if differentiable is not True:
            raise TypeError(f"differentiable must be a bool, got {differentiable!r}")
        check_differentiable(strategy=strategy, donate=donate, compiled=options is not None)
        return DifferentiableTrainStep(model, loss_fn, optimizer, strategy=strategy, **settings)
    if strategy is not None:
        built = strategy.build_train_step(model, loss_fn, optimizer, **settings)
        if built is not NotImplemented:
            return built if options is None else CompiledTrainStep.of(built, options)
    if options is None:
        return TrainStep(model, loss_fn, optimizer, strategy=strategy, **settings)
    return CompiledTrainStep(
        model, loss_fn, optimizer, strategy=strategy, options=options, **settings
    )


def eval_step(
    model: nn.Module,
    fn: Callable[[nn.Module, Any], Any],
    *,
    strategy: Strategy | None = None,
    compile: Any = False,
) -> EvalStep:
    """Build ``step(state, batch, index=0) -> metrics``, run in eval mode without gradients.

    ``fn(apply, batch)`` returns a loss, ``(loss, metrics)``, or a dict of metrics; the step
    returns a dict (the loss under ``"loss"``). ``index`` (the batch's position in the
    evaluation) enters the key of any random draw. ``compile``: as for ``train_step``.
    """
    options = compile_options(compile)
    if strategy is not None:
        built = strategy.build_eval_step(model, fn)
        if built is not NotImplemented:
            return built if options is None else compiled(built, options)
    if options is not None:
        return CompiledEvalStep(model, fn, strategy, options=options)
    return EvalStep(model, fn, strategy)


def predict_step(
    model: nn.Module,
    fn: Callable[[nn.Module, Any], Any] = _default_predict,
    *,
    strategy: Strategy | None = None,
    compile: Any = False,
) -> PredictStep:
    """Build ``step(state, batch, index=0) -> prediction`` (``fn`` defaults to ``apply(batch)``;
    ``compile`` as for ``train_step``)."""
    options = compile_options(compile)
    if strategy is not None:
        built = strategy.build_predict_step(model, fn)
        if built is not NotImplemented:
            return built if options is None else compiled(built, options)
    if options is not None:
        return CompiledPredictStep(model, fn, strategy, options=options)
    return PredictStep(model, fn, strategy)
