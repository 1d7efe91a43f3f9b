"""Compiling one function of a step: the ``torch.compile`` backend that counts graphs and
compile time, a code object per graph, the optimizer counters marked dynamic, and reading
dynamo's errors.

These are the pieces the compiled train step (``engine.compile``) and the compiled
eval/predict steps (``engine.compile_forward``) share; neither step kind lives here.
"""

from __future__ import annotations

import dataclasses
import time
import types
import uuid
from collections.abc import Callable
from typing import Any

import torch

from . import compile_guards
from .compile_options import CompileOptions
from .loss_output import SKIP_UNSUPPORTED
from .optim import base as optim_base
from .optim.hyperparams import InjectHyperparamsState

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


class _Backend:
    """The compiler ``torch.compile`` calls once per graph: counts graphs and compile time."""

    def __init__(self, options: CompileOptions) -> None:
        _prepare_dynamo()
        self.options = options
        self.compilations = 0
        self.seconds = 0.0
        patches: dict[str, Any] = {}
        if options.backend == "inductor":
            if options.guards == "engine":
                # the inputs' sizes and strides are guarded on every call: inductor's own
                # asserts of them inside the graph are the same check again
                patches["size_asserts"] = False
            if options.mode is not None:
                patches.update(torch._inductor.list_mode_options(options.mode, options.dynamic))
            patches.update(options.options or {})
        elif options.options:
            raise ValueError("options (inductor config patches) apply to the inductor backend")
        self._patches = patches
        self._direct: list[Any] = []  # the DirectCalls of this backend's graphs
        self._inner = (
            options.backend
            if callable(options.backend)
            else torch._dynamo.lookup_backend(options.backend)
            if options.backend != "inductor"
            else None
        )

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: the graphs' direct entries go with dynamo's."""
        for direct in self._direct:
            direct.forget()

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


#: dynamo's source name of the optimizer state argument of the train step's graphs
#: (``engine.compile``).
_OPT_SOURCE = "L['purestep_opt_state']"


def _mark_dynamic(sources: list[str]) -> None:
    """Add ``sources`` to ``torch.compiler.config.dynamic_sources`` (for good: patching the
    config around every call costs about 50 us). The names start with the argument name
    ``purestep_opt_state``, which only the compiled train step's graphs use."""
    config = torch.compiler.config
    known = [s for s in config.dynamic_sources.split(",") if s]
    new = [s for s in sources if s not in known]
    if new:
        config.dynamic_sources = ",".join(known + new)


class _Graph:
    """One function compiled with one step's options, at the guard floor of
    ``engine.compile_guards`` under ``guards="engine"``."""

    def __init__(self, fn: Callable[..., Any], name: str, backend: _Backend) -> None:
        opts = backend.options
        fresh = _fresh(fn, name)
        floor = opts.guards == "engine" and compile_guards.supports_guard_filter()
        inputs = fresh.__code__.co_varnames[: fresh.__code__.co_argcount]
        self.compiled = torch.compile(
            fresh,
            backend=backend,
            dynamic=opts.dynamic,
            fullgraph=opts.fullgraph,
            options={"guard_filter_fn": compile_guards.guard_filter(inputs)} if floor else None,
        )
        self._direct = compile_guards.DirectCalls(fresh) if floor and opts.fullgraph else None
        if self._direct is not None:
            backend._direct.append(self._direct)

    def __call__(self, *args: Any) -> Any:
        direct = self._direct
        if direct is None:
            return self.compiled(*args)
        out = direct.run(args)
        if out is direct.MISS:
            out = self.compiled(*args)
            direct.refresh()
        return out


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


class _CompileCounts:
    """``compilations`` and ``compile_seconds`` of a compiled step, from its ``_backend``."""

    _backend: _Backend

    @property
    def compilations(self) -> int:
        return self._backend.compilations

    @property
    def compile_seconds(self) -> float:
        return self._backend.seconds
