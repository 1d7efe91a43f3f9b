"""Pure step functions: ``step(state, batch) -> (new_state, out)`` built from a module template.

``train_step`` runs the user's loss function on the module bound to the state's parameters
and buffers, takes gradients, accumulates them over micro-batches when asked, reduces them
across processes through the strategy, unscales them for float16, and applies the
optimizer. The input state is never modified (unless ``donate=True`` hands its storage to
the step) and every random draw inside the step comes from a key derived from the state's
key, the optimizer step, the micro-batch and the rank, so a step is a pure function of
``(state, batch)``. ``eval_step`` and ``predict_step`` run without gradients in eval mode.

The loss function has the signature ``loss_fn(apply, batch)``; ``apply`` is the module,
bound to the state's tensors for the duration of the call (call it, or its submodules, like
the ``nn.Module`` it is; do not keep it beyond the call). It returns a scalar loss, a
``(loss, metrics)`` pair, or a dict with a ``"loss"`` key and metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import optim, rng
from .bind import Binder
from .state import Progress, TrainState, trainable_names
from .strategy import Local, Strategy
from .tree import leaves, map, struct

__all__ = ["Gradients", "StepOutput", "TrainStep", "eval_step", "predict_step", "train_step"]

LossFn = Callable[[nn.Module, Any], Any]


@struct
class StepOutput:
    """What a train step reports besides the new state.

    ``loss`` is the loss of this micro-batch as the loss function returned it (detached, not
    divided by the accumulation factor); ``metrics`` the loss function's other outputs
    (detached); ``grad_norm`` the global L2 norm of the gradients used by the optimizer
    (None when no optimizer step closed on this call, or when disabled; kept as per-tensor
    norms in ``grad_norms`` and combined on access, as ``clip_grad_norm_`` combines them,
    so a loop that never looks pays only for one foreach op); ``stepped`` whether
    an optimizer step happened on this call; ``skipped`` whether that step was skipped
    because the float16 gradients were not finite.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    grad_norms: tuple[torch.Tensor, ...] | None
    stepped: bool
    skipped: bool

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global L2 norm of the gradients (computed from per-tensor norms on access)."""
        norms = self.grad_norms
        if norms is None:
            return None
        if not norms:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)


@struct
class Gradients:
    """The result of ``TrainStep.backward``: gradients waiting for the optimizer.

    ``grads`` is None while an accumulation window is open (``ready`` is False then);
    ``finite`` is False when float16 gradients overflowed (``apply`` then skips the update);
    ``output`` is the step's output so far; ``batch_size`` the samples in the batch.
    """

    grads: dict[str, torch.Tensor] | None
    finite: bool
    output: StepOutput
    batch_size: int

    @property
    def ready(self) -> bool:
        return self.grads is not None


def _split_output(out: Any, where: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(loss, metrics)`` from what a loss function returned."""
    if isinstance(out, torch.Tensor):
        return out, {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        metrics = out[1]
        if not isinstance(metrics, dict):
            raise TypeError(f"{where}: the metrics of (loss, metrics) must be a dict")
        return out[0], metrics
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        metrics = {k: v for k, v in out.items() if k != "loss"}
        return out["loss"], metrics
    raise TypeError(
        f"{where} must return a scalar loss tensor, a (loss, metrics) pair or a dict with a "
        f"'loss' tensor; got {type(out).__name__}"
    )


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _detached(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics with every tensor detached (values may be tensors or pytrees of tensors)."""
    return {
        k: v.detach() if isinstance(v, torch.Tensor) else map(_detach, v)
        for k, v in metrics.items()
    }


def _batch_size(batch: Any) -> int:
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


class TrainStep:
    """A pure train step; call it as ``new_state, out = step(state, batch)``.

    ``step(state, batch, end_window=True)`` closes a gradient-accumulation window early
    (the loops do this on the last batch of an epoch, like a hand-written loop would).
    """

    def __init__(
        self,
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
    ) -> None:
        if grad not in ("autograd", "func"):
            raise ValueError(f"grad must be 'autograd' or 'func', got {grad!r}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                "optimizer must be a GradientTransformation (engine.optim), "
                f"got {type(optimizer).__name__}"
            )
        if isinstance(accumulate, bool) or not (
            callable(accumulate) or (isinstance(accumulate, int) and accumulate >= 1)
        ):
            raise ValueError(
                f"accumulate must be an int >= 1 or a function of Progress, got {accumulate!r}"
            )
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.strategy = strategy if strategy is not None else Local()
        self.accumulate = accumulate
        self.donate = donate
        self.grad = grad
        self.allow_unused = allow_unused
        self.compute_grad_norm = grad_norm
        self.binder = Binder(model)
        self.trainable = trainable_names(model)
        self._all_trainable = len(self.trainable) == len(self.binder.param_names)
        self._rng_devices = self.strategy.rng_devices()
        self._checked = False
        self._key_for: int | None = None
        self._key_prefix = 0

    def __repr__(self) -> str:
        return (
            f"TrainStep(model={type(self.model).__name__}, strategy={self.strategy!r}, "
            f"accumulate={self.accumulate!r}, donate={self.donate}, grad={self.grad!r})"
        )

    # ------------------------------------------------------------------ the step

    def __call__(
        self, state: TrainState, batch: Any, *, end_window: bool | None = None
    ) -> tuple[TrainState, StepOutput]:
        state, grads = self.backward(state, batch, end_window=end_window)
        if grads.ready:
            return self.apply(state, grads)
        return state, grads.output

    def backward(
        self, state: TrainState, batch: Any, *, end_window: bool | None = None
    ) -> tuple[TrainState, Gradients]:
        """The first half of a step: forward, backward and accumulation.

        Returns the state with the forward pass's buffers and, when the accumulation window
        stays open, the accumulated gradients and advanced counters (then ``grads.ready`` is
        False and the step is complete). When the window closes, ``grads`` holds the reduced,
        unscaled gradients ready for ``apply``; look at them (e.g. for logging) but do not
        modify them.
        """
        if not self._checked:
            self._check(state)
        strategy = self.strategy
        precision = strategy.precision
        progress = state.progress
        k, micro, close = self._window(progress, end_window)
        scaler = precision.scaler
        if scaler is not None and state.precision is None:
            raise ValueError(
                f"precision {precision.name!r} scales the loss but the state has no "
                "loss-scaler state: build the state with engine.init(..., strategy=...)"
            )

        batch = precision.convert_input(strategy.place(batch))
        if state.rng != self._key_for:
            self._key_for = state.rng
            self._key_prefix = rng.fold_in(state.rng, rng.Purpose.TRAIN)
        key = rng.fold_in(self._key_prefix, progress.step, micro, strategy.rank)
        loss_scale = state.precision.scale if scaler is not None else 1.0
        divisor = k if k > 1 else 1

        params = state.params
        buffers = state.buffers
        if not self.donate and buffers:
            buffers = {n: b.clone() for n, b in buffers.items()}
        if self.grad == "autograd":
            grads, loss, metrics, new_buffers = self._grad_autograd(
                params, buffers, batch, key, loss_scale, divisor
            )
        else:
            grads, loss, metrics, new_buffers = self._grad_func(
                params, buffers, batch, key, loss_scale, divisor
            )

        grads = self._accumulated(state, grads)
        n = _batch_size(batch)
        if not close:
            return self._keep_open(
                state, grads, new_buffers, StepOutput(loss, metrics, None, False, False), n
            )

        if strategy.world_size > 1:
            grads = strategy.all_reduce(grads, "mean")
        finite = True
        precision_state = state.precision
        if scaler is not None:
            grads, finite = scaler.unscale(grads, precision_state)
            precision_state = scaler.adjust(precision_state, finite)
        output = StepOutput(loss, metrics, None, True, not finite)
        state = state.replace(buffers=new_buffers, precision=precision_state)
        return state, Gradients(grads, finite, output, n)

    def _window(self, progress: Progress, end_window: bool | None) -> tuple[int, int, bool]:
        """``(micro-batches per window, position in the window, whether it closes now)``."""
        accumulate = self.accumulate
        k = accumulate if isinstance(accumulate, int) else _window_size(accumulate, progress)
        micro = progress.micro_step
        close = (micro + 1 >= k) if end_window is None else bool(end_window)
        return k, micro, close

    def _accumulated(self, state: TrainState, grads: dict[str, Any]) -> dict[str, Any]:
        """``grads`` added to the open window's sum (in place on it when donating)."""
        acc = state.grad_accum
        if state.progress.micro_step == 0 or acc is None:
            return grads
        names = list(grads)
        olds = [acc[n] for n in names]
        news = list(grads.values())
        if self.donate:
            torch._foreach_add_(olds, news)
            return dict(zip(names, olds))
        return dict(zip(names, torch._foreach_add(olds, news)))

    def _keep_open(
        self,
        state: TrainState,
        grads: dict[str, Any],
        buffers: dict[str, Any],
        output: StepOutput,
        batch_size: int,
    ) -> tuple[TrainState, Gradients]:
        """The step of a micro-batch that leaves its accumulation window open."""
        progress = state.progress
        new_progress = progress.replace(
            batch_in_epoch=progress.batch_in_epoch + 1,
            total_batches=progress.total_batches + 1,
            samples=progress.samples + batch_size,
            micro_step=progress.micro_step + 1,
        )
        new_state = state.replace(buffers=buffers, grad_accum=grads, progress=new_progress)
        return new_state, Gradients(None, True, output, batch_size)

    def apply(self, state: TrainState, grads: Gradients) -> tuple[TrainState, StepOutput]:
        """The second half of a step: the optimizer update on gradients from ``backward``.

        Consumes ``grads``: the optimizer may reuse their storage, so apply each
        ``Gradients`` once.
        """
        if not grads.ready:
            raise ValueError("these gradients are not ready: the accumulation window is open")
        params = state.params
        progress = state.progress
        values = grads.grads
        norms = (
            tuple(torch._foreach_norm(list(values.values()), 2.0))
            if self.compute_grad_norm
            else None
        )
        if grads.finite:
            trainable = params if self._all_trainable else {n: params[n] for n in self.trainable}
            # The gradients are this step's own temporaries: the optimizer may reuse them.
            with optim.donating() if self.donate else optim.owning_updates():
                new_trainable, opt_state = optim.step(
                    self.optimizer, values, state.opt_state, trainable
                )
            new_params = new_trainable if self._all_trainable else {**params, **new_trainable}
        else:
            new_params, opt_state = params, state.opt_state

        new_progress = progress.replace(
            step=progress.step + 1,
            batch_in_epoch=progress.batch_in_epoch + 1,
            total_batches=progress.total_batches + 1,
            samples=progress.samples + grads.batch_size,
            micro_step=0,
        )
        new_state = state.replace(
            params=new_params,
            opt_state=opt_state,
            progress=new_progress,
            grad_accum=None,
        )
        return new_state, grads.output.replace(grad_norms=norms)

    # ------------------------------------------------------------------ gradients

    def _grad_autograd(self, params, buffers, batch, key, loss_scale, divisor):
        if self._all_trainable:
            bound_params = {n: p.detach().requires_grad_() for n, p in params.items()}
            wrt = bound_params
        else:
            wrt = {n: params[n].detach().requires_grad_() for n in self.trainable}
            bound_params = {**params, **wrt}
        with (
            rng.scope(key, self._rng_devices),
            self.binder.bind(bound_params, buffers, True) as apply,
            torch.enable_grad(),
            self.strategy.precision.autocast(),
        ):
            loss, metrics = _split_output(self.loss_fn(apply, batch), "loss_fn")
            new_buffers = self.binder.collect_buffers() if buffers else buffers
        target = _loss_for_grad(loss, loss_scale, divisor)
        grads = torch.autograd.grad(target, list(wrt.values()), allow_unused=True)
        return (
            self._named_grads(wrt, grads),
            loss.detach(),
            _detached(metrics),
            new_buffers,
        )

    def _grad_func(self, params, buffers, batch, key, loss_scale, divisor):
        trainable_set = set(self.trainable)
        frozen = {n: p for n, p in params.items() if n not in trainable_set}
        wrt = params if self._all_trainable else {n: params[n] for n in self.trainable}
        binder, loss_fn, precision = self.binder, self.loss_fn, self.strategy.precision

        def objective(trainable, buffers):
            with binder.bind({**frozen, **trainable}, buffers, True) as apply:
                with precision.autocast():
                    loss, metrics = _split_output(loss_fn(apply, batch), "loss_fn")
                new_buffers = binder.collect_buffers() if buffers else buffers
            return _loss_for_grad(loss, loss_scale, divisor), (loss, metrics, new_buffers)

        with rng.scope(key, self._rng_devices):
            grads, (loss, metrics, new_buffers) = torch.func.grad(objective, has_aux=True)(
                wrt, buffers
            )
        return dict(grads), loss.detach(), _detached(metrics), new_buffers

    def _named_grads(self, wrt, grads):
        names = list(wrt)
        if any(g is None for g in grads):
            unused = [n for n, g in zip(names, grads) if g is None]
            if not self.allow_unused:
                raise RuntimeError(
                    f"parameters {unused} received no gradient (not used by the loss). "
                    "Freeze them with requires_grad_(False) on the template, or pass "
                    "allow_unused=True to treat their gradient as zero."
                )
            grads = [torch.zeros_like(wrt[n]) if g is None else g for n, g in zip(names, grads)]
        return dict(zip(names, grads))

    def _check(self, state: TrainState) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a TrainState, got {type(state).__name__}")
        self.binder.check(state.params, state.buffers)
        self._checked = True


def _loss_for_grad(loss: torch.Tensor, scale: float, divisor: int) -> torch.Tensor:
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


def _window_size(accumulate: Callable[[Progress], int], progress: Progress) -> int:
    k = accumulate(progress)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"the accumulation schedule returned {k!r}; it must be an int >= 1")
    return k


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
) -> TrainStep:
    """Build a pure train step ``step(state, batch) -> (new_state, StepOutput)``.

    ``accumulate``: micro-batches per optimizer step (an int, or a function of ``Progress``
    for a schedule); the loss is divided by it before the backward pass, as a hand-written
    accumulation loop does. ``donate``: the step may reuse the input state's storage (the
    input state is then consumed and must not be used again); saves memory and time.
    ``grad``: ``"autograd"`` (fast: ``torch.autograd.grad``) or ``"func"``
    (``torch.func.grad``, composable with ``vmap``). ``allow_unused``: treat the gradient of
    parameters the loss does not use as zero instead of raising. ``grad_norm``: report the
    global gradient norm in the output.
    """
    if strategy is not None:
        built = strategy.build_train_step(
            model,
            loss_fn,
            optimizer,
            accumulate=accumulate,
            donate=donate,
            grad=grad,
            allow_unused=allow_unused,
            grad_norm=grad_norm,
        )
        if built is not NotImplemented:
            return built
    return TrainStep(
        model,
        loss_fn,
        optimizer,
        strategy=strategy,
        accumulate=accumulate,
        donate=donate,
        grad=grad,
        allow_unused=allow_unused,
        grad_norm=grad_norm,
    )


# ---------------------------------------------------------------------- eval and predict


class _NoGradStep:
    """Shared machinery of the eval and predict steps: bind, eval mode, no grad, scoped RNG."""

    purpose = rng.Purpose.EVAL

    def __init__(self, model: nn.Module, fn: Callable[[nn.Module, Any], Any], strategy):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.model = model
        self.fn = fn
        self.strategy = strategy if strategy is not None else Local()
        self.binder = Binder(model)
        self._rng_devices = self.strategy.rng_devices()
        self._checked = False

    def _run(self, state: TrainState, batch: Any, index: int) -> Any:
        if not self._checked:
            if not isinstance(state, TrainState):
                raise TypeError(f"expected a TrainState, got {type(state).__name__}")
            self.binder.check(state.params, state.buffers)
            self._checked = True
        strategy = self.strategy
        batch = strategy.precision.convert_input(strategy.place(batch))
        key = rng.fold_in(state.rng, self.purpose, state.progress.step, index, strategy.rank)
        buffers = state.buffers
        versions = [b._version for b in buffers.values()]
        with (
            rng.scope(key, self._rng_devices),
            self.binder.bind(state.params, buffers, False) as apply,
            torch.no_grad(),
            strategy.precision.autocast(),
        ):
            out = self.fn(apply, batch)
        if versions != [b._version for b in buffers.values()]:
            changed = [n for (n, b), v in zip(buffers.items(), versions) if b._version != v]
            raise RuntimeError(
                f"the model modified buffers {changed} in place in eval mode, which would "
                "change the training state; make the forward pass leave buffers alone in "
                "eval mode"
            )
        return out


class EvalStep(_NoGradStep):
    """``step(state, batch, index=0) -> dict[str, Tensor]``: metrics, ``"loss"`` included."""

    purpose = rng.Purpose.EVAL

    def __call__(self, state: TrainState, batch: Any, *, index: int = 0) -> dict[str, Any]:
        out = self._run(state, batch, index)
        if isinstance(out, dict) and "loss" not in out:
            return _detached(out)
        loss, metrics = _split_output(out, "eval fn")
        return {"loss": loss.detach(), **_detached(metrics)}


class PredictStep(_NoGradStep):
    """``step(state, batch, index=0) -> whatever fn returns`` (tensors detached)."""

    purpose = rng.Purpose.PREDICT

    def __call__(self, state: TrainState, batch: Any, *, index: int = 0) -> Any:
        return map(_detach, self._run(state, batch, index))


def _default_predict(apply: nn.Module, batch: Any) -> Any:
    return apply(batch)


def eval_step(
    model: nn.Module, fn: Callable[[nn.Module, Any], Any], *, strategy: Strategy | None = None
) -> EvalStep:
    """Build ``step(state, batch, index=0) -> metrics``, run in eval mode without gradients.

    ``fn(apply, batch)`` returns a loss, ``(loss, metrics)``, or a dict of metrics; the step
    returns a dict (the loss under ``"loss"``). ``index`` (the batch's position in the
    evaluation) enters the key of any random draw.
    """
    if strategy is not None:
        built = strategy.build_eval_step(model, fn)
        if built is not NotImplemented:
            return built
    return EvalStep(model, fn, strategy)


def predict_step(
    model: nn.Module,
    fn: Callable[[nn.Module, Any], Any] = _default_predict,
    *,
    strategy: Strategy | None = None,
) -> PredictStep:
    """Build ``step(state, batch, index=0) -> prediction`` (``fn`` defaults to ``apply(batch)``)."""
    if strategy is not None:
        built = strategy.build_predict_step(model, fn)
        if built is not NotImplemented:
            return built
    return PredictStep(model, fn, strategy)
