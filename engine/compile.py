"""Whole-step compilation: the pure train step traced into one graph, like ``jax.jit``.

Because a step is a pure function of ``(state, batch)``, ``train_step(..., compile=True)``
hands the *whole* step to ``torch.compile``: the forward pass, the backward pass (through
``torch.func.grad``, which traces; ``torch.autograd.grad`` would break the graph), the
accumulation of a window's gradients, the gradient norms and the optimizer update become one
graph. What stays in Python is what the engine keeps as Python values by design: the
counters of ``Progress``, the key derivation, the accumulation-window decision and the
assembling of the new state.

**How each contract is kept.**

- *Purity.* The graph never writes its inputs: norm-layer buffers are copied inside the graph
  before the forward pass updates them, the optimizer runs out of place, and the version
  counters of the parameters and of the other buffers are checked after the call (an in-place
  write by the forward pass raises, as in eager mode).
- *Randomness.* The step's key seeds torch's global generators around the compiled call
  (``rng.scope``), exactly as in eager mode. The compiled graph draws its random numbers
  (or inductor's random seeds) from the seeded CPU/CUDA generator at call time, so dropout
  masks are a pure function of the state's key. They may differ from the eager step's masks
  (inductor may lower the random draws its own way), so a compiled and an eager run of a
  model with dropout can be different random draws rather than a tolerance apart.
- *No recompilation from counters.* Integer leaves of the optimizer state (Adam's step
  count) are marked dynamic (``torch.compiler.config.dynamic_sources``) so the first graph is
  already generic in them; float scalars (the loss scale) are not specialised
  (``torch._dynamo.config.specialize_float`` is False). Learning rates that are schedules of
  the count trace as symbolic arithmetic. Shapes are static by default: a short last batch
  compiles one more graph (``dynamic=None``, torch's automatic dynamic shapes, makes that
  second graph generic, so no third one follows).
- *What runs between graphs.* A step whose update needs the host (a ``16-mixed`` loss
  scaler's finite check, several processes' all-reduce, ``inject_hyperparams`` rebuilding
  its transform from float values, ``skip_nonfinite``, DP-SGD's noise from a
  ``torch.Generator`` in ``engine.per_sample``) runs as two pieces: the compiled
  gradient graph, then the eager glue and the optimizer (compiled too when it traces). This
  is automatic; ``step.fused`` says which form runs.
- *Untraceable loss functions.* With ``fullgraph=True`` (the default) a loss function that
  ``torch.compile`` cannot trace raises ``CompileError`` naming the construct and the line,
  after checking that the function works eagerly (an ordinary error in the loss function is
  raised as it is). The fallbacks: ``CompileOptions(fullgraph=False)`` lets torch.compile
  split the graph around the construct, ``compile=False`` runs the step eagerly.

Compiled and eager steps are different kernels: they agree to float32 rounding (the tests
use ``rtol=1e-4, atol=1e-5`` on parameters after a few Adam steps), while a compiled run
repeats bitwise against itself, in process, in a fresh process and across a resume.

This module holds the compiled train step and ``compiled``; the options live in
``engine.compile_options``, the backend and graph pieces in ``engine.compile_graphs``, the
compiled eval/predict steps in ``engine.compile_forward`` (all importable from here).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import optim, rng
from .compile_forward import CompiledEvalStep, CompiledPredictStep, _CompiledForward
from .compile_graphs import (
    _OPT_SOURCE,
    _Backend,
    _CompileCounts,
    _construct,
    _dynamo_error,
    _Graph,
    _mark_dynamic,
    _refuse_skip,
    _source_names,
    _traceable_update,
    _unique,
)
from .compile_options import CompileError, CompileOptions, compile_options
from .eval_steps import EvalStep, PredictStep
from .gradients import owned_gradients
from .loss_output import SKIP_UNSUPPORTED
from .purity import modified_in_place, raise_params_modified, unaliased
from .state import TrainState
from .step import Gradients, StepOutput, TrainStep
from .window import advance_progress

__all__ = [
    "CompileError",
    "compiled",
    "CompileOptions",
    "CompiledEvalStep",
    "CompiledPredictStep",
    "CompiledTrainStep",
    "compile_options",
]

Tensor = torch.Tensor


# ---------------------------------------------------------------------- the train step


@dataclasses.dataclass
class _Fused:
    """What the whole-step graph computed besides the gradients (held by ``Gradients``)."""

    params: dict[str, Tensor]
    opt_state: Any
    norms: tuple[Tensor, ...] | None
    buffers: dict[str, Tensor]


class _FusedGradients(Gradients):
    """``Gradients`` of a compiled whole step: the update is already computed."""


_COMPILED_CLASSES: dict[type, type] = {}


class CompiledTrainStep(_CompileCounts, TrainStep):
    """A ``TrainStep`` whose work runs as compiled graphs (see the module doc).

    The same ``step(state, batch)``, ``backward`` / ``apply`` halves, ``donating()`` and
    outputs as the eager step. ``compilations`` counts the graphs compiled so far,
    ``compile_seconds`` the time spent compiling them; ``fused`` is True when the whole
    step runs as one graph (None before the first call).
    """

    def __init__(self, *args: Any, options: CompileOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = options if options is not None else CompileOptions()
        self._reset_graphs()

    @classmethod
    def of(cls, step: TrainStep, options: CompileOptions) -> CompiledTrainStep:
        """The compiled form of an eager ``step`` (a ``TrainStep`` or a subclass a strategy
        built: DDP's, an ensemble's), sharing its configuration and template."""
        if isinstance(step, CompiledTrainStep):
            return step
        if not isinstance(step, TrainStep):
            raise TypeError(
                f"compile=True needs a train step built by engine.train_step, got "
                f"{type(step).__name__}"
            )
        unsupported = getattr(step, "_compile_unsupported", None)
        if unsupported:
            raise ValueError(
                f"compile=True is not supported for {type(step).__name__}: {unsupported}"
            )
        kind = type(step)
        base = TrainStep
        if kind._update is not base._update and kind._traced_update is base._traced_update:
            # the graphs trace ``_traced_update``: the base one would silently skip the
            # subclass's own update (a sharded optimizer step, say)
            raise ValueError(
                f"compile=True is not supported for {kind.__name__}: it overrides the optimizer "
                "update (_update) without a traced form (_traced_update); use compile=False"
            )
        if kind is TrainStep:
            new_cls: type = cls
        else:
            new_cls = _COMPILED_CLASSES.get(kind)
            if new_cls is None:
                new_cls = _COMPILED_CLASSES[kind] = type(
                    f"Compiled{kind.__name__}", (cls, kind), {}
                )
        twin = object.__new__(new_cls)
        twin.__dict__.update(step.__dict__)
        twin.options = options
        twin._reset_graphs()
        return twin

    def _reset_graphs(self) -> None:
        self._backend = _Backend(self.options)
        self._graphs: dict[Any, _Graph] = {}
        self.fused: bool | None = None
        self._update_compiled = True
        self._verified = False
        self._inner_view: TrainStep | None = None

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", compile={self.options!r})"

    def donating(self, *, backward: bool = True) -> CompiledTrainStep:
        twin = super().donating(backward=backward)
        twin._reset_graphs()  # donation is a constant of the graphs: they are built anew
        return twin

    # ------------------------------------------------------------------ graphs

    def _graph(self, key: Any, fn: Callable[..., Any]) -> _Graph:
        g = self._graphs.get(key)
        if g is None:
            name = f"purestep_{'_'.join(str(k) for k in key)}_{_unique()}"
            g = self._graphs[key] = _Graph(fn, re.sub(r"\W", "_", name), self._backend)
        return g

    def _traced(self) -> TrainStep:
        """A view of this step for use inside a graph: the same pieces (``_grad_func``,
        ``_tensor_norms``, ``_traced_update``), no generators to seed (the caller seeds them
        around the compiled call: ``manual_seed`` does not trace)."""
        inner = self._inner_view
        if inner is None:
            inner = self._inner_view = copy.copy(self)
            inner._rng_generators = ()
        return inner

    def _grad_graph(self, divisor: int) -> _Graph:
        inner, norm = self._traced(), self._norm_buffers

        def grad_graph(params, buffers, batch, loss_scale):
            bound = {n: b.clone() if n in norm else b for n, b in buffers.items()}
            return inner._grad_func(params, bound, batch, 0, loss_scale, divisor)

        return self._graph(("grad", divisor), grad_graph)

    def _whole_graph(
        self, divisor: int, accumulated: bool, keep_grads: bool, state: TrainState
    ) -> _Graph:
        key = ("whole", divisor, accumulated, keep_grads)
        g = self._graphs.get(key)
        if g is not None:
            return g
        inner, norm = self._traced(), self._norm_buffers

        def whole_graph(params, buffers, purestep_opt_state, acc, batch):
            opt_state = purestep_opt_state
            bound = {n: b.clone() if n in norm else b for n, b in buffers.items()}
            grads, loss, metrics, new_buffers = inner._grad_func(
                params, bound, batch, 0, 1.0, divisor
            )
            if acc is not None:
                names = list(grads)
                grads = dict(
                    zip(names, torch._foreach_add([acc[n] for n in names], list(grads.values())))
                )
            norms = inner._tensor_norms(grads)
            # the gradients the caller sees, as they were before the update: the optimizer
            # owns ``grads`` and may write its moments into them in place (owning_updates)
            kept = {n: g.clone() for n, g in grads.items()} if keep_grads else {}
            new_trainable, new_opt = inner._traced_update(params, grads, opt_state, norms)
            return new_trainable, new_opt, new_buffers, kept, loss, metrics, norms

        _mark_dynamic(_source_names(state.opt_state, _OPT_SOURCE))
        return self._graph(key, whole_graph)

    def _update_graph(self, state: TrainState) -> _Graph:
        g = self._graphs.get(("update",))
        if g is not None:
            return g
        inner = self._traced()

        def update_graph(params, grads, purestep_opt_state, norms):
            return inner._traced_update(params, grads, purestep_opt_state, norms)

        _mark_dynamic(_source_names(state.opt_state, _OPT_SOURCE))
        return self._graph(("update",), update_graph)

    # ------------------------------------------------------------------ the two forms

    def _first_call(self, state: TrainState) -> None:
        super()._first_call(state)
        check_update = getattr(self, "_check_update", None)  # what a strategy's step checks
        if check_update is not None:
            check_update(state)
        strategy = self.strategy
        self.fused = (
            strategy.world_size == 1
            and strategy.precision.scaler is None
            and _traceable_update(state.opt_state)
        )
        if not _traceable_update(state.opt_state):
            self._update_compiled = False

    def _ambient(self, whole: bool = False):
        """The optimizer's donation flags for a compiled call: the whole step (run in
        ``backward``) writes the input in place only under full donation; ``apply`` under
        any (``donating(backward=False)`` donates there only)."""
        donate = self._donate_backward if whole else self.donate
        return optim.donating() if donate else optim.owning_updates()

    def __call__(
        self, state: TrainState, batch: Any, *, end_window: bool | None = None
    ) -> tuple[TrainState, StepOutput]:
        # Called whole, the gradients are nobody's to see: the graph need not materialise
        # them as outputs (inductor fuses them into the update).
        state, grads = self._backward(state, batch, end_window, keep_grads=False)
        if grads.ready:
            return self.apply(state, grads)
        return state, grads.output

    def backward(
        self, state: TrainState, batch: Any, *, end_window: bool | None = None
    ) -> tuple[TrainState, Gradients]:
        return self._backward(state, batch, end_window, keep_grads=True)

    def _backward(
        self, state: TrainState, batch: Any, end_window: bool | None, keep_grads: bool
    ) -> tuple[TrainState, Gradients]:
        if not self._checked:
            self._first_call(state)
        if not self._probed:
            self._probe_unused_once(state, batch)
        if not self.fused:
            return super().backward(state, batch, end_window=end_window)
        progress = state.progress
        k, micro, close = self._window(progress, end_window)
        if not close:
            return super().backward(state, batch, end_window=end_window)
        strategy = self.strategy
        batch = strategy.precision.convert_input(strategy.place(batch))
        n = self._samples(batch)
        key = self._step_key(state)
        acc = state.grad_accum if micro > 0 else None
        buffers = state.buffers
        graph = self._whole_graph(k if k > 1 else 1, acc is not None, keep_grads, state)
        written = self._donate_backward  # the graph writes the donated state itself
        versions = None if written else self._versions(state)
        try:
            with rng.scope(key, generators=self._rng_generators), self._ambient(True):
                out = graph(state.params, buffers, state.opt_state, acc, batch)
        except Exception as exc:
            _refuse_skip(exc)
            if not _dynamo_error(exc) or self._verified:
                raise
            return self._fused_failed(exc, state, batch, end_window)
        self._verified = True
        self._check_versions(state, versions, written=written)
        new_trainable, opt_state, new_buffers, grads, loss, metrics, norms = out
        # Called whole (not keep_grads), ``apply`` follows at once: the norms go in the
        # output now and the new buffers with the rest of the new state (one replace).
        output = self._output_type(loss, metrics, None if keep_grads else norms, True, False)
        if keep_grads:
            state = state.replace(buffers=new_buffers)
        fused = _Fused(self._merged(state.params, new_trainable), opt_state, norms, new_buffers)
        return state, _FusedGradients(grads, True, output, n, fused)  # type: ignore[arg-type]

    def _fused_failed(self, exc, state, batch, end_window):
        """The whole step did not trace: find out whether the loss function or the optimizer
        is to blame (the gradient graph alone), and go on with the split form."""
        self.fused = False
        self._graphs.clear()
        try:
            result = super().backward(state, batch, end_window=end_window)
        except CompileError:
            raise
        self._update_compiled = False
        warnings.warn(
            "purestep: the optimizer update could not be traced into the compiled step; it "
            "runs eagerly after the compiled gradient graph. The reason:\n" + _construct(exc),
            stacklevel=3,
        )
        return result

    def _step_key(self, state: TrainState) -> int:
        cache = self._key_cache
        if cache is None or cache[0] != state.rng:
            cache = self._key_cache = (state.rng, rng.fold_in(state.rng, rng.Purpose.TRAIN))
        p = state.progress
        return rng.fold_in(cache[1], p.step, p.micro_step, self.strategy.rank)

    def _versions(self, state: TrainState) -> tuple[list[int], dict[str, Tensor], list[int]]:
        norm = self._norm_buffers
        kept = {n: b for n, b in state.buffers.items() if n not in norm}
        return (
            [p._version for p in state.params.values()],
            kept,
            [b._version for b in kept.values()],
        )

    def _check_versions(self, state: TrainState, versions: Any, written: bool = False) -> None:
        if written:
            return  # the graph wrote the donated parameters itself
        param_versions, kept, kept_versions = versions
        if [p._version for p in state.params.values()] != param_versions:
            raise_params_modified(modified_in_place(state.params, param_versions))
        changed = modified_in_place(kept, kept_versions)
        if changed:
            raise RuntimeError(
                f"the forward pass modified buffers {changed} in place; a compiled step copies "
                "only norm-layer buffers (BatchNorm statistics) before the forward pass, so "
                "that write reached the input state. Return a new tensor instead "
                "(self.buf = self.buf + x), or register the update through a norm layer"
            )

    def _probe_unused_once(self, state: TrainState, batch: Any) -> None:
        """One eager autograd pass to find parameters the loss leaves unused (see TrainStep)."""
        strategy = self.strategy
        placed = strategy.precision.convert_input(strategy.place(batch))
        scale = state.precision.scale if strategy.precision.scaler is not None else 1.0
        key = self._step_key(state)
        self._probe_unused(state.params, state.buffers, placed, key, scale, 1)

    # the split form: the gradient graph inside TrainStep.backward
    def _gradients(self, params, buffers, batch, key, loss_scale, divisor):
        graph = self._grad_graph(divisor)
        state_like = types.SimpleNamespace(params=params, buffers=buffers)
        versions = self._versions(state_like)  # type: ignore[arg-type]
        scale = float(loss_scale)
        try:
            with rng.scope(key, generators=self._rng_generators):
                grads, loss, metrics, new_buffers = graph(params, buffers, batch, scale)
        except Exception as exc:
            _refuse_skip(exc)
            if not _dynamo_error(exc):
                raise
            self._explain(exc, params, buffers, batch, key, loss_scale, divisor)
            raise  # pragma: no cover - _explain raises
        self._check_versions(state_like, versions)  # type: ignore[arg-type]
        return owned_gradients(grads, contiguous=self._contiguous_grads), loss, metrics, new_buffers

    def _explain(self, exc, params, buffers, batch, key, loss_scale, divisor) -> None:
        """Raise the loss function's own error if it fails eagerly too, else a
        ``CompileError`` naming what could not be traced."""
        copies = {n: b.clone() for n, b in buffers.items()}
        _, loss, _, _ = self._grad_autograd(params, copies, batch, key, loss_scale, divisor)
        if loss is None:  # the loss function skipped its batch: nothing to trace
            raise ValueError(SKIP_UNSUPPORTED) from None
        from .user_errors import describe_function

        if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
            raise CompileError(
                f"the {self.options.backend!r} backend failed to compile the traced train step "
                f"of {describe_function(self.loss_fn)} (the step traced; its compiler did not):"
                f"\n{_construct(exc)}\nFallbacks: compile={{'backend': 'aot_eager'}} runs the "
                "traced graph on torch's own kernels; compile=False runs the step eagerly."
            ) from exc
        raise CompileError(
            f"torch.compile could not trace the train step of {describe_function(self.loss_fn)} "
            "as one graph (fullgraph=True), though it runs eagerly:\n"
            f"{_construct(exc)}\n"
            "Fallbacks: compile=CompileOptions(fullgraph=False) lets torch.compile split the "
            "graph around that construct; compile=False runs the step eagerly."
        ) from exc

    def _update(self, state, grads, norms):
        if not self._update_compiled:
            return super()._update(state, grads, norms)
        params = state.params
        graph = self._update_graph(state)
        try:
            with self._ambient():
                new_trainable, opt_state = graph(params, grads, state.opt_state, norms)
        except Exception as exc:
            if not _dynamo_error(exc):
                raise
            self._update_compiled = False
            self._graphs.pop(("update",), None)
            warnings.warn(
                "purestep: the optimizer update could not be traced; it runs eagerly after "
                "the compiled gradient graph. The reason:\n" + _construct(exc),
                stacklevel=3,
            )
            return super()._update(state, grads, norms)
        return self._merged(params, new_trainable), opt_state

    def apply(self, state: TrainState, grads: Gradients) -> tuple[TrainState, StepOutput]:
        if not isinstance(grads, _FusedGradients):
            return super().apply(state, grads)
        fused: _Fused = grads.buffers_before  # type: ignore[assignment]
        output = grads.output
        if self.donate and output.metrics:
            safe = unaliased(output.metrics, state)
            if safe is not output.metrics:  # the usual: nothing shared, no new output
                output = output.replace(metrics=safe)
        new_state = state.replace(
            params=fused.params,
            opt_state=fused.opt_state,
            buffers=fused.buffers,
            progress=advance_progress(state.progress, grads.batch_size, True),
            grad_accum=None,
        )
        if output.grad_norms is None and fused.norms is not None:
            output = output.replace(grad_norms=fused.norms)
        return new_state, output


def compiled(step: Any, options: Any = True) -> Any:
    """The compiled form of an eager train, eval or predict step (``options`` as ``compile=``
    of the builders). Used where a step is built by other code (the Trainer, a strategy)."""
    opts = compile_options(options)
    if opts is None:
        return step
    if isinstance(step, TrainStep):
        return CompiledTrainStep.of(step, opts)
    for eager, comp in ((EvalStep, CompiledEvalStep), (PredictStep, CompiledPredictStep)):
        if type(step) is eager:
            twin = object.__new__(comp)
            twin.__dict__.update(step.__dict__)
            twin._init_compiled(opts)
            return twin
    if isinstance(step, _CompiledForward):
        return step
    if isinstance(step, (EvalStep, PredictStep)):
        warnings.warn(
            f"purestep: {type(step).__name__} (built by a strategy) is not compiled; it runs "
            "eagerly (compilation covers the train step and the plain eval/predict steps)",
            stacklevel=2,
        )
        return step
    raise TypeError(f"cannot compile a {type(step).__name__}: expected an engine step")
