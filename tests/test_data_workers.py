"""Workers: same batches as without workers, key-seeded workers, no skipped item loaded.

Few and small on purpose: each DataLoader with workers forks processes. Every loader here
uses two forked workers, no persistence and a timeout, so nothing can hang.
"""

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from purestep.engine import rng
from purestep.loops import data

WORKERS = {"num_workers": 2, "timeout": 60}


def jitter(item, g):
    return item + torch.rand(2, generator=g)


class SharedCounts(Dataset):
    """Counts loads in shared memory, so loads in worker processes are seen here too."""

    def __init__(self, n):
        self.loads = torch.zeros(n, dtype=torch.int64).share_memory_()

    def __len__(self):
        return len(self.loads)

    def __getitem__(self, i):
        self.loads[i] += 1
        return torch.tensor(i)


class WorkerSeeds(Dataset):
    """Item i reports the loading worker's id, its torch seed and a draw from ``random``."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        info = get_worker_info()
        return torch.tensor([info.id, torch.initial_seed(), int(random.random() * 2**31)])


@pytest.fixture(scope="module")
def fork_only():
    if "fork" not in torch.multiprocessing.get_all_start_methods():
        pytest.skip("needs the fork start method")
    return {"multiprocessing_context": "fork"}


def test_workers_give_the_same_batches_as_none(fork_only):
    ds = data.keyed(torch.arange(10.0).repeat(2, 1).T, jitter)
    options = {"batch_size": 3, "shuffle": True, "seed": 2**63 + 5}
    serial = data.source(ds, **options)
    parallel = data.source(ds, **options, **WORKERS, **fork_only)
    for epoch, start in ((0, 0), (1, 2)):
        expected = list(serial.iterate(epoch, start))
        got = list(parallel.iterate(epoch, start))
        assert len(got) == len(expected) == 4 - start
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    from_loader = data.source(
        DataLoader(ds, batch_size=3, shuffle=True, **WORKERS, **fork_only), seed=2**63 + 5
    )
    got, expected = list(from_loader.iterate(1)), list(serial.iterate(1))
    assert len(got) == len(expected) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_skipped_batches_are_not_loaded_by_workers(fork_only):
    ds = SharedCounts(12)
    b = data.source(ds, batch_size=2, shuffle=True, seed=1, **WORKERS, **fork_only)
    seen = [i for batch in b.iterate(0, 4) for i in batch.tolist()]
    assert len(seen) == 4
    assert ds.loads.sum().item() == 4
    assert all(ds.loads[i].item() == 1 for i in seen)


def test_workers_are_seeded_from_keys(fork_only):
    seed, epoch = 77, 3
    before = torch.get_rng_state()
    # Per-sample scoping (on by default) reseeds the streams for every sample; this test
    # reads what the worker seeding itself set, so it opts out.
    b = data.source(
        WorkerSeeds(), batch_size=1, seed=seed, scope_sample_rng=False, **WORKERS, **fork_only
    )
    rows = torch.cat(list(b.iterate(epoch)))
    assert torch.equal(before, torch.get_rng_state())  # the caller's generator is untouched
    assert set(rows[:, 0].tolist()) == {0, 1}
    for position, (worker_id, torch_seed, draw) in enumerate(rows.tolist()):
        key = rng.fold_in(seed, rng.Purpose.WORKER, epoch, worker_id)
        assert torch_seed == data.worker_key(seed, epoch, worker_id) == key
        if position < 2:  # each worker's first item: the first draw after seeding
            assert draw == int(random.Random(key).random() * 2**31)
    again = torch.cat(list(b.iterate(epoch)))
    assert torch.equal(rows, again)
