"""``source(data, ...)``: the one entry point that turns any data into ``Batches``.

What it accepts, and which path it takes:

* a ``Batches`` — returned unchanged (use ``with_options`` to change it);
* a tensor, or a non-empty tuple of tensors with a common first dimension — the fast path
  (``TensorBatches``: direct indexing);
* a ``DataLoader`` over a map-style dataset with a plain sampler (sequential, or random
  without replacement) — re-created on the deterministic order (``DatasetBatches``). Its own
  settings are kept: batch size, ``drop_last``, ``collate_fn``, workers, pinning,
  ``persistent_workers``, ``worker_init_fn``, ``timeout``, ``prefetch_factor``, the
  multiprocessing context; ``shuffle`` is whether its sampler was a ``RandomSampler``. The
  keyword arguments of those names are ignored for a loader (so loop code may pass them for
  every source); only ``seed``, ``rank`` and ``world_size`` apply. Change the rest with
  ``with_options``. A loader with ``in_order=False`` is made in-order (with a warning);
* a ``DataLoader`` with a custom sampler or batch sampler — its order cannot be made
  deterministic here, so it is iterated as it is (the weaker ``IterableBatches`` path) with a
  warning; a ``DataLoader`` over an ``IterableDataset`` is re-created with key-seeded
  workers on the same weaker path;
* a map-style dataset — anything with ``__getitem__`` and ``__len__`` that is not a mapping
  or a string (a ``Dataset``, a list of samples, a numpy array) — ``DatasetBatches``;
* an ``IterableDataset`` — batched by a DataLoader, weaker path (``shuffle`` has no effect,
  with a warning);
* any other iterable — its items are taken as ready-made batches, weaker path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data._utils.collate import default_collate, default_convert

from .batches import Batches
from .datasets import DatasetBatches
from .iterables import IterableBatches
from .options import Options
from .tensors import TensorBatches, TensorDatasetBatches, gathers

__all__ = ["batches", "source"]


def is_tensor_tuple(data: Any) -> bool:
    """Whether ``data`` is a tuple of tensors (one dataset, not several sources)."""
    return isinstance(data, tuple) and bool(data) and all(isinstance(t, torch.Tensor) for t in data)


def _custom_order(loader: DataLoader) -> str | None:
    """Why ``loader``'s order cannot be re-created deterministically (None when it can)."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return f"a custom batch_sampler ({type(batch_sampler).__name__})"
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    if type(sampler) is SequentialSampler:
        return None
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return None
    return f"a custom sampler ({type(sampler).__name__})"


def _loader_options(
    loader: DataLoader, seed: int, rank: int, world_size: int, scope: bool = True
) -> Options:
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is BatchSampler:
        batch_size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
        inner = batch_sampler.sampler
    else:
        batch_size, drop_last, inner = loader.batch_size, loader.drop_last, loader.sampler
    collate_fn = loader.collate_fn
    if collate_fn is default_collate or collate_fn is default_convert:
        collate_fn = None  # torch's default for the batching mode, chosen again on re-creation
    workers = loader.num_workers
    return Options(
        batch_size=batch_size,
        shuffle=type(inner) is RandomSampler,
        drop_last=drop_last,
        seed=seed,
        rank=rank,
        world_size=world_size,
        collate_fn=collate_fn,
        num_workers=workers,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
        worker_init_fn=loader.worker_init_fn,
        timeout=loader.timeout,
        prefetch_factor=loader.prefetch_factor if workers else None,
        multiprocessing_context=loader.multiprocessing_context,
        pin_memory_device=loader.pin_memory_device,
        scope_sample_rng=scope,
    )


def _from_loader(loader: DataLoader, seed: int, rank: int, world_size: int, scope: bool) -> Batches:
    if isinstance(loader.dataset, IterableDataset):
        options = _loader_options(loader, seed, rank, world_size, scope)
        return IterableBatches(loader.dataset, options, kind="loader")
    reason = _custom_order(loader)
    if reason is not None:
        warnings.warn(
            f"the DataLoader has {reason}, whose order cannot be made deterministic: it is "
            "iterated as it is (resuming consumes the skipped batches, no sharding)",
            UserWarning,
            stacklevel=3,
        )
        options = Options(seed=seed, rank=rank, world_size=world_size)
        return IterableBatches(loader, options, kind="loader")
    if not getattr(loader, "in_order", True):
        warnings.warn(
            "the DataLoader has in_order=False; it is re-created in order (determinism)",
            UserWarning,
            stacklevel=3,
        )
    options = _loader_options(loader, seed, rank, world_size, scope)
    if gathers(loader.dataset, options):
        return TensorDatasetBatches(loader.dataset, options)
    return DatasetBatches(loader.dataset, options, kind="loader")


def source(
    data: Any,
    *,
    batch_size: int | None = 1,
    shuffle: bool = False,
    drop_last: bool = False,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    collate_fn: Callable[[Any], Any] | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    worker_init_fn: Callable[[int], None] | None = None,
    timeout: float = 0,
    prefetch_factor: int | None = None,
    multiprocessing_context: Any = None,
    scope_sample_rng: bool = True,
) -> Batches:
    """Deterministic batches of ``data`` for this rank (see the module docstring for inputs).

    The epoch's order is a pure function of (seed, epoch, rank, world_size); ``seed`` is any
    integer key and must be the same on every rank. ``batch_size=None`` means the items are
    batches already. ``scope_sample_rng`` (also honoured for a DataLoader) seeds torch's,
    ``random``'s and numpy's global streams per sample around each ``dataset[i]``
    (``loops.data.sample_rng``); False leaves them to the process (the worker seeding).
    """
    if isinstance(data, Batches):
        return data
    if isinstance(data, DataLoader):
        return _from_loader(data, seed, rank, world_size, scope_sample_rng)
    options = Options(
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        seed=seed,
        rank=rank,
        world_size=world_size,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        worker_init_fn=worker_init_fn,
        timeout=timeout,
        prefetch_factor=prefetch_factor,
        multiprocessing_context=multiprocessing_context,
        scope_sample_rng=scope_sample_rng,
    )
    if isinstance(data, torch.Tensor) or is_tensor_tuple(data):
        return TensorBatches(data, options)
    if isinstance(data, IterableDataset):
        if shuffle:
            warnings.warn(
                "shuffle=True has no effect on an IterableDataset: it yields in its own order",
                UserWarning,
                stacklevel=2,
            )
        return IterableBatches(data, options, kind="iterable_dataset")
    if isinstance(data, Mapping):
        raise TypeError(
            "source() takes one dataset, not a mapping; for several use combine() or as_list()"
        )
    if isinstance(data, (str, bytes)):
        raise TypeError(f"cannot make batches from a {type(data).__name__}")
    if gathers(data, options):
        return TensorDatasetBatches(data, options)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return DatasetBatches(data, options)
    if isinstance(data, Iterable):
        return IterableBatches(data, options)
    raise TypeError(
        f"cannot make batches from {type(data).__name__}: expected a Dataset, a tensor or tuple "
        "of tensors, a DataLoader, an IterableDataset or an iterable of batches"
    )


def batches(data: Any, *, epoch: int = 0, start: int = 0, **options: Any) -> Iterator[Any]:
    """The batches of one epoch of ``data``: ``source(data, **options).iterate(epoch, start)``."""
    return source(data, **options).iterate(epoch, start)
