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

import glob
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from purestep.engine import tree
from purestep.engine.checkpoint import safe_load

from ..events import Context
from ..loggers import run_files
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

    def uses_run_folder(self, fn: str) -> bool:
        """Whether a run of ``fn`` writes into the run folder (a prediction run without
        ``output_dir``): the Trainer then gives the run a version folder of its own."""
        return fn == "predict" and self.output_dir is None

    def _base(self, ctx: Context) -> str:
        """The folder the default files are written under without following a link below
        it: ``output_dir`` itself when given (the user chose it), else the run folder's
        trusted root (``ctx.extra["log_root"]``, the logger's ``root_dir``, which the
        Trainer passes), else the run folder: a planted version folder or ``predictions``
        link is refused."""
        if self.output_dir is not None:
            return os.path.abspath(self.output_dir)
        run = os.path.abspath(ctx.log_dir or os.getcwd())
        root = ctx.extra.get("log_root") if ctx.extra else None
        if root is not None:
            root = os.path.abspath(root)
            if os.path.commonpath([root, run]) == root:
                return root
        return run

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
        """Write ``payload`` to ``name`` in the folder: a temporary file renamed into place
        (a reader never sees half a file), never through a link (``loggers.run_files``)."""
        path = os.path.join(os.path.abspath(self.folder(ctx)), name)
        run_files.write_file(self._base(ctx), path, lambda f: torch.save(payload, f))

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
        folder = os.path.abspath(self.folder(ctx))
        if not uses_default:
            return
        base = self._base(ctx)
        # listed without following a planted link: a "predictions" link out of the run
        # folder is refused here, before anything in its target could be removed
        for name in run_files.list_folder(base, folder):
            if name == f"predictions_rank{ctx.rank}.pt" or (
                name.startswith(f"predictions_rank{ctx.rank}_") and _BATCH_FILE.fullmatch(name)
            ):
                run_files.remove_file(base, os.path.join(folder, name))

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
    repeated on several ranks (to give every rank as many) appear once. Files are read as
    checkpoint files are (``engine.checkpoint.safe_load.torch_load``): data only, bounded.
    """
    files = _files(source)
    if not files:
        raise FileNotFoundError(f"no prediction files in {os.fspath(source)!r}")
    by_loader: dict[int, dict[int, Any]] = {}
    world_sizes: set[int] = set()
    for path in files:
        # checked as a checkpoint file is (archive layout, pickle scan, tensor layouts)
        data = safe_load.torch_load(path)
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
