"""The fast path for in-memory tensors: batches are ``index_select`` calls, nothing else.

A tensor (or a tuple of tensors sharing their first dimension) is indexed directly with the
rank's slice of the epoch order: no per-sample Python, no DataLoader, no workers (the
worker options are ignored: indexing memory needs none). Each batch is a fresh copy, so a
step that writes into its batch cannot change the data. ``batch_size=None`` yields single
rows. Tensors already on an accelerator are indexed there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .batches import IndexedBatches, check_position
from .options import Options

__all__ = ["TensorBatches", "TensorDatasetBatches", "check_tensors", "gathers"]


def check_tensors(tensors: tuple[torch.Tensor, ...]) -> int:
    """The common number of samples of ``tensors`` (a clear error when they disagree)."""
    if not tensors:
        raise ValueError("need at least one tensor")
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("a 0-dim tensor has no samples to batch")
    sizes = [t.shape[0] for t in tensors]
    if len(set(sizes)) != 1:
        raise ValueError(f"tensors must share their first dimension, got sizes {sizes}")
    return sizes[0]


class TensorBatches(IndexedBatches):
    """Batches sliced straight out of a tensor or a tuple of tensors."""

    resumable = True

    def __init__(self, data: torch.Tensor | tuple[torch.Tensor, ...], options: Options) -> None:
        if options.collate_fn is not None:
            raise ValueError(
                "collate_fn is not used with tensors (they are indexed directly); "
                "wrap them in a TensorDataset to collate"
            )
        self._single = isinstance(data, torch.Tensor)
        self._tensors: tuple[torch.Tensor, ...] = (data,) if self._single else tuple(data)
        self._n = check_tensors(self._tensors)
        self._options = options

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        check_position(epoch, start, self.num_batches)
        return self._generate(epoch, start)

    def _generate(self, epoch: int, start: int) -> Iterator[Any]:
        o = self._options
        indices = self.epoch_indices(epoch)
        on_device = {t.device: indices.to(t.device) for t in self._tensors}
        size = o.batch_size or 1
        pin = o.pin_memory and torch.cuda.is_available()
        for b in range(start, self.num_batches):
            parts = []
            for t in self._tensors:
                part = t.index_select(0, on_device[t.device][b * size : (b + 1) * size])
                if o.batch_size is None:
                    part = part[0]
                parts.append(part.pin_memory() if pin and part.device.type == "cpu" else part)
            yield parts[0] if self._single else tuple(parts)

    def with_options(self, **changes: Any) -> TensorBatches:
        data = self._tensors[0] if self._single else self._tensors
        return TensorBatches(data, self._options.replace(**changes))

    def describe(self) -> dict[str, Any]:
        return self._summary("tensors", self._options, num_samples=self._n)


def gathers(dataset: Any, options: Options) -> bool:
    """Whether batches of ``dataset`` can be gathered by index instead of sample by sample:
    a plain ``TensorDataset`` batched with the default collate (which stacks its rows into a
    list of tensors, exactly what one ``index_select`` per tensor gives)."""
    return (
        type(dataset) is torch.utils.data.TensorDataset
        and options.collate_fn is None
        and options.batch_size is not None
        and bool(dataset.tensors)
    )


class TensorDatasetBatches(TensorBatches):
    """A ``TensorDataset`` under the default collate, served by index gathering.

    The batches are bitwise those of the per-sample path (``default_collate`` stacks the rows
    of each tensor; that is ``index_select`` of the same rows), as the same list of tensors,
    without a ``__getitem__`` call or a collate per sample. ``TensorDataset`` draws no random
    numbers, so the per-sample RNG scoping has nothing to scope; workers are not needed.
    """

    def __init__(self, dataset: torch.utils.data.TensorDataset, options: Options) -> None:
        super().__init__(tuple(dataset.tensors), options)
        self._dataset = dataset
        self._single = False
        self._scoped = False  # nothing to scope (as DatasetBatches says for a TensorDataset)

    def _generate(self, epoch: int, start: int) -> Iterator[Any]:
        for parts in super()._generate(epoch, start):
            yield list(parts)

    def with_options(self, **changes: Any) -> Any:
        options = self._options.replace(**changes)
        if gathers(self._dataset, options):
            return TensorDatasetBatches(self._dataset, options)
        from .datasets import DatasetBatches

        return DatasetBatches(self._dataset, options)

    def describe(self) -> dict[str, Any]:
        return self._summary("tensor_dataset", self._options, num_samples=self._n)
