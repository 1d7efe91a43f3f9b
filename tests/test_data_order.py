"""The epoch order is a pure function of its arguments, and sharding follows the written rule."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from purestep.engine import rng
from purestep.loops.data import order

seeds = st.integers(0, 2**64 - 1)
sizes = st.integers(0, 60)
worlds = st.integers(1, 6)


@given(n=sizes, seed=seeds, epoch=st.integers(0, 1000), shuffle=st.booleans())
def test_order_is_a_pure_permutation(n, seed, epoch, shuffle):
    first = order.epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    again = order.epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    assert torch.equal(first, again)
    assert sorted(first.tolist()) == list(range(n))
    if not shuffle:
        assert first.tolist() == list(range(n))


@given(seed=seeds, epoch=st.integers(0, 1000))
def test_order_is_the_documented_randperm(seed, epoch):
    key = rng.fold_in(seed, rng.Purpose.DATA, epoch)
    expected = torch.randperm(37, generator=rng.generator(key))
    assert torch.equal(order.epoch_order(37, seed=seed, epoch=epoch, shuffle=True), expected)


@given(seed=seeds, epoch=st.integers(0, 1000))
def test_other_epoch_or_seed_gives_another_order(seed, epoch):
    base = order.epoch_order(50, seed=seed, epoch=epoch, shuffle=True)
    other_epoch = order.epoch_order(50, seed=seed, epoch=epoch + 1, shuffle=True)
    other_seed = order.epoch_order(50, seed=(seed + 1) % 2**64, epoch=epoch, shuffle=True)
    assert not torch.equal(base, other_epoch)
    assert not torch.equal(base, other_seed)


@given(n=sizes, world=worlds, drop_last=st.booleans(), data=st.data())
def test_shard_matches_distributed_sampler_without_shuffle(n, world, drop_last, data):
    rank = data.draw(st.integers(0, world - 1))
    sampler = DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last
    )
    ours = order.shard(torch.arange(n), rank, world, drop_last)
    assert ours.tolist() == list(sampler)


@given(n=sizes, world=worlds, drop_last=st.booleans(), seed=seeds)
def test_ranks_partition_the_epoch_by_the_documented_rule(n, world, drop_last, seed):
    epoch_order = order.epoch_order(n, seed=seed, epoch=3, shuffle=True).tolist()
    shards = [
        order.rank_order(
            n, seed=seed, epoch=3, shuffle=True, rank=r, world_size=world, drop_last=drop_last
        ).tolist()
        for r in range(world)
    ]
    per_rank = n // world if drop_last else math.ceil(n / world)
    assert all(len(s) == per_rank == order.samples_per_rank(n, world, drop_last) for s in shards)
    # rank r takes positions r, r + W, ... of the padded (or trimmed) epoch order
    for r, s in enumerate(shards):
        assert s == [epoch_order[p % n] for p in range(r, per_rank * world, world)]
    seen = sorted(i for s in shards for i in s)
    if drop_last:  # the last n % W positions of the order are dropped, nothing is doubled
        assert seen == sorted(epoch_order[: n - n % world])
    else:  # the first (W - n % W) % W positions come again (wrapping when n < W)
        pad = per_rank * world - n
        doubled = [epoch_order[p % n] for p in range(pad)]
        assert seen == sorted(epoch_order + doubled)


@given(
    n=sizes, world=worlds, drop_last=st.booleans(), batch=st.one_of(st.none(), st.integers(1, 8))
)
def test_batches_per_rank(n, world, batch, drop_last):
    per_rank = order.samples_per_rank(n, world, drop_last)
    if batch is None:
        expected = per_rank
    else:
        sizes = [min(batch, per_rank - b) for b in range(0, per_rank, batch)]
        expected = len([s for s in sizes if s == batch or not drop_last])
    assert order.batches_per_rank(n, world, batch, drop_last) == expected


def test_negative_size_is_an_error():
    with pytest.raises(ValueError, match="cannot have -1 samples"):
        order.epoch_order(-1, seed=0, epoch=0, shuffle=True)
