"""``Batches``: what every loop driver iterates — one epoch at a time, from any batch.

A ``Batches`` object is a recipe, not an iterator: ``iterate(epoch, start)`` returns a fresh
iterator over batch ``start``, ``start + 1``, ... of that epoch, so resuming mid-epoch is one
call. ``resumable`` says whether ``start`` is free (the index list is sliced, nothing before
it is loaded) or costs consuming and discarding ``start`` batches (iterables). There is no
``__iter__``: the epoch is always explicit.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator
from typing import Any

from .options import Options

__all__ = ["Batches", "check_position"]


def check_position(epoch: int, start: int, num_batches: int | float) -> None:
    """Validate ``iterate``'s arguments against an epoch of ``num_batches`` batches."""
    for name, value in (("epoch", epoch), ("start", start)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if start > num_batches:
        raise ValueError(f"start={start} is past the end of the epoch ({num_batches} batches)")


class Batches(abc.ABC):
    """Batches of one source (or a combination): per-rank length, epochs, options, metadata.

    Single sources also expose ``options`` (their ``Options``); combinations expose
    ``sources``."""

    #: True when ``iterate(epoch, start)`` costs the same for every ``start``.
    resumable: bool = True

    @property
    @abc.abstractmethod
    def num_batches(self) -> int | float:
        """Batches per epoch for this rank; ``math.inf`` when the source has no length."""

    @abc.abstractmethod
    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """The batches of ``epoch`` from batch index ``start`` on."""

    @abc.abstractmethod
    def with_options(self, **changes: Any) -> Batches:
        """The same source with some options changed (e.g. ``shuffle=False``, ``rank=1``)."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """A short, JSON-friendly summary for checkpoint metadata."""

    def __len__(self) -> int:
        n = self.num_batches
        if n == math.inf:
            raise TypeError(f"{type(self).__name__} has no length (its source is unsized)")
        return int(n)

    def _summary(self, kind: str, options: Options | None, **extra: Any) -> dict[str, Any]:
        n = self.num_batches
        return {
            "kind": kind,
            "length": None if n == math.inf else int(n),
            "resumable": self.resumable,
            **(options.summary() if options is not None else {}),
            **extra,
        }


class IndexedBatches(Batches):
    """Batches of ``self._n`` indexable samples under ``self._options``: the sized sources
    whose order ``loops.data.order`` computes (datasets and tensors)."""

    _n: int
    _options: Options

    @property
    def options(self) -> Options:
        return self._options

    @property
    def num_batches(self) -> int:
        from . import order

        o = self._options
        return order.batches_per_rank(self._n, o.world_size, o.batch_size, o.drop_last)

    def epoch_indices(self, epoch: int) -> Any:
        """This rank's sample indices for ``epoch``, in order (a tensor)."""
        from . import order

        o = self._options
        return order.rank_order(
            self._n,
            seed=o.seed,
            epoch=epoch,
            shuffle=o.shuffle,
            rank=o.rank,
            world_size=o.world_size,
            drop_last=o.drop_last,
        )


def length(batches: Any) -> int | float:
    """Batches per epoch of a ``Batches`` (or anything with a ``len``); ``math.inf`` when
    unsized."""
    n = getattr(batches, "num_batches", None)
    if n is not None:
        return n
    try:
        return len(batches)
    except TypeError:
        return math.inf
