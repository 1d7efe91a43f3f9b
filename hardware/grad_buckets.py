"""Gradient buckets for data-parallel steps: reduced while the backward pass still runs.

Torch's ``DistributedDataParallel`` groups the gradients into buckets of about
``bucket_cap_mb`` (the first one smaller, 1 MiB, so the first all-reduce starts early) in the
reverse order of the parameters, the order in which the backward pass produces them, and
launches each bucket's all-reduce as soon as its last gradient exists, while autograd
computes the gradients of earlier layers. ``BucketLayout`` is that grouping and
``BucketedReduction`` one step's reduction: a hook on every parameter leaf copies the
gradient (plus the accumulation window's sum, when the window had earlier micro-batches) into
its bucket's fresh flat buffer and launches the bucket's collective asynchronously once the
bucket is full; ``finish`` launches what the backward pass left (unused parameters), waits,
and hands out the reduced gradients as views of the buffers.

Buckets are launched strictly in their index order on every rank (a bucket that fills early
waits for the ones before it), so the ranks' collectives always match even when the
gradients' ready order differs between steps. The layout is a function of the parameters
alone (names, shapes, dtypes, devices), never of what a previous step observed, so a resumed
run reduces exactly the buckets an uninterrupted one does: bitwise resume at any world size.

A communication hook is torch's: ``hook(state, bucket) -> torch.futures.Future[Tensor]``
(``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook`` and the
like take a ``GradBucket``; ``Bucket`` offers the same ``buffer()``, ``index()``,
``is_last()``, ``gradients()`` and ``parameters()``), the future's value being the bucket
averaged over the ranks. Without a hook the bucket is summed and then divided by the world
size, the arithmetic of ``hardware.collectives.all_reduce_tree``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .collectives import diagnosed

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "FIRST_BUCKET_BYTES",
    "Bucket",
    "BucketLayout",
    "BucketedReduction",
    "COMM_HOOKS",
    "CommHook",
    "resolve_comm_hook",
]

#: Torch DDP's default bucket size in MiB.
DEFAULT_BUCKET_CAP_MB = 25.0
#: The size of the first bucket (torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``).
FIRST_BUCKET_BYTES = 1024 * 1024

#: ``hook(state, bucket) -> Future[Tensor]``: the bucket's buffer averaged over the ranks.
CommHook = Callable[[Any, "Bucket"], "torch.futures.Future[torch.Tensor]"]


#: Names for torch's default hooks (``ddp_comm_hooks.default_hooks``).
COMM_HOOKS = ("allreduce", "fp16", "bf16")


def resolve_comm_hook(hook: str | CommHook | None) -> CommHook | None:
    """A comm hook from a name in ``COMM_HOOKS`` or a callable; None (and "allreduce"): the
    built-in sum-then-divide all-reduce."""
    if hook is None or hook == "allreduce":
        return None
    if isinstance(hook, str):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        named = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        if hook not in named:
            raise ValueError(
                f"unknown comm_hook {hook!r}; choose one of {COMM_HOOKS} or pass a "
                "function hook(state, bucket) -> torch.futures.Future"
            )
        return named[hook]
    if not callable(hook):
        raise TypeError(
            "comm_hook must be a name in "
            f"{COMM_HOOKS} or a function hook(state, bucket) -> Future, got {hook!r}"
        )
    return hook


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Which gradients share a bucket: ``buckets[i]`` lists parameter names in the order they
    sit in bucket ``i``'s flat buffer; bucket 0 is reduced first."""

    buckets: tuple[tuple[str, ...], ...]
    numels: dict[str, int]

    @classmethod
    def of(
        cls,
        params: dict[str, torch.Tensor],
        cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bytes: int = FIRST_BUCKET_BYTES,
    ) -> BucketLayout:
        """Torch's assignment: the parameters in reverse order, one open bucket per (dtype,
        device), closed when it reaches its limit (``first_bytes`` for the first bucket of a
        dtype and device, ``cap_mb`` MiB after); buckets ordered by their first gradient."""
        cap = int(cls.check_cap(cap_mb) * 1024 * 1024)
        open_: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
        done: list[list[str]] = []
        for name in reversed(list(params)):
            t = params[name]
            key = (t.dtype, t.device)
            bucket = open_.setdefault(key, [])
            bucket.append(name)
            sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
            limit = first_bytes if closed_count.get(key, 0) == 0 else cap
            if sizes[key] >= limit:
                done.append(open_.pop(key))
                sizes[key] = 0
                closed_count[key] = closed_count.get(key, 0) + 1
        done.extend(b for b in open_.values() if b)
        order = {name: i for i, name in enumerate(reversed(list(params)))}
        done.sort(key=lambda b: order[b[0]])
        return cls(tuple(tuple(b) for b in done), {n: t.numel() for n, t in params.items()})

    @staticmethod
    def check_cap(cap_mb: Any) -> float:
        """``cap_mb`` if it is a positive number of MiB, else a ``ValueError``."""
        if isinstance(cap_mb, bool) or not isinstance(cap_mb, (int, float)) or not cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {cap_mb!r}")
        return float(cap_mb)

    def bucket_of(self) -> dict[str, tuple[int, int]]:
        """``name -> (bucket index, offset in its flat buffer)``."""
        out = {}
        for i, names in enumerate(self.buckets):
            offset = 0
            for n in names:
                out[n] = (i, offset)
                offset += self.numels[n]
        return out


class Bucket:
    """One bucket of one step, as torch's ``GradBucket`` presents it to a comm hook."""

    def __init__(
        self, index: int, last: bool, flat: torch.Tensor, names: Sequence[str], params: list
    ):
        self._index, self._last, self._flat = index, last, flat
        self._names, self._params = tuple(names), params

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket (the hook may reduce it in place)."""
        return self._flat

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Overwrite the bucket's flat gradients with ``tensor`` (same size)."""
        self._flat.copy_(tensor)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        """Whether this is the bucket reduced last in the step."""
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """The bucket's gradients as views of its buffer, in buffer order."""
        out, offset = [], 0
        for p in self._params:
            out.append(self._flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    @property
    def names(self) -> tuple[str, ...]:
        return self._names


class BucketedReduction:
    """One step's gradient reduction, overlapped with its backward pass (module docstring).

    ``watch(name, leaf)`` before the backward pass; ``finish(grads)`` after it returns.
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: dict[str, torch.Tensor],
        accumulated: dict[str, torch.Tensor] | None,
        *,
        hook: CommHook | None = None,
        hook_state: Any = None,
        timeout: float | None = None,
    ) -> None:
        self.layout = layout
        self._where = layout.bucket_of()
        self._params = params
        self._acc = accumulated or None
        self._hook, self._hook_state = hook, hook_state
        self._timeout = timeout
        self._world = dist.get_world_size()
        self._flats: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self._dtype_device = [
            (params[names[0]].dtype, params[names[0]].device) for names in layout.buckets
        ]
        self._missing = [len(names) for names in layout.buckets]
        self._filled: set[str] = set()
        self._pending: list[Any] = []  # (index, work or future) in launch order
        self._next = 0  # the next bucket to launch
        #: Bytes whose reduction was launched from inside the backward pass.
        self.launched_in_backward = 0
        self._in_backward = True
        #: Whether the leaf hooks may fill buckets (set around the step's own backward pass).
        self.armed = False
        #: Whether ``finish`` has waited for every bucket.
        self.finished = False

    # ------------------------------------------------------------------ during backward

    def watch(self, name: str, leaf: torch.Tensor) -> None:
        """Copy ``leaf``'s gradient into its bucket when autograd produces it."""
        if name in self._where:
            leaf.register_hook(self._hook_for(name))

    def _hook_for(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.armed:
                self._fill(name, grad)

        return hook

    def _fill(self, name: str, grad: torch.Tensor) -> None:
        if name in self._filled:
            return
        index, offset = self._where[name]
        flat = self._flats[index]
        if flat is None:
            dtype, device = self._dtype_device[index]
            total = sum(self.layout.numels[n] for n in self.layout.buckets[index])
            flat = self._flats[index] = torch.empty(total, dtype=dtype, device=device)
        numel = self.layout.numels[name]
        slot = flat[offset : offset + numel].view(grad.shape)
        with torch.no_grad():
            if self._acc is not None and name in self._acc:
                torch.add(self._acc[name], grad, out=slot)
            else:
                slot.copy_(grad)
        self._filled.add(name)
        self._missing[index] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._missing) and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        flat = self._flats[index]
        assert flat is not None
        if self._in_backward:
            self.launched_in_backward += flat.numel() * flat.element_size()
        names = self.layout.buckets[index]
        what = f"all_reduce of gradient bucket {index} ({flat.numel()} values)"
        with diagnosed(what, self._timeout):
            if self._hook is None:
                pending: Any = dist.all_reduce(flat, async_op=True)
            else:
                bucket = Bucket(
                    index,
                    index == len(self.layout.buckets) - 1,
                    flat,
                    names,
                    [self._params[n] for n in names],
                )
                pending = self._hook(self._hook_state, bucket)
        self._pending.append((index, pending))

    # ------------------------------------------------------------------ after backward

    def finish(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The mean over ranks of every gradient in ``grads`` (the window's sum included):
        buckets the backward pass did not fill (parameters it did not reach) are filled
        from ``grads`` and launched, then every bucket is waited on."""
        self._in_backward = False
        for name, g in grads.items():
            if name not in self._filled and name in self._where:
                self._fill(name, g)
        if self._next < len(self._missing):
            absent = [n for n in self._where if n not in self._filled]
            raise RuntimeError(f"no gradient was given for parameters {absent[:5]}")
        out: dict[str, torch.Tensor] = {}
        for index, pending in self._pending:
            flat = self._flats[index]
            assert flat is not None
            with diagnosed(
                f"all_reduce of gradient bucket {index} ({flat.numel()} values)", self._timeout
            ):
                if self._hook is None:
                    pending.wait()
                    if self._world > 1:
                        flat.div_(self._world)
                else:
                    value = pending.wait()
                    value = value[0] if isinstance(value, (list, tuple)) else value
                    if value is not flat:
                        flat.copy_(value)
            offset = 0
            for n in self.layout.buckets[index]:
                numel = self.layout.numels[n]
                out[n] = flat[offset : offset + numel].view(grads[n].shape)
                offset += numel
        self.finished = True
        return {n: out[n] for n in grads}

    @property
    def launched(self) -> bool:
        """Whether any bucket's collective has been launched."""
        return bool(self._pending)

    def release(self) -> None:
        """Drop what the step no longer needs: the buffers (now the returned gradients'),
        the state's parameters, the window's sum, the finished works."""
        self._flats = [None] * len(self._flats)
        self._params, self._acc, self._pending = {}, None, []
