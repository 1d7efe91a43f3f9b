"""A ``TensorDataset`` under the default collate is served by index gathering, with the
batches bitwise those of the per-sample path (``DatasetBatches``: ``__getitem__`` then
``default_collate``), in every epoch, from every start batch, sharded or not."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from purestep.loops import data
from purestep.loops.data import DatasetBatches, Options, TensorDatasetBatches


def dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(
        torch.randn(n, 3, generator=g),
        torch.randint(0, 5, (n,), generator=g),
        torch.arange(n, dtype=torch.float64),
    )


def assert_same_batches(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y) is list
        assert len(x) == len(y)
        for s, t in zip(x, y):
            assert s.dtype == t.dtype and s.shape == t.shape
            assert torch.equal(s, t)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 9),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    world_size=st.integers(1, 3),
    epoch=st.integers(0, 3),
    start_frac=st.floats(0, 1),
    data=st.data(),
)
def test_gathered_batches_are_bitwise_the_per_sample_ones(
    n, batch_size, shuffle, drop_last, world_size, epoch, start_frac, data
):
    rank = data.draw(st.integers(0, world_size - 1))
    ds = dataset(n)
    options = Options(
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        seed=7,
        rank=rank,
        world_size=world_size,
    )
    fast = data_source(ds, options)
    assert isinstance(fast, TensorDatasetBatches)
    slow = DatasetBatches(ds, options)
    assert fast.num_batches == slow.num_batches
    start = int(start_frac * fast.num_batches)
    assert_same_batches(fast.iterate(epoch, start), slow.iterate(epoch, start))


def data_source(ds, options):
    return data.source(
        ds,
        batch_size=options.batch_size,
        shuffle=options.shuffle,
        drop_last=options.drop_last,
        seed=options.seed,
        rank=options.rank,
        world_size=options.world_size,
    )


def test_a_loader_over_a_tensor_dataset_is_gathered_like_its_own_batches():
    ds = dataset(10)
    loader = DataLoader(ds, batch_size=4)
    fast = data.source(loader, seed=0)
    assert isinstance(fast, TensorDatasetBatches)
    assert_same_batches(fast.iterate(0), loader)  # sequential: torch's own batches
    shuffled = data.source(DataLoader(ds, batch_size=4, shuffle=True, drop_last=True), seed=3)
    assert isinstance(shuffled, TensorDatasetBatches) and shuffled.num_batches == 2


def test_other_datasets_and_collates_keep_the_per_sample_path():
    ds = dataset(6)

    class Sub(TensorDataset):
        pass

    assert isinstance(data.source(Sub(*ds.tensors), batch_size=2), DatasetBatches)
    custom = DataLoader(ds, batch_size=2, collate_fn=lambda items: items)
    assert isinstance(data.source(custom), DatasetBatches)
    assert isinstance(data.source(ds, batch_size=None), DatasetBatches)
    fast = data.source(ds, batch_size=2)
    assert isinstance(fast.with_options(batch_size=3), TensorDatasetBatches)
    assert isinstance(fast.with_options(collate_fn=lambda items: items), DatasetBatches)
    assert fast.describe()["kind"] == "tensor_dataset"


def test_gathered_batches_are_fresh_copies():
    ds = dataset(4)
    (x, *_), *_ = data.source(ds, batch_size=2).iterate(0)
    x.zero_()
    assert not torch.equal(ds.tensors[0][:2], x)


@pytest.mark.parametrize("n", [0])
def test_an_empty_tensor_dataset_is_refused_or_empty(n):
    ds = TensorDataset(torch.zeros(n, 2))
    assert list(data.source(ds, batch_size=2).iterate(0)) == []
