"""The index order of an epoch: a pure function of (n, seed, epoch, shuffle, rank, world size).

1. ``epoch_order``: ``arange(n)``, or with shuffling
   ``torch.randperm(n, generator=generator(fold_in(seed, Purpose.DATA, epoch)))``. Every rank
   computes the same permutation (the seed must be the same on every rank).
2. ``shard`` splits it across ranks the way ``DistributedSampler`` does:

   * ``drop_last=False``: the order is padded to ``ceil(n / W) * W`` entries by appending its
     own first entries again (wrapping around as often as needed when ``n < W``), so the
     samples at the first ``(W - n % W) % W`` positions of the epoch order appear twice.
   * ``drop_last=True``: the order is trimmed to ``(n // W) * W`` entries, so the samples at
     its last ``n % W`` positions are not seen this epoch.

   Rank ``r`` then takes positions ``r, r + W, r + 2W, ...`` of that list. Every rank gets
   the same number of samples, so every rank runs the same number of batches.
3. Batch ``b`` of a rank covers its positions ``[b * B, (b + 1) * B)``;
   with ``drop_last`` a rank's incomplete last batch is dropped. Starting at batch ``b`` is a
   slice of the rank's list: nothing before it is computed or loaded.

The permutation is bit-identical for a given torch version (``randperm``'s algorithm is
torch's; a torch upgrade may change the order of a resumed run).
"""

from __future__ import annotations

import math

import torch

from purestep.engine import rng

__all__ = [
    "batches_per_rank",
    "epoch_order",
    "rank_order",
    "samples_per_rank",
    "shard",
]


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The epoch's order of the ``n`` sample indices before sharding (int64, on the CPU)."""
    if n < 0:
        raise ValueError(f"a dataset cannot have {n} samples")
    if not shuffle:
        return torch.arange(n, dtype=torch.int64)
    generator = rng.generator(rng.fold_in(seed, rng.Purpose.DATA, epoch))
    return torch.randperm(n, generator=generator, dtype=torch.int64)


def samples_per_rank(n: int, world_size: int, drop_last: bool) -> int:
    """How many samples each rank gets from an epoch of ``n`` (after padding or trimming)."""
    return n // world_size if drop_last else -(-n // world_size)


def batches_per_rank(n: int, world_size: int, batch_size: int | None, drop_last: bool) -> int:
    """How many batches each rank runs per epoch (``batch_size=None``: one per sample)."""
    per_rank = samples_per_rank(n, world_size, drop_last)
    if batch_size is None:
        return per_rank
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def shard(order: torch.Tensor, rank: int, world_size: int, drop_last: bool) -> torch.Tensor:
    """Rank ``rank``'s positions of ``order`` after padding (or trimming) to a multiple of W."""
    n = order.numel()
    if drop_last:
        order = order[: (n // world_size) * world_size]
    else:
        pad = samples_per_rank(n, world_size, False) * world_size - n
        if pad:
            repeats = math.ceil(pad / n)
            order = torch.cat([order, order.repeat(repeats)[:pad]])
    return order[rank::world_size]


def rank_order(
    n: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
) -> torch.Tensor:
    """The sample indices rank ``rank`` visits in epoch ``epoch``, in order."""
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    return shard(order, rank, world_size, drop_last)
