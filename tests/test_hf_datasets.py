"""Hugging Face ``datasets`` as data sources: the map-style order, the fast batched loader,
and a streaming ``IterableDataset`` resumed from its own ``state_dict`` through a Trainer
checkpoint, bitwise."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

datasets = pytest.importorskip("datasets")

from purestep import Trainer  # noqa: E402
from purestep.engine import optim  # noqa: E402
from purestep.loops import Task, data  # noqa: E402
from purestep.loops.callbacks import ModelCheckpoint  # noqa: E402
from purestep.loops.integrations.hf_datasets import (  # noqa: E402
    HFRows,
    HFStream,
    HFStreamData,
    hf_loader,
)
from purestep.loops.loggers import MemoryLogger  # noqa: E402


def table(n: int = 40, width: int = 6) -> datasets.Dataset:
    g = torch.Generator().manual_seed(n)
    return datasets.Dataset.from_dict(
        {
            "x": torch.randn(n, width, generator=g).tolist(),
            "y": torch.randint(0, 3, (n,), generator=g).tolist(),
            "index": list(range(n)),
        }
    ).with_format("torch")


def stream(n: int = 40, shards: int = 4):
    return table(n).to_iterable_dataset(num_shards=shards).with_format("torch")


def equal_batches(a, b) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


# ---------------------------------------------------------------------- map-style


@pytest.mark.bitwise
def test_a_dataset_is_a_source_and_the_fast_loader_gives_the_same_batches():
    ds = table()
    plain = data.source(ds, batch_size=8, shuffle=True, seed=5)
    fast = data.source(hf_loader(ds, 8, shuffle=True), seed=5)
    a, b = list(plain.iterate(2)), list(fast.iterate(2))
    assert len(a) == 5 and equal_batches(a, b)
    assert set(a[0]) == {"x", "y", "index"} and a[0]["x"].shape == (8, 6)
    # shuffled: not the identity order, and each epoch its own
    order = torch.cat([batch["index"] for batch in a])
    assert sorted(order.tolist()) == list(range(40)) and order.tolist() != list(range(40))
    other = torch.cat([batch["index"] for batch in fast.iterate(3)])
    assert not torch.equal(order, other)


@given(
    n=st.integers(1, 60),
    batch_size=st.integers(1, 9),
    epoch=st.integers(0, 5),
    world=st.integers(1, 3),
    drop_last=st.booleans(),
    data_=st.data(),
)
def test_resuming_at_any_batch_gives_the_rest_of_the_epoch(
    n, batch_size, epoch, world, drop_last, data_
):
    ds = _cached(n)
    rank = data_.draw(st.integers(0, world - 1))
    source = data.source(
        hf_loader(ds, batch_size, shuffle=True, drop_last=drop_last),
        seed=7,
        rank=rank,
        world_size=world,
    )
    full = list(source.iterate(epoch))
    assert len(full) == source.num_batches
    start = data_.draw(st.integers(0, len(full)))
    assert equal_batches(list(source.iterate(epoch, start)), full[start:])
    # O(1): the plan of a resumed epoch starts at its batch, nothing before it is read
    assert source.plan(epoch, start) == source.plan(epoch)[start:]


_TABLES: dict[int, datasets.Dataset] = {}


def _cached(n: int) -> datasets.Dataset:
    if n not in _TABLES:
        _TABLES[n] = table(n)
    return _TABLES[n]


def test_ranks_split_the_epoch_between_them():
    ds = table(40)
    seen = []
    for rank in range(2):
        source = data.source(hf_loader(ds, 4, shuffle=True), seed=1, rank=rank, world_size=2)
        seen += [i for batch in source.iterate(0) for i in batch["index"].tolist()]
    assert sorted(seen) == list(range(40))


def test_columns_and_bad_input_get_clear_errors():
    ds = table(10)
    rows = HFRows(ds, columns=["x", "y"])
    assert set(rows.__getitems__([0, 1])) == {"x", "y"}
    with pytest.raises(KeyError, match="no columns"):
        HFRows(ds, columns=["nope"])
    with pytest.raises(TypeError, match="datasets.Dataset"):
        HFRows([{"x": 1}])
    with pytest.raises(ValueError, match="batch_size"):
        hf_loader(ds, 0)
    ragged = datasets.Dataset.from_dict({"t": [[1, 2], [3]]})
    with pytest.raises(ValueError, match="different shapes"):
        next(data.source(hf_loader(ragged, 2)).iterate(0))


def test_a_text_column_comes_as_the_per_row_path_gives_it():
    ds = datasets.Dataset.from_dict({"text": ["a", "bb", "c"], "y": [0, 1, 2]})
    per_row = next(data.source(ds.with_format("torch"), batch_size=2).iterate(0))
    fast = next(data.source(hf_loader(ds, 2)).iterate(0))
    assert per_row["text"] == fast["text"] == ["a", "bb"]
    assert torch.equal(per_row["y"], fast["y"])


# ---------------------------------------------------------------------- streaming


def resumed_at_batch_3(make, saved_from=None) -> HFStream:
    """A new ``HFStream(make(), 6)`` loaded with what ``saved_from`` (by default a stream that
    served epoch 1's first three batches) holds in its ``state_dict``."""
    if saved_from is None:
        saved_from = HFStream(make(), 6)
        it = saved_from.iterate(1)
        for _ in range(3):
            next(it)
    resumed = HFStream(make(), 6)
    resumed.load_state_dict(saved_from.state_dict())
    return resumed


@pytest.mark.bitwise
def test_a_stream_resumes_from_its_recorded_state():
    full = list(HFStream(stream(), 6).iterate(1))
    assert len(full) == 7  # 40 rows: 6 batches of 6 and one of 4
    resumed = resumed_at_batch_3(stream)
    assert equal_batches(list(resumed.iterate(1, 3)), full[3:])
    assert resumed.starts == [(1, 3, "state")]
    # without a recorded position the epoch is replayed: the same batches, the weaker way
    replayed = HFStream(stream(), 6)
    assert equal_batches(list(replayed.iterate(1, 3)), full[3:])
    assert replayed.starts == [(1, 3, "replay")]
    # the dataset given is never left at a loaded position
    assert equal_batches(list(resumed.iterate(1)), full) and resumed.starts[-1] == (1, 0, "fresh")


@pytest.mark.bitwise
def test_a_checkpoint_taken_at_the_resume_batch_resumes_there_again():
    """Saved while the resumed run holds its first batch: a second resume starts there."""
    full = list(HFStream(stream(), 6).iterate(1))
    once = resumed_at_batch_3(stream)
    next(once.iterate(1, 3))  # the loop holds batch 3; nothing after it served yet
    twice = resumed_at_batch_3(stream, saved_from=once)
    assert equal_batches(list(twice.iterate(1, 3)), full[3:])
    assert twice.starts == [(1, 3, "state")]


@pytest.mark.bitwise
def test_a_shuffle_buffered_stream_resumes_by_replay_exactly():
    """datasets drops a shuffle buffer's examples on a state resume: replay instead."""

    def shuffled():
        return stream().shuffle(seed=0, buffer_size=8)

    full = list(HFStream(shuffled(), 6).iterate(1))
    resumed = resumed_at_batch_3(shuffled)
    assert equal_batches(list(resumed.iterate(1, 3)), full[3:])
    assert resumed.starts == [(1, 3, "replay")]


def test_a_stream_checks_what_it_is_given():
    with pytest.raises(TypeError, match="IterableDataset"):
        HFStream(table(), 4)
    with pytest.raises(ValueError, match="batch_size"):
        HFStream(stream(), 0)
    with pytest.raises(ValueError, match="state_dict returned"):
        HFStream(stream(), 4).load_state_dict({"nope": 1})
    with pytest.raises(TypeError, match="HFStream"):
        HFStreamData(train=table())
    short = list(HFStream(stream(), 6, drop_last=True).iterate(0))
    assert len(short) == 6 and all(len(b["index"]) == 6 for b in short)


class Probe(Task):
    """A linear classifier that notes the rows of every batch it trains on."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Sequential(nn.Linear(6, 3)))
        self.seen: list[list[int]] = []

    def configure_optimizers(self):
        return optim.adam(1e-2)

    def training_step(self, apply, batch):
        self.seen.append(batch["index"].tolist())
        return nn.functional.cross_entropy(apply(batch["x"]), batch["y"])


def _fit(root, max_steps, ckpt_path=None):
    task = Probe()
    dm = HFStreamData(train=HFStream(stream(), 6))
    trainer = Trainer(
        max_steps=max_steps,
        max_epochs=2,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=MemoryLogger(),
        callbacks=[ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)],
    )
    state = trainer.fit(task, datamodule=dm, ckpt_path=ckpt_path, seed=0)
    return state, task.seen, dm.train


@pytest.mark.bitwise
def test_a_trainer_run_resumed_mid_epoch_sees_the_same_batches_and_ends_bitwise_equal(tmp_path):
    whole, seen_whole, _ = _fit(tmp_path / "whole", 10)
    _, seen_first, _ = _fit(tmp_path / "cut", 4)
    ckpts = sorted((tmp_path / "cut").rglob("*step=4.ckpt"))
    assert ckpts, "the interrupted run saved no checkpoint at step 4"
    resumed, seen_rest, stream_ = _fit(tmp_path / "cut", 10, ckpt_path=str(ckpts[0]))
    # epoch 0 continued from the stream's own position at batch 4, epoch 1 started afresh
    assert stream_.starts == [(0, 4, "state"), (1, 0, "fresh")]
    assert seen_first + seen_rest == seen_whole  # 7 batches in epoch 0, 3 of epoch 1
    assert vars(resumed.progress) == vars(whole.progress)
    for name in whole.params:
        assert torch.equal(resumed.params[name], whole.params[name]), name
