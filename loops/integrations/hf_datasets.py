"""Hugging Face ``datasets`` as purestep data sources.

**Map-style.** A ``datasets.Dataset`` is already a map-style dataset (``__getitem__``,
``__len__``), so ``loops.data.source(ds, ...)`` and the Trainer take it as it is: the order
is purestep's (a pure function of seed, epoch, rank and world size; starting at batch ``b``
slices the index list, so skipped batches are never read), each row is read alone and the
rows are collated by torch's ``default_collate``. ``hf_loader(ds, batch_size=...)`` is the
fast form of the same: a ``DataLoader`` over ``HFRows``, which reads a whole batch with one
``ds[indices]`` (Arrow does the gathering) and hands it on as the batch, a dict of stacked
tensors, bitwise what the per-row path gives. The Trainer (and ``source``) re-create that
loader on the deterministic order, keeping its batch size and collate, so it resumes in O(1)
and shards over ranks like any dataset. The rows of a batch are read together, so the
per-sample scoping of torch's global RNG does not apply: a ``set_transform`` that draws
random numbers is not made deterministic here (use ``loops.data.keyed`` on a dataset of
your own for that).

**Streaming.** A ``datasets.IterableDataset`` has an order of its own and a position it can
save (``state_dict()``) and return to (``load_state_dict``). ``HFStream(ds, batch_size)``
batches it and records the stream's position after each batch it serves, so a run that
restarts at batch ``b`` of an epoch continues from the stream's saved position instead of
reading and dropping ``b`` batches. The positions travel in the checkpoint through the
data-module hooks: ``HFStreamData(train=stream)`` is a ``DataModule`` whose
``state_dict()`` (plain data, saved in every checkpoint) holds the stream's recent
positions, and ``load_state_dict`` gives them back before the data is iterated again. A
start the stream has no position for (another epoch, an older checkpoint) is served the
weaker way, by replaying the epoch from its beginning; ``HFStream.starts`` says how each
iteration started: ``(epoch, start, "fresh" | "state" | "replay")``.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from purestep.loops.data.batches import Batches, check_position
from purestep.loops.task import DataModule

__all__ = ["HFRows", "HFStream", "HFStreamData", "hf_loader"]


def _torch_format(ds: Any, columns: list[str] | None) -> Any:
    """``ds`` formatted as torch tensors (only ``columns``, when given)."""
    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"expected a datasets.Dataset, got {type(ds).__name__}")
    if columns is not None:
        missing = sorted(set(columns) - set(ds.column_names))
        if missing:
            raise KeyError(f"the dataset has no columns {missing} (it has {ds.column_names})")
    fmt = ds.format
    if fmt["type"] != "torch" or (columns is not None and fmt["columns"] != list(columns)):
        ds = ds.with_format("torch", columns=columns)
    return ds


class HFRows(Dataset):
    """A ``datasets.Dataset`` read a batch at a time: ``rows[indices]`` is ``ds[indices]``,
    a dict ``column -> tensor`` stacked over the batch (Arrow gathers the rows).

    ``columns``: the columns to serve (default: all). Every served column must have rows of
    one shape (pad sequences first, e.g. with ``ds.map``), or a batch cannot be stacked; a
    text column comes as a list of strings, as ``default_collate`` gives it.
    """

    #: The rows are read together: no per-sample RNG scoping (``loops.data.sample_rng``).
    scope_sample_rng = False

    def __init__(self, ds: Any, columns: list[str] | None = None) -> None:
        self.ds = _torch_format(ds, columns)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.ds[int(index)]

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = self.ds[list(indices)]
        ragged = [
            k
            for k, v in batch.items()
            if not isinstance(v, torch.Tensor) and not all(isinstance(x, str) for x in v)
        ]
        if ragged:
            raise ValueError(
                f"columns {ragged} have rows of different shapes, so a batch of them cannot "
                "be stacked: pad them to one length (ds.map(...)), or leave them out with "
                "columns=[...]"
            )
        return batch


def _has_shuffle_buffer(ds: Any) -> bool:
    """Whether the stream's chain of example iterables holds a shuffle buffer
    (``IterableDataset.shuffle(buffer_size=...)``)."""
    it = getattr(ds, "_ex_iterable", None)
    while it is not None:
        if type(it).__name__ == "BufferShuffledExamplesIterable":
            return True
        it = getattr(it, "ex_iterable", None)
    return False


def _whole_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The collate of ``HFRows`` batches: ``__getitems__`` has stacked them already."""
    return batch


def hf_loader(
    ds: Any,
    batch_size: int,
    *,
    shuffle: bool = False,
    drop_last: bool = False,
    columns: list[str] | None = None,
    num_workers: int = 0,
) -> DataLoader:
    """A ``DataLoader`` of dict batches of ``ds`` (a ``datasets.Dataset``), each read with
    one ``ds[indices]``. Give it to the Trainer or ``loops.data.source``: they re-create it
    on purestep's deterministic, O(1)-resumable order (``shuffle`` and ``drop_last`` are
    kept; the seed, rank and world size are theirs)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return DataLoader(
        HFRows(ds, columns),
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        collate_fn=_whole_batch,
        num_workers=num_workers,
    )


# ---------------------------------------------------------------------- streaming


class HFStream(Batches):
    """Batches of a streaming ``datasets.IterableDataset``, resumed from its own state.

    ``iterate(epoch, start)`` calls the stream's ``set_epoch(epoch)`` and batches
    ``batch_size`` examples at a time (``collate_fn``, default torch's ``default_collate``;
    ``drop_last`` drops a short final batch). With each batch it records the stream's
    ``state_dict()``, keeping the latest ``keep`` positions; ``state_dict()`` /
    ``load_state_dict()`` carry them (put the stream in an ``HFStreamData`` so checkpoints
    do). One iteration at a time: the stream is one object with one position.
    """

    resumable = True

    def __init__(
        self,
        ds: Any,
        batch_size: int,
        *,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        keep: int = 8,
    ) -> None:
        if not isinstance(ds, datasets.IterableDataset):
            raise TypeError(
                f"HFStream takes a datasets.IterableDataset, got {type(ds).__name__} (a "
                "map-style datasets.Dataset is a source as it is, or through hf_loader)"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (the loops look one batch ahead), got {keep}")
        self._ds = ds
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn or default_collate
        self.keep = keep
        self._marks: dict[tuple[int, int], Any] = {}
        #: a shuffle buffer's examples are lost by a resume from ``state_dict`` (datasets
        #: refills the buffer): such a stream resumes by replaying its epoch instead
        self._exact = not _has_shuffle_buffer(ds)
        #: ``(epoch, start, how)`` of every ``iterate``: how is "fresh" (batch 0), "state"
        #: (from a recorded position) or "replay" (read from the epoch's start, dropping).
        self.starts: list[tuple[int, int, str]] = []

    @property
    def num_batches(self) -> float:
        return math.inf

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        check_position(epoch, start, self.num_batches)
        return self._generate(epoch, start)

    def _stream(self, epoch: int, position: Any) -> Any:
        """A copy of the stream at ``epoch``, starting at ``position`` (None: its start),
        so the dataset given is never left at a loaded position (loading a position
        changes the iterables a shallow copy shares)."""
        ds = copy.deepcopy(self._ds)
        ds.set_epoch(epoch)
        if position is not None:
            ds.load_state_dict(copy.deepcopy(position))
        return ds

    def _generate(self, epoch: int, start: int) -> Iterator[Any]:
        position = self._marks.get((epoch, start)) if start and self._exact else None
        how = "fresh" if not start else ("state" if position is not None else "replay")
        self.starts.append((epoch, start, how))
        ds = self._stream(epoch, position)
        examples = iter(ds)
        b = start if position is not None else 0
        if position is not None:  # ds.state_dict() says its start until iteration begins
            self._record(epoch, b, position)
        while True:
            rows = list(itertools.islice(examples, self.batch_size))
            if not rows or (self.drop_last and len(rows) < self.batch_size):
                return
            b += 1
            # the position after this batch, before it is served: a checkpoint taken
            # while the loop holds it resumes at batch b
            self._record(epoch, b, ds.state_dict())
            if b > start:
                yield self.collate_fn(rows)

    def _record(self, epoch: int, batch: int, position: Any) -> None:
        marks = self._marks
        marks[(epoch, batch)] = position
        while len(marks) > self.keep:
            del marks[next(iter(marks))]

    def state_dict(self) -> dict[str, Any]:
        """The recorded positions, as plain data: ``{"positions": [[epoch, batch, state]]}``."""
        return {"positions": [[e, b, s] for (e, b), s in self._marks.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the positions ``state_dict`` gave (a run resuming from a checkpoint)."""
        try:
            marks = {(int(e), int(b)): s for e, b, s in state["positions"]}
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                "HFStream.load_state_dict expects what HFStream.state_dict returned "
                f"({{'positions': [[epoch, batch, state], ...]}}); got {state!r:.200}"
            ) from err
        self._marks = marks

    def with_options(self, **changes: Any) -> HFStream:
        order_only = {"shuffle", "seed", "rank", "world_size"}
        fixed = sorted(set(changes) - order_only)
        if fixed:
            raise ValueError(f"cannot change {fixed} of an HFStream: build a new one")
        return self  # the stream keeps its own order (shard it with split_dataset_by_node)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "hf_stream",
            "length": None,
            "resumable": True,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }


class HFStreamData(DataModule):
    """A ``DataModule`` serving streams (``HFStream``), whose positions go into checkpoints.

    ``HFStreamData(train=stream, val=None)``; pass it as ``Trainer.fit(task,
    datamodule=...)``. ``state_dict()`` holds the train stream's recorded positions (saved
    with every checkpoint), ``load_state_dict`` gives them back when a run resumes.
    """

    def __init__(self, train: HFStream, val: Any = None) -> None:
        if not isinstance(train, HFStream):
            raise TypeError(
                f"HFStreamData(train=...) takes an HFStream, got {type(train).__name__}"
            )
        self.train = train
        self.val = val

    def train_dataloader(self) -> HFStream:
        return self.train

    def val_dataloader(self) -> Any:
        return self.val

    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "train" in state_dict:
            self.train.load_state_dict(state_dict["train"])
