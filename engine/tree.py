"""Pytrees for purestep: the project's optree namespace, ``@struct`` and a few tree helpers.

Every piece of training state is a pytree. ``@struct`` turns a class into a frozen dataclass
that optree flattens (in the ``purestep`` namespace): ordinary fields are children, fields
declared with ``field(static=True)`` (functions, names, config) travel in the tree definition
and are never treated as leaves. The helpers are the handful the rest of the code needs:
map, leaves, zeros_like, the global norm (and combining per-tensor norms), cast, move to
device, and comparisons of two trees that name the first paths that differ (every parity
test uses them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import optree
import torch

NAMESPACE = "purestep"

T = TypeVar("T")
PyTree = Any

# Every @struct class by "module:qualname", so checkpoints can name and rebuild them without
# unpickling (see engine.checkpoint).
STRUCTS: dict[str, type] = {}

__all__ = [
    "NAMESPACE",
    "STRUCTS",
    "PyTree",
    "assert_trees_close",
    "assert_trees_equal",
    "cast",
    "combine_norms",
    "device_dtype_groups",
    "diff",
    "field",
    "flatten_with_paths",
    "global_norm",
    "leaves",
    "map",
    "struct",
    "structure",
    "to_device",
    "trees_equal",
    "unflatten",
    "zeros_like",
]


# --------------------------------------------------------------------------- @struct


def field(*, static: bool = False, **kwargs: Any) -> Any:
    """A dataclass field; ``static=True`` keeps it out of the leaves (functions, names, config)."""
    metadata = dict(kwargs.pop("metadata", None) or {})
    metadata["static"] = static
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self: T, **changes: Any) -> T:
    """A copy of this struct with some fields changed (no validation, no ``__init__``)."""
    fields = type(self).__struct_fields__
    for name in changes:
        if name not in fields:
            raise TypeError(
                f"{type(self).__name__}.replace() got an unknown field {name!r}; "
                f"fields are {sorted(fields)}"
            )
    new = object.__new__(type(self))
    d = new.__dict__
    d.update(self.__dict__)
    d.update(changes)
    return new


def struct(cls: type[T] | None = None, /) -> Any:
    """Make ``cls`` a frozen dataclass registered as a pytree node in the purestep namespace.

    Fields are children (leaves or subtrees) unless declared ``field(static=True)``; static
    values become part of the tree definition, so they must be hashable and comparable.
    Instances are immutable: use ``.replace(**changes)`` to build an updated copy.
    """

    def wrap(cls: type[T]) -> type[T]:
        # Tensors have no truth value, so structs compare by identity; compare contents with
        # ``trees_equal``.
        cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
        all_fields = dataclasses.fields(cls)
        data = tuple(f.name for f in all_fields if not f.metadata.get("static", False))
        meta = tuple(f.name for f in all_fields if f.metadata.get("static", False))
        cls.__struct_fields__ = frozenset(data + meta)
        cls.__struct_data__ = data
        cls.__struct_static__ = meta
        cls.replace = _replace
        STRUCTS[f"{cls.__module__}:{cls.__qualname__}"] = cls

        def flatten(obj: Any) -> tuple[tuple, tuple, tuple]:
            d = obj.__dict__
            return (
                tuple(d[n] for n in data),
                tuple(d[n] for n in meta),
                data,
            )

        def unflatten(metadata: tuple, children: Iterable[Any]) -> Any:
            obj = object.__new__(cls)
            d = obj.__dict__
            d.update(zip(data, children))
            d.update(zip(meta, metadata))
            return obj

        optree.register_pytree_node(
            cls,
            flatten,
            unflatten,
            namespace=NAMESPACE,
            path_entry_type=optree.GetAttrEntry,
        )
        return cls

    return wrap if cls is None else wrap(cls)


# --------------------------------------------------------------------------- basic helpers


def map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Any = None) -> PyTree:
    """``fn`` applied leaf by leaf over ``tree`` (and ``rest``, which must share its structure)."""
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in flattening order (dict keys sorted, fields in order)."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def structure(tree: PyTree) -> optree.PyTreeSpec:
    """The tree definition of ``tree``."""
    return optree.tree_structure(tree, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, values: Iterable[Any]) -> PyTree:
    """Rebuild a tree from its definition and leaves."""
    return optree.tree_unflatten(spec, values)


def flatten_with_paths(tree: PyTree) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs, the path written as Python accessors: ``.opt_state.mu['fc.w']``."""
    accessors, values, _ = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [(_path_str(a), v) for a, v in zip(accessors, values)]


def _path_str(accessor: Any) -> str:
    parts = []
    for entry in accessor:
        if isinstance(entry, optree.GetAttrEntry):
            parts.append(f".{entry.name}")
        else:
            parts.append(f"[{entry.entry!r}]")
    return "".join(parts) or "<root>"


def zeros_like(tree: PyTree) -> PyTree:
    """A tree of the same structure with every tensor leaf replaced by zeros."""
    return map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, tree)


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all tensor leaves taken together, bitwise as ``clip_grad_norm_`` gives it.

    Per-tensor norms from ``torch._foreach_norm``, then ``combine_norms``: torch's own
    arithmetic. Tensors of several devices or dtypes are handed to torch's public
    ``torch.nn.utils.get_total_norm`` (torch >= 2.6): torch orders its device/dtype groups
    by an internal hash table, not by first appearance, and that order changes the last bit
    of the final reduction. Older torch gets first-appearance groups (equal to rounding).
    The result is on the first tensor's device.
    """
    if isinstance(tree, dict):
        tensors = [x for x in tree.values() if isinstance(x, torch.Tensor)]
        if len(tensors) != len(tree):
            tensors = [x for x in leaves(tree) if isinstance(x, torch.Tensor)]
    else:
        tensors = [x for x in leaves(tree) if isinstance(x, torch.Tensor)]
    if not tensors:
        return torch.tensor(0.0)
    if _one_group(tensors):
        return combine_norms(torch._foreach_norm(tensors, 2.0))
    if _TOTAL_NORM is not None:
        return _TOTAL_NORM(tensors, 2.0)
    norms: list[torch.Tensor] = []
    for group in device_dtype_groups(tensors):
        norms.extend(torch._foreach_norm([tensors[i] for i in group], 2.0))
    return combine_norms(norms)


def combine_norms(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of per-tensor L2 norms, in the given order (``clip_grad_norm_``'s last step).

    ``combine_norms(torch._foreach_norm(tensors, 2.0))`` is bitwise ``global_norm(tensors)``
    when the tensors share one device and dtype. Norms on other devices are moved to the
    first one's. Each norm may also be a vector (say one entry per ensemble member): the
    result then has that shape, entry ``i`` combining the ``i``-th entries as the 0-d norms of
    that entry alone would combine (the same arithmetic; tested to 1e-6 relative, as the
    per-entry reduction kernels may group differently from the 0-d ones).
    """
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    for n in norms:
        if n.device != first:
            norms = [n.to(first) for n in norms]
            break
    if norms[0].dim() == 0:
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)  # torch's exact call
    return torch.linalg.vector_norm(torch.stack(norms, dim=-1), 2.0, dim=-1)


def device_dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), groups in order of first appearance.

    Elementwise ``torch._foreach_*`` kernels run fastest on one group at a time.
    """
    out: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.device, t.dtype), []).append(i)
    return list(out.values())


def _one_group(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    dtype, device = first.dtype, first.device
    return all(t.dtype == dtype and t.device == device for t in tensors)


# Public since torch 2.6; the total norm exactly as ``clip_grad_norm_`` computes it.
_TOTAL_NORM: Callable[..., torch.Tensor] | None = getattr(torch.nn.utils, "get_total_norm", None)


def cast(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """Floating-point tensor leaves cast to ``dtype``; integer, bool and other leaves kept."""

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return map(one, tree)


def to_device(tree: PyTree, device: torch.device | str, non_blocking: bool = False) -> PyTree:
    """Tensor leaves moved to ``device`` (leaves already there are returned as they are)."""
    device = torch.device(device)

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device != device:
            return x.to(device, non_blocking=non_blocking)
        return x

    return map(one, tree)


# --------------------------------------------------------------------------- comparisons


def _leaf_problem(a: Any, b: Any, rtol: float, atol: float) -> str | None:
    """Why two leaves differ, or None if they match (bitwise when rtol == atol == 0)."""
    a_t, b_t = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
    if a_t != b_t:
        return f"{type(a).__name__} vs {type(b).__name__}"
    if not a_t:
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return None
        if type(a) is not type(b) or a != b:
            return f"{a!r} vs {b!r}"
        return None
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.device != b.device:
        return f"device {a.device} vs {b.device}"
    exact = rtol == 0 and atol == 0
    if exact and torch.equal(a, b):
        return None
    if a.is_floating_point() or a.is_complex():
        x, y = _as_real(a), _as_real(b)
        both_nan = x.isnan() & y.isnan()
        if exact:
            bad = (x != y) & ~both_nan
        else:
            bad = ((x - y).abs() > atol + rtol * y.abs()) & ~both_nan
            bad |= x.isnan() ^ y.isnan()
            # An infinity matches only the same infinity (|inf - -inf| <= rtol * inf holds).
            bad |= (x != y) & (x.isinf() | y.isinf()) & ~both_nan
        if a.is_complex():
            bad = bad.any(dim=-1)  # an element differs when its real or imaginary part does
        if not bool(bad.any()):
            return None
        n_bad = int(bad.sum())
        idx = tuple(int(i) for i in bad.nonzero()[0]) if a.dim() else ()
        gap = (x - y).abs().amax(dim=-1) if a.is_complex() else (x - y).abs()
        max_abs = float(gap[bad].max())
        first_a, first_b = a.detach()[idx].item(), b.detach()[idx].item()
        return (
            f"{n_bad}/{a.numel()} elements differ, max |a-b| = {max_abs:.3g}, "
            f"first at {list(idx)}: {first_a:.9g} vs {first_b:.9g}"
        )
    bad = a != b
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0]) if a.dim() else ()
    return f"{n_bad}/{a.numel()} elements differ, first at {list(idx)}: {a[idx]!r} vs {b[idx]!r}"


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 for comparison; a complex tensor as (real, imaginary) pairs."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.double()


def diff(
    a: PyTree, b: PyTree, *, rtol: float = 0.0, atol: float = 0.0, limit: int = 10
) -> list[str]:
    """Human-readable differences between two trees; empty when they match.

    With the default ``rtol = atol = 0`` tensors must be equal under ``torch.equal`` (NaNs in
    the same places count as equal). Structure differences list missing and extra paths.
    At most ``limit`` lines are returned, the first mismatching paths in flattening order.
    """
    pa, pb = flatten_with_paths(a), flatten_with_paths(b)
    out: list[str] = []
    da, db = dict(pa), dict(pb)
    if structure(a) != structure(b):
        missing = [p for p, _ in pb if p not in da]
        extra = [p for p, _ in pa if p not in db]
        for p in missing:
            out.append(f"{p}: missing in the first tree")
        for p in extra:
            out.append(f"{p}: missing in the second tree")
        if not missing and not extra:
            out.append(
                f"structures differ: {structure(a)} vs {structure(b)}"
                " (same paths; node types or static fields differ)"
            )
    for path, x in pa:
        if path not in db:
            continue
        problem = _leaf_problem(x, db[path], rtol, atol)
        if problem is not None:
            out.append(f"{path}: {problem}")
        if len(out) >= limit:
            break
    if len(out) > limit:
        out = out[:limit]
    return out


def trees_equal(a: PyTree, b: PyTree) -> bool:
    """Whether two trees have the same structure and bitwise-equal leaves."""
    return not diff(a, b, limit=1)


def assert_trees_equal(a: PyTree, b: PyTree, *, limit: int = 10) -> None:
    """Raise ``AssertionError`` naming the first differing paths unless ``a`` equals ``b``."""
    problems = diff(a, b, limit=limit)
    if problems:
        raise AssertionError("trees differ:\n  " + "\n  ".join(problems))


def assert_trees_close(
    a: PyTree, b: PyTree, *, rtol: float = 1e-6, atol: float = 0.0, limit: int = 10
) -> None:
    """Like ``assert_trees_equal`` but tensors may differ by ``atol + rtol * |b|``."""
    problems = diff(a, b, rtol=rtol, atol=atol, limit=limit)
    if problems:
        raise AssertionError(
            f"trees differ (rtol={rtol}, atol={atol}):\n  " + "\n  ".join(problems)
        )
