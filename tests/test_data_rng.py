"""Datasets that augment with the global random streams are deterministic without asking.

A ``__getitem__`` drawing from ``torch.rand``, ``torch.randint``, ``random.random`` and
``np.random`` gets the same numbers for a sample whatever the worker count, the batch size,
the start batch or the run (``loops.data.sample_rng``); the caller's streams are untouched;
``scope_sample_rng=False`` (or a dataset's ``scope_sample_rng = False``) restores the old
behaviour; a Trainer run stopped mid-epoch and resumed from its checkpoint ends bitwise
equal to an uninterrupted one.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset, Subset

from purestep.engine import optim, rng, tree
from purestep.loops import Trainer
from purestep.loops.callbacks import ModelCheckpoint
from purestep.loops.data import keyed, sample_rng_key, source
from tests.helpers import mlp

pytestmark = pytest.mark.bitwise


class Augmented(Dataset):
    """Sample ``i`` plus draws from every global stream."""

    def __init__(self, n: int = 24) -> None:
        self.x = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.rand(8) + torch.randint(0, 5, (8,)).float()
        extra = random.random() + float(np.random.rand())
        return self.x[i] + noise + extra, (self.x[i, 0] > 80).long()


class Unscoped(Augmented):
    scope_sample_rng = False


def _epoch(data, epoch=1, start=0, **options):
    options.setdefault("batch_size", 4)
    options.setdefault("shuffle", True)
    options.setdefault("seed", 7)
    if options.get("num_workers"):
        options.setdefault("timeout", 60)
    return list(source(data, **options).iterate(epoch, start))


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        tree.assert_trees_equal(x, y)


def test_the_same_batches_for_0_and_2_workers_twice_in_a_row():
    ds = Augmented()
    first = _epoch(ds)
    _assert_batches_equal(first, _epoch(ds))
    _assert_batches_equal(first, _epoch(ds, num_workers=2))
    _assert_batches_equal(first, _epoch(ds, num_workers=2))


def test_a_mid_epoch_start_gives_the_tail_of_a_full_pass():
    ds = Augmented()
    full = _epoch(ds)
    torch.rand(5), random.random(), np.random.rand()  # the caller's streams moved on
    _assert_batches_equal(full[3:], _epoch(ds, start=3))
    _assert_batches_equal(full[2:], _epoch(ds, start=2, num_workers=2))


def test_a_sample_draws_the_same_whatever_its_batch_position_and_epoch_differ():
    ds = Augmented()
    by_four = torch.cat([x for x, _ in _epoch(ds, shuffle=False)])
    by_three = torch.cat([x for x, _ in _epoch(ds, shuffle=False, batch_size=3)])
    shuffled = _epoch(ds)
    order = source(ds, batch_size=4, shuffle=True, seed=7).epoch_indices(1)
    assert torch.equal(by_four, by_three)
    assert torch.equal(torch.cat([x for x, _ in shuffled]), by_four[order])
    other_epoch = torch.cat([x for x, _ in _epoch(ds, epoch=2, shuffle=False)])
    assert not torch.equal(other_epoch, by_four)


def test_the_draws_follow_the_documented_key():
    ds = Augmented(4)
    (x, _), *_ = _epoch(ds, epoch=3, shuffle=False, seed=11, batch_size=1)
    k = sample_rng_key(11, 3, 0)
    assert k == rng.fold_in(11, rng.Purpose.SAMPLE_RNG, 3, 0)
    torch.manual_seed(k)
    random.seed(k)
    np.random.seed(k >> 32)
    assert torch.equal(x[0], ds[0][0])


def test_the_callers_global_streams_are_untouched_in_the_main_process():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expected = (torch.rand(4), random.random(), np.random.rand(3))
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    _epoch(Augmented())
    _epoch(Augmented(), batch_size=None)
    assert torch.equal(torch.rand(4), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.rand(3), expected[2])


def _seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.mark.parametrize("how", ["option", "attribute"])
def test_opting_out_leaves_the_draws_to_the_process(how):
    ds, options = (
        (Augmented(), {"scope_sample_rng": False}) if how == "option" else (Unscoped(), {})
    )
    _seed_all(3)
    before = torch.rand(4)
    _seed_all(3)
    first = _epoch(ds, **options)
    assert not torch.equal(torch.rand(4), before)  # the dataset drew from the caller's stream
    _seed_all(3)
    _assert_batches_equal(first, _epoch(ds, **options))  # the same stream: the same draws
    again = _epoch(ds, **options)  # the stream moved on: other draws
    assert not torch.equal(torch.cat([x for x, _ in first]), torch.cat([x for x, _ in again]))


def test_keyed_datasets_subsets_and_batched_readers_are_scoped_too():
    def jitter(sample, g):
        x, y = sample
        return x + torch.rand(8, generator=g) + torch.rand(8), y

    ds = keyed(Augmented(), jitter)
    _assert_batches_equal(_epoch(ds), _epoch(ds, num_workers=2))
    _assert_batches_equal(_epoch(ds)[2:], _epoch(ds, start=2))

    sub = Subset(Augmented(), list(range(3, 20)))
    full = _epoch(sub)
    _assert_batches_equal(full[1:], _epoch(sub, start=1))
    by_three = torch.cat([x for x, _ in _epoch(sub, shuffle=False, batch_size=3)])
    assert torch.equal(torch.cat([x for x, _ in _epoch(sub, shuffle=False)]), by_three)

    class Batched(Augmented):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    ds = Batched()
    _assert_batches_equal(_epoch(ds), _epoch(ds, num_workers=2))
    _assert_batches_equal(_epoch(ds)[2:], _epoch(ds, start=2))


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(12):
            yield torch.full((2,), float(i)) + torch.rand(2) + random.random()


def test_an_iterable_dataset_without_workers_resumes_exactly_and_leaves_the_caller_alone():
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    full = _epoch(Stream(), shuffle=False)
    assert torch.equal(torch.rand(3), before)
    torch.rand(7)
    _assert_batches_equal(full[1:], _epoch(Stream(), shuffle=False, start=1))
    unscoped = _epoch(Stream(), shuffle=False, scope_sample_rng=False)
    assert not torch.equal(torch.cat(unscoped), torch.cat(full))


# ----------------------------------------------------------------------- through the Trainer


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _fit(root, ckpt_path=None, **flags):
    trainer = Trainer(
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=str(root / "ckpt"), save_last=True, every_n_train_steps=1, save_top_k=0
            )
        ],
        **flags,
    )
    torch.manual_seed(0)
    net = mlp()
    return trainer.fit(net, _loss, optim.adam(1e-2), source_data(), ckpt_path=ckpt_path)


def source_data():
    from torch.utils.data import DataLoader

    return DataLoader(Augmented(24), batch_size=4, shuffle=True)


def test_a_trainer_fit_stopped_mid_epoch_and_resumed_equals_an_uninterrupted_one(tmp_path):
    whole = _fit(tmp_path / "whole", max_epochs=2)
    torch.rand(11), random.random(), np.random.rand()  # a resumed process's streams differ
    _fit(tmp_path / "part", max_epochs=2, max_steps=8)  # epoch 1, batch 2
    last = str(tmp_path / "part" / "ckpt" / "last.ckpt")
    torch.rand(5)
    resumed = _fit(tmp_path / "part", ckpt_path=last, max_epochs=2)
    assert resumed.progress.step == whole.progress.step == 12
    for field in ("params", "buffers", "opt_state"):
        tree.assert_trees_equal(getattr(resumed, field), getattr(whole, field))


def test_a_tensor_dataset_is_read_unscoped_and_a_subclass_that_augments_is_not():
    """``TensorDataset`` draws nothing, so it skips the per-sample seeding (the Trainer's
    data path costs nothing extra over it); a subclass may augment, so it is scoped."""
    from torch.utils.data import TensorDataset

    x = torch.arange(12.0).reshape(6, 2)

    class Noisy(TensorDataset):
        def __getitem__(self, i):
            (row,) = super().__getitem__(i)
            return row + torch.rand(2)

    for plain in (TensorDataset(x), Subset(TensorDataset(x), [0, 2, 4])):
        assert source(plain, batch_size=2, seed=0)._scoped is False
    noisy = source(Noisy(x), batch_size=2, seed=0)
    assert noisy._scoped is True
    first = torch.cat(list(noisy.iterate(0)))
    torch.rand(5)  # the caller's stream moves; the samples' draws do not
    assert torch.equal(first, torch.cat(list(noisy.iterate(0))))
