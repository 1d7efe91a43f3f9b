"""Per-sample randomness that does not depend on worker count: keys for samples and workers.

An augmentation that draws from torch's global generator inside a ``DataLoader`` worker gets
numbers that depend on which worker loads the sample, so changing ``num_workers`` changes
the data. Here each sample's draws come from its own generator instead,
``sample_generator(seed, epoch, index)``: the same sample in the same epoch gets the same
numbers whichever process loads it, in whatever order.

``keyed(dataset, fn)`` wraps a map-style dataset so that item ``i`` is
``fn(dataset[i], generator)``. Batches built by ``loops.data.source`` from a keyed dataset
ask for items with ``SampleKey(index, epoch, seed)`` instead of a bare index (the wrapper
unpacks it), so the key reaches the worker with the request. Indexing the wrapper with a
plain ``int`` (outside a source) draws with ``epoch=0`` and ``seed=0``. The wrapper must be
the outermost one (``keyed(Subset(ds, ...), fn)``, not ``Subset(keyed(ds, fn), ...)``). A
sample that sharding pads in twice gets the same key, hence the same draws, both times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch.utils.data import Dataset

from purestep.engine import rng

__all__ = [
    "KeyedDataset",
    "SampleKey",
    "keyed",
    "sample_generator",
    "sample_key",
]

T = TypeVar("T")


class SampleKey(NamedTuple):
    """What a keyed dataset is indexed with: the sample, the epoch and the source's seed."""

    index: int
    epoch: int
    seed: int


def sample_key(seed: int, epoch: int, index: int) -> int:
    """The key of sample ``index`` in ``epoch``: ``fold_in(seed, Purpose.SAMPLE, epoch, index)``.

    Use it to seed other libraries (e.g. ``numpy.random.default_rng(sample_key(...))``).
    """
    return rng.fold_in(seed, rng.Purpose.SAMPLE, epoch, index)


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A fresh CPU generator seeded from ``sample_key(seed, epoch, index)``."""
    return rng.generator(sample_key(seed, epoch, index))


class KeyedDataset(Dataset, Generic[T]):
    """A map-style dataset whose item ``key`` is ``fn(dataset[key.index], generator)``."""

    def __init__(self, dataset: Any, fn: Callable[[Any, torch.Generator], T]) -> None:
        if not callable(fn):
            raise TypeError(f"keyed() needs a callable fn(item, generator), got {fn!r}")
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(
                f"keyed() needs a map-style dataset (with __getitem__ and __len__), "
                f"got {type(dataset).__name__}"
            )
        self.dataset = dataset
        self.fn = fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: SampleKey | int) -> T:
        if not isinstance(key, SampleKey):
            key = SampleKey(int(key), 0, 0)
        item = self.dataset[key.index]
        return self.fn(item, sample_generator(key.seed, key.epoch, key.index))


def keyed(dataset: Any, fn: Callable[[Any, torch.Generator], T]) -> KeyedDataset[T]:
    """Wrap ``dataset`` so item ``i`` of epoch ``e`` is ``fn(dataset[i], sample_generator)``.

    ``fn`` must draw all its randomness from the generator it receives (for example
    ``torch.rand(3, generator=g)``); then items are the same for any ``num_workers``.
    """
    return KeyedDataset(dataset, fn)
