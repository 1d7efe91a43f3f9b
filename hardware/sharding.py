"""Tensors sharded across ranks as DTensors, and the collectives a sharded step needs.

The FSDP strategy (``hardware.fsdp``) keeps every parameter and every optimizer-state tensor
of a ``TrainState`` as a ``torch.distributed.tensor.DTensor`` on a one-dimensional device
mesh over all ranks: a tensor with at least one dimension is ``Shard(0)`` (rank ``r`` holds
chunk ``r`` of ``torch.chunk(t, W)``, so shards may be uneven or empty), a 0-d tensor is
``Replicate()``. Buffers stay plain tensors, the same on every rank. So the state says what
is sharded and how, and ``torch.distributed.checkpoint`` can save it and load it at another
world size (``engine.checkpoint.sharded``).

This module holds what does not depend on a module template:

* ``shard`` / ``shard_tree`` / ``full_tree``: plain tensors to shards (no communication:
  every rank holds the same full tensor and keeps its own chunk) and back (all-gathers).
* ``local_tree`` / ``rewrap``: a tree's DTensors as their local tensors, and local tensors
  back as DTensors laid out like a reference (no communication), so fused optimizers run
  on plain local tensors at plain-tensor speed.
* ``gather``: a parameter's full value from its local shard, differentiably: the backward
  pass reduce-scatters the gradient (sum over ranks divided by the world size, like DDP's
  mean) in a chosen reduction dtype. Both collectives are DTensor redistributions, one per
  parameter: ``sharding="grad_op"`` uses them; the fully sharded step gathers and
  reduces a unit's parameters at once (``hardware.fsdp_units``), on the same layout.
* ``global_norms`` and ``sharded_norms()``: per-tensor norms of sharded tensors taken over
  all ranks, so global-norm clipping, ``skip_nonfinite`` and the reported gradient norm
  see the full tensors. Inside ``sharded_norms()``, every ``torch._foreach_norm`` call (the
  one norm primitive of ``engine.optim`` and ``engine.tree.global_norm``) is taken to be
  over per-parameter tensors laid out like the parameters: tensors with dimensions are
  shards (their norms combine across ranks), 0-d tensors are replicated (counted once).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from purestep.engine.tree import leaves, map

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

# torch.distributed.tensor takes about a second to import: it is imported on first use, so
# importing purestep.hardware stays as cheap as before FSDP existed.

__all__ = [
    "full_tree",
    "gather",
    "global_norms",
    "is_sharded",
    "local_chunk",
    "local_tree",
    "placements_for",
    "reduce_scatter_mean",
    "rewrap",
    "shard",
    "shard_tree",
    "sharded_norms",
    "world_mesh",
]

Tensor = torch.Tensor


def _dt() -> Any:
    import torch.distributed.tensor as dt

    return dt


def world_mesh(device_type: str = "cpu") -> DeviceMesh:
    """A one-dimensional device mesh over the default process group (all ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise RuntimeError("sharded tensors need a process group: build the strategy first")
    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def placements_for(t: Tensor) -> tuple[Any, ...]:
    """How a tensor is laid out: ``Shard(0)`` with dimensions, ``Replicate()`` when 0-d."""
    dt = _dt()
    return (dt.Shard(0),) if t.dim() > 0 else (dt.Replicate(),)


def shard(t: Tensor, mesh: DeviceMesh) -> DTensor:
    """``t`` (the same full value on every rank) as a DTensor: each rank keeps its chunk."""
    return _dt().distribute_tensor(t.detach(), mesh, placements_for(t), src_data_rank=None)


def is_sharded(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a DTensor."""
    DTensor = _dt().DTensor
    return any(isinstance(x, DTensor) for x in leaves(tree))


def shard_tree(tree: Any, mesh: DeviceMesh) -> Any:
    """Every plain floating or integer tensor of ``tree`` sharded (DTensors kept as they are)."""
    DTensor = _dt().DTensor

    def one(x: Any) -> Any:
        if isinstance(x, Tensor) and not isinstance(x, DTensor):
            return shard(x, mesh)
        return x

    return map(one, tree)


def full_tree(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its full value (all-gathers; every rank)."""
    DTensor = _dt().DTensor
    return map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, tree)


def local_tree(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local tensor (shares its storage)."""
    DTensor = _dt().DTensor
    return map(lambda x: x.to_local() if isinstance(x, DTensor) else x, tree)


def local_chunk(t: Tensor, like: DTensor) -> Tensor:
    """This rank's chunk of the whole tensor ``t``, laid out as ``like``'s local shard (a view
    of ``t`` where the layout allows)."""
    if isinstance(like.placements[0], _dt().Replicate):
        return t
    world, rank = like.device_mesh.size(), like.device_mesh.get_local_rank()
    chunks = torch.chunk(t, world, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return t.narrow(0, t.shape[0], 0)  # torch.chunk gave fewer chunks: an empty shard


def _wrap(local: Tensor, like: DTensor) -> DTensor:
    return _dt().DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def rewrap(new: Any, like: Any) -> Any:
    """Local tensors ``new`` as DTensors laid out like the DTensors at the same places of
    ``like`` (same tree structure); a local tensor that is ``like``'s own storage (an update
    in place) gets ``like``'s DTensor back. Leaves where ``like`` is not a DTensor stay."""
    DTensor = _dt().DTensor

    def one(x: Any, ref: Any) -> Any:
        if not isinstance(ref, DTensor) or isinstance(x, DTensor):
            return x
        own = ref.to_local()
        if x is own or (
            x.data_ptr() == own.data_ptr() and x.shape == own.shape and x.dtype == own.dtype
        ):
            return ref
        return _wrap(x, ref)

    return map(one, new, like)


# ---------------------------------------------------------------------- gathering


def _full(local: Tensor, like: DTensor) -> Tensor:
    """The full tensor from every rank's local shard (an all-gather; none when replicated)."""
    if isinstance(like.placements[0], _dt().Replicate):
        return local
    return _wrap(local, like).full_tensor()


def reduce_scatter_mean(grad: Tensor, like: DTensor, reduce_dtype: torch.dtype | None) -> Tensor:
    """This rank's shard of the mean over ranks of the full gradients ``grad``."""
    g = grad if reduce_dtype is None or grad.dtype == reduce_dtype else grad.to(reduce_dtype)
    g = g.contiguous()
    mesh = like.device_mesh
    dt = _dt()
    partial = dt.DTensor.from_local(
        g, mesh, (dt.Partial(),), run_check=False, shape=g.shape, stride=g.stride()
    )
    out = partial.redistribute(mesh, like.placements).to_local()
    return out / mesh.size()


class _Gather(torch.autograd.Function):
    """Forward: all-gather a parameter (cast to the compute dtype first); backward:
    reduce-scatter its gradient (in the reduction dtype), averaged over ranks."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, like: DTensor, compute: Any, reduce: Any) -> Tensor:
        ctx.like, ctx.reduce, ctx.dtype = like, reduce, local.dtype
        x = local.detach()
        x = x if compute is None or compute == x.dtype else x.to(compute)
        full = _full(x, like)
        return full.clone() if full is local else full

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        shard_grad = reduce_scatter_mean(grad, ctx.like, ctx.reduce)
        return shard_grad.to(ctx.dtype), None, None, None


def gather(
    local: Tensor,
    like: DTensor,
    *,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> Tensor:
    """The full value of the parameter whose local shard is ``local`` (laid out as ``like``).

    When ``local`` requires grad, the result is differentiable: its gradient reaches
    ``local`` reduce-scattered and averaged over ranks, reduced in ``reduce_dtype`` (default:
    the gradient's own dtype) and cast to ``local``'s dtype. Without grad it is a plain
    all-gather.
    """
    if local.requires_grad and torch.is_grad_enabled():
        return _Gather.apply(local, like, compute_dtype, reduce_dtype)
    with torch.no_grad():
        x = (
            local
            if compute_dtype is None or compute_dtype == local.dtype
            else local.to(compute_dtype)
        )
        return _full(x, like)


# ---------------------------------------------------------------------- norms over shards


def _combine(
    norms: list[Tensor], replicated: list[bool], ord: float, mesh_group: Any
) -> list[Tensor]:
    if not norms:
        return norms
    values = torch.stack([n.detach().to(torch.float64) for n in norms])
    if math.isinf(ord):
        op = dist.ReduceOp.MAX if ord > 0 else dist.ReduceOp.MIN
        dist.all_reduce(values, op=op, group=mesh_group)
        out = values
    else:
        powered = values.pow(ord)
        if dist.get_rank(mesh_group) != 0:
            mask = torch.tensor(replicated, dtype=torch.bool)
            powered = powered.masked_fill(mask, 0.0)
        dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=mesh_group)
        out = powered.pow(1.0 / ord)
    return [o.to(dtype=n.dtype, device=n.device) for o, n in zip(out.unbind(0), norms)]


def global_norms(tensors: list[Tensor], ord: float = 2.0, group: Any = None) -> list[Tensor]:
    """Per-tensor ``ord``-norms of the full tensors whose local shards are ``tensors``
    (0-d tensors are taken as replicated): one all-reduce over ``group`` for the lot."""
    local = list(torch._foreach_norm(tensors, ord)) if tensors else []
    return _combine(local, [t.dim() == 0 for t in tensors], float(ord), group)


class sharded_norms(TorchFunctionMode):
    """Within the block, ``torch._foreach_norm(tensors, ord)`` returns the norms of the full
    tensors of which ``tensors`` are this rank's shards (see the module docstring)."""

    def __init__(self, group: Any = None) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is torch._foreach_norm:
            tensors = list(args[0])
            ord = args[1] if len(args) > 1 else kwargs.get("ord", 2.0)
            local = list(func(tensors, ord))
            return tuple(_combine(local, [t.dim() == 0 for t in tensors], float(ord), self.group))
        return func(*args, **kwargs)
