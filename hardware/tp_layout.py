"""The layout pieces of tensor parallelism: the 2-D device mesh, plans, and norms over shards.

``hardware.tensor_parallel`` (``hardware.tensor_parallel``) trains a model whose parameters
are laid out by one of torch's ``parallelize_module`` plans. This module holds what does not
depend on a train step:

* ``device_mesh``: the ``("dp", "tp")`` ``DeviceMesh`` over all ranks (data-parallel
  replicas x tensor-parallel shards), made once per process group and shape (building a
  mesh forms process subgroups, a collective of every rank).
* ``check_plan`` / ``parallelized``: a plan checked against a model (every key names a
  submodule, every value is a ``ParallelStyle``), and a private copy of the model on the meta
  device with the plan applied: the step's template, carrying the plan's input and output
  hooks, whose parameters say how each one is laid out (no memory: the state's tensors are
  bound into it).
* ``distribute`` / ``localize`` / ``rewrap_like``: full tensors laid out as the template's
  parameters (no communication: each rank keeps its part), DTensors as their local tensors,
  and local tensors back as DTensors.
* ``replica_placements`` / ``tp_part``: under ``data_parallel="fsdp"`` a parameter is also
  sharded over "dp" (a 2-D DTensor); ``tp_part`` gathers this rank's tensor-parallel part of
  it for the forward pass and reduce-scatters its gradient back (averaged over "dp").
* ``tp_norms``: per-tensor norms of the full tensors whose local parts a rank holds, each
  element counted once (``counted``: a part replicated over a mesh dimension counts on one
  rank of it); ``plan_norms`` is the same as a ``TorchFunctionMode`` around the optimizer,
  whose ``torch._foreach_norm`` calls (global-norm clipping, ``skip_nonfinite``) are over
  per-parameter lists laid out like the parameters.
"""

from __future__ import annotations

import copy
import fnmatch
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from purestep.engine.tree import map

from . import sharding

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = [
    "MESH_DIMS",
    "check_mesh_shape",
    "check_plan",
    "counted",
    "device_mesh",
    "distribute",
    "layout",
    "localize",
    "parallelized",
    "plan_norms",
    "replica_placements",
    "rewrap_like",
    "tp_norms",
    "tp_part",
]

#: The names of the mesh's dimensions: data-parallel replicas, tensor-parallel shards.
MESH_DIMS = ("dp", "tp")

Tensor = torch.Tensor

# (process group, (shape, device type, names), mesh): one mesh (one set of subgroups) each.
_MESHES: list[tuple[Any, tuple[Any, ...], Any]] = []


def check_mesh_shape(mesh_shape: Any, world_size: int) -> tuple[int, int]:
    """``mesh_shape`` as ``(dp, tp)``: two positive ints whose product is the world size;
    ``None`` is ``(1, world_size)`` (tensor parallelism only)."""
    if mesh_shape is None:
        return (1, world_size)
    try:
        shape = tuple(mesh_shape)
    except TypeError:
        shape = None
    if (
        shape is None
        or len(shape) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
    ):
        raise ValueError(
            f"mesh_shape must be two positive ints (data parallel, tensor parallel), got "
            f"{mesh_shape!r}"
        )
    if shape[0] * shape[1] != world_size:
        raise ValueError(
            f"mesh_shape {shape} has {shape[0] * shape[1]} ranks but the world size is "
            f"{world_size}: the product of the mesh's dimensions must be the world size"
        )
    return shape  # type: ignore[return-value]


def device_mesh(
    shape: tuple[int, int], device_type: str, names: tuple[str, str] = MESH_DIMS
) -> DeviceMesh:
    """The 2-D mesh of ``shape`` over the default group, its dimensions named ``names``
    (rank ``r`` sits at ``(r // shape[1], r % shape[1])``: the ranks along the second
    dimension are consecutive). Made once per group, shape, device type and names."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("a device mesh needs a process group: build the strategy first")
    world = dist.group.WORLD
    _MESHES[:] = [m for m in _MESHES if m[0] is world]  # those of a destroyed group: gone
    key = (tuple(shape), device_type, tuple(names))
    for _, made, mesh in _MESHES:
        if made == key:
            return mesh
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    _MESHES.append((world, key, mesh))
    return mesh


# ---------------------------------------------------------------------- plans


def _styles() -> Any:
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle


def _matches(key: str, name: str) -> bool:
    atoms, parts = key.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatch(p, a) for a, p in zip(atoms, parts))


def check_plan(plan: Any, model: nn.Module | None = None) -> Any:
    """``plan`` if it is a ``ParallelStyle`` or a dict ``module name -> ParallelStyle`` whose
    names (``fnmatch`` patterns per dotted part, as ``parallelize_module`` reads them) each
    match a submodule of ``model`` (when given); otherwise a clear error."""
    style = _styles()
    if isinstance(plan, style):
        return plan
    if not isinstance(plan, dict) or not plan:
        raise TypeError(
            "plan must be a ParallelStyle (ColwiseParallel(), RowwiseParallel(), "
            "SequenceParallel(), ...) or a non-empty dict module name -> ParallelStyle, "
            f"got {type(plan).__name__}"
        )
    for key, value in plan.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"the plan's keys must be submodule names, got {key!r}")
        if not isinstance(value, style):
            raise TypeError(
                f"the plan's entry {key!r} is a {type(value).__name__}, not a ParallelStyle "
                "(use torch.distributed.tensor.parallel's ColwiseParallel(), "
                "RowwiseParallel(), SequenceParallel(), PrepareModuleInput(), ...)"
            )
    if model is not None:
        names = [n for n, _ in model.named_modules() if n]
        missing = [k for k in plan if not any(_matches(k, n) for n in names)]
        if missing:
            raise ValueError(
                f"the plan names modules {missing} that the model does not have; its "
                f"submodules are {names[:12]}{' ...' if len(names) > 12 else ''}"
            )
    return plan


def _meta_copy(model: nn.Module) -> nn.Module:
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    return copy.deepcopy(model, memo)


def parallelized(model: nn.Module, plan: Any, tp_mesh: DeviceMesh) -> nn.Module:
    """A private copy of ``model`` with ``plan`` applied on ``tp_mesh``: its parameters are
    DTensors on the meta device (the layout, no data); its buffers are copies of the
    model's (the state's are bound in their place)."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_plan(plan, model)
    template = _meta_copy(model)
    parallelize_module(template, tp_mesh, plan)
    return template


def layout(template: nn.Module) -> dict[str, tuple[Any, ...]]:
    """``parameter name -> placements`` of a parallelized template (``Replicate()`` for a
    parameter the plan does not touch)."""
    from torch.distributed.tensor import DTensor, Replicate

    return {
        n: (tuple(p.placements) if isinstance(p, DTensor) else (Replicate(),))
        for n, p in template.named_parameters()
    }


# ---------------------------------------------------------------------- tensors


def distribute(t: Tensor, mesh: DeviceMesh, placements: tuple[Any, ...]) -> DTensor:
    """``t`` (the same full value on every rank) as a DTensor of ``placements``; each rank
    keeps its part, without communication."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)


def localize(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local tensor (shares its storage)."""
    from torch.distributed.tensor import DTensor

    return map(lambda x: x.to_local() if isinstance(x, DTensor) else x, tree)


def wrap(local: Tensor, like: DTensor) -> DTensor:
    """``local`` as a DTensor laid out like ``like`` (no communication, no checks)."""
    return sharding._wrap(local, like)


#: Local tensors as DTensors laid out like a reference tree (``hardware.sharding.rewrap``).
rewrap_like = sharding.rewrap


# ---------------------------------------------------------------------- fsdp over "dp"


def replica_placements(shape: tuple[int, ...], tp: tuple[Any, ...]) -> tuple[Any, Any]:
    """The 2-D placements ``(over "dp", over "tp")`` of a parameter whose plan placement is
    ``tp`` when its parts are sharded over the replicas as well: ``Shard`` of the first
    dimension the plan does not shard (so a rank's part of its tensor-parallel part is one
    contiguous slice of it), ``Replicate()`` when there is none (a 0-d tensor, or a 1-D one
    the plan shards)."""
    from torch.distributed.tensor import Replicate, Shard

    (inner,) = tp
    taken = inner.dim if isinstance(inner, Shard) else None
    free = [d for d in range(len(shape)) if d != taken]
    return (Shard(free[0]) if free else Replicate(), inner)


class _GatherReplicas(torch.autograd.Function):
    """Forward: a 2-D parameter's local part gathered over "dp" into this rank's
    tensor-parallel part; backward: that part's gradient reduce-scattered over "dp" and
    averaged (a replica's mean-loss gradients, averaged over replicas, as DDP averages)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, like: DTensor) -> Tensor:
        from torch.distributed.tensor import Replicate

        ctx.like = like
        mesh = like.device_mesh
        out = wrap(local.detach(), like).redistribute(mesh, (Replicate(), like.placements[1]))
        out = out.to_local()
        return out.clone() if out.data_ptr() == local.data_ptr() else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, None]:
        from torch.distributed.tensor import DTensor, Partial

        like = ctx.like
        mesh = like.device_mesh
        g = grad.contiguous()
        partial = DTensor.from_local(
            g,
            mesh,
            (Partial(), like.placements[1]),
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
        out = partial.redistribute(mesh, like.placements).to_local()
        return out / mesh.size(0), None


def tp_part(local: Tensor, like: DTensor, tp_mesh: DeviceMesh) -> DTensor:
    """This rank's tensor-parallel part of the 2-D parameter ``like`` (whose local part is
    ``local``) as a DTensor on ``tp_mesh``: gathered over "dp", differentiably when
    ``local`` requires grad (see ``_GatherReplicas``)."""
    from torch.distributed.tensor import DTensor, Replicate

    if local.requires_grad and torch.is_grad_enabled():
        part = _GatherReplicas.apply(local, like)
    else:
        with torch.no_grad():
            mesh = like.device_mesh
            part = wrap(local, like).redistribute(mesh, (Replicate(), like.placements[1]))
            part = part.to_local()
    return DTensor.from_local(
        part,
        tp_mesh,
        (like.placements[1],),
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


# ---------------------------------------------------------------------- norms


def counted(t: Any, group: Any = None) -> bool:
    """Whether this rank counts DTensor ``t``'s local part in a norm taken over its mesh
    (``group``): a part replicated over a mesh dimension counts on that dimension's first
    rank only; a plain tensor on the group's first rank only."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return dist.get_rank(group) == 0
    coordinate = t.device_mesh.get_coordinate()
    return all(c == 0 for c, p in zip(coordinate, t.placements) if isinstance(p, Replicate))


def _combine(local: list[Tensor], counts: list[bool], ord: float, group: Any) -> list[Tensor]:
    if not local:
        return local
    values = torch.stack([n.detach().to(torch.float64) for n in local])
    if math.isinf(ord):
        op = dist.ReduceOp.MAX if ord > 0 else dist.ReduceOp.MIN
        dist.all_reduce(values, op=op, group=group)
        out = values
    else:
        powered = values.pow(ord)
        skip = torch.tensor([not c for c in counts], device=powered.device)
        powered = powered.masked_fill(skip, 0.0)
        dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
        out = powered.pow(1.0 / ord)
    return [o.to(dtype=n.dtype, device=n.device) for o, n in zip(out.unbind(0), local)]


def tp_norms(tensors: list[Tensor], counts: list[bool], ord: float, group: Any) -> list[Tensor]:
    """Per-tensor ``ord``-norms of the full tensors of which ``tensors`` are this rank's local
    parts, over the ranks of ``group`` (``counts[i]``: this rank's part of tensor ``i`` is
    counted; see ``counted``): one all-reduce for the lot."""
    local = list(torch._foreach_norm(tensors, ord)) if tensors else []
    return _combine(local, counts, float(ord), group)


class plan_norms(TorchFunctionMode):
    """Within the block, ``torch._foreach_norm(tensors, ord)`` over a per-parameter list (as
    many tensors as ``counts`` flags, in the parameters' order) returns the norms of the
    full tensors; a list of another length is an error (its layout is unknown)."""

    def __init__(self, counts: list[bool], group: Any) -> None:
        super().__init__()
        self.counts = list(counts)
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is torch._foreach_norm:
            tensors = list(args[0])
            ord = args[1] if len(args) > 1 else kwargs.get("ord", 2.0)
            if len(tensors) != len(self.counts):
                raise RuntimeError(
                    f"an optimizer transform took the norms of {len(tensors)} tensors under "
                    f"tensor parallelism, which knows the layout of per-parameter lists "
                    f"({len(self.counts)} tensors) only"
                )
            local = list(func(tensors, ord))
            return tuple(_combine(local, self.counts, float(ord), self.group))
        return func(*args, **kwargs)
