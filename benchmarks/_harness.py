"""Shared machinery of the benchmarks: interleaved timing and peak live tensor memory on CPU.

Timing (``interleaved``): every side runs a block of steps per round; the order of the
sides rotates from round to round, ``gc.collect()`` runs before each block (outside the
timed region; collections triggered inside a block count, as they would in a real loop),
and a block's time divided by its steps is one sample. Background load on a shared machine
then falls on all sides alike, and the median over rounds discards the disturbed blocks.
``interleaved_calls`` does the same for calls too long to repeat in a block (an epoch, a
checkpoint write): one timed call per side per round, after an untimed ``prepare``.

Memory: CPU tensors have no allocator statistics, so two independent meters are offered.

* ``peak_live_bytes`` (the primary one) counts live tensor storage. The bytes alive at the
  start are those of the *roots* the caller names (the storages of everything its side
  holds between steps, deduplicated by storage data pointer; meta tensors hold none). While
  the step runs, a ``TorchDispatchMode`` sees every aten op (forward; backward, which on
  CPU runs in the calling thread; optimizer ``_foreach_*`` ops) and records each output
  storage that is not one of the op's input storages, i.e. each allocation an op hands
  back (in-place ops and views allocate nothing). A weak reference with a callback on every
  counted untyped storage (torch keeps one Python object per storage alive as long as the
  storage itself) subtracts its bytes when it is freed. The peak is the largest live total
  after any op. It misses scratch memory an op allocates and frees inside its own kernel,
  and memory that is not tensor storage; it counts every side the same way.
* ``allocator_peak_bytes`` (the cross-check) reads the c10 CPU allocator's own allocation
  and free records through ``torch.profiler(profile_memory=True)``. The allocator only
  knows the size of blocks allocated while profiling, so a priming step runs under the
  profiler first and the peak is taken over the second step: the same roots at its start
  plus the largest running sum of allocations minus frees inside it. This one sees kernel
  scratch memory too (but not memory MKL or oneDNN take from their own allocators).

``self_check()`` validates the primary meter on tensors of known size and on a backward
pass (see its docstring); the benchmarks run it before measuring.
"""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from purestep.engine import rng

try:
    import resource
except ImportError:  # not on Unix: no page-fault counts
    resource = None

__all__ = [
    "Memory",
    "allocator_peak_bytes",
    "interleaved",
    "interleaved_calls",
    "paired",
    "peak_live_bytes",
    "release_free_memory",
    "self_check",
    "storage_bytes",
    "summary",
]


# --------------------------------------------------------------------------- timing


def cross_entropy_loss(apply: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> torch.Tensor:
    """The classification loss the MLP benchmarks train: cross-entropy of ``apply(x)``."""
    x, y = batch
    return F.cross_entropy(apply(x), y)


def classification_batches(
    n: int, batch: int, features: int, classes: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random ``(x, y)`` batches, the same on every run (drawn from key 1)."""
    g = rng.generator(rng.key(1))
    return [
        (
            torch.randn(batch, features, generator=g),
            torch.randint(0, classes, (batch,), generator=g),
        )
        for _ in range(n)
    ]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def interleaved(
    sides: dict[str, Callable[[], Any]],
    rounds: int,
    steps: int,
    faults: dict[str, list[float]] | None = None,
    sync: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each side, one sample per round (``steps`` calls of the side).

    When ``faults`` is given, it receives the minor page faults per step of each block (the
    process's count, so a fault in another thread of this process would count too). ``sync``
    (e.g. ``torch.cuda.synchronize``) runs before the clock starts and before it stops, so a
    block of asynchronous device work is timed to its completion.
    """
    names = list(sides)
    samples: dict[str, list[float]] = {n: [] for n in names}
    if faults is not None:
        faults.update({n: [] for n in names})
    clock = time.perf_counter_ns
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = sides[name]
            gc.collect()
            if sync is not None:
                sync()
            f0 = _minor_faults()
            t0 = clock()
            for _ in range(steps):
                fn()
            if sync is not None:
                sync()
            samples[name].append((clock() - t0) * 1e-9 / steps)
            if faults is not None:
                faults[name].append((_minor_faults() - f0) / steps)
    return samples


def interleaved_calls(
    sides: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]], rounds: int
) -> dict[str, list[float]]:
    """Seconds of one timed call of each side per round, for calls too long to repeat in a block.

    Each side is ``(prepare, run)``: ``prepare()`` runs untimed before every call (e.g. to
    remove the file the previous call wrote), then ``gc.collect()``, then ``run(prepared)``
    is timed. What ``run`` returns is released after the clock stops, so freeing a large
    result is not charged to the call. The order of the sides rotates from round to round
    as in ``interleaved``.
    """
    names = list(sides)
    samples: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter_ns
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            prepare, run = sides[name]
            prepared = prepare()
            gc.collect()
            t0 = clock()
            result = run(prepared)
            samples[name].append((clock() - t0) * 1e-9)
            del result, prepared
    return samples


def release_free_memory() -> bool:
    """Hand the memory the C allocator holds free back to the OS (glibc ``malloc_trim``).

    Calls that allocate hundreds of MB (loading a checkpoint) run at two speeds depending on
    whether the allocator still holds pages a previous call freed (no page faults) or must
    fault in fresh ones, as a new process does. Calling this before each such call puts
    every side in the fresh-process case. Returns False where there is no glibc.
    """
    try:
        import ctypes

        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of ``a / b``: the ratio of two sides timed in the same rounds,
    robust to a round a background job slowed down (it slows both sides of that round)."""
    return statistics.median(x / y for x, y in zip(a, b))


def summary(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """``median (min..max)`` of ``values`` times ``scale``, for the per-side lines."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}..{max(v):.{digits}f})"


# --------------------------------------------------------------------------- live storage


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for meta, empty or storage-less tensors."""
    if t.is_meta or t.layout != torch.strided:
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return s if s.nbytes() and s.data_ptr() else None


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (deduplicated by data pointer)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = _storage(t)
        if s is not None:
            seen.setdefault(s.data_ptr(), s.nbytes())
    return sum(seen.values())


class _Live:
    """Live bytes of the storages registered with ``add``, with the peak of their sum."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def add(self, s: torch.UntypedStorage) -> None:
        ptr = s.data_ptr()
        if ptr in self._refs:
            return
        n = s.nbytes()
        self._refs[ptr] = weakref.ref(s, lambda _, ptr=ptr, n=n: self._free(ptr, n))
        self.current += n
        if self.current > self.peak:
            self.peak = self.current

    def _free(self, ptr: int, n: int) -> None:
        if self._refs.pop(ptr, None) is not None:
            self.current -= n

    def close(self) -> None:
        self._refs.clear()


class _Recorder(TorchDispatchMode):
    """Registers every storage an aten op returns that none of its inputs had."""

    def __init__(self, live: _Live) -> None:
        super().__init__()
        self.live = live
        self.peak_op = "(before the call)"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = set()
        for t in _tensors((args, kwargs)):
            s = _storage(t)
            if s is not None:
                before.add(s.data_ptr())
        out = func(*args, **kwargs)
        peak = self.live.peak
        for t in _tensors(out):
            s = _storage(t)
            if s is not None and s.data_ptr() not in before:
                self.live.add(s)
        if self.live.peak > peak:
            self.peak_op = str(func)
        return out


@dataclass(frozen=True)
class Memory:
    """Bytes alive at the start of the measured call, at its peak and at its end, and the
    aten op whose output reached the peak."""

    start: int
    peak: int
    end: int
    peak_op: str


def _register(live: _Live, roots: Callable[[], Iterable[torch.Tensor]]) -> None:
    # A function of its own, so that no reference to a root outlives the registration.
    for t in roots():
        s = _storage(t)
        if s is not None:
            live.add(s)


def peak_live_bytes(run: Callable[[], Any], roots: Callable[[], Iterable[torch.Tensor]]) -> Memory:
    """Peak live tensor storage while ``run()`` executes, starting from ``roots()``' storages.

    ``roots`` is a function so that the measurement holds no reference to the tensors it
    returns: a root that the call frees (an old gradient, a consumed state) is subtracted.
    ``run``'s return value is dropped; whatever ``run`` stores elsewhere stays counted.
    """
    live = _Live()
    _register(live, roots)
    start = live.current
    try:
        recorder = _Recorder(live)
        with recorder:
            run()
        gc.collect()
        return Memory(start, live.peak, live.current, recorder.peak_op)
    finally:
        live.close()


def allocator_peak_bytes(
    prime: Callable[[], Any], run: Callable[[], Any], roots: Callable[[], Iterable[torch.Tensor]]
) -> int:
    """Peak bytes by the CPU allocator's records: ``roots()`` at the start of ``run()`` plus
    the largest running sum of allocations minus frees during ``run()``, with ``prime()``
    run first under the profiler (see the module doc)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    tag = "__benchmark_measured_call__"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        prime()
        gc.collect()
        base = storage_bytes(roots())
        with record_function(tag):
            run()
    allocs: list[tuple[int, int]] = []
    window = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            allocs.append((e.start_time_ns, e.extra_fields.alloc_size))
        elif e.name == tag:
            window = (e.start_time_ns, e.end_time_ns)
        stack.extend(e.children)
    if window is None:
        raise RuntimeError("the profiler recorded no measured window")
    running = top = 0
    for when, size in sorted(allocs):
        if window[0] <= when <= window[1]:
            running += size
            top = max(top, running)
    return base + top


# --------------------------------------------------------------------------- validation


def self_check() -> None:
    """Validate ``peak_live_bytes`` on known sizes; raise ``AssertionError`` if it is off.

    1. A 1 MiB root, named twice (itself and a view), and an empty call: start = peak =
       end = 1 MiB.
    2. Inside the call: a 1 MiB tensor, a 1 MiB result of an op on it, the first freed, an
       in-place op and a view (no allocation), a 2 MiB tensor, then all freed: the peak is
       the root plus 3 MiB and the end is the root again.
    3. A 1 MiB root that the call replaces by a new 1 MiB tensor: the peak is 2 MiB and the
       end 1 MiB (a root freed during the call is subtracted).
    4. A backward pass inside the call on a 1 MiB leaf: the gradient the backward pass
       allocates and ``.grad`` keeps is counted (end = root + 1 MiB) and the forward
       temporary is freed.
    """
    mib = 1 << 20
    root = torch.zeros(mib // 4)
    m = peak_live_bytes(lambda: None, lambda: [root, root[1:]])
    assert (m.start, m.peak, m.end) == (mib, mib, mib), m

    def allocations() -> None:
        a = torch.ones(mib // 4)
        b = a * 2
        del a
        b.add_(1)
        v = b.view(2, -1)[0]
        c = torch.zeros(mib // 2)
        del b, v, c

    m = peak_live_bytes(allocations, lambda: [root])
    assert (m.start, m.peak, m.end) == (mib, 4 * mib, mib), m

    held = {"x": torch.zeros(mib // 4)}

    def replace() -> None:
        held["x"] = torch.ones(mib // 4)

    m = peak_live_bytes(replace, lambda: held.values())
    assert (m.start, m.peak, m.end) == (mib, 2 * mib, mib), m

    leaf = torch.zeros(mib // 4, requires_grad=True)

    def backward() -> None:
        (leaf * 3).sum().backward()

    m = peak_live_bytes(backward, lambda: [leaf])
    assert leaf.grad is not None and m.end == 2 * mib, m
    assert 2 * mib <= m.peak <= 3 * mib, m
