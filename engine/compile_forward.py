"""The compiled eval and predict steps: their forward pass traced as one graph (no grad, eval
mode), with the eager step's own error first where the function fails eagerly too."""

from __future__ import annotations

from typing import Any

from .compile_graphs import _Backend, _CompileCounts, _construct, _dynamo_error, _Graph, _unique
from .compile_options import CompileError, CompileOptions
from .eval_steps import EvalStep, PredictStep

__all__ = ["CompiledEvalStep", "CompiledPredictStep"]


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
