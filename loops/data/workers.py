"""DataLoader workers seeded from keys, and the DataLoaders that the sources build.

Each worker's ``torch``, ``random`` and ``numpy`` generators are seeded from
``worker_key(seed, epoch, worker_id) = fold_in(seed, Purpose.WORKER, epoch, worker_id)``
when it starts (then the user's own ``worker_init_fn`` runs). With ``persistent_workers``
the workers start once, so their seeds come from the first epoch they served. This makes
worker-side randomness reproducible, but it still depends on which worker loads which
batch; for randomness that does not depend on the worker count use ``loops.data.keyed``.

Every loader built here also gets a private ``generator`` reseeded before each iteration:
a ``DataLoader`` draws its workers' base seed from the global torch generator otherwise,
and starting an epoch must not change the caller's random stream.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

from purestep.engine import rng
from purestep.hardware.pdeathsig import die_with_parent

from .options import Options

__all__ = ["WorkerSeeder", "build_loader", "seed_worker", "worker_key"]


def worker_key(seed: int, epoch: int, worker_id: int) -> int:
    """The key a worker is seeded from: ``fold_in(seed, Purpose.WORKER, epoch, worker_id)``."""
    return rng.fold_in(seed, rng.Purpose.WORKER, epoch, worker_id)


def seed_worker(key: int) -> None:
    """Seed this worker process's global generators from a key (``rng.seed_process``)."""
    rng.seed_process(key)


class WorkerSeeder:
    """The ``worker_init_fn`` of the loaders built here (picklable, for spawned workers).

    ``epoch`` is set by the source right before each iteration starts its workers. Each
    worker first asks the kernel to end it with the process that started it
    (``hardware.pdeathsig``; Linux): torch's own check for a dead parent starts only after
    ``worker_init_fn``, and a worker busy in ``__getitem__`` does not look, so workers of a
    SIGKILLed run lived on (minutes, holding the job's stdout). Only for iterations started
    from the main thread (the kernel ties a child to the thread that started it).
    """

    def __init__(self, seed: int, user_fn: Callable[[int], None] | None = None) -> None:
        self.seed = seed
        self.epoch = 0
        self.user_fn = user_fn
        self.parent_pid: int | None = None  # set by start(); None: do not tie the workers

    def __call__(self, worker_id: int) -> None:
        if self.parent_pid is not None:
            die_with_parent(self.parent_pid)
        seed_worker(worker_key(self.seed, self.epoch, worker_id))
        if self.user_fn is not None:
            self.user_fn(worker_id)

    def start(self, loader: DataLoader, epoch: int) -> None:
        """Prepare ``loader`` (built with this seeder) for an iteration of ``epoch``."""
        self.epoch = epoch
        on_main = threading.current_thread() is threading.main_thread()
        self.parent_pid = os.getpid() if on_main else None
        loader.generator.manual_seed(rng.fold_in(self.seed, rng.Purpose.WORKER, epoch))


def build_loader(
    dataset: Any,
    options: Options,
    seeder: WorkerSeeder,
    *,
    batch_sampler: Iterable[list[Any]] | None = None,
    sampler: Iterable[Any] | None = None,
) -> DataLoader:
    """A DataLoader over ``dataset`` with the given (batch) sampler and ``options``' settings.

    Give ``batch_sampler`` to batch (``options.batch_size`` is then the sampler's business),
    or ``sampler`` with ``options.batch_size=None`` for items that already are batches, or
    neither for an ``IterableDataset`` (batched by ``options.batch_size``).
    """
    workers = options.num_workers
    kwargs: dict[str, Any] = {
        "num_workers": workers,
        "collate_fn": options.collate_fn,
        "pin_memory": options.pin_memory,
        "timeout": options.timeout if workers else 0,
        "worker_init_fn": seeder,
        "multiprocessing_context": options.multiprocessing_context if workers else None,
        "generator": torch.Generator(),
        "persistent_workers": options.persistent_workers and workers > 0,
        "pin_memory_device": options.pin_memory_device,
    }
    if workers:
        kwargs["prefetch_factor"] = options.prefetch_factor
    if batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=batch_sampler, **kwargs)
    if sampler is not None:
        return DataLoader(dataset, batch_size=None, sampler=sampler, **kwargs)
    return DataLoader(dataset, batch_size=options.batch_size, drop_last=options.drop_last, **kwargs)
