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
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
import types
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import optim, rng
from .optim import base as optim_base
from .optim.hyperparams import InjectHyperparamsState
from .state import TrainState
from .step import (
    SKIP_UNSUPPORTED,
    EvalStep,
    Gradients,
    PredictStep,
    StepOutput,
    TrainStep,
    _raise_params_modified,
    advance_progress,
    modified_in_place,
    owned_gradients,
)

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

_PREPARED = False


def _prepare_dynamo() -> None:
    """Import dynamo (only when a step is compiled: it is slow to import) and tell it how to
    read the optimizers' two ambient flags (``is_donating`` / ``owns_updates``, context
    variables it cannot read). A compiled step sets them around its call, the same way on
    every call, so their values are constants of its graphs: dynamo evaluates them while
    tracing."""
    global _PREPARED
    if _PREPARED:
        return
    import torch._dynamo

    torch._dynamo.assume_constant_result(optim_base.is_donating)
    torch._dynamo.assume_constant_result(optim_base.owns_updates)
    _PREPARED = True


class CompileError(RuntimeError):
    """A step function could not be traced as one graph (``fullgraph=True``)."""


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How a step is compiled (``compile=CompileOptions(...)``; ``compile=True`` is the default).

    ``backend``: a ``torch.compile`` backend name (``"inductor"``, ``"aot_eager"``,
    ``"eager"``) or callable. ``mode``: inductor's mode (``"default"``, ``"reduce-overhead"``,
    ``"max-autotune"``, ...; inductor only). ``dynamic``: as ``torch.compile`` (None: static
    first, then generic in a shape that changes; True: generic from the start; False: one
    graph per shape). ``fullgraph``: refuse graph breaks (a clear ``CompileError``).
    ``options``: inductor config patches (``torch._inductor.config`` names).
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = True
    options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(f"backend must be a name or a callable, got {self.backend!r}")
        if self.mode is not None and not isinstance(self.mode, str):
            raise TypeError(f"mode must be a string or None, got {self.mode!r}")
        if self.mode is not None and self.backend != "inductor":
            raise ValueError(f"mode={self.mode!r} applies to the inductor backend only")
        if self.mode is not None:  # an unknown mode fails here, not at the first step
            import torch._inductor

            try:
                torch._inductor.list_mode_options(self.mode, self.dynamic)
            except RuntimeError as exc:
                raise ValueError(f"unknown inductor mode {self.mode!r}: {exc}") from None
        if self.dynamic not in (None, True, False):
            raise TypeError(f"dynamic must be None, True or False, got {self.dynamic!r}")
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"fullgraph must be a bool, got {self.fullgraph!r}")
        if self.options is not None and not isinstance(self.options, Mapping):
            raise TypeError(f"options must be a mapping, got {type(self.options).__name__}")


def compile_options(value: Any) -> CompileOptions | None:
    """``compile=`` as given to a step builder: None/False (eager), True, a ``CompileOptions``
    or a dict of its fields."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if isinstance(value, CompileOptions):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(CompileOptions)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"unknown compile options {unknown}; known: {sorted(known)}")
        return CompileOptions(**value)
    raise TypeError(
        f"compile must be a bool, a CompileOptions or a dict of its fields, got "
        f"{type(value).__name__}"
    )


# ---------------------------------------------------------------------- compiling one function


class _Backend:
    """The compiler ``torch.compile`` calls once per graph: counts graphs and compile time."""

    def __init__(self, options: CompileOptions) -> None:
        _prepare_dynamo()
        self.options = options
        self.compilations = 0
        self.seconds = 0.0
        patches: dict[str, Any] = {}
        if options.backend == "inductor":
            if options.mode is not None:
                patches.update(torch._inductor.list_mode_options(options.mode, options.dynamic))
            patches.update(options.options or {})
        elif options.options:
            raise ValueError("options (inductor config patches) apply to the inductor backend")
        self._patches = patches
        self._inner = (
            options.backend
            if callable(options.backend)
            else torch._dynamo.lookup_backend(options.backend)
            if options.backend != "inductor"
            else None
        )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        start = time.perf_counter()
        try:
            if self._inner is None:
                from torch._inductor.compile_fx import compile_fx

                compiled = compile_fx(gm, example_inputs, config_patches=self._patches)
            else:
                compiled = self._inner(gm, example_inputs)
        finally:
            self.seconds += time.perf_counter() - start
        self.compilations += 1  # graphs compiled (an attempt dynamo restarts is not one)
        return compiled


def _unique() -> str:
    """A name part no other graph has, in this process or any other: dynamo keeps what it
    learnt about a function (automatic dynamic shapes, also on disk as its profile-guided
    state) under its file, line and name, and a graph must not start from what another
    step's graph learnt (it would compile generic shapes, which round differently)."""
    return uuid.uuid4().hex[:16]


def _fresh(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own: dynamo keeps its graphs (and its recompilation
    limit) per code object, so each step's graphs live apart from every other step's."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _source_names(tree: Any, prefix: str) -> list[str]:
    """dynamo's source names of the int leaves of ``tree`` (struct fields, dict entries,
    tuple items), to mark them dynamic."""
    out: list[str] = []
    if isinstance(tree, bool):
        return out
    if isinstance(tree, int):
        return [prefix]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            out += _source_names(getattr(tree, f.name), f"{prefix}.{f.name}")
    elif isinstance(tree, dict):
        for k, v in tree.items():
            if isinstance(k, str):
                out += _source_names(v, f"{prefix}[{k!r}]")
    elif isinstance(tree, (tuple, list)):
        for i, v in enumerate(tree):
            out += _source_names(v, f"{prefix}[{i}]")
    return out


def _construct(exc: BaseException) -> str:
    """The first lines of dynamo's explanation (what it could not trace, and where)."""
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    keep = []
    for ln in lines:
        if ln.strip().startswith(
            ("Set TORCHDYNAMO_VERBOSE", "For more information", "Developer debug")
        ):
            continue
        keep.append(ln)
        if len(keep) >= 14:
            break
    return "\n".join(keep)


def _refuse_skip(exc: BaseException) -> None:
    """A loss function that skipped its batch inside a traced step: torch.compile reports
    the refusal wrapped in its own error; raise the refusal itself."""
    if SKIP_UNSUPPORTED in str(exc):
        raise ValueError(SKIP_UNSUPPORTED) from None


def _dynamo_error(exc: BaseException) -> bool:
    return isinstance(exc, torch._dynamo.exc.TorchDynamoException)


#: dynamo's source name of the optimizer state argument of the graphs below.
_OPT_SOURCE = "L['purestep_opt_state']"


def _mark_dynamic(sources: list[str]) -> None:
    """Add ``sources`` to ``torch.compiler.config.dynamic_sources`` (for good: patching the
    config around every call costs about 50 us). The names start with the argument name
    ``purestep_opt_state``, which only this module's graphs use."""
    config = torch.compiler.config
    known = [s for s in config.dynamic_sources.split(",") if s]
    new = [s for s in sources if s not in known]
    if new:
        config.dynamic_sources = ",".join(known + new)


class _Graph:
    """One function compiled with one step's options."""

    def __init__(self, fn: Callable[..., Any], name: str, backend: _Backend) -> None:
        opts = backend.options
        self.compiled = torch.compile(
            _fresh(fn, name), backend=backend, dynamic=opts.dynamic, fullgraph=opts.fullgraph
        )

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)


def _traceable_update(opt_state: Any) -> bool:
    """Whether the optimizer's state says its update can be traced (``inject_hyperparams``
    rebuilds its transform from Python floats read from tensors: it cannot)."""
    found = []

    def visit(x: Any) -> None:
        if isinstance(x, InjectHyperparamsState):
            found.append(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name))
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                visit(v)

    visit(opt_state)
    return not found


# ---------------------------------------------------------------------- the train step


@dataclasses.dataclass
class _Fused:
    """What the whole-step graph computed besides the gradients (held by ``Gradients``)."""

    params: dict[str, Tensor]
    opt_state: Any
    norms: tuple[Tensor, ...] | None


class _FusedGradients(Gradients):
    """``Gradients`` of a compiled whole step: the update is already computed."""


_COMPILED_CLASSES: dict[type, type] = {}


class _CompileCounts:
    """``compilations`` and ``compile_seconds`` of a compiled step, from its ``_backend``."""

    _backend: _Backend

    @property
    def compilations(self) -> int:
        return self._backend.compilations

    @property
    def compile_seconds(self) -> float:
        return self._backend.seconds


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
        versions = self._versions(state)
        try:
            with rng.scope(key, generators=self._rng_generators), self._ambient(True):
                out = graph(state.params, buffers, state.opt_state, acc, batch)
        except Exception as exc:
            _refuse_skip(exc)
            if not _dynamo_error(exc) or self._verified:
                raise
            return self._fused_failed(exc, state, batch, end_window)
        self._verified = True
        self._check_versions(state, versions, written=self._donate_backward)
        new_trainable, opt_state, new_buffers, grads, loss, metrics, norms = out
        output = self._output_type(loss, metrics, None, True, False)
        state = state.replace(buffers=new_buffers)
        fused = _Fused(self._merged(state.params, new_trainable), opt_state, norms)
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
        param_versions, kept, kept_versions = versions
        if written:
            return  # the graph wrote the donated parameters itself
        if [p._version for p in state.params.values()] != param_versions:
            _raise_params_modified(modified_in_place(state.params, param_versions))
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
            from .step import _unaliased

            safe = _unaliased(output.metrics, state)
            if safe is not output.metrics:  # the usual: nothing shared, no new output
                output = output.replace(metrics=safe)
        new_state = state.replace(
            params=fused.params,
            opt_state=fused.opt_state,
            progress=advance_progress(state.progress, grads.batch_size, True),
            grad_accum=None,
        )
        return new_state, output.replace(grad_norms=fused.norms)


# ---------------------------------------------------------------------- eval and predict


class _CompiledForward(_CompileCounts):
    """The eval/predict steps' forward pass as a compiled graph (no grad, eval mode)."""

    def _init_compiled(self, options: CompileOptions | None) -> None:
        self.options = options if options is not None else CompileOptions()
        self._backend = _Backend(self.options)
        self._compiled_graph: _Graph | None = None

    def _forward(self, params: dict, buffers: dict, batch: Any) -> Any:
        graph = self._compiled_graph
        if graph is None:
            binder, fn, precision = self.binder, self.fn, self.strategy.precision

            def forward_graph(params, buffers, batch):
                with binder.bind(params, buffers, False) as apply, precision.autocast():
                    return fn(apply, batch)

            name = f"purestep_{type(self).__name__}_{_unique()}"
            graph = self._compiled_graph = _Graph(forward_graph, name, self._backend)
        try:
            return graph(params, buffers, batch)
        except Exception as exc:
            if not _dynamo_error(exc):
                raise
            super()._forward(params, buffers, batch)  # the function's own error, if any
            from .user_errors import describe_function

            raise CompileError(
                f"torch.compile could not trace {self._stage} of {describe_function(self.fn)} "
                f"as one graph (fullgraph=True), though it runs eagerly:\n{_construct(exc)}\n"
                "Fallbacks: compile=CompileOptions(fullgraph=False), or compile=False."
            ) from exc


class CompiledEvalStep(_CompiledForward, EvalStep):
    """An ``EvalStep`` whose forward pass is compiled."""

    def __init__(self, *args: Any, options: CompileOptions | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._init_compiled(options)


class CompiledPredictStep(_CompiledForward, PredictStep):
    """A ``PredictStep`` whose forward pass is compiled."""

    def __init__(self, *args: Any, options: CompileOptions | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._init_compiled(options)


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
