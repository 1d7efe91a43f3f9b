"""Tensor parallelism from torch's ``parallelize_module`` plans, data parallel on a 2-D mesh.

``hardware.tensor_parallel(plan, mesh_shape=(dp, tp))`` is called in every worker process
(``torchrun`` or ``hardware.launch``), like ``hardware.ddp()``, whose process group,
collectives, buffer policy and rank-0 effects it shares (``TensorParallel`` is a ``DDP``).
The ranks form a ``("dp", "tp")`` ``DeviceMesh`` (``hardware.tp_layout.device_mesh``): ``dp``
data-parallel replicas, each split over ``tp`` consecutive ranks that share one model.

**The plan** is what ``torch.distributed.tensor.parallel.parallelize_module`` takes: a dict
``submodule name -> ParallelStyle`` (``ColwiseParallel()``, ``RowwiseParallel()``,
``SequenceParallel()``, ``PrepareModuleInput(...)``, ...; names may hold ``*`` patterns) or
one style for the whole model. It is applied on the "tp" dimension to a private copy of the
model on the meta device: that copy is the steps' template, so the plan's input and output
hooks (turning activations into DTensors and back, the all-reduce after a row-wise layer, the
all-gather before a column-wise one) run in every forward pass; the user's model is never
changed.

**State.** ``engine.init(model, opt, strategy=tp)`` builds the state as DDP does (rank 0's
values on every rank), then lays each parameter out as the plan does: a ``DTensor`` on the
"tp" mesh (``Shard(0)`` for a column-wise weight, ``Shard(1)`` for a row-wise one,
``Replicate()`` for what the plan replicates or leaves alone), the same on every replica. The
optimizer's ``init`` runs on those DTensors, so its moments are laid out alike. With
``data_parallel="fsdp"`` each replica's parts are sharded over "dp" as well: 2-D DTensors on
the whole mesh, ``Shard`` over "dp" along the first dimension the plan leaves whole
(``(Shard(1), Shard(0))`` for a column-wise weight; a 1-D tensor the plan shards stays
whole over "dp"; ``tp_layout.replica_placements``), so a rank holds about ``1/(dp*tp)`` of
the parameters and optimizer state. Buffers stay plain tensors, kept in step by the
``buffers=`` policy. ``engine.checkpoint.sharded`` saves
such a state and loads it at another mesh shape or into a plain state (``full_state`` /
``shard_state`` convert by hand).

**Step.** The state's DTensors are bound into the template; ``torch.autograd.grad`` gives
DTensor gradients laid out as the parameters (a gradient the plan leaves ``Partial``, such as
a ``SequenceParallel`` norm weight's, is all-reduced over "tp" to the parameter's layout).
When a window closes they are averaged over the "dp" dimension only (one bucketed
all-reduce of their local tensors per replica group: ranks of one tensor-parallel group hold
different parts). The optimizer (any ``engine.optim`` transform) runs on the local tensors;
the norms it takes (global-norm clipping, ``skip_nonfinite``) and the reported gradient norm
are those of the full tensors (``tp_layout.plan_norms``; a replicated tensor counts once).
Accumulation adds DTensor gradients. Eval and predict steps bind the same way.

Under ``data_parallel="fsdp"`` each micro-batch first gathers every parameter's
tensor-parallel part over "dp" (one all-gather per parameter, the whole model at once: no
units, no prefetch, no resharding after the forward pass, unlike ``hardware.fsdp``), and the
backward pass reduce-scatters each gradient back to the rank's shard, averaged over "dp"
(``tp_layout.tp_part``); the closing window then reduces nothing more.

**Data and randomness.** The ranks of one tensor-parallel group compute on the same batch:
``data_options()`` shards the data over the "dp" dimension (rank = the replica's index), and
each step's key folds in the replica's index instead of the rank, so dropout on replicated
activations draws the same mask on every rank of the group (on sharded activations each
rank draws its part from the same stream: deterministic, but not the masks one process
would draw). ``sync_metrics`` merges over the "dp" dimension (each replica's ranks logged the
same values).

**Overlap.** Under "ddp", gradients are reduced over "dp" once per optimizer step, after the
backward pass (as ``engine.train_step`` does for DDP); under "fsdp" each gradient is
reduce-scattered as soon as the backward pass produces it, blocking. The plan's own
collectives run where ``parallelize_module`` puts them, in the forward and backward passes,
not overlapped.
``grad="func"`` (vmap), loss-scaling precisions ("16-mixed") and ``engine.compile`` are not
supported.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
from torch import nn

from purestep.engine import metrics, optim
from purestep.engine.eval_steps import EvalStep, PredictStep
from purestep.engine.loss_scale import DynamicLossScale
from purestep.engine.step import TrainStep, loss_for_grad, scalar_gradients
from purestep.engine.strategy import Precision

from . import tp_layout
from .collectives import all_reduce_tree
from .ddp import DDP, ddp

__all__ = [
    "DATA_PARALLEL_MODES",
    "TensorParallel",
    "TensorParallelEvalStep",
    "TensorParallelPredictStep",
    "TensorParallelTrainStep",
    "tensor_parallel",
]

#: How the "dp" dimension of the mesh keeps its replicas in step.
DATA_PARALLEL_MODES = ("ddp", "fsdp")


class TensorParallel(DDP):
    """One rank of a tensor-parallel run; build it with ``hardware.tensor_parallel(plan)``."""

    def __init__(
        self, base: DDP, plan: Any, *, mesh_shape: Any = None, data_parallel: str = "ddp"
    ) -> None:
        if data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {data_parallel!r}"
            )
        # per_run=False: the state's DTensors live on the mesh, so the group must stay
        super().__init__(**{**base._settings(), "per_run": False})
        if base.precision.scaler is not None:
            raise ValueError(
                f"precision {base.precision.name!r} scales the loss, which tensor_parallel "
                "does not support (each rank would decide on overflow from its own shards); "
                "use 'bf16-mixed' or full precision"
            )
        self.plan = tp_layout.check_plan(plan)
        self.mesh_shape = tp_layout.check_mesh_shape(mesh_shape, base.world_size)
        self.mesh = tp_layout.device_mesh(self.mesh_shape, self.device.type)
        self.tp_mesh = self.mesh["tp"]
        self.dp_group = self.mesh.get_group("dp")
        self.tp_group = self.mesh.get_group("tp")
        self.dp_rank, self.tp_rank = self.mesh.get_coordinate()
        self.dp_size, self.tp_size = self.mesh_shape
        self.data_parallel = data_parallel
        #: Whether the parameters are sharded over "dp" too (2-D DTensors).
        self.replica_sharded = data_parallel == "fsdp"
        #: The mesh the state's DTensors live on, and the group norms over them reduce on.
        self.state_mesh = self.mesh if self.replica_sharded else self.tp_mesh
        self.norm_group = None if self.replica_sharded else self.tp_group
        self._layout: dict[str, tuple[Any, ...]] | None = None

    def __repr__(self) -> str:
        return (
            f"TensorParallel(rank={self.rank}/{self.world_size}, mesh=(dp={self.dp_size}, "
            f"tp={self.tp_size}), data_parallel={self.data_parallel!r}, device={self.device}, "
            f"precision={self.precision.name!r})"
        )

    def data_options(self) -> dict[str, int]:
        """The data is sharded over the replicas: every rank of a tensor-parallel group
        reads the same batches."""
        return {"rank": self.dp_rank, "world_size": self.dp_size}

    # ------------------------------------------------------------------ layout

    def template(self, model: nn.Module) -> nn.Module:
        """The steps' template: a meta-device copy of ``model`` with the plan applied."""
        return tp_layout.parallelized(model, self.plan, self.tp_mesh)

    def layout(self, model: nn.Module) -> dict[str, tuple[Any, ...]]:
        """``parameter name -> placements on the "tp" mesh`` that the plan gives ``model``."""
        return tp_layout.layout(self.template(model))

    def state_placements(self, name_shapes: dict[str, Any], layout: dict) -> dict[str, tuple]:
        """``parameter name -> placements of the state's DTensor`` on ``state_mesh``: the
        plan's (``data_parallel="ddp"``), or sharded over "dp" as well ("fsdp")."""
        if not self.replica_sharded:
            return dict(layout)
        return {n: tp_layout.replica_placements(tuple(name_shapes[n]), layout[n]) for n in layout}

    # ------------------------------------------------------------------ state

    def build_state(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        """As DDP's; notes the plan's layout of ``model`` for ``prepare_state``."""
        self._layout = self.layout(model)
        return super().build_state(model, optimizer, **kwargs)

    def prepare_state(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Rank 0's parameters laid out as the plan does (DTensors) and its buffers (plain)."""
        layout = self._layout
        if layout is None or set(layout) != set(params):
            raise ValueError(
                "tensor_parallel lays parameters out by the model's plan: build the state "
                "with engine.init(model, optimizer, strategy=tensor_parallel(...))"
            )
        params, buffers = super().prepare_state(params, buffers)
        return self._distribute(params, layout), buffers

    def _distribute(self, params: dict[str, torch.Tensor], layout: dict) -> dict[str, Any]:
        shapes = {n: p.shape for n, p in params.items()}
        placements = self.state_placements(shapes, layout)
        mesh = self.state_mesh
        return {n: tp_layout.distribute(p, mesh, placements[n]) for n, p in params.items()}

    def shard_state(self, state: Any, model: nn.Module | None = None) -> Any:
        """A plain ``TrainState`` (full tensors, the same on every rank: one loaded from an
        ordinary checkpoint, say) laid out by the plan for ``model`` (default: the model of
        the last ``engine.init`` under this strategy): the parameters, and every
        optimizer-state tensor shaped like its parameter (the others replicated)."""
        layout = self._layout if model is None else self.layout(model)
        if layout is None or set(layout) != set(state.params):
            raise ValueError(
                "shard_state needs the model whose plan lays the state out: pass it, or "
                "build a state with engine.init(model, optimizer, strategy=...) first"
            )
        params = self._distribute(dict(state.params), layout)
        from torch.distributed.tensor import Replicate

        def one(path: str, x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            name = _param_of(path, params)
            if name is not None and tuple(x.shape) == tuple(params[name].shape):
                return tp_layout.distribute(x, self.state_mesh, params[name].placements)
            whole = (Replicate(),) * self.state_mesh.ndim
            return tp_layout.distribute(x, self.state_mesh, whole)

        from purestep.engine.tree import flatten_with_paths, structure, unflatten

        flat = flatten_with_paths(state.opt_state)
        opt_state = unflatten(structure(state.opt_state), [one(p, x) for p, x in flat])
        return state.replace(params=params, opt_state=opt_state)

    @staticmethod
    def full_state(state: Any) -> Any:
        """The plain ``TrainState`` a laid-out one stands for (all-gathers; every rank calls)."""
        from purestep.hardware import sharding

        return state.replace(
            params=sharding.full_tree(state.params),
            opt_state=sharding.full_tree(state.opt_state),
            grad_accum=sharding.full_tree(state.grad_accum),
        )

    # ------------------------------------------------------------------ steps

    def build_train_step(self, model: Any, loss_fn: Any, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs.get("grad", "autograd") != "autograd":
            raise ValueError("tensor_parallel supports grad='autograd' only (not torch.func)")
        return TensorParallelTrainStep(model, loss_fn, optimizer, strategy=self, **kwargs)

    def build_eval_step(self, model: Any, fn: Any) -> Any:
        return TensorParallelEvalStep(self.template(model), fn, _ReplicaView(self))

    def build_predict_step(self, model: Any, fn: Any) -> Any:
        return TensorParallelPredictStep(self.template(model), fn, _ReplicaView(self))

    # ------------------------------------------------------------------ collectives

    def all_reduce_replicas(self, tree: Any, op: str = "mean") -> Any:
        """``tree`` reduced over the "dp" dimension (this rank's replica group): DTensors by
        their local tensors, laid out as they were."""
        if self.dp_size == 1:
            return tree
        self._ready()
        local = tp_layout.localize(tree)
        reduced = all_reduce_tree(local, op, group=self.dp_group, timeout=self.timeout)
        return tp_layout.rewrap_like(reduced, tree)

    def sync_metrics(self, tree: Any) -> Any:
        """Metrics merged over the replicas (the ranks of one replica logged the same)."""
        return metrics.sync(tree, self.all_reduce_replicas, device=self._small_device())

    def gradient_norms(self, tensors: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
        """The ``ord``-norms of the full gradients (DTensors, as the train step hands them
        out): what the loop's ``track_grad_norm`` logs, the same on every rank."""
        return _norms(list(tensors), ord, self.norm_group)


def _param_of(path: str, params: dict[str, Any]) -> str | None:
    """The parameter an optimizer-state path ends with (``.exp_avg['0.weight']`` ->
    ``0.weight``), as ``engine.tree.flatten_with_paths`` writes dict keys."""
    for name in params:
        if path.endswith(f"[{name!r}]"):
            return name
    return None


def _norms(tensors: list[Any], ord: float, group: Any) -> list[torch.Tensor]:
    counts = [tp_layout.counted(t, group) for t in tensors]
    return tp_layout.tp_norms(tp_layout.localize(tensors), counts, float(ord), group)


class _ReplicaView:
    """The strategy as a step sees it: ``rank`` is the replica's index (the ranks of one
    tensor-parallel group draw the same keys) and ``all_reduce`` averages over the "dp"
    dimension only."""

    def __init__(self, strategy: TensorParallel) -> None:
        self._strategy = strategy
        self.rank = strategy.dp_rank

    def all_reduce(self, tree: Any, op: str = "mean") -> Any:
        return self._strategy.all_reduce_replicas(tree, op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)

    def __repr__(self) -> str:
        return repr(self._strategy)


class TensorParallelTrainStep(TrainStep):
    """``engine.TrainStep`` over a state laid out by a plan (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Any,
        optimizer: Any,
        *,
        strategy: TensorParallel,
        **kw: Any,
    ) -> None:
        template = strategy.template(model)
        super().__init__(template, loss_fn, optimizer, strategy=_ReplicaView(strategy), **kw)  # type: ignore[arg-type]
        self.tp = strategy
        self.placements = tp_layout.layout(template)  # on the "tp" mesh
        shapes = {n: p.shape for n, p in template.named_parameters()}
        self.state_placements = strategy.state_placements(shapes, self.placements)

    def _check(self, state: Any) -> None:
        super()._check(state)
        from torch.distributed.tensor import DTensor

        bad = [
            n
            for n, p in state.params.items()
            if not isinstance(p, DTensor) or tuple(p.placements) != self.state_placements[n]
        ]
        if bad:
            raise ValueError(
                f"the state's parameters {bad[:3]} are not laid out by the plan: build the "
                "state with engine.init(model, optimizer, strategy=tensor_parallel(...)) (or "
                "strategy.shard_state(state, model))"
            )

    def _grad_autograd(self, params, buffers, batch, key, loss_scale, divisor):
        if self.tp.replica_sharded:
            return self._grad_gathered(params, buffers, batch, key, loss_scale, divisor)
        grads, loss, metrics_, new_buffers = super()._grad_autograd(
            params, buffers, batch, key, loss_scale, divisor
        )
        grads = {n: self._laid_out(g, params[n]) for n, g in grads.items()}
        return grads, loss, metrics_, new_buffers

    def _grad_gathered(self, params, buffers, batch, key, loss_scale, divisor):
        """``data_parallel="fsdp"``: each parameter's tensor-parallel part gathered over "dp"
        (its gradient reduce-scattered back in the backward pass), then bound."""
        tp_mesh = self.tp.tp_mesh
        local = {n: p.to_local() for n, p in params.items()}
        trainable = self.trainable if not self._all_trainable else list(local)
        wrt = {n: local[n].detach().requires_grad_() for n in trainable}
        sources = {**{n: t.detach() for n, t in local.items()}, **wrt}
        bound = {n: tp_layout.tp_part(sources[n], params[n], tp_mesh) for n in params}
        with self._forward_scope(bound, buffers, key) as apply:
            loss, metrics_, new_buffers = self._call_loss(apply, batch, buffers)
            if loss is None:
                return {}, None, metrics_, new_buffers
            target = loss_for_grad(loss, loss_scale, divisor)
            grads = scalar_gradients(target, tuple(wrt.values()))
        named = self._named_grads(wrt, grads)
        out = {n: tp_layout.wrap(_owned(g), params[n]) for n, g in named.items()}
        return out, loss.detach(), metrics_, new_buffers

    def _reduced(self, grads: dict[str, Any]) -> dict[str, Any]:
        if self.tp.replica_sharded:  # reduce-scattered over "dp" in the backward pass
            return grads
        return super()._reduced(grads)

    @staticmethod
    def _laid_out(grad: Any, param: Any) -> Any:
        """``grad`` laid out as ``param`` (a ``Partial`` gradient all-reduced over "tp"),
        holding its own local tensor (the optimizer may write it in place)."""
        if tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
        return tp_layout.wrap(_owned(grad.to_local()), param)

    def _grad_func(self, *args: Any) -> Any:
        raise ValueError("tensor_parallel supports grad='autograd' only")

    def _tensor_norms(self, grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        if not self.compute_grad_norm:
            return None
        return tuple(_norms(list(grads.values()), 2.0, self.tp.norm_group))

    def _update(self, state: Any, grads: dict[str, Any], norms: Any) -> tuple[dict, Any]:
        params = self._trainable(state.params)
        local_grads = tp_layout.localize(grads)
        local_params = tp_layout.localize(params)
        local_opt = tp_layout.localize(state.opt_state)
        group = self.tp.norm_group
        counts = [tp_layout.counted(params[n], group) for n in grads]
        with (
            optim.donating() if self.donate else optim.owning_updates(),
            tp_layout.plan_norms(counts, group),
        ):
            new_local, new_opt = optim.step(self.optimizer, local_grads, local_opt, local_params)
        new_params = tp_layout.rewrap_like(new_local, params)
        opt_state = tp_layout.rewrap_like(new_opt, state.opt_state)
        return self._merged(state.params, new_params), opt_state


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dense tensor of its own (the optimizer may write it in place)."""
    if not t.is_contiguous():
        return t.contiguous()
    return t.clone() if t._base is not None else t


class _Gathered:
    """Eval and predict over a state sharded over "dp" too: the parameters' tensor-parallel
    parts are gathered (no gradient) before the template is bound."""

    def _forward(self, params: dict, buffers: dict, batch: Any) -> Any:
        strategy = self.strategy._strategy  # type: ignore[attr-defined]
        if strategy.replica_sharded:
            mesh = strategy.tp_mesh
            params = {n: tp_layout.tp_part(p.to_local(), p, mesh) for n, p in params.items()}
        return super()._forward(params, buffers, batch)  # type: ignore[misc]


class TensorParallelEvalStep(_Gathered, EvalStep):
    """``engine.EvalStep`` on the plan's template (build it with the strategy)."""


class TensorParallelPredictStep(_Gathered, PredictStep):
    """``engine.PredictStep`` on the plan's template (build it with the strategy)."""


# ---------------------------------------------------------------------- construction


def tensor_parallel(
    plan: Any,
    mesh_shape: tuple[int, int] | None = None,
    *,
    data_parallel: str = "ddp",
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    precision: str | int | Precision = "32-true",
    device: torch.device | str | None = None,
    buffers: str = "broadcast",
    loss_scale: DynamicLossScale | None = None,
    cluster: Any = None,
) -> TensorParallel:
    """This process's rank of a tensor-parallel run, with the process group and mesh formed.

    ``plan``: a ``parallelize_module`` plan (a dict ``submodule name -> ParallelStyle``, or one
    ``ParallelStyle``). ``mesh_shape``: ``(dp, tp)``, data-parallel replicas times ranks per
    model, whose product is the world size (default ``(1, world size)``). ``data_parallel``:
    how the replicas keep in step, one of ``DATA_PARALLEL_MODES``: ``"ddp"`` (each replica
    holds its ranks' parts whole; the gradients are averaged over "dp"), ``"fsdp"`` (the
    parts are sharded over "dp" as well: gathered for each micro-batch's forward pass, their
    gradients reduce-scattered). The other arguments are ``hardware.ddp``'s.
    """
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(
            f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {data_parallel!r}"
        )
    tp_layout.check_plan(plan)  # before forming anything
    base = ddp(
        backend=backend,
        timeout=timeout,
        precision=precision,
        device=device,
        buffers=buffers,
        loss_scale=loss_scale,
        cluster=cluster,
    )
    value = TensorParallel(base, plan, mesh_shape=mesh_shape, data_parallel=data_parallel)
    value.cluster = base.cluster  # who started the processes (SLURM auto-requeue reads it)
    return value
