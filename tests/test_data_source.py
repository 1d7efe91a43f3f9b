"""``source``: every kind of input, resuming at any batch, O(1) skips, options and errors."""

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)

from purestep.loops import data
from purestep.loops.data import order


class Counting(Dataset):
    """Item ``i`` is ``tensor(i)``; ``loads[i]`` counts how often it was read."""

    def __init__(self, n):
        self.n = n
        self.loads = [0] * n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loads[i] += 1
        return torch.tensor(i)


class Stream(IterableDataset):
    """Yields ``0 .. n-1``; ``started`` counts iterations, ``yielded`` the items produced."""

    def __init__(self, n, sized=False):
        self.n, self.sized, self.yielded, self.started = n, sized, 0, 0

    def __iter__(self):
        self.started += 1
        for i in range(self.n):
            self.yielded += 1
            yield torch.tensor(i)

    def __len__(self):
        if not self.sized:
            raise TypeError("unsized")
        return self.n


def flat(batch):
    """The sample indices in a batch (a tensor or a tuple whose first part holds them)."""
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return batch.reshape(-1).tolist()


settings = st.fixed_dictionaries(
    {
        "batch_size": st.one_of(st.none(), st.integers(1, 7)),
        "shuffle": st.booleans(),
        "drop_last": st.booleans(),
        "seed": st.integers(0, 2**64 - 1),
    }
)


def make(kind, n, **options):
    if kind == "tensors":
        return data.source((torch.arange(n), torch.arange(n) * 2), **options)
    if kind == "tensor":
        return data.source(torch.arange(n), **options)
    return data.source(Counting(n), **options)


@given(
    kind=st.sampled_from(["tensors", "tensor", "dataset"]),
    n=st.integers(0, 30),
    world=st.integers(1, 4),
    opts=settings,
    epoch=st.integers(0, 5),
    data_=st.data(),
)
def test_start_equals_dropping_batches(kind, n, world, opts, epoch, data_):
    rank = data_.draw(st.integers(0, world - 1))
    b = make(kind, n, rank=rank, world_size=world, **opts)
    full = [flat(x) for x in b.iterate(epoch)]
    assert len(full) == len(b) == b.num_batches
    assert [flat(x) for x in b.iterate(epoch)] == full  # a pure function of the arguments
    start = data_.draw(st.integers(0, len(b)))
    assert [flat(x) for x in b.iterate(epoch, start)] == full[start:]
    # the batches are the rank's slice of the documented order, chunked by batch size
    expected = order.rank_order(
        n,
        seed=opts["seed"],
        epoch=epoch,
        shuffle=opts["shuffle"],
        rank=rank,
        world_size=world,
        drop_last=opts["drop_last"],
    ).tolist()
    size = opts["batch_size"] or 1
    chunks = [expected[i : i + size] for i in range(0, len(expected), size)]
    assert full == [c for c in chunks if len(c) == size or not opts["drop_last"]]


@given(n=st.integers(1, 30), opts=settings, world=st.integers(1, 3), data_=st.data())
def test_skipped_batches_are_never_loaded(n, opts, world, data_):
    rank = data_.draw(st.integers(0, world - 1))
    ds = Counting(n)
    b = data.source(ds, rank=rank, world_size=world, **opts)
    start = data_.draw(st.integers(0, len(b)))
    seen = [i for x in b.iterate(2, start) for i in flat(x)]
    assert sum(ds.loads) == len(seen)
    assert all(ds.loads[i] == seen.count(i) for i in range(n))


def test_tensor_batches_are_copies_with_the_input_structure():
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    b = data.source((x, y), batch_size=2)
    first = next(b.iterate(0))
    assert isinstance(first, tuple) and torch.equal(first[0], x[:2])
    first[0].add_(100)
    assert torch.equal(x, torch.arange(10.0).reshape(5, 2))
    assert isinstance(next(data.source(x, batch_size=2).iterate(0)), torch.Tensor)
    assert next(data.source(x, batch_size=None).iterate(0)).shape == (2,)


def test_tensors_and_their_dataset_give_the_same_values():
    x, y = torch.randn(11, 3), torch.arange(11)
    kwargs = {"batch_size": 4, "shuffle": True, "seed": 9}
    fast = list(data.source((x, y), **kwargs).iterate(1))
    slow = list(data.source(TensorDataset(x, y), **kwargs).iterate(1))
    assert len(fast) == len(slow) == 3
    for (fx, fy), (sx, sy) in zip(fast, slow):
        assert torch.equal(fx, sx) and torch.equal(fy, sy)


def test_iterating_does_not_touch_the_global_generator():
    before = torch.get_rng_state()
    for b in (make("tensors", 9, shuffle=True), make("dataset", 9, shuffle=True, batch_size=2)):
        list(b.iterate(3, 1))
    assert torch.equal(before, torch.get_rng_state())


def test_prebatched_items_pass_through_unchanged():
    ready = [(torch.randn(4, 2), torch.arange(4)) for _ in range(5)]
    b = data.source(ready, batch_size=None, shuffle=True, seed=1)
    got = list(b.iterate(0, 2))
    assert len(b) == 5 and len(got) == 3
    positions = order.epoch_order(5, seed=1, epoch=0, shuffle=True).tolist()[2:]
    for (gx, gy), p in zip(got, positions):
        assert torch.equal(gx, ready[p][0]) and torch.equal(gy, ready[p][1])
    unbatched = data.source(DataLoader(ready, batch_size=None, shuffle=True), seed=1)
    assert (unbatched.options.batch_size, unbatched.options.shuffle) == (None, True)
    again = list(unbatched.iterate(0, 2))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, got))


def collate_sum(items):
    return torch.stack(items).sum()


def noop_worker_init(worker_id):
    return None


def test_dataloader_is_recreated_with_its_settings():
    ds = Counting(10)
    loader = DataLoader(
        ds,
        batch_size=3,
        shuffle=True,
        drop_last=True,
        collate_fn=collate_sum,
        worker_init_fn=noop_worker_init,
    )
    b = data.source(loader, seed=4, rank=1, world_size=2, batch_size=99, shuffle=False)
    o = b.options
    assert (o.batch_size, o.shuffle, o.drop_last) == (3, True, True)
    assert (o.collate_fn, o.worker_init_fn) == (collate_sum, noop_worker_init)
    assert (o.seed, o.rank, o.world_size) == (4, 1, 2)
    assert b.resumable and len(b) == 1  # 10 -> 5 per rank -> one full batch of 3
    expected = order.rank_order(10, seed=4, epoch=0, shuffle=True, rank=1, world_size=2)
    assert [int(x) for x in b.iterate(0)] == [sum(expected[:3].tolist())]
    plain = data.source(DataLoader(ds, batch_size=2))
    assert not plain.options.shuffle and plain.options.collate_fn is None
    assert b.describe()["kind"] == "loader"


def test_worker_settings_of_a_dataloader_are_kept():
    loader = DataLoader(
        Counting(4),
        batch_size=2,
        num_workers=2,
        prefetch_factor=3,
        persistent_workers=True,
        timeout=7,
        pin_memory=True,
        multiprocessing_context="fork",
    )
    o = data.source(loader).options
    assert (o.num_workers, o.prefetch_factor, o.persistent_workers) == (2, 3, True)
    assert (o.timeout, o.pin_memory) == (7, True)
    assert o.multiprocessing_context is loader.multiprocessing_context


def test_an_explicit_batch_sampler_is_recreated():
    ds = Counting(7)
    loader = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 2, drop_last=False))
    b = data.source(loader, seed=3)
    assert b.resumable and (b.options.batch_size, b.options.shuffle) == (2, True)
    assert len(b) == 4


class EvenFirst(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter([*range(0, self.n, 2), *range(1, self.n, 2)])

    def __len__(self):
        return self.n


@pytest.mark.parametrize(
    "make_loader",
    [
        lambda ds: DataLoader(ds, batch_size=2, sampler=EvenFirst(len(ds))),
        lambda ds: DataLoader(ds, batch_sampler=[[4, 3], [2, 1], [0]]),
        lambda ds: DataLoader(ds, sampler=RandomSampler(ds, replacement=True), batch_size=2),
    ],
)
def test_custom_sampler_falls_back_to_consuming(make_loader):
    ds = Counting(5)
    loader = make_loader(ds)
    with pytest.warns(UserWarning, match="cannot be made deterministic"):
        b = data.source(loader)
    assert not b.resumable and len(b) == len(loader) == 3
    torch.manual_seed(0)
    full = [flat(x) for x in b.iterate(0)]
    ds.loads = [0] * 5
    torch.manual_seed(0)
    assert [flat(x) for x in b.iterate(0, 2)] == full[2:]
    assert sum(ds.loads) == 5  # the skipped batches were loaded and thrown away
    if isinstance(loader.sampler, EvenFirst):
        assert full == [[0, 2], [4, 1], [3]]


def test_iterable_dataset_resumes_by_consuming():
    stream = Stream(7)
    with pytest.warns(UserWarning, match="no effect on an IterableDataset"):
        b = data.source(stream, batch_size=2, shuffle=True)
    assert not b.resumable and b.num_batches == math.inf
    with pytest.raises(TypeError, match="no length"):
        len(b)
    assert [flat(x) for x in b.iterate(0)] == [[0, 1], [2, 3], [4, 5], [6]]
    stream.yielded = 0
    assert [flat(x) for x in b.iterate(1, 2)] == [[4, 5], [6]]
    assert stream.yielded == 7
    sized = data.source(Stream(7, sized=True), batch_size=2, drop_last=True)
    assert len(sized) == 3 and len(list(sized.iterate(0))) == 3
    assert len(data.source(DataLoader(Stream(6, sized=True), batch_size=4))) == 2


def test_iterable_of_batches_and_set_epoch():
    class Epochs:
        def __init__(self):
            self.epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            return iter([self.epoch * 10 + i for i in range(4)])

    b = data.source(Epochs())
    assert list(b.iterate(2, 1)) == [21, 22, 23]
    assert b.describe()["length"] is None
    once = data.source(iter([1, 2, 3]))
    assert list(once.iterate(0, 1)) == [2, 3] and list(once.iterate(1)) == []


def test_with_options():
    b = make("dataset", 10, batch_size=3, shuffle=True, seed=2)
    plain = b.with_options(shuffle=False)
    assert [flat(x) for x in plain.iterate(5)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert b.options.shuffle  # the original is unchanged
    other = b.with_options(rank=1, world_size=2)
    assert len(other) == 2
    assert data.source(plain) is plain
    with pytest.raises(TypeError, match="unknown option"):
        b.with_options(shufle=False)
    ready = data.source([torch.zeros(1)] * 3, batch_size=None)
    assert len(ready.with_options(batch_size=2)) == 2
    stream = data.source(iter([1, 2]))
    assert stream.with_options(shuffle=False, rank=0).options.shuffle is False
    with pytest.raises(ValueError, match="cannot change"):
        stream.with_options(batch_size=4)


def test_describe_is_small_and_plain():
    d = make("tensors", 10, batch_size=4, shuffle=True, seed=7).describe()
    assert d == {
        "kind": "tensors",
        "length": 3,
        "resumable": True,
        "batch_size": 4,
        "shuffle": True,
        "drop_last": False,
        "seed": 7,
        "rank": 0,
        "world_size": 1,
        "scope_sample_rng": True,
        "num_samples": 10,
    }


def test_keyed_items_depend_on_sample_epoch_and_seed_only():
    base = torch.zeros(6, 3)
    ds = data.keyed(base, lambda item, g: item + torch.rand(3, generator=g))
    b = data.source(ds, batch_size=2, shuffle=True, seed=5)
    epoch0 = {}
    for batch, indices in zip(
        b.iterate(0), order.epoch_order(6, seed=5, epoch=0, shuffle=True).reshape(3, 2)
    ):
        for row, i in zip(batch, indices.tolist()):
            epoch0[i] = row
    for i in range(6):
        g = data.sample_generator(5, 0, i)
        assert torch.equal(epoch0[i], torch.rand(3, generator=g))
    resumed = list(b.iterate(0, 1))
    assert len(resumed) == 2
    assert all(torch.equal(x, y) for x, y in zip(resumed, list(b.iterate(0))[1:]))
    other_epoch = torch.cat(list(b.iterate(1)))
    assert not any(torch.equal(other_epoch[0], row) for row in epoch0.values())
    assert torch.equal(ds[2], ds[data.SampleKey(2, 0, 0)])
    with pytest.raises(TypeError, match="callable"):
        data.keyed(base, None)
    with pytest.raises(TypeError, match="map-style"):
        data.keyed(5, lambda item, g: item)


def test_batches_helper():
    assert [x.tolist() for x in data.batches(torch.arange(5), batch_size=2, start=1)] == [
        [2, 3],
        [4],
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": -3}, ValueError, "batch_size"),
        ({"batch_size": True}, ValueError, "batch_size"),
        ({"batch_size": 2.0}, ValueError, "batch_size"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank"),
        ({"rank": -1}, ValueError, "rank"),
        ({"world_size": 0}, ValueError, "world_size"),
        ({"num_workers": -1}, ValueError, "num_workers"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"shuffle": 1}, TypeError, "shuffle"),
        ({"collate_fn": 3}, TypeError, "collate_fn"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"prefetch_factor": 0}, ValueError, "prefetch_factor"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        data.source(Counting(4), **kwargs)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (5, TypeError, "cannot make batches from int"),
        (None, TypeError, "cannot make batches from NoneType"),
        ("text", TypeError, "cannot make batches from a str"),
        ({"a": [1]}, TypeError, "not a mapping"),
        ((torch.zeros(3), torch.zeros(4)), ValueError, "first dimension"),
        (torch.tensor(1.0), ValueError, "0-dim"),
    ],
)
def test_bad_input(bad, error, match):
    with pytest.raises(error, match=match):
        data.source(bad)


def test_bad_positions_and_tensor_collate():
    b = make("tensors", 5, batch_size=2)
    with pytest.raises(ValueError, match="past the end"):
        b.iterate(0, 4)
    with pytest.raises(ValueError, match="start must be"):
        b.iterate(0, -1)
    with pytest.raises(ValueError, match="epoch must be"):
        b.iterate(-1)
    with pytest.raises(ValueError, match="collate_fn is not used"):
        data.source(torch.zeros(3), collate_fn=collate_sum)


def test_out_of_order_loader_is_put_in_order():
    with pytest.warns(UserWarning, match="in_order=False"):
        b = data.source(DataLoader(Counting(3), in_order=False))
    assert b.resumable and [flat(x) for x in b.iterate(0)] == [[0], [1], [2]]


def test_sequential_sampler_loader_is_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = data.source(DataLoader(Counting(3), sampler=SequentialSampler(range(3))))
    assert b.resumable
