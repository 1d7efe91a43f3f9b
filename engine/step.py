"""The train step: ``step(state, batch) -> (new_state, StepOutput)``, in two halves.

``TrainStep`` runs the user's loss function on the module bound to the state's parameters
and buffers, takes gradients, accumulates them over micro-batches when asked, reduces them
across processes through the strategy, unscales them for float16, and applies the
optimizer. The input state is never modified (unless ``donate=True`` hands its storage to
the step) and every random draw inside the step comes from a key derived from the state's
key, the optimizer step, the micro-batch and the rank, so a step is a pure function of
``(state, batch)``. ``backward`` (forward, backward, accumulation) and ``apply`` (the
optimizer update) are its halves; ``Gradients`` passes between them and ``StepOutput`` is
what a step reports.

The loss function has the signature ``loss_fn(apply, batch)``; ``apply`` is the module,
bound to the state's tensors for the duration of the call (call it, or its submodules, like
the ``nn.Module`` it is; do not keep it beyond the call). What it returns is read by
``loss_output``. An exception it raises propagates unchanged but for one note naming the
function, the step and the batch's structure; a Lightning-style ``(batch, batch_idx)``
signature is refused when the step is built (``user_errors``).

**Purity checks.** A forward pass must not modify the state's parameters in place (weight
clipping with ``w.clamp_()`` under ``no_grad``, say): every step compares the parameters'
version counters before and after the forward pass and raises ``RuntimeError`` if one
moved (``purity``). The train step copies the buffers the forward pass updates (BatchNorm
statistics) and binds the others uncopied; see ``TrainStep`` for how it tells them apart.

The builders (``engine.train_step``, ``eval_step``, ``predict_step``) are in ``builders``
(import them from ``purestep.engine``; ``purestep.engine.step`` no longer holds them, since
the builders choose between this module and ``engine.compile``, which builds on it); the
eval and predict steps are in ``eval_steps``. This module re-exports the step API that
strategies and loops build on (``EvalStep``, ``SKIP``, ``owned_gradients``, ...).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import optim, rng, user_errors
from .bind import Binder
from .eval_steps import EvalStep, NoGradStep, PredictStep
from .eval_steps import _default_predict as _default_predict  # loops.predict's default
from .gradients import owned_gradients, scalar_gradients
from .loss_output import SKIP, SKIP_UNSUPPORTED, batch_size, detached, loss_for_grad, split_output
from .optim.nonfinite import skip_count
from .purity import (
    check_unchanged,
    modified_in_place,
    norm_layer_buffers,
    raise_params_modified,
    unaliased,
)
from .state import Progress, TrainState, trainable_names
from .strategy import Local, Strategy, step_generators
from .tree import combine_norms, leaves, struct, structure, unflatten
from .window import advance_progress, window_size

__all__ = [
    "EvalStep",
    "Gradients",
    "NoGradStep",
    "PredictStep",
    "SKIP",
    "SKIP_UNSUPPORTED",
    "StepOutput",
    "TrainStep",
    "advance_progress",
    "batch_size",
    "check_unchanged",
    "detached",
    "loss_for_grad",
    "modified_in_place",
    "owned_gradients",
    "scalar_gradients",
    "split_output",
    "window_size",
]

LossFn = Callable[[nn.Module, Any], Any]
Tensor = torch.Tensor
# A reusable do-nothing context (entering ``torch.enable_grad()`` when grad mode is already on
# costs about 1.5 us a step).
_NO_CONTEXT = contextlib.nullcontext()


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
    (float16 gradients that overflowed, or ``optim.skip_nonfinite``). A skipped step leaves
    the parameters, the optimizer state and the buffers as they were before its micro-batch.
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
        return None if norms is None else combine_norms(norms)


@struct
class Gradients:
    """The result of ``TrainStep.backward``: gradients waiting for the optimizer.

    ``grads`` is None while an accumulation window is open (``ready`` is False then);
    ``finite`` is False when float16 gradients overflowed (``apply`` then skips the update);
    ``output`` is the step's output so far; ``batch_size`` the samples in the batch;
    ``buffers_before`` the buffers before this micro-batch, which ``apply`` puts back when the
    optimizer skips the update (None: nothing to put back).
    """

    grads: dict[str, torch.Tensor] | None
    finite: bool
    output: StepOutput
    batch_size: int
    buffers_before: dict[str, torch.Tensor] | None = None

    @property
    def ready(self) -> bool:
        return self.grads is not None


def _kept_if_nonfinite(
    loss: Tensor, new: dict[str, Tensor], old: dict[str, Tensor]
) -> dict[str, Tensor]:
    """``new`` buffers, except that a micro-batch whose loss is not finite keeps the ``old``
    values of the buffers it changed (a select on the device: no host sync)."""
    ok = torch.isfinite(loss.detach()).all()
    return {
        n: b if b is old.get(n) else torch.where(ok.to(b.device), b, old[n]) for n, b in new.items()
    }


# ---------------------------------------------------------------------- the train step


class TrainStep:
    """A pure train step; call it as ``new_state, out = step(state, batch)``.

    ``step(state, batch, end_window=True)`` closes a gradient-accumulation window early
    (the loops do this on the last batch of an epoch, like a hand-written loop would).

    **Buffers.** Without ``donate``, a buffer the forward pass updates in place (BatchNorm
    statistics) must be copied first, or the input state would change; copying constant
    buffers (masks, rotary tables) every step would cost as much as a large matmul. So the
    first call copies every buffer and notes which copies the forward pass wrote: version
    counter moved, or value changed (torch's batch-norm kernels update the running
    statistics without moving the counter), plus the buffers of BatchNorm/InstanceNorm
    layers, always. Later calls copy only those and bind the others as they are, and check
    the uncopied buffers' version counters after the forward pass. If a forward pass writes
    a buffer it left alone on the first call, the input state's buffer has been written by
    then; to lose nothing, the step keeps one copy of every uncopied buffer (taken once per
    buffer tensor: once per run in a loop that threads the state, but anew on each call
    that gets new buffer tensors, as DDP's default buffer broadcast makes them), restores
    the input state's value from it, copies that buffer from then on, and raises
    ``RuntimeError``. The trade-offs: memory for one resident copy of the constant buffers
    (copying every step needed as much, but only during the step); and a later write that
    does not move the version counter (a batch-norm kernel run by hand on a buffer of a
    module that is not a norm layer, whose first call left the value unchanged) is not
    seen. Results are bitwise those of copying every buffer every step.

    **Parameters** are never copied: a forward pass that writes one in place is found by its
    version counter after the fact (the input state's value has changed by then; copying
    every parameter to be able to restore it would double the model's memory) and raises.

    ``grad="func"`` with ``allow_unused=False`` runs one extra autograd forward and backward
    pass on the first call, to find parameters the loss does not use (``torch.func.grad``
    gives them zeros without saying so).

    A step object caches what it learns from its first call and shares its module template:
    use one step object per thread.
    """

    _output_type: type[StepOutput] = StepOutput
    #: The step's name in the note added to an exception the loss function raises.
    _stage = "train_step"
    #: Whether ``owned_gradients`` also makes the gradients row-major.
    _contiguous_grads = False
    #: The autograd path's two choices: how a parameter becomes a tensor to differentiate
    #: with respect to, and how the gradients are taken (a differentiable step keeps the
    #: graph in both).
    _leaf = staticmethod(lambda p: p.detach().requires_grad_())
    _take_gradients = staticmethod(scalar_gradients)

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
        trainable: Sequence[str] | None = None,
    ) -> None:
        if grad not in ("autograd", "func"):
            raise ValueError(f"grad must be 'autograd' or 'func', got {grad!r}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        user_errors.check_signature(loss_fn, "loss_fn")
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
        # Whether backward() may write the input state in place: its buffers in the forward
        # pass, its accumulated gradients (see donating).
        self._donate_backward = donate
        self.grad = grad
        self.allow_unused = allow_unused
        self.compute_grad_norm = grad_norm
        self.binder = Binder(model)
        # ``trainable``: the parameters this step's optimizer updates (one of several
        # optimizers' subset); the others are bound as constants. Default: requires_grad.
        self.trainable = trainable_names(model) if trainable is None else list(trainable)
        trainable = set(self.trainable)
        self._frozen = tuple(n for n in self.binder.param_names if n not in trainable)
        self._all_trainable = not self._frozen
        self._rng_generators = rng.default_generators()  # until the first call: see _first_call
        self._checked = False
        self._probed = grad == "autograd" or allow_unused
        self._key_cache: tuple[int, int] | None = None
        # What the first call learnt: the buffers the forward pass writes in place (None:
        # not learnt yet), and a copy of each buffer bound uncopied, to restore it.
        self._mutated: frozenset[str] | None = None
        self._spares: dict[str, tuple[weakref.ref, int, Tensor]] = {}
        self._norm_buffers = norm_layer_buffers(model)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={type(self.model).__name__}, "
            f"strategy={self.strategy!r}, accumulate={self.accumulate!r}, "
            f"donate={self.donate}, grad={self.grad!r})"
        )

    def donating(self, *, backward: bool = True) -> TrainStep:
        """This step as one that consumes its input state (``donate=True``), sharing what this
        step learnt on its first call. Results are bitwise the same.

        ``backward=False`` donates only in ``apply``: the first half (forward, backward,
        accumulation) leaves the input state untouched, as without donation, and only the
        optimizer update writes the input's parameters and optimizer state in place. So user
        code (the loss function, callbacks between the halves) never runs on a half-written
        state, and a failure before ``apply`` leaves the input whole; the loops rely on that.
        """
        twin = copy.copy(self)
        twin.donate = True
        twin._donate_backward = backward
        return twin

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
            self._first_call(state)
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
        n = self._samples(batch)
        cache = self._key_cache
        if cache is None or cache[0] != state.rng:
            cache = self._key_cache = (state.rng, rng.fold_in(state.rng, rng.Purpose.TRAIN))
        key = rng.fold_in(cache[1], progress.step, micro, strategy.rank)
        loss_scale = state.precision.scale if scaler is not None else 1.0
        divisor = k if k > 1 else 1

        grads, loss, metrics, new_buffers = self._gradients(
            state.params, state.buffers, batch, key, loss_scale, divisor
        )
        if loss is None and strategy.world_size > 1:
            raise ValueError(SKIP_UNSUPPORTED)
        grads = self._accumulated(state, grads)
        output_type = self._output_type
        if not close:
            if new_buffers and loss is not None:
                new_buffers = _kept_if_nonfinite(loss, new_buffers, state.buffers)
            if strategy.world_size > 1 and new_buffers:
                new_buffers = strategy.sync_step_buffers(new_buffers)
            return self._keep_open(
                state, grads, new_buffers, output_type(loss, metrics, None, False, False), n
            )

        if not grads:  # every micro-batch of the window skipped: no update (Lightning's)
            output = output_type(loss, metrics, None, True, True)
            state = state.replace(buffers=new_buffers)
            return state, Gradients(grads, True, output, n, None)
        if strategy.world_size > 1:
            grads = self._reduced(grads)
        finite = True
        precision_state = state.precision
        if scaler is not None:
            grads, finite = scaler.unscale(grads, precision_state)
            precision_state = scaler.adjust(precision_state, finite)
        old_buffers = state.buffers
        if not finite:
            new_buffers = old_buffers  # a skipped step leaves the buffers as they were
        elif strategy.world_size > 1 and new_buffers:
            new_buffers = strategy.sync_step_buffers(new_buffers)
        output = output_type(loss, metrics, None, True, not finite)
        state = state.replace(buffers=new_buffers, precision=precision_state)
        return state, Gradients(grads, finite, output, n, old_buffers if finite else None)

    def apply(self, state: TrainState, grads: Gradients) -> tuple[TrainState, StepOutput]:
        """The second half of a step: the optimizer update on gradients from ``backward``.

        Consumes ``grads``: the optimizer may reuse their storage, so apply each
        ``Gradients`` once.
        """
        if not grads.ready:
            raise ValueError("these gradients are not ready: the accumulation window is open")
        values = grads.grads
        norms = self._tensor_norms(values) if values else None
        output = grads.output
        buffers = state.buffers
        if grads.finite and values:
            if self.donate and output.metrics:
                safe = unaliased(output.metrics, state)
                if safe is not output.metrics:  # the usual: nothing shared, no new output
                    output = output.replace(metrics=safe)
            skips = skip_count()
            new_params, opt_state = self._update(state, values, norms)
            if skip_count() != skips:  # skip_nonfinite skipped the update
                output = output.replace(skipped=True)
                if grads.buffers_before is not None:
                    buffers = grads.buffers_before
        else:
            new_params, opt_state = state.params, state.opt_state
        new_state = state.replace(
            params=new_params,
            buffers=buffers,
            opt_state=opt_state,
            progress=advance_progress(state.progress, grads.batch_size, True),
            grad_accum=None,
        )
        reported = norms if self.compute_grad_norm else None
        return new_state, output.replace(grad_norms=reported)

    # ------------------------------------------------------------------ pieces subclasses change

    def _check(self, state: TrainState) -> None:
        """Validate the first state this step sees."""
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a TrainState, got {type(state).__name__}")
        self.binder.check(state.params, state.buffers)

    def _reduced(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """The window's gradients averaged over the ranks (a strategy's step may have
        reduced them during the backward pass already, e.g. DDP's buckets)."""
        return self.strategy.all_reduce(grads, "mean")

    def _samples(self, batch: Any) -> int:
        """The samples ``batch`` adds to ``Progress.samples``."""
        return batch_size(batch)

    def _tensor_norms(self, grads: dict[str, Tensor]) -> tuple[Tensor, ...] | None:
        """Per-tensor gradient norms for ``StepOutput.grad_norms`` (None when not reported)."""
        if not self.compute_grad_norm:
            return None
        return tuple(torch._foreach_norm(list(grads.values()), 2.0))

    def _update(
        self, state: TrainState, grads: dict[str, Tensor], norms: Any
    ) -> tuple[dict[str, Tensor], Any]:
        """``(new params, new optimizer state)`` from the optimizer on ``grads``."""
        params = state.params
        trainable = self._trainable(params)
        # The gradients are this step's own temporaries: the optimizer may reuse them.
        with optim.donating() if self.donate else optim.owning_updates():
            new_trainable, opt_state = optim.step(self.optimizer, grads, state.opt_state, trainable)
        return self._merged(params, new_trainable), opt_state

    def _traced_update(
        self, params: dict[str, Tensor], grads: dict[str, Tensor], opt_state: Any, norms: Any
    ) -> tuple[dict[str, Tensor], Any]:
        """``_update`` as a compiled step traces it: ``(new trainable params, new optimizer
        state)``, the donation flags set by the caller (``engine.compile``)."""
        return optim.step(self.optimizer, grads, opt_state, self._trainable(params))

    # ------------------------------------------------------------------ helpers

    def _first_call(self, state: TrainState) -> None:
        self._check(state)
        self._rng_generators = step_generators(self.strategy, state.params.values())
        self._checked = True

    def _trainable(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        return params if self._all_trainable else {n: params[n] for n in self.trainable}

    def _merged(self, params: dict[str, Tensor], new: dict[str, Tensor]) -> dict[str, Tensor]:
        return new if self._all_trainable else {**params, **new}

    def _window(self, progress: Progress, end_window: bool | None) -> tuple[int, int, bool]:
        """``(micro-batches per window, position in the window, whether it closes now)``."""
        accumulate = self.accumulate
        k = accumulate if isinstance(accumulate, int) else window_size(accumulate, progress)
        micro = progress.micro_step
        close = (micro + 1 >= k) if end_window is None else bool(end_window)
        return k, micro, close

    def _accumulated(self, state: TrainState, grads: dict[str, Any]) -> dict[str, Any]:
        """``grads`` added to the open window's sum (in place on it when donating); a
        skipped micro-batch (no gradients) adds nothing."""
        acc = state.grad_accum
        if state.progress.micro_step == 0 or not acc:
            return grads
        if not grads:
            return acc
        names = list(grads)
        olds = [acc[n] for n in names]
        news = list(grads.values())
        if self._donate_backward:
            torch._foreach_add_(olds, news)
            return dict(zip(names, olds))
        return dict(zip(names, torch._foreach_add(olds, news)))

    def _keep_open(
        self,
        state: TrainState,
        grads: dict[str, Any],
        buffers: dict[str, Any],
        output: StepOutput,
        samples: int,
    ) -> tuple[TrainState, Gradients]:
        """The step of a micro-batch that leaves its accumulation window open."""
        new_state = state.replace(
            buffers=buffers,
            grad_accum=grads,
            progress=advance_progress(state.progress, samples, False),
        )
        return new_state, Gradients(None, True, output, samples)

    # ------------------------------------------------------------------ gradients

    def _gradients(self, params, buffers, batch, key, loss_scale, divisor):
        """``(owned grads, loss, metrics, new buffers)`` of one micro-batch, with the purity
        checks around the forward pass (see the class doc)."""
        param_versions = [p._version for p in params.values()]
        if not buffers:
            bound, kept, kept_versions = buffers, None, None
        elif self._donate_backward:
            # Norm-layer statistics are still copied, so a skipped step can put them back.
            norm = self._norm_buffers
            bound = (
                {n: b.clone() if n in norm else b for n, b in buffers.items()} if norm else buffers
            )
            kept, kept_versions = None, None
        else:
            bound, kept, kept_versions = self._bind_buffers(buffers)
        if not self._probed:
            self._probe_unused(params, buffers, batch, key, loss_scale, divisor)
        compute = self._grad_autograd if self.grad == "autograd" else self._grad_func
        grads, loss, metrics, new_buffers = compute(params, bound, batch, key, loss_scale, divisor)
        if [p._version for p in params.values()] != param_versions:
            raise_params_modified(modified_in_place(params, param_versions))
        if kept:
            self._check_kept(kept, kept_versions)
        elif self._mutated is None and not self._donate_backward:
            self._mutated = self._norm_buffers | {
                n for n, b in bound.items() if b._version != 0 or not torch.equal(b, buffers[n])
            }
        return owned_gradients(grads, contiguous=self._contiguous_grads), loss, metrics, new_buffers

    def _bind_buffers(self, buffers):
        """``(buffers to bind, those bound uncopied, their version counters)``."""
        mutated = self._mutated
        if mutated is None:  # the first call: copy all, learn which copies get written
            return {n: b.clone() for n, b in buffers.items()}, {}, []
        bound = {n: b.clone() if n in mutated else b for n, b in buffers.items()}
        kept = {n: b for n, b in buffers.items() if n not in mutated}
        spares = self._spares
        for n, b in kept.items():
            spare = spares.get(n)
            if spare is None or spare[0]() is not b or spare[1] != b._version:
                spares[n] = (weakref.ref(b), b._version, b.clone())
        return bound, kept, [b._version for b in kept.values()]

    def _check_kept(self, kept: dict[str, Tensor], versions: list[int]) -> None:
        changed = modified_in_place(kept, versions)
        if not changed:
            return
        with torch.no_grad():
            for n in changed:
                kept[n].copy_(self._spares.pop(n)[2])
        self._mutated = self._mutated | frozenset(changed)
        raise RuntimeError(
            f"the forward pass modified buffers {changed} in place, which it had not done on "
            "this step's first call, so the step had bound them without copying (it copies "
            "the buffers its first call wrote). Their values in the input state have been "
            "restored, so nothing is lost, and the step copies them from now on: calling it "
            "again with the same state gives the correct result"
        )

    def _probe_unused(self, params, buffers, batch, key, loss_scale, divisor) -> None:
        """Raise (through ``_named_grads``) if the loss leaves parameters unused: one
        autograd pass on copies of the buffers, whose results are discarded."""
        copies = {n: b.clone() for n, b in buffers.items()}
        _, loss, _, _ = self._grad_autograd(params, copies, batch, key, loss_scale, divisor)
        self._probed = loss is not None  # a skipped batch tells nothing: probe the next one

    def _grad_autograd(self, params, buffers, batch, key, loss_scale, divisor):
        leaf = self._leaf
        if self._all_trainable:
            bound_params = {n: leaf(p) for n, p in params.items()}
            wrt = bound_params
        else:
            wrt = {n: leaf(params[n]) for n in self.trainable}
            bound_params = {**params, **wrt}
        with self._forward_scope(bound_params, buffers, key) as apply:
            loss, metrics, new_buffers = self._call_loss(apply, batch, buffers)
            if loss is None:  # the loss function skipped the batch: no gradients
                return {}, None, metrics, new_buffers
            target = loss_for_grad(loss, loss_scale, divisor)
            grads = self._take_gradients(target, tuple(wrt.values()))
        return self._named_grads(wrt, grads), loss.detach(), metrics, new_buffers

    @contextlib.contextmanager
    def _forward_scope(self, bound_params, buffers, key, around=_NO_CONTEXT):
        """The template bound to ``bound_params`` and ``buffers``, under the key's RNG
        scope, with grad enabled and the precision's autocast; ``around`` is a context a
        strategy adds inside them (FSDP's parameter gathering). Gradients are taken inside
        it too: a forward pass that activation checkpointing (``torch.utils.checkpoint``,
        ``gradient_checkpointing_enable()``) recomputes during the backward pass then runs
        on the state's tensors, not on the template's own, and under the same key."""
        with (
            rng.scope(key, generators=self._rng_generators),
            self.binder.bind(bound_params, buffers, True) as apply,
            _NO_CONTEXT if torch.is_grad_enabled() else torch.enable_grad(),
            around,
            self.strategy.precision.autocast(),
        ):
            yield apply

    def _call_loss(self, apply, batch, buffers):
        """``(loss, detached metrics, new buffers)`` of the loss function on ``apply``
        (inside ``_forward_scope``). The loss keeps its graph."""
        try:
            out = self.loss_fn(apply, batch)
        except Exception as exc:
            user_errors.annotate(exc, self.loss_fn, self._stage, batch)
            raise
        loss, metrics = split_output(out, "loss_fn")
        new_buffers = self.binder.collect_buffers() if buffers else buffers
        return loss, detached(metrics), new_buffers

    def _loss_forward(self, bound_params, buffers, batch, key, around=_NO_CONTEXT):
        """``(loss, detached metrics, new buffers)`` of the loss function inside
        ``_forward_scope``, for callers that take no gradients there."""
        with self._forward_scope(bound_params, buffers, key, around) as apply:
            return self._call_loss(apply, batch, buffers)

    def _grad_func(self, params, buffers, batch, key, loss_scale, divisor):
        frozen = {n: params[n] for n in self._frozen}
        wrt = self._trainable(params)
        binder, loss_fn, precision = self.binder, self.loss_fn, self.strategy.precision
        stage = self._stage

        # Metrics that are not plain tensors (purestep structs: a Lightning-style module's
        # logged values) leave torch.func as their leaves, torch.func returning torch's
        # pytrees only; the structure is rebuilt after.
        structures = []

        def objective(trainable, buffers):
            with binder.bind({**frozen, **trainable}, buffers, True) as apply:
                with precision.autocast():
                    try:
                        out = loss_fn(apply, batch)
                    except Exception as exc:
                        user_errors.annotate(exc, loss_fn, stage, batch)
                        raise
                    loss, metrics = split_output(out, "loss_fn")
                new_buffers = binder.collect_buffers() if buffers else buffers
            if all(type(v) is Tensor for v in metrics.values()):  # the usual: as they are
                values = metrics
            else:
                structures.append(structure(metrics))
                values = leaves(metrics)
            return loss_for_grad(loss, loss_scale, divisor), (loss, values, new_buffers)

        with rng.scope(key, generators=self._rng_generators):
            grads, (loss, values, new_buffers) = torch.func.grad(objective, has_aux=True)(
                wrt, buffers
            )
        metrics = unflatten(structures[-1], values) if structures else values
        return dict(grads), loss.detach(), detached(metrics), new_buffers

    def _named_grads(self, wrt, grads):
        names = list(wrt)
        if any(g is None for g in grads):  # not `None in grads`: that compares tensors
            unused = [n for n, g in zip(names, grads) if g is None]
            if not self.allow_unused:
                raise RuntimeError(
                    f"parameters {unused} received no gradient (not used by the loss). "
                    "Freeze them with requires_grad_(False) on the template, or pass "
                    "allow_unused=True to treat their gradient as zero."
                )
            grads = [torch.zeros_like(wrt[n]) if g is None else g for n, g in zip(names, grads)]
        return dict(zip(names, grads))
