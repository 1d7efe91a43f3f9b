"""Collectives over pytrees of tensors: one flat buffer and one call per (dtype, device) bucket.

``all_reduce_tree`` and ``broadcast_tree`` flatten a tree (dicts, lists, ``@struct``s; the
purestep namespace), copy its tensors into one fresh 1-D buffer per (dtype, device), in the
order the leaves first appear, run one ``torch.distributed`` collective per buffer, and split
the buffer back into the tree's shapes. So a gradient dict of 100 float32 tensors costs one
collective, not 100 (the latency of a collective, not its bytes, dominates small models).

Pure: the input tree is never written (the buffers are copies); the results are detached
views into the reduced buffers (one storage per bucket; do not resize them). Deterministic:
the bucket layout is a function of the tree's structure, and gloo and NCCL give every rank
the same bits for the same inputs and world size, run after run. Every rank must pass a tree
of the same structure, dtypes and shapes, or the collectives will not match.

A collective that fails (a peer crashed or was killed, or did not reach the same collective
before the process group's timeout) raises ``CollectiveError`` naming this rank and the
operation, instead of the backend's bare message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from purestep.engine.tree import NAMESPACE, PyTree

__all__ = ["REDUCE_OPS", "CollectiveError", "all_reduce_tree", "broadcast_tree", "diagnosed"]

#: The reductions ``all_reduce_tree`` understands ("mean" is a sum divided by the world size).
REDUCE_OPS = ("mean", "sum", "max", "min")

_TORCH_OPS = {
    "mean": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class CollectiveError(RuntimeError):
    """A collective that did not complete: a peer died, hung past the timeout, or disagreed."""


@contextlib.contextmanager
def diagnosed(what: str, timeout: float | None = None) -> Iterator[None]:
    """Re-raise a backend failure inside the block as a ``CollectiveError`` that says why."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:  # DistBackendError / DistNetworkError derive from it
        rank = dist.get_rank() if dist.is_initialized() else "?"
        limit = f" ({timeout:g} s)" if timeout is not None else ""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CollectiveError(
            f"rank {rank}: {what} failed: {first}. Another rank probably crashed, was "
            f"killed, or did not reach the same collective within the timeout{limit}; "
            "look at the other ranks' output for the cause"
        ) from err


def check_op(op: str) -> str:
    """``op`` if it is a known reduction, else a ``ValueError`` listing them."""
    if op not in _TORCH_OPS:
        raise ValueError(f"unknown reduction {op!r}; choose one of {', '.join(REDUCE_OPS)}")
    return op


def _flatten(tree: PyTree) -> tuple[list[torch.Tensor], Any]:
    paths, values, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    for path, value in zip(paths, values):
        if not isinstance(value, torch.Tensor):
            where = "/".join(str(p) for p in path) or "<root>"
            raise TypeError(
                f"collectives take trees of tensors; the leaf at {where} is a "
                f"{type(value).__name__}"
            )
    return values, spec


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Leaf indices grouped by (dtype, device), buckets in order of first appearance."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def _pack(tensors: Sequence[torch.Tensor], idx: list[int]) -> torch.Tensor:
    """A fresh 1-D buffer holding the tensors at ``idx`` one after the other."""
    return torch.cat([tensors[i].detach().reshape(-1) for i in idx])


def _unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], idx: list[int], out: list) -> None:
    parts = flat.split([tensors[i].numel() for i in idx])
    for i, part in zip(idx, parts):
        out[i] = part.view(tensors[i].shape)


def _check_dtype(dtype: torch.dtype, op: str) -> None:
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            f"cannot take the mean of {dtype} tensors across ranks; use 'sum' (and divide "
            "yourself) or cast them to a floating dtype"
        )
    if dtype == torch.bool and op == "sum":
        raise TypeError("cannot sum bool tensors across ranks; use 'max' (any) or 'min' (all)")


def all_reduce_tree(
    tree: PyTree,
    op: str = "mean",
    *,
    group: Any = None,
    timeout: float | None = None,
) -> PyTree:
    """``tree`` reduced element-wise across the ranks of ``group`` (default: all) with ``op``.

    ``"mean"`` sums and then divides by the world size (floating and complex dtypes only);
    ``"max"``/``"min"`` of bool tensors are "any"/"all". ``timeout`` only enters the message
    of a ``CollectiveError`` (the process group's own timeout is what bounds the wait).
    """
    check_op(op)
    tensors, spec = _flatten(tree)
    if not tensors:
        return tree
    buckets = _buckets(tensors)
    for idx in buckets:
        _check_dtype(tensors[idx[0]].dtype, op)
    world = dist.get_world_size(group)
    out: list[Any] = [None] * len(tensors)
    with torch.no_grad():
        for idx in buckets:
            flat = _pack(tensors, idx)
            is_bool = flat.dtype == torch.bool
            if is_bool:
                flat = flat.to(torch.uint8)
            with diagnosed(f"all_reduce({op!r}) of {flat.numel()} {flat.dtype} values", timeout):
                dist.all_reduce(flat, op=_TORCH_OPS[op], group=group)
            if is_bool:
                flat = flat.to(torch.bool)
            elif op == "mean" and world > 1:
                flat.div_(world)
            _unpack(flat, tensors, idx, out)
    return optree.tree_unflatten(spec, out)


def broadcast_tree(
    tree: PyTree, src: int = 0, *, group: Any = None, timeout: float | None = None
) -> PyTree:
    """``tree`` as rank ``src`` holds it, on every rank (same structure and shapes everywhere).

    Bool tensors travel as uint8. The result never aliases the input, on ``src`` included.
    """
    world = dist.get_world_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"src must be a rank in [0, {world}), got {src!r}")
    tensors, spec = _flatten(tree)
    if not tensors:
        return tree
    out: list[Any] = [None] * len(tensors)
    with torch.no_grad():
        for idx in _buckets(tensors):
            flat = _pack(tensors, idx)
            is_bool = flat.dtype == torch.bool
            if is_bool:
                flat = flat.to(torch.uint8)
            with diagnosed(f"broadcast from rank {src} of {flat.numel()} values", timeout):
                dist.broadcast(flat, src=src, group=group)
            if is_bool:
                flat = flat.to(torch.bool)
            _unpack(flat, tensors, idx, out)
    return optree.tree_unflatten(spec, out)
