"""PredictionWriter: the write intervals, the user's functions and subclass methods, the
default files in the run folder, and the ranks' parts merged back into the dataset's order
(one process with shuffled data, and 2 gloo ranks whose shards are padded)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from purestep import hardware
from purestep.loops import Trainer
from purestep.loops.callbacks import PredictionWriter, merge_predictions


def dataset(n=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.arange(n))


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3))


def trainer(tmp_path, writer, **flags):
    return Trainer(
        callbacks=[writer],
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **flags,
    )


def expected(n=13):
    with torch.no_grad():
        return net()(dataset(n).tensors[0])


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
def test_default_files_merge_back_into_dataset_order(tmp_path, interval):
    writer = PredictionWriter(interval)
    loader = DataLoader(dataset(), batch_size=4, shuffle=True)
    tr = trainer(tmp_path, writer)
    out = tr.predict(net(), loader)
    folder = tmp_path / "predictions"
    names = sorted(os.listdir(folder))
    per_batch = [f for f in names if "_batch" in f]
    assert (len(per_batch) == 4) == (interval != "epoch")
    assert ("predictions_rank0.pt" in names) == (interval != "batch")
    merged = merge_predictions(folder)
    assert len(merged) == 1 and merged[0].shape == (13, 3)
    # every row is the prediction of that sample (a stated tolerance: the batches differ)
    torch.testing.assert_close(merged[0], expected(), rtol=1e-6, atol=1e-6)
    # and exactly the predictions the trainer returned, reordered by the indices
    order = torch.cat([torch.as_tensor(b) for b in _indices(folder, interval)])
    assert torch.equal(merged[0][order], torch.cat(out))
    if interval == "batch_and_epoch":  # the per-batch files alone merge the same
        files = [str(folder / f) for f in per_batch]
        assert torch.equal(merge_predictions(files)[0], merged[0])


def _indices(folder, interval):
    if interval == "batch":
        files = sorted(folder.glob("*_batch*.pt"), key=lambda p: int(p.stem.rsplit("batch", 1)[1]))
        return [torch.load(f, weights_only=True)["batch_indices"] for f in files]
    return torch.load(folder / "predictions_rank0.pt", weights_only=True)["batch_indices"][0]


def test_user_functions_and_subclasses_get_the_indices(tmp_path):
    seen, epochs = [], []
    writer = PredictionWriter(
        "batch_and_epoch",
        on_batch=lambda ctx, pred, idx, batch, i, dl: seen.append((idx, batch[1].tolist(), i, dl)),
        on_epoch=lambda ctx, preds, idx: epochs.append(idx),
    )
    trainer(tmp_path, writer).predict(
        net(), [DataLoader(dataset(), batch_size=5), DataLoader(dataset(6, 1), batch_size=4)]
    )
    assert [s[0] for s in seen] == [s[1] for s in seen]  # the indices name the samples
    assert [(s[2], s[3]) for s in seen] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
    assert epochs == [[[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12]], [[0, 1, 2, 3], [4, 5]]]]
    assert not (tmp_path / "predictions").exists()  # the user's functions wrote instead

    class Mine(PredictionWriter):
        def write_on_epoch_end(self, ctx, predictions, batch_indices):
            epochs.append(("mine", len(predictions[0])))

    trainer(tmp_path, Mine("epoch")).predict(net(), DataLoader(dataset(), batch_size=5))
    assert epochs[-1] == ("mine", 3)


def test_writer_bad_input_and_merge_errors(tmp_path):
    with pytest.raises(ValueError, match="write_interval"):
        PredictionWriter("step")
    with pytest.raises(TypeError, match="on_batch"):
        PredictionWriter(on_batch=3)
    with pytest.raises(FileNotFoundError):
        merge_predictions(tmp_path)
    writer = PredictionWriter("batch", output_dir=tmp_path / "out")
    trainer(tmp_path, writer).predict(net(), DataLoader(dataset(), batch_size=4))
    files = sorted(str(p) for p in (tmp_path / "out").glob("*.pt"))
    with pytest.raises(ValueError, match="lack the predictions of samples"):
        merge_predictions(files[1:])
    torch.save({"x": 1}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a PredictionWriter file"):
        merge_predictions([str(tmp_path / "bad.pt")])

    class Stream(IterableDataset):
        def __iter__(self):
            yield from (torch.randn(4) for _ in range(3))

    writer = PredictionWriter("epoch", output_dir=tmp_path / "stream")
    trainer(tmp_path, writer).predict(net(), DataLoader(Stream(), batch_size=2))
    with pytest.raises(ValueError, match="no sample indices"):
        merge_predictions(tmp_path / "stream")


def test_a_second_run_into_the_folder_is_not_merged_with_the_first(tmp_path):
    folder = tmp_path / "predictions"
    trainer(tmp_path, PredictionWriter("batch")).predict(
        net(), DataLoader(dataset(), batch_size=4)
    )  # 13 samples: batches 0..3
    trainer(tmp_path, PredictionWriter("batch")).predict(
        net(), DataLoader(dataset(6), batch_size=4)
    )  # 6 samples: batches 0..1; the first run's batches 2 and 3 are gone
    assert len(list(folder.glob("*_batch*.pt"))) == 2
    torch.testing.assert_close(merge_predictions(folder)[0], expected(6), rtol=1e-6, atol=1e-6)
    trainer(tmp_path, PredictionWriter("epoch")).predict(net(), DataLoader(dataset(), batch_size=4))
    trainer(tmp_path, PredictionWriter("batch")).predict(
        net(), DataLoader(dataset(6), batch_size=4)
    )  # the epoch file of the run before would win the merge: it is gone
    assert not (folder / "predictions_rank0.pt").exists()
    assert merge_predictions(folder)[0].shape == (6, 3)
    # files of runs with different world sizes are refused
    torch.save(
        {"predictions": [[]], "batch_indices": [[]], "rank": 3, "world_size": 4},
        folder / "predictions_rank3.pt",
    )
    files = [str(f) for f in folder.glob("*.pt")]
    with pytest.raises(ValueError, match="different numbers of processes"):
        merge_predictions(files)


# --------------------------------------------------------------------------- 2 gloo ranks


def _rank_main(rank: int, folder: str) -> None:
    tr = Trainer(
        strategy=hardware.ddp(),
        callbacks=[PredictionWriter("batch_and_epoch", output_dir=folder)],
        default_root_dir=folder,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    tr.predict(net(), DataLoader(dataset(), batch_size=3, shuffle=True))


@pytest.mark.timeout(120)
def test_two_ranks_write_their_shards_and_merge_into_dataset_order(tmp_path):
    hardware.launch(_rank_main, 2, str(tmp_path), max_seconds=90, timeout=30)
    epoch_files = sorted(tmp_path.glob("predictions_rank?.pt"))
    batch_files = sorted(str(p) for p in tmp_path.glob("*_batch*.pt"))
    assert [p.name for p in epoch_files] == ["predictions_rank0.pt", "predictions_rank1.pt"]
    assert len(batch_files) == 2 * 3  # 7 samples per rank in batches of 3
    shards = [
        [i for batch in torch.load(p, weights_only=True)["batch_indices"][0] for i in batch]
        for p in epoch_files
    ]
    # 13 samples padded to 2 x 7: each rank wrote its own 7, one sample on both
    assert len(shards[0]) == len(shards[1]) == 7
    assert sorted(set(shards[0] + shards[1])) == list(range(13))
    merged = merge_predictions(tmp_path)  # the per-rank epoch files
    assert merged[0].shape == (13, 3)
    torch.testing.assert_close(merged[0], expected(), rtol=1e-6, atol=1e-6)
    assert torch.equal(merge_predictions(batch_files)[0], merged[0])


def test_merge_refuses_a_crafted_prediction_file(tmp_path):
    """merge_predictions reads files as checkpoints are read: a stride-0 tensor that would
    expand to 512 MiB is refused naming the file, never materialised."""
    from purestep.engine.checkpoint import CheckpointError
    from purestep.loops.callbacks import merge_predictions

    path = tmp_path / "predictions_rank0.pt"
    torch.save({"indices": [torch.arange(2)], "predictions": [torch.zeros(1).expand(2**27)]}, path)
    with pytest.raises(CheckpointError, match="predictions_rank0.pt"):
        merge_predictions(tmp_path)
