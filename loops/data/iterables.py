"""The weaker path: iterables whose order is theirs, resumed by consuming batches.

Used for an ``IterableDataset`` (batched here by a DataLoader built from the options), for a
DataLoader whose sampler cannot be made deterministic (a custom sampler or batch sampler),
and for any other iterable, whose items are taken to be batches already. Guarantees:

* the order is whatever the iterable yields (it is not shuffled nor sharded here; an
  ``IterableDataset`` shards itself across workers and ranks, as with torch);
* ``iterate(epoch, start)`` first calls ``set_epoch(epoch)`` on the loader's sampler, batch
  sampler or dataset when they have one, then starts a fresh iteration and consumes and
  discards ``start`` batches, so ``resumable`` is False and skipped batches are loaded;
* the length is ``len(iterable)`` when that works, else ``math.inf``;
* an iterator (rather than a re-iterable collection) is used up by its first epoch;
* randomness: with workers, each worker's global streams are seeded from (seed, epoch,
  worker id) (``loops.data.workers``), so a rerun or a resume with the same worker count and
  non-persistent workers draws the same numbers. Without workers, an ``IterableDataset``'s
  batches are each fetched with the global streams scoped to (seed, epoch, batch position)
  (``Options.scope_sample_rng``), which a resume, replaying the skipped batches, reproduces.
  Not covered: the dataset's own order and sharding, other iterables (their batches are
  made by code outside this source), persistent workers across a resume.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from .batches import Batches, check_position
from .options import Options
from .sample_rng import sample_rng_key, scoped_streams
from .workers import WorkerSeeder, build_loader

__all__ = ["IterableBatches"]

# Changing these does not change what a foreign iterable yields; the new values are kept
# (describe() reports them) so that generic code such as ``with_options(shuffle=False)``
# works on any source.
_ORDER_ONLY = frozenset({"shuffle", "seed", "rank", "world_size"})
_END = object()


def _set_epoch(iterable: Any, epoch: int) -> None:
    targets = [iterable]
    if isinstance(iterable, DataLoader):
        targets = [iterable.sampler, iterable.batch_sampler, iterable.dataset]
    for target in targets:
        set_epoch = getattr(target, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


class IterableBatches(Batches):
    """Batches from an iterable: its own order; ``start`` costs consuming ``start`` batches."""

    resumable = False

    def __init__(self, data: Iterable[Any], options: Options, kind: str = "iterable") -> None:
        self._data = data
        self._options = options
        self._kind = kind
        self._seeder = WorkerSeeder(options.seed, options.worker_init_fn)
        self._loader: DataLoader | None = None

    @property
    def options(self) -> Options:
        return self._options

    @property
    def _builds_loader(self) -> bool:
        return isinstance(self._data, IterableDataset)

    def _iterable(self) -> Iterable[Any]:
        if not self._builds_loader:
            return self._data
        if self._loader is None:
            self._loader = build_loader(self._data, self._options, self._seeder)
        return self._loader

    @property
    def num_batches(self) -> int | float:
        try:
            return len(self._iterable())  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            return math.inf

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        check_position(epoch, start, self.num_batches)
        return self._generate(epoch, start)

    def _generate(self, epoch: int, start: int) -> Iterator[Any]:
        iterable = self._iterable()
        _set_epoch(iterable, epoch)
        if self._loader is None:
            yield from itertools.islice(iter(iterable), start, None)
            return
        self._seeder.start(self._loader, epoch)
        o = self._options
        if o.num_workers or not o.scope_sample_rng:
            yield from itertools.islice(iter(self._loader), start, None)
            return
        it = iter(self._loader)
        for b in itertools.count():
            with scoped_streams(sample_rng_key(o.seed, epoch, b)):
                batch = next(it, _END)
            if batch is _END:
                return
            if b >= start:
                yield batch

    def with_options(self, **changes: Any) -> IterableBatches:
        options = self._options.replace(**changes)
        fixed = sorted(set(changes) - _ORDER_ONLY)
        if fixed and not self._builds_loader:
            raise ValueError(
                f"cannot change {fixed} of a {self._kind} source: it yields ready-made batches "
                f"(only {sorted(_ORDER_ONLY)} may change, and they do not change its order)"
            )
        return IterableBatches(self._data, options, self._kind)

    def describe(self) -> dict[str, Any]:
        return self._summary(self._kind, self._options)
