"""Write predictions as they are made (Lightning's ``BasePredictionWriter``), per rank.

``PredictionWriter(write_interval)`` writes at every predict batch ("batch"), once at the
end of the prediction epoch ("epoch"), or both ("batch_and_epoch"). Writing is an effect, so
the writer is an event observer (like the progress bar and the monitors), not a pure
callback: the Trainer takes it in ``callbacks=[...]`` all the same.

What is written: by default, with ``torch.save`` into ``<run folder>/predictions`` (or
``output_dir``), one file per batch ``predictions_rank<r>_dataloader<d>_batch<i>.pt`` and/or
one per rank ``predictions_rank<r>.pt``, each a dict holding the predictions and their
``batch_indices`` (the dataset index of every sample); or whatever the user's functions
(``on_batch=fn(ctx, prediction, batch_indices, batch, batch_idx, dataloader_idx)``,
``on_epoch=fn(ctx, predictions, batch_indices)``) or a subclass's ``write_on_batch_end`` /
``write_on_epoch_end`` do. The indices come from the data order (``loops.data``): under DDP
each rank predicts and writes its own shard, and ``merge_predictions`` puts the ranks' parts
back into the dataset's order (dropping the samples the sharding repeated to even out the
ranks). Each file records its rank and the run's world size; at ``on_predict_start`` each
rank removes its own default files of an earlier run into the same folder, so a merge never
mixes two runs (files of a run with another world size are refused). Nothing in a file
needs code to read it back (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from purestep.engine import tree

from ..events import Context
from ..profiling.monitor import Monitor

__all__ = ["PredictionWriter", "batch_indices", "merge_predictions"]

INTERVALS = ("batch", "epoch", "batch_and_epoch")
FOLDER = "predictions"


def batch_indices(source: Any, batch_idx: int, epoch: int = 0) -> list[int] | None:
    """The dataset indices of batch ``batch_idx`` of ``source`` (a ``loops.data`` stream),
    on this rank; None for data without an index order (iterable datasets)."""
    indices = getattr(source, "epoch_indices", None)
    options = getattr(source, "options", None)
    size = getattr(options, "batch_size", None)
    if indices is None or not size:
        return None
    order = indices(epoch)
    return [int(i) for i in order[batch_idx * size : (batch_idx + 1) * size]]


class PredictionWriter(Monitor):
    """Writes predictions at ``write_interval`` (see the module doc)."""

    def __init__(
        self,
        write_interval: str = "batch",
        output_dir: str | os.PathLike[str] | None = None,
        *,
        on_batch: Callable[..., None] | None = None,
        on_epoch: Callable[..., None] | None = None,
    ) -> None:
        if write_interval not in INTERVALS:
            raise ValueError(
                f"write_interval must be one of {', '.join(map(repr, INTERVALS))}, got "
                f"{write_interval!r}"
            )
        for name, fn in (("on_batch", on_batch), ("on_epoch", on_epoch)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
        self.write_interval = write_interval
        self.output_dir = os.fspath(output_dir) if output_dir is not None else None
        self._on_batch = on_batch
        self._on_epoch = on_epoch
        self.events = frozenset(
            {"on_predict_start", "on_predict_batch_end", "on_predict_epoch_end"}
        )
        self._orders: dict[int, Any] = {}
        self._predictions: list[list[Any]] = []
        self._indices: list[list[Any]] = []

    @property
    def interval_batch(self) -> bool:
        return self.write_interval in ("batch", "batch_and_epoch")

    @property
    def interval_epoch(self) -> bool:
        return self.write_interval in ("epoch", "batch_and_epoch")

    def folder(self, ctx: Context) -> str:
        """Where the default writer puts its files."""
        if self.output_dir is not None:
            return self.output_dir
        return os.path.join(ctx.log_dir or os.getcwd(), FOLDER)

    # ------------------------------------------------------------------ what is written

    def write_on_batch_end(
        self,
        ctx: Context,
        prediction: Any,
        batch_indices: list[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's prediction (override, or pass ``on_batch``)."""
        if self._on_batch is not None:
            self._on_batch(ctx, prediction, batch_indices, batch, batch_idx, dataloader_idx)
            return
        name = f"predictions_rank{ctx.rank}_dataloader{dataloader_idx}_batch{batch_idx}.pt"
        self._save(
            ctx,
            name,
            {
                "predictions": prediction,
                "batch_indices": batch_indices,
                "dataloader_idx": dataloader_idx,
                **_origin(ctx),
            },
        )

    def write_on_epoch_end(
        self, ctx: Context, predictions: list[list[Any]], batch_indices: list[list[Any]]
    ) -> None:
        """Write every prediction of this rank, one list per dataloader (override, or pass
        ``on_epoch``)."""
        if self._on_epoch is not None:
            self._on_epoch(ctx, predictions, batch_indices)
            return
        self._save(
            ctx,
            f"predictions_rank{ctx.rank}.pt",
            {"predictions": predictions, "batch_indices": batch_indices, **_origin(ctx)},
        )

    def _save(self, ctx: Context, name: str, payload: Any) -> None:
        folder = self.folder(ctx)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(payload, tmp)
        os.replace(tmp, path)  # a reader never sees half a file

    def _clear_own_files(self, ctx: Context) -> None:
        """Remove the default files this rank wrote in an earlier prediction run into the
        same folder (an earlier run's extra batches, or an epoch file a "batch" run would
        leave behind, would otherwise be merged with this run's). Each rank removes only
        its own names, so no rank can remove another's new files."""
        uses_default = (
            self.interval_batch
            and self._on_batch is None
            and type(self).write_on_batch_end is PredictionWriter.write_on_batch_end
        ) or (
            self.interval_epoch
            and self._on_epoch is None
            and type(self).write_on_epoch_end is PredictionWriter.write_on_epoch_end
        )
        folder = self.folder(ctx)
        if not uses_default or not os.path.isdir(folder):
            return
        own = glob.glob(os.path.join(glob.escape(folder), f"predictions_rank{ctx.rank}_*.pt"))
        own.append(os.path.join(folder, f"predictions_rank{ctx.rank}.pt"))
        for path in own:
            name = os.path.basename(path)
            if name == f"predictions_rank{ctx.rank}.pt" or _BATCH_FILE.fullmatch(name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    # ------------------------------------------------------------------ events

    def on_event(self, event: str, ctx: Context) -> None:
        if event == "on_predict_start":
            self._orders, self._predictions, self._indices = {}, [], []
            self._clear_own_files(ctx)
        elif event == "on_predict_batch_end":
            i = ctx.dataloader_idx
            indices = self._batch_indices(ctx, i, ctx.batch_idx)
            if self.interval_batch:
                self.write_on_batch_end(ctx, ctx.outputs, indices, ctx.batch, ctx.batch_idx, i)
            if self.interval_epoch:
                while len(self._predictions) <= i:
                    self._predictions.append([])
                    self._indices.append([])
                self._predictions[i].append(ctx.outputs)
                self._indices[i].append(indices)
        elif event == "on_predict_epoch_end" and self.interval_epoch:
            predictions, indices = self._predictions, self._indices
            self._predictions, self._indices = [], []
            self.write_on_epoch_end(ctx, predictions, indices)
        return None

    def _batch_indices(self, ctx: Context, dataloader_idx: int, batch_idx: int) -> Any:
        sources = ctx.extra.get("predict_sources") or ()
        if dataloader_idx >= len(sources):
            return None
        order = self._orders.get(dataloader_idx)
        if order is None:
            source = sources[dataloader_idx]
            fn = getattr(source, "epoch_indices", None)
            size = getattr(getattr(source, "options", None), "batch_size", None)
            order = self._orders[dataloader_idx] = (fn(0), size) if fn and size else (None, 0)
        indices, size = order
        if indices is None:
            return None
        return [int(j) for j in indices[batch_idx * size : (batch_idx + 1) * size]]


# ---------------------------------------------------------------------- merging the parts

_BATCH_FILE = re.compile(r"predictions_rank\d+_dataloader\d+_batch\d+\.pt")


def _origin(ctx: Context) -> dict[str, int]:
    """Who wrote a file: its rank and the run's world size (``merge_predictions`` checks
    that the files it merges come from one run's ranks)."""
    return {"rank": int(ctx.rank), "world_size": int(ctx.world_size)}


def _split(prediction: Any, count: int) -> list[Any]:
    """One prediction per sample: every tensor of ``prediction`` cut along its first dim."""
    leaves, spec = tree.leaves(prediction), tree.structure(prediction)
    parts = [x.unbind(0) if isinstance(x, torch.Tensor) else [x] * count for x in leaves]
    for x, p in zip(leaves, parts):
        if len(p) != count:
            raise ValueError(
                f"a prediction leaf of shape {tuple(getattr(x, 'shape', ()))} does not have "
                f"one row per sample of its batch ({count})"
            )
    return [tree.unflatten(spec, [p[k] for p in parts]) for k in range(count)]


def _stack(samples: Sequence[Any]) -> Any:
    leaves = [tree.leaves(s) for s in samples]
    spec = tree.structure(samples[0])
    stacked = [
        torch.stack([row[j] for row in leaves])
        if isinstance(leaves[0][j], torch.Tensor)
        else [row[j] for row in leaves]
        for j in range(len(leaves[0]))
    ]
    return tree.unflatten(spec, stacked)


def _files(source: str | os.PathLike[str] | Sequence[str]) -> list[str]:
    if isinstance(source, (str, os.PathLike)):
        folder = os.fspath(source)
        if os.path.isdir(folder):
            epoch = sorted(glob.glob(os.path.join(folder, "predictions_rank*.pt")))
            per_rank = [f for f in epoch if "_dataloader" not in os.path.basename(f)]
            return per_rank or epoch
        return [folder]
    return [os.fspath(f) for f in source]


def merge_predictions(source: str | os.PathLike[str] | Sequence[str]) -> list[Any]:
    """The predictions the ranks wrote, back in the dataset's order: one entry per
    dataloader, each the per-sample predictions stacked (a tensor, or the prediction's
    structure with stacked tensors), sample ``k`` of the dataset at row ``k``.

    ``source``: the folder a ``PredictionWriter`` wrote to (its per-rank epoch files if there
    are any, else its per-batch files) or a list of its files. Samples that the sharding
    repeated on several ranks (to give every rank as many) appear once. Files are read with
    ``torch.load(weights_only=True)``: they hold data only.
    """
    files = _files(source)
    if not files:
        raise FileNotFoundError(f"no prediction files in {os.fspath(source)!r}")
    by_loader: dict[int, dict[int, Any]] = {}
    world_sizes: set[int] = set()
    for path in files:
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or "predictions" not in data or "batch_indices" not in data:
            raise ValueError(f"{path}: not a PredictionWriter file (no predictions/batch_indices)")
        if "world_size" in data:
            world_sizes.add(int(data["world_size"]))
        if "dataloader_idx" in data:  # one batch
            loaders = {
                int(data["dataloader_idx"]): ([data["predictions"]], [data["batch_indices"]])
            }
        else:
            loaders = {
                i: (p, ix)
                for i, (p, ix) in enumerate(zip(data["predictions"], data["batch_indices"]))
            }
        for i, (predictions, indices) in loaders.items():
            samples = by_loader.setdefault(i, {})
            for prediction, idx in zip(predictions, indices):
                if idx is None:
                    raise ValueError(
                        f"{path}: a batch has no sample indices (an iterable dataset): its "
                        "order cannot be restored"
                    )
                for k, sample in zip(idx, _split(prediction, len(idx))):
                    samples.setdefault(int(k), sample)  # a repeated (padding) sample: once
    if len(world_sizes) > 1:
        raise ValueError(
            "the files come from runs with different numbers of processes "
            f"(world sizes {sorted(world_sizes)}): merge one run's files (pass them as a list)"
        )
    out = []
    for i in range(max(by_loader) + 1):
        samples = by_loader.get(i, {})
        keys = sorted(samples)
        if keys != list(range(len(keys))):
            missing = sorted(set(range(keys[-1] + 1)) - set(keys)) if keys else []
            raise ValueError(
                f"dataloader {i}: the files lack the predictions of samples {missing[:10]}"
            )
        out.append(_stack([samples[k] for k in keys]) if keys else [])
    return out
