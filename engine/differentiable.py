"""Differentiating through training: a train step whose update keeps its autograd graph.

A step is a pure function of ``(state, batch)``, so ``k`` steps are a function of the
initial state and of the hyper-parameters, and autograd can differentiate it, as optax
users do in JAX and ``higher`` / TorchOpt users do in PyTorch. ``engine.train_step(...,
differentiable=True)`` builds ``DifferentiableTrainStep``: the inner gradients are taken
with ``create_graph=True``, the parameters are bound undetached, and the optimizer runs
under ``optim.differentiable()`` (no in-place update, no donation), so the new state's
parameters and optimizer state are functions of the old ones with their graph.
``torch.autograd.grad(objective, initial_params)`` then gives the meta-gradient (MAML), and
``sgd``/``adam``/``adamw`` hyper-parameters held as tensors that require grad (passed to
the factory, or stored by ``inject_hyperparams`` and set with ``with_hyperparams``) get
hypergradients.

The values are not changed, only kept with their graph: every parameter, moment and loss
is bitwise what the ordinary step computes for the same state and batch (the tests check
it with ``torch.equal``).

What cannot be differentiated is refused with a ``ValueError`` when the step is built:
``donate=True`` (the update would overwrite values autograd saved), ``compile=`` (AOTAutograd
traces no double backward), a strategy that builds its own step (DDP, FSDP, ensembles:
collectives and sharding autograd does not see through) or runs more than one process, and
float16 loss scaling (an overflow skips the step: a data-dependent jump with no gradient).

``unroll`` runs a step over batches, ``leaf_params`` makes the parameters leaves to
differentiate with respect to, ``with_hyperparams`` puts tensors into an
``inject_hyperparams`` state, and ``loss_of`` evaluates the step's loss function on a state
keeping the graph (the outer objective).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from . import optim, rng
from .optim.hyperparams import InjectHyperparamsState
from .state import TrainState
from .step import LossFn, StepOutput, TrainStep
from .strategy import Strategy

__all__ = [
    "DifferentiableTrainStep",
    "check_differentiable",
    "leaf_params",
    "loss_of",
    "unroll",
    "with_hyperparams",
]

Tensor = torch.Tensor


def check_differentiable(
    *, strategy: Strategy | None = None, donate: bool = False, compiled: bool = False
) -> None:
    """Raise ``ValueError`` saying why, for what a differentiable step cannot do."""
    if compiled:
        raise ValueError(
            "differentiable=True cannot be combined with compile=: a compiled step's backward "
            "pass is traced by AOTAutograd, which does not support double backward "
            "(create_graph=True), so the update would lose its graph; use the eager step"
        )
    if donate:
        raise ValueError(
            "differentiable=True cannot donate: donate=True lets the update write the input "
            "state's parameters and optimizer state in place, destroying values autograd "
            "saved for the backward pass through the step"
        )
    if strategy is None:
        return
    if type(strategy).build_train_step is not Strategy.build_train_step:
        raise ValueError(
            f"differentiable=True needs a one-process strategy that uses the ordinary step "
            f"(engine.Local, hardware.single_device); {strategy!r} builds its own step, whose "
            "collectives, sharding or vmap over members autograd does not differentiate "
            "through"
        )
    if strategy.world_size != 1:
        raise ValueError(
            f"differentiable=True runs in one process; {strategy!r} has world_size="
            f"{strategy.world_size}, and its gradient all-reduce is not differentiable"
        )
    precision = strategy.precision
    if precision.scaler is not None:
        raise ValueError(
            f"differentiable=True cannot use precision {precision.name!r}: float16 loss "
            "scaling skips a step when the gradients overflow and changes the scale by "
            "data-dependent factors, a jump with no gradient; use '32-true', '64-true' or "
            "'bf16-mixed'"
        )


class _InsideTransform(ValueError):
    """torch.autograd cannot mark the parameters: the step runs inside a torch.func
    transform over something else."""


def _tracked(p: Tensor) -> Tensor:
    """``p`` itself when it carries a graph (or is a leaf requiring grad), else a leaf view."""
    if p.requires_grad:
        return p
    try:
        return p.detach().requires_grad_()
    except RuntimeError as exc:  # inside a torch.func transform over something else
        raise _InsideTransform(
            "this differentiable step (grad='autograd') runs inside a torch.func transform "
            "that does not differentiate the parameters, where torch.autograd cannot mark "
            "them; build the step with grad='func' to take its gradients with torch.func"
        ) from exc


_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _graph_gradients(loss: Tensor, inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(loss, inputs, create_graph=True, allow_unused=True)`` for a
    scalar loss, through the engine's entry point when this torch has it (as
    ``gradients.scalar_gradients`` does: the public wrapper costs about 25 us a call)."""
    if _RUN_BACKWARD is None or type(loss) is not Tensor:
        return torch.autograd.grad(loss, inputs, create_graph=True, allow_unused=True)
    one = torch.ones_like(loss, memory_format=torch.preserve_format)
    return _RUN_BACKWARD((loss,), (one,), True, True, inputs, True, accumulate_grad=False)


class DifferentiableTrainStep(TrainStep):
    """A train step whose new state keeps the autograd graph back to the input state.

    Call it like any train step (``new_state, out = step(state, batch)``); the loss and
    metrics in ``out`` are detached as usual, the new parameters and optimizer state are
    not. Build it with ``engine.train_step(..., differentiable=True)``. The graph of ``k``
    steps holds ``k`` forward and backward passes: memory grows with ``k``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: optim.GradientTransformation,
        *,
        strategy: Strategy | None = None,
        donate: bool = False,
        **options: Any,
    ) -> None:
        """``TrainStep``'s arguments (``options``: its other keywords); a strategy that runs
        its own step, or ``donate=True``, is refused with the reason."""
        check_differentiable(strategy=strategy, donate=donate)
        super().__init__(model, loss_fn, optimizer, strategy=strategy, donate=False, **options)

    _leaf = staticmethod(_tracked)  # a parameter carrying the graph of earlier steps stays
    _take_gradients = staticmethod(_graph_gradients)  # create_graph=True

    def _probe_unused(self, params, buffers, batch, key, loss_scale, divisor) -> None:
        """The unused-parameter check runs an autograd pass, which a torch.func transform
        over the hyper-parameters does not allow: a ``grad="func"`` step first called
        inside one checks on its first call outside."""
        try:
            super()._probe_unused(params, buffers, batch, key, loss_scale, divisor)
        except _InsideTransform:
            if self.grad != "func":
                raise

    def donating(self, *, backward: bool = True) -> TrainStep:
        check_differentiable(donate=True)
        raise AssertionError("unreachable")  # pragma: no cover

    def _tensor_norms(self, grads: dict[str, Tensor]) -> tuple[Tensor, ...] | None:
        with torch.no_grad():  # reported values: no graph for them
            return super()._tensor_norms(grads)

    def _update(
        self, state: TrainState, grads: dict[str, Tensor], norms: Any
    ) -> tuple[dict[str, Tensor], Any]:
        params = state.params
        with optim.differentiable():
            new_trainable, opt_state = optim.step(
                self.optimizer, grads, state.opt_state, self._trainable(params)
            )
        return self._merged(params, new_trainable), opt_state

    def _traced_update(self, params, grads, opt_state, norms):  # pragma: no cover
        raise ValueError("a differentiable step is never compiled")


def _check_step(step: Any, what: str) -> None:
    if not isinstance(step, DifferentiableTrainStep):
        raise TypeError(
            f"{what} needs a differentiable step, got {type(step).__name__}: build it with "
            "engine.train_step(..., differentiable=True)"
        )


def unroll(
    step: DifferentiableTrainStep, state: TrainState, batches: Iterable[Any]
) -> tuple[TrainState, list[StepOutput]]:
    """Run ``step`` over ``batches``: ``(final state, the step outputs)``, the final state
    keeping the graph of every step."""
    _check_step(step, "unroll")
    outputs = []
    for batch in batches:
        state, out = step(state, batch)
        outputs.append(out)
    return state, outputs


def leaf_params(state: TrainState, names: Iterable[str] | None = None) -> TrainState:
    """``state`` with its parameters (or those named) as new autograd leaves that require
    grad: the tensors to differentiate the unrolled steps with respect to. They share
    storage with the old ones (``detach``)."""
    chosen = set(state.params) if names is None else set(names)
    unknown = sorted(chosen - set(state.params))
    if unknown:
        raise KeyError(f"no parameters {unknown} in the state (it has {sorted(state.params)})")
    params = {n: p.detach().requires_grad_() if n in chosen else p for n, p in state.params.items()}
    return state.replace(params=params)


def with_hyperparams(state: TrainState, **values: Any) -> TrainState:
    """``state`` whose ``inject_hyperparams`` optimizer state holds ``values`` as they are
    (tensors keep their graph: ``with_hyperparams(state, lr=log_lr.exp())``).

    The optimizer state must be an ``InjectHyperparamsState`` or a tuple (a ``chain``)
    holding them; each value goes to every injected state that has its name, and a name
    none has is a ``KeyError``. A tuple value (Adam's ``betas``) replaces the whole tuple.
    """
    found: set[str] = set()

    def replace(node: Any) -> Any:
        if isinstance(node, InjectHyperparamsState):
            ours = {n: v for n, v in values.items() if n in node.hyperparams}
            found.update(ours)
            return node.replace(hyperparams={**node.hyperparams, **ours}) if ours else node
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(replace(x) for x in node)
        return node

    opt_state = replace(state.opt_state)
    missing = sorted(set(values) - found)
    if missing:
        raise KeyError(
            f"no injected hyper-parameters {missing} in the optimizer state; build the "
            "optimizer with engine.optim.inject_hyperparams(factory)(name=value)"
        )
    return state.replace(opt_state=opt_state)


def loss_of(step: DifferentiableTrainStep, state: TrainState, batch: Any) -> Tensor:
    """The loss ``step``'s loss function gives on ``state`` and ``batch``, with its graph:
    the outer objective of an unroll (a MAML query loss, a validation loss).

    It runs as the step's forward pass would (training mode, the precision's autocast, the
    random key the next step on ``state`` uses), on copies of the buffers, so the state is
    not modified.
    """
    _check_step(step, "loss_of")
    if not step._checked:
        step._first_call(state)
    strategy = step.strategy
    batch = strategy.precision.convert_input(strategy.place(batch))
    progress = state.progress
    base = rng.fold_in(state.rng, rng.Purpose.TRAIN)
    key = rng.fold_in(base, progress.step, progress.micro_step, strategy.rank)
    buffers = {n: b.clone() for n, b in state.buffers.items()}
    loss, _, _ = step._loss_forward(state.params, buffers, batch, key)
    if loss is None:
        raise ValueError("the loss function skipped this batch (SKIP): there is no loss")
    return loss
