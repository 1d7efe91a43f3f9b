"""The FSDP step's per-unit collectives: one all-gather and one reduce-scatter per unit.

``hardware.fsdp``'s template is split into *units* (``wrap_units``). This module gathers a
unit's parameters with one ``all_gather_single`` (``all_gather_into_tensor``'s current
name) and reduces its gradients with one ``reduce_scatter_single``
(``reduce_scatter_tensor``'s), as torch's FSDP2 does, and prefetches the next unit's
all-gather while the current one computes:

**Layout.** The state's ``DTensor`` layout is unchanged (``Shard(0)`` as ``torch.chunk``
cuts it, so shards may be uneven or empty; 0-d parameters ``Replicate()``). For the
collectives each rank packs its shards into one flat buffer per dtype, each shard padded to
the common chunk size ``ceil(rows / W) * row_numel``: the all-gather's output is then every
rank's piece side by side, copied out into each parameter's padded full tensor and narrowed
to its rows. The reduce-scatter's input is the same layout built from the full gradients
(``torch._chunk_cat``); a replicated (0-d) parameter's gradient takes one slot in every
rank's piece, so its sum over ranks comes out of the same collective.

**Forward.** A unit's all-gather is waited on in its forward pre-hook; the next unit's (in
the order the units ran on the step's first call) is issued right after, asynchronously, so
it runs while the current unit computes: at most two units' gathers are in flight or held
at a time. The root unit (parameters of no wrapped unit, tied ones) is gathered when the
pass starts, and the first unit prefetched with it.

**Backward.** Every unit's full tensors come out of one autograd ``Function`` whose backward
receives all the unit's gradients at once, when the last of them is produced: it waits for
the previous unit's reduce-scatter (so one is in flight at a time) and launches this one's
asynchronously; the averaged shards are collected after the backward pass. With
``reshard_after_forward`` the tensors autograd saves are replaced by tokens and the unit is
gathered again when the backward pass reaches it; a unit's pre-backward hook (on its
outputs) issues that all-gather and prefetches the unit before it. The root and the last
unit to run forward are not resharded (the backward pass starts with them; FSDP2 keeps the
root too).

gloo note: gloo (torch 2.13) has both collectives; it runs ``reduce_scatter_single`` (and the
list ``reduce_scatter``) as one all-reduce of the whole buffer, each rank keeping its chunk:
one collective per unit, as counted, at the bandwidth of an all-reduce.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from purestep.engine.tree import map

__all__ = ["Units", "UnitPass", "Token"]

Tensor = torch.Tensor


# ---------------------------------------------------------------------- flat layouts


class _Piece:
    """One parameter's place in a unit's flat buffer."""

    __slots__ = ("chunk", "name", "padded", "replicated", "rows", "shape")

    def __init__(self, name: str, shape: torch.Size, world: int, replicated: bool) -> None:
        self.name, self.shape, self.replicated = name, shape, replicated
        if replicated:
            self.rows, self.chunk, self.padded = 0, 0, 1
        else:
            self.rows = shape[0]
            self.chunk = -(-self.rows // world)  # torch.chunk's chunk size
            self.padded = self.chunk * math.prod(shape[1:])


class _Layout:
    """Parameters of one unit and one dtype packed per rank (see the module docstring)."""

    def __init__(self, pieces: list[_Piece], dtype: torch.dtype, world: int) -> None:
        self.pieces, self.dtype, self.world = pieces, dtype, world
        self.sizes = [p.padded for p in pieces]
        self.numel = sum(self.sizes)


def _layouts(
    names: list[str], likes: dict[str, Any], dtype_of: Callable[[str], torch.dtype], world: int
) -> list[_Layout]:
    from torch.distributed.tensor import Replicate, Shard

    groups: dict[torch.dtype, list[_Piece]] = {}
    for n in names:
        like = likes[n]
        placement = like.placements[0] if len(like.placements) == 1 else None
        replicated = isinstance(placement, Replicate)
        piece = _Piece(n, like.shape, world, replicated)
        if not replicated:
            rank = like.device_mesh.get_local_rank()
            rows = max(0, min(piece.chunk, piece.rows - rank * piece.chunk))
            if (
                not isinstance(placement, Shard)
                or placement.dim != 0
                or like.to_local().numel() != rows * math.prod(like.shape[1:])
            ):
                raise ValueError(
                    f"parameter {n!r} is laid out as {like.placements}, not as the fsdp "
                    "state's Shard(0) (torch.chunk's rows) or Replicate(): build the state "
                    "with engine.init(model, optimizer, strategy=fsdp)"
                )
        groups.setdefault(dtype_of(n), []).append(piece)
    return [_Layout(pieces, dtype, world) for dtype, pieces in groups.items()]


class _Gather:
    """One unit's all-gather in flight (one collective per dtype)."""

    __slots__ = ("parts", "replicated")

    def __init__(self, layouts: list[_Layout], local: dict[str, Tensor], group: Any) -> None:
        self.parts: list[tuple[_Layout, Any, Tensor, Tensor]] = []
        self.replicated: list[tuple[str, torch.dtype]] = []
        for layout in layouts:
            sharded = [p for p in layout.pieces if not p.replicated]
            self.replicated += [(p.name, layout.dtype) for p in layout.pieces if p.replicated]
            if not sharded:
                continue
            sizes = [p.padded for p in sharded]
            inp = torch.empty(sum(sizes), dtype=layout.dtype)
            shards = [local[p.name] for p in sharded]
            dst = [v[: s.numel()] for v, s in zip(inp.split(sizes), shards)]
            torch._foreach_copy_(dst, [s.reshape(-1) for s in shards])
            out = torch.empty(layout.world * inp.numel(), dtype=layout.dtype)
            work = dist.all_gather_single(out, inp, group=group, async_op=True)
            self.parts.append((layout, work, out, inp))

    def wait(self) -> None:
        for _, work, _, _ in self.parts:
            work.wait()

    def fulls(self, local: dict[str, Tensor]) -> dict[str, Tensor]:
        """The unit's full tensors (call after ``wait``): each a padded buffer of its own,
        narrowed to the parameter's rows where the rows do not divide evenly."""
        out: dict[str, Tensor] = {}
        for layout, _, flat, _ in self.parts:
            world = layout.world
            sharded = [p for p in layout.pieces if not p.replicated]
            if len(sharded) == 1 and sharded[0].chunk * world == sharded[0].rows:
                p = sharded[0]  # one parameter, even rows: the buffer is the full tensor
                out[p.name] = flat.view(p.shape)
                continue
            bufs = [
                torch.empty((p.chunk * world, *p.shape[1:]), dtype=layout.dtype) for p in sharded
            ]
            torch.split_with_sizes_copy(
                flat.view(world, -1),
                [p.padded for p in sharded],
                dim=1,
                out=[b.view(world, -1) for b in bufs],
            )
            for p, b in zip(sharded, bufs):
                out[p.name] = b if b.shape[0] == p.rows else b[: p.rows]
        for name, dtype in self.replicated:
            x = local[name]
            out[name] = x.to(dtype) if x.dtype != dtype else x.clone()
        return out


class _Reduce:
    """One unit's reduce-scatter in flight (one collective per reduction dtype)."""

    __slots__ = ("parts", "present")

    def __init__(self, layouts: list[_Layout], grads: dict[str, Tensor | None], group: Any) -> None:
        self.parts: list[tuple[_Layout, Any, Tensor, Tensor]] = []
        self.present = {n for n, g in grads.items() if g is not None}
        for layout in layouts:
            world, dtype = layout.world, layout.dtype
            chunks = []
            for p in layout.pieces:
                g = grads[p.name]
                if g is None:  # not used on this rank: zeros take its place
                    g = torch.zeros(() if p.replicated else p.shape, dtype=dtype)
                elif g.dtype != dtype:
                    g = g.to(dtype)
                chunks.append(g.reshape(1).expand(world) if p.replicated else g)
            inp = torch._chunk_cat(chunks, dim=0, num_chunks=world).view(-1)
            out = torch.empty(layout.numel, dtype=dtype)
            work = dist.reduce_scatter_single(out, inp, group=group, async_op=True)
            self.parts.append((layout, work, out, inp))

    def shards(self, local: dict[str, Tensor]) -> dict[str, Tensor]:
        """Waits; this rank's shards of the gradients averaged over ranks, each its own
        tensor in the local shard's dtype (None for a gradient this rank did not get)."""
        out: dict[str, Tensor] = {}
        for layout, work, flat, _ in self.parts:
            work.wait()
            views, names = [], []
            for p, v in zip(layout.pieces, flat.split(layout.sizes)):
                if p.name not in self.present:
                    continue
                shard = local[p.name]
                views.append(v[: shard.numel()].view(shard.shape))
                names.append(p.name)
            for n, g in zip(names, torch._foreach_div(views, layout.world)):
                dtype = local[n].dtype
                out[n] = g if g.dtype == dtype else g.to(dtype)
        return out


# ---------------------------------------------------------------------- autograd


class _UnitFunction(torch.autograd.Function):
    """Forward: a unit's full tensors (the gather already waited on); backward: all the
    unit's gradients at once, handed to the pass to reduce-scatter. Its one tensor input is
    the pass's anchor, so that autograd runs every unit's backward."""

    @staticmethod
    def forward(
        ctx: Any, run: UnitPass, unit: str, make: Callable[[], list[Tensor]], anchor: Tensor
    ) -> Any:
        ctx.set_materialize_grads(False)
        ctx.run, ctx.unit = run, unit
        return tuple(make())  # copied out of the all-gather buffer here, as outputs are

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        ctx.run.reduce(ctx.unit, grads)
        return None, None, None, None


# ---------------------------------------------------------------------- the units


class Token:
    """What a saved-tensor hook keeps instead of a gathered parameter (or a view of one)."""

    __slots__ = ("name", "offset", "size", "stride")

    def __init__(self, name: str, t: Tensor) -> None:
        self.name = name
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class Units:
    """The hooks that gather each unit's parameters into a meta template while it runs.

    ``units``: ``unit path -> canonical parameter names`` (``wrap_units``; "" the root).
    ``order``: the units' forward order, recorded on the first pass (prefetch follows it).
    """

    def __init__(
        self, template: nn.Module, units: dict[str, list[str]], mp: Any, reshard: bool
    ) -> None:
        self.template = template
        self.mp = mp
        self.reshard = reshard
        self.active: UnitPass | None = None
        self.order: list[str] | None = None
        self._layouts: dict[tuple[str, frozenset[str] | None], list[_Layout]] = {}
        slots: dict[str, list[tuple[dict, str]]] = {}
        first: dict[int, str] = {}
        for slot, p in template.named_parameters(remove_duplicate=False):
            path, _, attr = slot.rpartition(".")
            canon = first.setdefault(id(p), slot)
            slots.setdefault(canon, []).append((template.get_submodule(path)._parameters, attr))
        self.names = {u: list(names) for u, names in units.items()}
        self.places = {u: [(n, slots[n]) for n in names] for u, names in units.items()}
        self.unit_of = {n: u for u, names in units.items() for n in names}
        for path in units:
            if path:
                module = template.get_submodule(path)
                module.register_forward_pre_hook(self._pre(path))
                module.register_forward_hook(self._post(path))
        if mp.param_dtype is not None and (mp.cast_forward_inputs or mp.output_dtype):
            template.register_forward_pre_hook(self._cast_inputs)
            template.register_forward_hook(self._cast_output)

    def layouts(
        self, unit: str, likes: dict[str, Any], trainable: frozenset[str] | None = None
    ) -> list[_Layout]:
        """The unit's flat layouts for the all-gather (``trainable=None``: every parameter,
        in the compute dtype) or the reduce-scatter (the ``trainable`` ones, in the
        reduction dtype), built once per unit."""
        key = (unit, trainable)
        found = self._layouts.get(key)
        if found is None:
            names = self.names[unit]
            if trainable is not None:
                names = [n for n in names if n in trainable]
            compute, reduce = self.mp.param_dtype, self.mp.reduce_dtype

            def dtype_of(n: str) -> torch.dtype:
                own = likes[n].dtype
                if not own.is_floating_point:
                    return own
                if trainable is not None and reduce is not None:
                    return reduce
                return compute if compute is not None else own

            world = likes[names[0]].device_mesh.size() if names else 1
            found = self._layouts[key] = _layouts(names, likes, dtype_of, world)
        return found

    def _pre(self, path: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            run = self.active
            if run is not None:
                run.enter(path)

        return hook

    def _post(self, path: str) -> Callable:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            run = self.active
            if run is not None:
                run.leave(path, out)

        return hook

    def bind(self, unit: str, fulls: dict[str, Tensor] | None) -> None:
        for name, places in self.places[unit]:
            full = None if fulls is None else fulls[name]
            for table, attr in places:
                table[attr] = full  # None: the Binder puts the template's own back on exit

    def _cast_inputs(self, module: nn.Module, args: Any) -> Any:
        if self.active is None or not self.mp.cast_forward_inputs:
            return None
        dtype = self.mp.param_dtype
        return map(
            lambda x: x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x, args
        )

    def _cast_output(self, module: nn.Module, args: Any, out: Any) -> Any:
        if self.active is None or self.mp.output_dtype is None:
            return None
        dtype = self.mp.output_dtype
        return map(
            lambda x: x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x, out
        )

    def gathering(
        self, params: dict[str, Any], local: dict[str, Tensor], trainable: list[str] | None
    ) -> Active:
        """The context of one pass over the state's shards ``params`` (their local tensors
        ``local``); ``trainable``: the parameters to take gradients of (None: no autograd)."""
        return Active(self, UnitPass(self, params, local, trainable))


class UnitPass:
    """One forward (and backward) pass's gathers and reductions (see the module docstring)."""

    def __init__(
        self,
        units: Units,
        params: dict[str, Any],
        local: dict[str, Tensor],
        trainable: list[str] | None,
    ) -> None:
        self.units, self.params, self.local = units, params, local
        self.grad = trainable is not None
        self.trainable = frozenset(trainable or ())
        self.reshard = self.grad and units.reshard
        self.anchor = torch.zeros((), requires_grad=True) if self.grad else None
        any_like = next(iter(params.values()), None)
        self.group = any_like.device_mesh.get_group() if any_like is not None else None
        self.pending: dict[str, _Gather] = {}  # unit -> its all-gather in flight
        self.back: dict[str, dict[str, Tensor]] = {}  # unit -> gathered again for backward
        self.made: dict[int, tuple[weakref.ref, str]] = {}  # resharded full tensors
        self.seq: list[str] = []  # the units in the order their forward ran
        self.resharded: list[bool] = []
        self.last: dict[str, int] = {}  # unit -> its last position in seq
        self.reducing: _Reduce | None = None
        self.grads: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ gathering

    def _issue(self, unit: str) -> _Gather:
        layouts = self.units.layouts(unit, self.params)
        return _Gather(layouts, self.local, self.group)

    def _prefetch(self, unit: str) -> None:
        if unit not in self.pending and unit not in self.back:
            self.pending[unit] = self._issue(unit)

    def _take(self, unit: str) -> _Gather:
        gather = self.pending.pop(unit, None) or self._issue(unit)
        gather.wait()
        return gather

    def _regather(self, unit: str) -> dict[str, Tensor]:
        """A resharded unit's full tensors for the backward pass, held until its gradients
        are reduced."""
        fulls = self.back.get(unit)
        if fulls is None:
            gather = self._take(unit)
            with torch.no_grad():
                fulls = self.back[unit] = gather.fulls(self.local)
        return fulls

    def _materialise(self, unit: str, gather: _Gather, reshard: bool) -> dict[str, Tensor]:
        names = self.units.names[unit]
        wanted = [n for n in names if n in self.trainable]
        if self.grad and wanted and torch.is_grad_enabled():
            holder: dict[str, Tensor] = {}

            def fulls() -> list[Tensor]:
                holder.update(gather.fulls(self.local))
                return [holder[n] for n in wanted]

            outs = _UnitFunction.apply(self, unit, fulls, self.anchor)
            full = {**holder, **dict(zip(wanted, outs))}
        else:
            full = gather.fulls(self.local)
        if reshard:
            for name, t in full.items():
                root = t if t._base is None else t._base
                self.made[id(root)] = (weakref.ref(root), name)
        return full

    def start(self) -> None:
        """The root unit's parameters bound, the first unit prefetched."""
        order = self.units.order
        root = self._take("") if self.units.names[""] else None
        if order:
            self._prefetch(order[0])
        if root is not None:
            self.units.bind("", self._materialise("", root, False))

    def enter(self, unit: str) -> None:
        """A unit's forward pre-hook: its parameters gathered (waited on, or gathered now),
        the next unit's all-gather issued, the full tensors bound."""
        k = len(self.seq)
        order = self.units.order
        reshard = self.reshard and not (order is not None and k == len(order) - 1)
        self.seq.append(unit)
        self.resharded.append(reshard)
        self.last[unit] = k
        full = self._materialise(unit, self._take(unit), reshard)
        if order is not None and k + 1 < len(order):
            self._prefetch(order[k + 1])  # after the copy-out: two units' buffers at most
        self.units.bind(unit, full)

    def leave(self, unit: str, out: Any) -> None:
        """A unit's forward post-hook: its parameters unbound; when resharding, a hook on its
        outputs to gather it (and prefetch the unit before it) as the backward pass comes."""
        self.units.bind(unit, None)
        if self.reshard and torch.is_grad_enabled():
            k = len(self.seq) - 1
            hook = self._pre_backward(k)
            for x in _tensors(out):
                if x.requires_grad:
                    x.register_hook(hook)

    def _pre_backward(self, k: int) -> Callable:
        def hook(grad: Tensor) -> None:
            if self.resharded[k]:
                self._regather(self.seq[k])
            if k > 0 and self.resharded[k - 1]:
                self._prefetch(self.seq[k - 1])

        return hook

    # ------------------------------------------------------------------ saved tensors

    def pack(self, t: Tensor) -> Any:
        base = t if t._base is None else t._base
        entry = self.made.get(id(base))
        if entry is None or entry[0]() is not base:
            return t
        return Token(entry[1], t)

    def unpack(self, x: Any) -> Tensor:
        if not isinstance(x, Token):
            return x
        unit = self.units.unit_of[x.name]
        fulls = self.back.get(unit)
        if fulls is None:  # no pre-backward hook ran for the unit: gather it here
            fulls = self._regather(unit)
            k = self.last.get(unit, 0)
            if k > 0 and self.resharded[k - 1]:
                self._prefetch(self.seq[k - 1])
        full = fulls[x.name]
        root = full if full._base is None else full._base
        # the same gather lays its buffers out the same way: the saved view, rebuilt
        return root.as_strided(x.size, x.stride, x.offset)

    # ------------------------------------------------------------------ reducing

    def reduce(self, unit: str, grads: tuple[Tensor | None, ...]) -> None:
        """A unit's backward: the previous reduce-scatter collected, this one launched."""
        self._collect()
        self.back.pop(unit, None)
        names = [n for n in self.units.names[unit] if n in self.trainable]
        layouts = self.units.layouts(unit, self.params, self.trainable)
        self.reducing = _Reduce(layouts, dict(zip(names, grads)), self.group)

    def _collect(self) -> None:
        reducing, self.reducing = self.reducing, None
        if reducing is None:
            return
        for n, g in reducing.shards(self.local).items():
            self.grads[n] = self.grads[n] + g if n in self.grads else g

    def gradients(self) -> dict[str, Tensor]:
        """The averaged gradient shards of the pass (after its backward pass)."""
        self._collect()
        return self.grads

    def close(self) -> None:
        """Every collective still in flight waited on (so no buffer is freed under one)."""
        pending, self.pending = list(self.pending.values()), {}
        for gather in pending:
            gather.wait()
        reducing, self.reducing = self.reducing, None
        if reducing is not None:
            for _, work, _, _ in reducing.parts:
                work.wait()
        self.back.clear()
        self.made.clear()


def _tensors(out: Any) -> list[Tensor]:
    from purestep.engine.tree import leaves

    if isinstance(out, Tensor):
        return [out]
    try:
        return [x for x in leaves(out) if isinstance(x, Tensor)]
    except Exception:  # an output the tree utilities do not know: no pre-backward hook
        return []


class Active:
    """The context in which the template's units gather from one state's shards."""

    def __init__(self, units: Units, run: UnitPass) -> None:
        self.units, self.run = units, run
        self.saved = (
            torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack) if run.reshard else None
        )

    def __enter__(self) -> UnitPass:
        units, run = self.units, self.run
        if units.active is not None:
            raise RuntimeError("this fsdp step is already running (one call at a time per step)")
        units.active = run
        try:
            run.start()
        except BaseException:
            units.active = None
            run.close()
            raise
        if self.saved is not None:
            self.saved.__enter__()
        return run

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if self.saved is not None:
                self.saved.__exit__(exc_type, *exc)
        finally:
            self.units.active = None
            run = self.run
            if exc_type is None and self.units.order is None:
                self.units.order = list(run.seq)
            try:
                run.close()
            except Exception:
                if exc_type is None:
                    raise
