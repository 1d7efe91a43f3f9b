"""Per-example gradients and DP-SGD: a train step that clips each example's gradient.

``per_sample_step(model, loss_fn, optimizer, max_grad_norm=C, noise_multiplier=s)`` builds
a ``PerSampleStep`` (a ``TrainStep``: same ``step(state, batch)``, ``backward`` / ``apply``
halves and ``StepOutput``) whose backward pass is DP-SGD's:

1. per-example gradients with ``torch.func.vmap(torch.func.grad(...))`` over the batch's
   leading axis (``loss_fn`` sees each example as a batch of one);
2. each example's gradient scaled by ``min(1, C / (norm + 1e-6))``, ``norm`` its global L2
   norm over all trainable parameters, and summed over the batch;
3. Gaussian noise ``N(0, (s * C)^2)`` added to every coordinate of the sum, drawn from
   ``rng.generator(fold_in(state.rng, Purpose.NOISE, step, rank))`` (so the noise is a pure
   function of the state and differs at every step); with W processes each adds
   ``N(0, (s * C)^2 / W)``, so the summed noise has the single-process variance;
4. divided by the batch size, averaged over processes, then the optimizer step.

Dropout runs under the step's scoped key with ``randomness="different"`` (every example
draws its own mask). Models with BatchNorm are refused: with batch statistics one example's
output depends on the others, so a per-example gradient is not defined (use GroupNorm or
LayerNorm). ``out.loss`` is the mean of the per-example losses; a plain tensor metric is
averaged over the examples and a ``engine.metrics`` metric merged over them.

``compile=True`` (or a ``CompileOptions``) gives a ``CompiledPerSampleStep``: steps 1 and
2 as one compiled graph, the noise drawn eagerly as above (bitwise the same noise), then the
update, compiled when it traces.

Privacy accounting (turning ``s``, the sampling rate and the number of steps into
``(epsilon, delta)``) is not done here; the data order decides the sampling.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from . import compile as compile_lib
from . import metrics as metrics_lib
from . import optim, rng, user_errors
from .state import TrainState
from .step import (
    Gradients,
    LossFn,
    StepOutput,
    TrainStep,
    check_unchanged,
    detached,
    loss_for_grad,
    split_output,
)
from .strategy import Strategy
from .tree import NAMESPACE

__all__ = [
    "CompiledPerSampleStep",
    "PerSampleStep",
    "clip_per_sample",
    "clipped_sum",
    "gaussian_noise",
    "per_sample_norms",
    "per_sample_step",
]

Tensor = torch.Tensor


# --------------------------------------------------------------------------- the arithmetic


def per_sample_norms(grads: dict[str, Tensor]) -> Tensor:
    """Each example's global L2 norm over all tensors of ``grads`` (values ``[B, ...]``)."""
    tensors = list(grads.values())
    if not tensors:
        raise ValueError("per_sample_norms needs at least one gradient tensor")
    n = tensors[0].shape[0]
    per_tensor = [torch.linalg.vector_norm(g.reshape(n, -1), 2.0, dim=1) for g in tensors]
    return torch.linalg.vector_norm(torch.stack(per_tensor, dim=-1), 2.0, dim=-1)


def _clip_coefficients(grads: dict[str, Tensor], max_norm: float) -> Tensor:
    return torch.clamp(max_norm / (per_sample_norms(grads) + 1e-6), max=1.0)


def clip_per_sample(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """Every example's gradient scaled by ``min(1, max_norm / (its norm + 1e-6))``."""
    coef = _clip_coefficients(grads, max_norm)
    return {n: g * coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}


def clipped_sum(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """The sum over examples of the clipped per-example gradients (one contraction each)."""
    coef = _clip_coefficients(grads, max_norm)
    return {n: torch.tensordot(coef.to(g.dtype), g, dims=1) for n, g in grads.items()}


def gaussian_noise(like: dict[str, Tensor], std: float, key: int) -> dict[str, Tensor]:
    """``N(0, std^2)`` tensors shaped like ``like``, drawn in order from a generator of ``key``."""
    out = {}
    generators: dict[torch.device, torch.Generator] = {}
    for name, t in like.items():
        g = generators.get(t.device)
        if g is None:
            g = generators[t.device] = rng.generator(key, t.device)
        out[name] = torch.randn(t.shape, generator=g, dtype=t.dtype, device=t.device) * std
    return out


def _reduce_examples(metrics: dict[str, Any]) -> dict[str, Any]:
    """Per-example metrics combined over the example axis: tensors averaged, metrics merged."""

    def one(value: Any) -> Any:
        if isinstance(value, metrics_lib.Metric):
            return _merge_examples(value)
        if isinstance(value, Tensor):
            return value.mean(0) if value.is_floating_point() else value.double().mean(0)
        return value

    return optree.tree_map(
        one,
        metrics,
        is_leaf=lambda x: isinstance(x, metrics_lib.Metric),
        namespace=NAMESPACE,
    )


def _merge_examples(metric: metrics_lib.Metric) -> metrics_lib.Metric:
    """A metric whose fields carry an example axis merged over it, in order (pairwise)."""
    leaves, spec = optree.tree_flatten(metric, namespace=NAMESPACE)
    n = leaves[0].shape[0]
    while n > 1:
        half = n // 2
        first = optree.tree_unflatten(spec, [t[0 : 2 * half : 2] for t in leaves])
        second = optree.tree_unflatten(spec, [t[1 : 2 * half : 2] for t in leaves])
        merged = optree.tree_leaves(first.merge(second), namespace=NAMESPACE)
        if n % 2:
            merged = [torch.cat([m, t[n - 1 :]]) for m, t in zip(merged, leaves)]
        leaves, n = merged, half + n % 2
    return optree.tree_unflatten(spec, [t[0] for t in leaves])


# --------------------------------------------------------------------------- the step


def _batchnorms(model: nn.Module) -> list[str]:
    return [
        name or type(model).__name__
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def _check_real(name: str, value: Any, *, positive: bool) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or (value <= 0 if positive else value < 0)
    ):
        raise ValueError(
            f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}"
        )
    return float(value)


class PerSampleStep(TrainStep):
    """A DP-SGD train step (see the module doc); ``per_sample_grads`` exposes step 1."""

    _stage = "per_sample_step"  # the first call's unused-parameter check: the whole batch

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: optim.GradientTransformation,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        strategy: Strategy | None = None,
        donate: bool = False,
        grad_norm: bool = True,
        chunk_size: int | None = None,
        allow_unused: bool = False,
    ) -> None:
        super().__init__(
            model,
            loss_fn,
            optimizer,
            strategy=strategy,
            donate=donate,
            grad="func",
            grad_norm=grad_norm,
            allow_unused=allow_unused,
        )
        self.max_grad_norm = _check_real("max_grad_norm", max_grad_norm, positive=True)
        self.noise_multiplier = _check_real("noise_multiplier", noise_multiplier, positive=False)
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
        self.chunk_size = chunk_size
        norms = _batchnorms(model)
        if norms:
            raise ValueError(
                f"per-sample gradients are undefined for a model with BatchNorm ({norms}): "
                "with batch statistics each example's output depends on the whole batch. "
                "Use GroupNorm or LayerNorm (or freeze the statistics in a module of your own)"
            )
        if self.strategy.precision.scaler is not None:
            raise ValueError(
                f"precision {self.strategy.precision.name!r} scales the loss; per-sample "
                "clipping needs unscaled per-example gradients: use 'bf16-mixed' or a "
                "'-true' precision"
            )

    def __repr__(self) -> str:
        return (
            f"PerSampleStep(model={type(self.model).__name__}, strategy={self.strategy!r}, "
            f"max_grad_norm={self.max_grad_norm}, noise_multiplier={self.noise_multiplier})"
        )

    def per_sample_grads(
        self, state: TrainState, batch: Any
    ) -> tuple[dict[str, Tensor], Tensor, dict[str, Any]]:
        """``(grads, losses, metrics)`` of every example: ``grads[name]`` is ``[B, ...]``,
        ``losses`` is ``[B]``, metric leaves carry the example axis. Pure; the step's key."""
        if not self._checked:
            self._first_call(state)
        strategy = self.strategy
        batch = strategy.precision.convert_input(strategy.place(batch))
        return self._per_sample(state, batch)

    def _per_sample(self, state: TrainState, batch: Any) -> tuple:
        """Step 1 eagerly: the probe for unused parameters, the step's key, the purity checks
        around ``_vmapped``."""
        key = self._train_key(state)
        params, buffers = state.params, state.buffers
        if not self._probed:  # torch.func.grad gives unused parameters zeros silently
            self._probe_unused(params, buffers, batch, key, 1.0, 1)
        # The buffers are bound as they are (no BatchNorm here): a forward pass that writes
        # them or the parameters in place is refused, by version counter, after the fact.
        param_versions = [p._version for p in params.values()]
        buffer_versions = [b._version for b in buffers.values()]
        with rng.scope(key, generators=self._rng_generators):
            grads, losses, metrics = self._vmapped(params, buffers, batch)
        check_unchanged(params, param_versions, buffers, buffer_versions, "a per-sample step")
        return grads, losses.detach(), detached(metrics)

    def _train_key(self, state: TrainState) -> int:
        progress = state.progress
        return rng.fold_in(state.rng, rng.Purpose.TRAIN, progress.step, 0, self.strategy.rank)

    def _vmapped(self, params: dict, buffers: dict, batch: Any) -> tuple:
        """``(grads, losses, metrics)`` of every example by ``vmap(grad(...))``: no key, no
        checks (the caller seeds the generators; a compiled step traces this)."""
        frozen = {n: params[n] for n in self._frozen}
        wrt = self._trainable(params)
        binder, loss_fn, precision = self.binder, self.loss_fn, self.strategy.precision
        stage = "per_sample_step (one example, under vmap)"
        split: list[Any] = [None, None, None]  # spec, tensor mask, non-tensor leaves

        def objective(wrt: dict, example: Any) -> tuple:
            one = torch_pytree.tree_map(
                lambda x: x.unsqueeze(0) if isinstance(x, Tensor) else x, example
            )
            with binder.bind({**frozen, **wrt}, buffers, True) as apply, precision.autocast():
                try:
                    out = loss_fn(apply, one)
                except Exception as exc:
                    user_errors.annotate(exc, loss_fn, stage, one)
                    raise
                loss, metrics = split_output(out, "loss_fn")
            if not metrics:  # (dynamo cannot trace optree's flattening of an empty dict)
                return loss_for_grad(loss, 1.0, 1), (loss.reshape(()), [])
            flat, split[0] = optree.tree_flatten(metrics, namespace=NAMESPACE)
            split[1] = [isinstance(x, Tensor) for x in flat]
            split[2] = [x for x in flat if not isinstance(x, Tensor)]
            tensors = [x for x in flat if isinstance(x, Tensor)]
            return loss_for_grad(loss, 1.0, 1), (loss.reshape(()), tensors)

        in_dims = torch_pytree.tree_map(lambda x: 0 if isinstance(x, Tensor) else None, batch)
        fn = torch.func.vmap(
            torch.func.grad(objective, has_aux=True),
            in_dims=(None, in_dims),
            randomness="different",
            chunk_size=self.chunk_size,
        )
        grads, (losses, tensors) = fn(wrt, batch)
        if split[0] is None:
            return dict(grads), losses, {}
        ts, others = iter(tensors), iter(split[2])
        metrics = optree.tree_unflatten(
            split[0], [next(ts) if m else next(others) for m in split[1]]
        )
        return dict(grads), losses, metrics

    def _clipped(self, state: TrainState, batch: Any) -> tuple:
        """``(sum of the clipped per-example gradients, losses, metrics)``: steps 1 and 2."""
        grads, losses, metrics = self._per_sample(state, batch)
        return clipped_sum(grads, self.max_grad_norm), losses, metrics

    def backward(
        self, state: TrainState, batch: Any, *, end_window: bool | None = None
    ) -> tuple[TrainState, Gradients]:
        """Per-example gradients, clipped, summed, noised and averaged (ready for ``apply``).

        Every call closes its window (no gradient accumulation; ``end_window`` is ignored).
        """
        if not self._checked:
            self._first_call(state)
        strategy, progress = self.strategy, state.progress
        batch = strategy.precision.convert_input(strategy.place(batch))
        summed, losses, metrics = self._clipped(state, batch)
        n = losses.shape[0]
        if self.noise_multiplier > 0:
            std = self.noise_multiplier * self.max_grad_norm / math.sqrt(strategy.world_size)
            key = rng.fold_in(state.rng, rng.Purpose.NOISE, progress.step, strategy.rank)
            noise = gaussian_noise(summed, std, key)
            summed = dict(
                zip(summed, torch._foreach_add(list(summed.values()), list(noise.values())))
            )
        # New tensors from the contraction and the foreach ops, never aliasing each other:
        # no need for owned_gradients here.
        mean = dict(zip(summed, torch._foreach_div(list(summed.values()), float(n))))
        if strategy.world_size > 1:
            mean = strategy.all_reduce(mean, "mean")
        output = StepOutput(losses.mean(), _reduce_examples(metrics), None, True, False)
        return state, Gradients(mean, True, output, n)


def per_sample_step(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: optim.GradientTransformation,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    strategy: Strategy | None = None,
    donate: bool = False,
    grad_norm: bool = True,
    chunk_size: int | None = None,
    allow_unused: bool = False,
    compile: Any = False,
) -> PerSampleStep:
    """Build a DP-SGD step ``step(state, batch) -> (new_state, StepOutput)``.

    ``max_grad_norm``: the bound C on each example's gradient norm; ``noise_multiplier``:
    the noise standard deviation in units of C (0 disables the noise: per-example clipping
    only). ``chunk_size``: examples per vmap chunk (bounds the memory of the per-example
    gradients; None does the whole batch at once; chunks round differently and draw their
    dropout masks separately, so results depend on it). ``grad_norm`` reports the norm of the
    final (noised, averaged) gradient. ``allow_unused``: parameters the loss does not use
    get a zero per-example gradient (then only noise) instead of an error; the check costs
    one ordinary forward and backward pass on the first call. See the module doc for the
    exact arithmetic. ``compile``: True, a ``CompileOptions`` or a dict of its fields compiles
    steps 1 and 2 (per-example gradients, clipping, sum) into one graph; the noise is drawn
    eagerly as without compilation, then the update runs (compiled when it traces). See
    ``CompiledPerSampleStep``.
    """
    options = compile_lib.compile_options(compile)
    step = PerSampleStep(
        model,
        loss_fn,
        optimizer,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        strategy=strategy,
        donate=donate,
        grad_norm=grad_norm,
        chunk_size=chunk_size,
        allow_unused=allow_unused,
    )
    return step if options is None else compile_lib.CompiledTrainStep.of(step, options)


class CompiledPerSampleStep(compile_lib.CompiledTrainStep, PerSampleStep):
    """A ``PerSampleStep`` in two compiled pieces (``per_sample_step(..., compile=...)``).

    The per-example gradients (``vmap`` over ``torch.func.grad``), their clipping and their
    sum are one graph; the Gaussian noise is then drawn eagerly from the key-derived
    ``torch.Generator`` (which does not trace), exactly as the eager step draws it, so the
    same key gives bitwise the same noise; the optimizer update follows, compiled when it
    traces (``compilations`` counts both graphs). Dropout inside the graph draws from the
    generators seeded with the step's key around the call (a pure function of the key; the
    masks may differ from the eager step's). Compiled and eager steps agree to float32
    rounding, not bitwise (different kernels); a compiled run repeats bitwise.
    """

    def _first_call(self, state: TrainState) -> None:
        super()._first_call(state)
        self.fused = False  # the noise between gradient and update is drawn eagerly

    def _clipped_graph(self) -> Any:
        inner, max_norm = self._traced(), self.max_grad_norm

        def per_sample_graph(params, buffers, batch):
            grads, losses, metrics = inner._vmapped(params, buffers, batch)
            return clipped_sum(grads, max_norm), losses, metrics

        return self._graph(("per_sample",), per_sample_graph)

    def _clipped(self, state: TrainState, batch: Any) -> tuple:
        key = self._train_key(state)
        params, buffers = state.params, state.buffers
        if not self._probed:
            self._probe_unused(params, buffers, batch, key, 1.0, 1)
        graph = self._clipped_graph()
        param_versions = [p._version for p in params.values()]
        buffer_versions = [b._version for b in buffers.values()]
        try:
            with rng.scope(key, generators=self._rng_generators):
                summed, losses, metrics = graph(params, buffers, batch)
        except Exception as exc:
            if not compile_lib._dynamo_error(exc):
                raise
            PerSampleStep._clipped(self, state, batch)  # the loss function's own error, if any
            from .user_errors import describe_function

            raise compile_lib.CompileError(
                "torch.compile could not trace the per-example gradients of "
                f"{describe_function(self.loss_fn)} as one graph (fullgraph=True), though "
                f"they run eagerly:\n{compile_lib._construct(exc)}\nFallbacks: "
                "compile=CompileOptions(fullgraph=False), or compile=False."
            ) from exc
        check_unchanged(params, param_versions, buffers, buffer_versions, "a per-sample step")
        return summed, losses.detach(), detached(metrics)


compile_lib._COMPILED_CLASSES[PerSampleStep] = CompiledPerSampleStep
