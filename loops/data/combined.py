"""Several sources at once, with the semantics of Lightning's ``CombinedLoader`` modes.

``combine(sources, mode, limits=)`` takes a dict, list or tuple of sources (``Batches`` or
anything ``source`` accepts) and returns ``CombinedBatches``. With ``len_i`` the batches per
epoch of source ``i`` and ``lim_i = min(len_i, limit_i)``:

========================  ==========================================  ======================
mode                      one item of ``iterate``                     batches per epoch
========================  ==========================================  ======================
``max_size_cycle``        one batch of every source, in the input's   ``max(lim_i)``; 0 if a
                          structure; a shorter source restarts         source is empty
                          (cycles at its real length ``len_i``)
``min_size``              one batch of every source                   ``min(lim_i)``
``max_size``              one batch of every source, ``None`` for      ``max(lim_i)``
                          one that is exhausted (past ``len_i``)
``sequential``            ``(batch, batch_idx, dataloader_idx)``: the  ``sum(lim_i)``
                          first ``lim_i`` batches of source 0, then
                          of source 1, ...; ``batch_idx`` restarts at
                          0 for each source, ``dataloader_idx`` is
                          the source's position (dict order for a
                          dict)
========================  ==========================================  ======================

Unsized sources count as ``math.inf``. As in Lightning, limits only shape the length in the
first three modes (a source still cycles, or runs out, at its real length), while
``sequential`` takes at most ``lim_i`` batches of each source. A source restarted by cycling
replays the same epoch's order. Resuming is O(1) in every mode: batch ``start`` is at batch
``start % len_i`` of a cycled source, ``start`` of the others, and for ``sequential`` in the
source where the running sum of ``lim_i`` passes ``start`` (unsized sources are consumed).

``as_list(data)`` is the "one or several evaluation sets" helper: a list of ``Batches``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .batches import Batches, check_position
from .source import is_tensor_tuple, source

__all__ = ["MODES", "CombinedBatches", "as_list", "combine"]

MODES = ("max_size_cycle", "min_size", "max_size", "sequential")

Limit = int | float | None


def _as_batches(item: Any, options: dict[str, Any]) -> Batches:
    return item if isinstance(item, Batches) else source(item, **options)


def _check_limit(value: Limit) -> int | float:
    if value is None or value == math.inf:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a limit must be an int >= 0, None or math.inf, got {value!r}")
    return value


class CombinedBatches(Batches):
    """Batches of several sources in one of the ``MODES`` (see the module docstring)."""

    def __init__(
        self,
        sources: Mapping[Any, Batches] | Sequence[Batches],
        mode: str = "max_size_cycle",
        limits: Limit | Mapping[Any, Limit] | Sequence[Limit] = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {list(MODES)}")
        if isinstance(sources, Mapping):
            self._keys: list[Any] | None = list(sources)
            self._container: type = dict
            items = list(sources.values())
        elif isinstance(sources, (list, tuple)):
            self._keys, self._container, items = None, type(sources), list(sources)
        else:
            raise TypeError(f"combine() takes a dict, list or tuple of sources, got {sources!r}")
        if not items:
            raise ValueError("combine() needs at least one source")
        for item in items:
            if not isinstance(item, Batches):
                raise TypeError(f"every source must be a Batches, got {type(item).__name__}")
        self._sources = items
        self._mode = mode
        self._limits = self._parse_limits(limits)
        self.resumable = all(s.resumable for s in items)

    def _parse_limits(self, limits: Any) -> list[int | float]:
        k = len(self._sources)
        if limits is None or isinstance(limits, (int, float)):
            return [_check_limit(limits)] * k
        if isinstance(limits, Mapping):
            if self._keys is None or set(limits) != set(self._keys):
                raise ValueError(
                    f"limits keys {list(limits)} do not match the sources: {self._keys}"
                )
            return [_check_limit(limits[key]) for key in self._keys]
        if isinstance(limits, (list, tuple)) and self._keys is None:
            if len(limits) != k:
                raise ValueError(f"got {len(limits)} limits for {k} sources")
            return [_check_limit(v) for v in limits]
        raise TypeError(f"limits must be an int, None, or match the sources' structure: {limits!r}")

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def sources(self) -> list[Batches]:
        """The combined sources, in order (dict order for a dict)."""
        return list(self._sources)

    @property
    def names(self) -> list[Any]:
        """The dict keys of the sources, or their positions for a list or tuple."""
        return list(self._keys) if self._keys is not None else list(range(len(self._sources)))

    @property
    def lengths(self) -> list[int | float]:
        """``lim_i = min(len_i, limit_i)`` of every source."""
        return [min(s.num_batches, lim) for s, lim in zip(self._sources, self._limits)]

    @property
    def num_batches(self) -> int | float:
        lims = self.lengths
        if self._mode == "sequential":
            return sum(lims)
        if self._mode == "min_size":
            return min(lims)
        if self._mode == "max_size_cycle" and any(s.num_batches == 0 for s in self._sources):
            return 0
        return max(lims)

    def _pack(self, values: list[Any]) -> Any:
        if self._keys is not None:
            return dict(zip(self._keys, values))
        return self._container(values)

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        check_position(epoch, start, self.num_batches)
        if self._mode == "sequential":
            return self._sequential(epoch, start)
        return self._parallel(epoch, start)

    def _parallel(self, epoch: int, start: int) -> Iterator[Any]:
        total, mode = self.num_batches, self._mode
        if start >= total:
            return
        iterators: list[Iterator[Any] | None] = []
        consumed: list[bool] = []
        for s in self._sources:
            n = s.num_batches
            if mode == "max_size_cycle" and n != math.inf:
                iterators.append(s.iterate(epoch, start % n))
            else:
                iterators.append(s.iterate(epoch, start) if start < n else None)
            consumed.append(start >= n)
        index = start
        while index < total:
            values: list[Any] = []
            for i, it in enumerate(iterators):
                if it is None:
                    values.append(None)
                    continue
                try:
                    values.append(next(it))
                except StopIteration:
                    if mode == "min_size":
                        return
                    iterators[i], consumed[i] = None, True
                    if all(consumed):
                        return
                    if mode == "max_size":
                        values.append(None)
                        continue
                    restarted = self._sources[i].iterate(epoch, 0)
                    iterators[i] = restarted
                    values.append(next(restarted, _EMPTY))
                    if values[-1] is _EMPTY:
                        return
            yield self._pack(values)
            index += 1

    def _sequential(self, epoch: int, start: int) -> Iterator[Any]:
        skip = start
        for i, (s, lim) in enumerate(zip(self._sources, self.lengths)):
            if skip >= lim:
                skip -= lim
                continue
            if lim != math.inf:
                it, batch_idx = s.iterate(epoch, skip), skip
                skip = 0
            else:
                it, batch_idx = s.iterate(epoch, 0), 0
                while batch_idx < skip and next(it, _EMPTY) is not _EMPTY:
                    batch_idx += 1
                if batch_idx < skip:  # the unsized source ended before ``start``
                    skip -= batch_idx
                    continue
                skip = 0
            for batch in it:
                if batch_idx >= lim:
                    break
                yield batch, batch_idx, i
                batch_idx += 1

    def with_options(self, **changes: Any) -> CombinedBatches:
        """Every source with ``changes`` applied; mode and limits kept."""
        changed = [s.with_options(**changes) for s in self._sources]
        if self._keys is None:
            return CombinedBatches(self._container(changed), self._mode, self._limits)
        return CombinedBatches(
            dict(zip(self._keys, changed)), self._mode, dict(zip(self._keys, self._limits))
        )

    def describe(self) -> dict[str, Any]:
        return self._summary(
            "combined",
            None,
            mode=self._mode,
            limits=[None if lim == math.inf else lim for lim in self._limits],
            sources=[s.describe() for s in self._sources],
        )


_EMPTY = object()


def combine(
    sources: Mapping[Any, Any] | Sequence[Any],
    mode: str = "max_size_cycle",
    *,
    limits: Limit | Mapping[Any, Limit] | Sequence[Limit] = None,
    **options: Any,
) -> CombinedBatches:
    """Combine a dict, list or tuple of sources in ``mode`` (one of ``MODES``).

    Items that are not ``Batches`` yet go through ``source(item, **options)``. ``limits`` is
    one limit for every source, or a dict / list of them matching ``sources`` (``None`` or
    ``math.inf``: no limit).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {list(MODES)}")
    if isinstance(sources, Mapping):
        converted: Any = {k: _as_batches(v, options) for k, v in sources.items()}
    elif is_tensor_tuple(sources):
        raise TypeError("a tuple of tensors is one source; pass a list of sources to combine()")
    elif isinstance(sources, (list, tuple)):
        converted = type(sources)(_as_batches(v, options) for v in sources)
    else:
        raise TypeError(
            f"combine() takes a dict, list or tuple of sources, got {type(sources).__name__}"
        )
    return CombinedBatches(converted, mode, limits)


def as_list(data: Any, **options: Any) -> list[Batches]:
    """One or several evaluation sets as a list of ``Batches``.

    A dict, list or tuple (other than a tuple of tensors, which is one source) is several
    sets, in order; a sequential ``CombinedBatches`` is its sources (its limits are left to
    the caller, who limits each set anyway); anything else is one set.
    Items that are not ``Batches`` yet go through ``source(item, **options)``.
    """
    if isinstance(data, CombinedBatches) and data.mode == "sequential":
        return data.sources
    if isinstance(data, Mapping):
        return [_as_batches(v, options) for v in data.values()]
    if isinstance(data, (list, tuple)) and not is_tensor_tuple(data):
        return [_as_batches(v, options) for v in data]
    return [_as_batches(data, options)]
