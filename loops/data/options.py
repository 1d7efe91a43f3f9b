"""How a source turns data into batches: one frozen, validated record of every setting.

``Options`` holds what a ``torch.utils.data.DataLoader`` is configured with (batch size,
collation, workers, pinning, ...) plus what decides the order (``shuffle``, ``seed``,
``rank``, ``world_size``). Every ``Batches`` keeps one; ``with_options(**changes)`` builds
the same source with some of them changed, and unknown names or bad values fail here, once,
with a message naming the setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["Options"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Options:
    """Batching, ordering and loading settings of one source (all keyword-only).

    ``batch_size=None`` means the items already are batches (torch's "no automatic
    batching": each item passes through ``collate_fn`` on its own). ``seed`` is any integer
    key (the loops pass ``fold_in(state.rng, ...)``) and must be the same on every rank.
    ``drop_last`` both trims the epoch to a multiple of ``world_size`` and drops each rank's
    incomplete last batch (see ``loops.data.order``). The worker settings mean what they mean
    to a ``DataLoader``; ``persistent_workers`` and ``prefetch_factor`` are ignored without
    workers. ``scope_sample_rng`` seeds the global random streams per sample around each
    ``dataset[i]`` of a map-style dataset (``loops.data.sample_rng``).
    """

    batch_size: int | None = 1
    shuffle: bool = False
    drop_last: bool = False
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    collate_fn: Callable[[Any], Any] | None = None
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    worker_init_fn: Callable[[int], None] | None = None
    timeout: float = 0
    prefetch_factor: int | None = None
    multiprocessing_context: Any = None
    pin_memory_device: str = ""
    scope_sample_rng: bool = True

    def __post_init__(self) -> None:
        if self.batch_size is not None and (not _is_int(self.batch_size) or self.batch_size < 1):
            raise ValueError(f"batch_size must be an int >= 1 or None, got {self.batch_size!r}")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if not _is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be an int in [0, world_size={self.world_size}), got {self.rank!r}"
            )
        if not _is_int(self.seed):
            raise TypeError(f"seed must be an int (a key), got {type(self.seed).__name__}")
        if not _is_int(self.num_workers) or self.num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {self.num_workers!r}")
        if self.prefetch_factor is not None and (
            not _is_int(self.prefetch_factor) or self.prefetch_factor < 1
        ):
            raise ValueError(f"prefetch_factor must be an int >= 1, got {self.prefetch_factor!r}")
        if not isinstance(self.timeout, (int, float)) or self.timeout < 0:
            raise ValueError(f"timeout must be a number >= 0, got {self.timeout!r}")
        for name in (
            "shuffle",
            "drop_last",
            "pin_memory",
            "persistent_workers",
            "scope_sample_rng",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("collate_fn", "worker_init_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable or None, got {value!r}")

    def replace(self, **changes: Any) -> Options:
        """These options with ``changes`` applied (unknown names are a ``TypeError``)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; known options: {sorted(known)}")
        return dataclasses.replace(self, **changes)

    def summary(self) -> dict[str, Any]:
        """The settings that decide which batches come out, for checkpoint metadata."""
        return {
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "scope_sample_rng": self.scope_sample_rng,
        }
