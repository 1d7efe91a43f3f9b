"""Map-style datasets: a DataLoader driven by the deterministic order, from any batch.

The loader is built once per ``DatasetBatches`` (so persistent workers persist) around a
``PlanSampler``. Each ``iterate(epoch, start)`` sets the sampler's plan — the rank's index
list of that epoch, sliced at batch ``start`` — and starts the loader; the loader reads the
plan right away, so iterators of different epochs do not disturb one another. Skipped
batches are never requested, so never loaded, with or without workers, and workers return
batches in plan order. For a ``KeyedDataset``, and whenever the global streams are scoped per
sample (``Options.scope_sample_rng``, the default; ``loops.data.sample_rng``), the plan holds
``SampleKey``s rather than bare indices, which is how per-sample keys reach the workers. A
dataset (or its class) with ``scope_sample_rng = False`` opts out, wherever its source is
built (the Trainer's included).

With ``persistent_workers`` the one loader keeps one set of workers, so (as with any
DataLoader) only one iteration of a given ``DatasetBatches`` may be in progress at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Sampler

from .batches import IndexedBatches, check_position
from .keyed import KeyedDataset, SampleKey
from .options import Options
from .sample_rng import ScopedDataset, draws_nothing
from .workers import WorkerSeeder, build_loader

__all__ = ["DatasetBatches", "PlanSampler"]


class PlanSampler(Sampler):
    """Yields the current plan: lists of indices or keys as a loader's ``batch_sampler``, or
    single ones as its ``sampler`` (for ``batch_size=None``)."""

    def __init__(self) -> None:
        self.plan: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)


class DatasetBatches(IndexedBatches):
    """Batches of a map-style dataset (anything with ``__getitem__`` and ``__len__``)."""

    resumable = True

    def __init__(self, dataset: Any, options: Options, kind: str = "dataset") -> None:
        self._dataset = dataset
        self._options = options
        self._kind = kind
        self._n = len(dataset)
        self._loader: DataLoader | None = None
        self._sampler = PlanSampler()
        self._seeder = WorkerSeeder(options.seed, options.worker_init_fn)
        self._scoped = (
            options.scope_sample_rng
            and getattr(dataset, "scope_sample_rng", True) is not False
            and not draws_nothing(dataset)
        )

    @property
    def dataset(self) -> Any:
        return self._dataset

    def plan(self, epoch: int, start: int = 0) -> list[Any]:
        """What the loader is asked for from batch ``start`` of ``epoch`` (lists of indices)."""
        check_position(epoch, start, self.num_batches)
        o = self._options
        indices = self.epoch_indices(epoch).tolist()
        if self._scoped or isinstance(self._dataset, KeyedDataset):
            indices = [SampleKey(i, epoch, o.seed) for i in indices]
        if o.batch_size is None:
            return indices[start:]
        size = o.batch_size
        return [indices[b * size : (b + 1) * size] for b in range(start, self.num_batches)]

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        check_position(epoch, start, self.num_batches)
        return self._generate(epoch, start)

    def _generate(self, epoch: int, start: int) -> Iterator[Any]:
        plan = self.plan(epoch, start)
        if not plan:
            return
        if self._loader is None:
            batched = self._options.batch_size is not None
            self._loader = build_loader(
                ScopedDataset(self._dataset) if self._scoped else self._dataset,
                self._options,
                self._seeder,
                batch_sampler=self._sampler if batched else None,
                sampler=None if batched else self._sampler,
            )
        self._sampler.plan = plan
        self._seeder.start(self._loader, epoch)
        yield from iter(self._loader)

    def with_options(self, **changes: Any) -> DatasetBatches:
        return DatasetBatches(self._dataset, self._options.replace(**changes), self._kind)

    def describe(self) -> dict[str, Any]:
        return self._summary(self._kind, self._options, num_samples=self._n)
