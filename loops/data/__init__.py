"""Deterministic, O(1)-resumable data order.

``source(data, batch_size=..., shuffle=..., seed=..., rank=..., world_size=...)`` turns a
dataset, tensors, a DataLoader or an iterable into ``Batches``; ``batches.iterate(epoch,
start)`` yields the batches of an epoch from any batch on. The order is a pure function of
(seed, epoch, rank, world size) (``loops.data.order``); starting at batch ``b`` slices the
index list, so skipped batches are never loaded. Tensors, and a ``TensorDataset`` under the
default collate, are served by index gathering (``TensorBatches``,
``TensorDatasetBatches``). ``keyed(dataset, fn)`` gives each sample its own generator so
augmentations do not depend on the worker count; without asking, each ``dataset[i]`` runs
with torch's, ``random``'s and numpy's global streams seeded from (seed, epoch, index)
(``sample_rng``; ``scope_sample_rng=False`` opts out). ``combine`` runs several sources
with Lightning's ``CombinedLoader`` modes; ``as_list`` turns "one or several
evaluation sets" into a list.
"""

from . import order
from .batches import Batches, length
from .combined import MODES, CombinedBatches, as_list, combine
from .datasets import DatasetBatches
from .iterables import IterableBatches
from .keyed import KeyedDataset, SampleKey, keyed, sample_generator, sample_key
from .options import Options
from .order import epoch_order, rank_order, shard
from .sample_rng import ScopedDataset, sample_rng_key
from .source import batches, source
from .tensors import TensorBatches, TensorDatasetBatches
from .workers import seed_worker, worker_key

__all__ = [
    "MODES",
    "Batches",
    "CombinedBatches",
    "DatasetBatches",
    "IterableBatches",
    "KeyedDataset",
    "Options",
    "SampleKey",
    "ScopedDataset",
    "TensorBatches",
    "TensorDatasetBatches",
    "as_list",
    "batches",
    "combine",
    "epoch_order",
    "keyed",
    "length",
    "order",
    "rank_order",
    "sample_generator",
    "sample_key",
    "sample_rng_key",
    "seed_worker",
    "shard",
    "source",
    "worker_key",
]
