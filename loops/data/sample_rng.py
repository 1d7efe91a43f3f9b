"""Per-sample scoping of the global random streams a dataset's ``__getitem__`` draws from.

Augmentations usually call ``torch.rand``, ``random.random`` or ``np.random.*``: the global
streams, whose position depends on the worker count, the batch position and whether the run
was resumed. ``ScopedDataset`` seeds those streams for each sample from
``sample_rng_key(seed, epoch, index) = fold_in(seed, Purpose.SAMPLE_RNG, epoch, index)``
right before ``dataset[index]`` and restores the caller's states afterwards, so a sample's
draws are a pure function of (seed, epoch, index).

Scoped: torch's global CPU generator, Python's ``random`` module and numpy's global
``RandomState`` (only when numpy is imported; its legacy seeding takes 32 bits, so it is
seeded from the key's upper half). Not scoped: CUDA generators, threads the dataset starts,
generators the dataset owns (``np.random.default_rng()``, its own ``torch.Generator``). A
dataset known to draw nothing (``TensorDataset``, a ``Subset`` of one) is read unscoped.

Cost: each sample pays for three seedings (about 7 us, most of it Python's ``random``). In
the main process the caller's states are also saved once per batch and restored after it
(no user code runs between the samples of one batch fetch; about 90 us a batch, numpy's
state the most); in a DataLoader worker nothing is restored, as the worker's streams serve
only the data path.
A dataset with a batched reader of its own (``__getitems__``) is called once per batch,
scoped with a key of the batch's indices (deterministic, but not per sample).
"""

from __future__ import annotations

import _random
import random
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset, get_worker_info

from purestep.engine import rng

from .keyed import KeyedDataset, SampleKey

__all__ = ["ScopedDataset", "draws_nothing", "reads_batches", "sample_rng_key", "scoped_streams"]

_seed_python = _random.Random.seed  # the C seeding, without Random.seed's type checks
_MASK32 = 0xFFFFFFFF


def sample_rng_key(seed: int, epoch: int, index: int) -> int:
    """The key a sample's global streams are seeded from:
    ``fold_in(seed, Purpose.SAMPLE_RNG, epoch, index)``."""
    return rng.fold_in(seed, rng.Purpose.SAMPLE_RNG, epoch, index)


def _save() -> tuple[Any, Any, Any] | None:
    """The caller's stream states, or None inside a DataLoader worker: the worker's streams
    belong to the data path (no user code of the training process sees them), so they are
    not restored, which saves most of the cost (numpy's state alone takes ~70 us to copy)."""
    if get_worker_info() is not None:
        return None
    np = sys.modules.get("numpy")
    return (
        torch.default_generator.get_state(),
        random.getstate(),
        np.random.get_state() if np is not None else None,
    )


def _restore(saved: tuple[Any, Any, Any] | None) -> None:
    if saved is None:
        return
    torch.default_generator.set_state(saved[0])
    random.setstate(saved[1])
    if saved[2] is not None:
        sys.modules["numpy"].random.set_state(saved[2])


def _seed(k: int) -> None:
    torch.default_generator.manual_seed(k)
    inst = random._inst
    _seed_python(inst, k)
    inst.gauss_next = None
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(k >> 32)


class scoped_streams:
    """``with scoped_streams(k):`` seeds the three global streams from ``k`` for a block and
    restores the caller's states afterwards (exception or not)."""

    __slots__ = ("_k", "_saved")

    def __init__(self, k: int) -> None:
        self._k = k

    def __enter__(self) -> None:
        self._saved = _save()
        _seed(self._k)

    def __exit__(self, *exc: object) -> None:
        _restore(self._saved)


def draws_nothing(dataset: Any) -> bool:
    """Whether ``dataset[i]`` is known to draw no random numbers, so scoping would only cost
    time: a ``TensorDataset`` (exactly that class: a subclass may augment), or a ``Subset``
    of one."""
    if type(dataset) is Subset:
        return draws_nothing(dataset.dataset)
    return type(dataset) is TensorDataset


def reads_batches(dataset: Any) -> bool:
    """Whether ``dataset`` has a batched reader (``__getitems__``) of its own: a ``Subset``
    has one only when the dataset it wraps does."""
    fn = getattr(type(dataset), "__getitems__", None)
    if fn is None:
        return False
    if isinstance(dataset, Subset) and fn is Subset.__getitems__:
        return reads_batches(dataset.dataset)
    return True


class ScopedDataset(Dataset):
    """``dataset`` read with ``SampleKey``s, each sample under its own seeded global streams.

    A ``KeyedDataset`` inside receives the ``SampleKey`` itself (its own generator and the
    scoped streams then both apply); any other dataset receives ``key.index``.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._keyed = isinstance(dataset, KeyedDataset)
        self._batched = reads_batches(dataset)
        self._base: tuple[int, int, int] = (-1, -1, 0)  # (seed, epoch, fold_in(seed, P, epoch))

    def __len__(self) -> int:
        return len(self.dataset)

    def _key(self, key: SampleKey) -> int:
        seed, epoch, base = self._base
        if seed != key.seed or epoch != key.epoch:
            base = rng.fold_in(key.seed, rng.Purpose.SAMPLE_RNG, key.epoch)
            self._base = (key.seed, key.epoch, base)
        return rng.fold_in(base, key.index)  # == sample_rng_key(seed, epoch, index)

    def _read(self, key: SampleKey) -> Any:
        return self.dataset[key if self._keyed else key.index]

    def __getitem__(self, key: SampleKey) -> Any:
        if not isinstance(key, SampleKey):
            raise TypeError(
                f"ScopedDataset is indexed with SampleKey(index, epoch, seed), got {key!r}"
            )
        saved = _save()
        try:
            _seed(self._key(key))
            return self._read(key)
        finally:
            _restore(saved)

    def __getitems__(self, keys: Sequence[SampleKey]) -> list[Any]:
        saved = _save()
        try:
            if self._batched and keys:
                first = keys[0]
                _seed(rng.fold_in(self._key(first), "batch", *(k.index for k in keys)))
                return self.dataset.__getitems__([k.index for k in keys])
            items = []
            for key in keys:
                _seed(self._key(key))
                items.append(self._read(key))
            return items
        finally:
            _restore(saved)
