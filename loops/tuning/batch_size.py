"""Find the largest batch size that fits in memory (Lightning's ``scale_batch_size``).

Each trial is a short ``fit`` (``steps_per_trial`` optimizer steps, validation limited to
as many batches) on a private trainer, from the state the next ``fit`` starts from, with the
batch size written where Lightning writes it: the ``batch_arg_name`` attribute of the task,
its hparams, the datamodule or the datamodule's hparams (every one that holds it), which the
datamodule's ``train_dataloader()`` reads. A trial that runs out of memory — CUDA's
``torch.OutOfMemoryError`` or ``RuntimeError`` messages, or the CPU allocator's
"DefaultCPUAllocator: can't allocate memory" — counts as too large; any other error is
raised. "power" doubles the size until a trial fails; "binsearch" then bisects between the
largest size that ran and the smallest that failed. The result is the largest size that
ran, left in the attribute. As in Lightning, a size is capped at the length of the
datamodule's training dataset (a larger batch holds no more samples), and the search ends
there. Trials keep nothing (the private trainer's results are
dropped), so nothing is restored afterwards.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from . import attrs
from .trial import trial_trainer

__all__ = ["is_oom_error", "scale_batch_size"]

MODES = ("power", "binsearch")

_OOM_MESSAGES = (
    "CUDA out of memory.",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says memory ran out: torch's
    ``OutOfMemoryError``, a ``MemoryError``, or a ``RuntimeError`` with the CUDA, cuBLAS,
    cuDNN or CPU allocator's out-of-memory message."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(exc, RuntimeError) and exc.args:
            text = str(exc.args[0])
            if any(m in text for m in _OOM_MESSAGES):
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def _free_memory() -> None:
    """Release what a failed trial left (its traceback's tensors): a full collection and
    CUDA's cache on a CUDA machine (Lightning's ``garbage_collection_cuda``); on the CPU the
    young generations, where that garbage is, at a fraction of a full collection's cost."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    else:
        gc.collect(1)


def _dataset_length(owner: Any) -> int | None:
    """How many samples the training data of ``owner`` (a datamodule or a task with its
    own ``train_dataloader``) holds (None if it cannot tell)."""
    if owner is None:
        return None
    try:
        data = owner.train_dataloader()
        data = getattr(data, "dataset", data)
        return len(data)
    except Exception:
        return None


def _check(mode: str, steps_per_trial: Any, init_val: Any, max_trials: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be 'power' or 'binsearch', got {mode!r}")
    for name, value in (
        ("steps_per_trial", steps_per_trial),
        ("init_val", init_val),
        ("max_trials", max_trials),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def scale_batch_size(
    trainer: Any,
    model: Any,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    *,
    datamodule: Any = None,
    state: Any = None,
    seed: int | None = None,
    mode: str = "power",
    steps_per_trial: int = 3,
    init_val: int = 2,
    max_trials: int = 25,
    batch_arg_name: str = "batch_size",
) -> int | None:
    """Search the batch size for ``trainer`` (see the module doc); ``Tuner`` calls it.

    Returns the size settled on (None with ``fast_dev_run``, which skips the search).
    """
    from .. import lightning
    from ..task import Task
    from ..trainer_data import task_defines
    from ..trainer_run import printer

    _check(mode, steps_per_trial, init_val, max_trials)
    say = printer(trainer)
    if trainer.config.fast_dev_run:
        say("Skipping batch size scaler since `fast_dev_run` is enabled.")
        return None
    model = lightning.adapt(model, trainer)  # a Lightning-style module: its LightningTask
    if not isinstance(model, Task):
        raise TypeError(
            "scale_batch_size needs a Task (the batch size is one of its attributes, its "
            f"hparams or its datamodule's), got {type(model).__name__}"
        )
    if train_dataloaders is not None:
        raise ValueError(
            "scale_batch_size cannot change the batch size of dataloaders passed directly: "
            "pass a datamodule whose train_dataloader() reads the batch size"
        )
    # who builds the loaders: the datamodule, else the task's own train_dataloader() (a
    # LightningModule's, as Lightning's tuner allows)
    loaders = datamodule if datamodule is not None else model
    if datamodule is None and not task_defines(model, "train_dataloader"):
        raise ValueError(
            "scale_batch_size needs a datamodule, or a task that defines train_dataloader(), "
            f"that builds its loaders with its `{batch_arg_name}`"
        )
    if not attrs.has_attr(batch_arg_name, model, datamodule):
        raise AttributeError(
            f"Field {batch_arg_name!r} not found in the task, its hparams, the datamodule or "
            "its hparams: give one of them the batch size attribute the datamodule's "
            "train_dataloader() reads (or name it with batch_arg_name=...)"
        )
    length = _dataset_length(loaders)
    inner = trial_trainer(
        trainer,
        (),
        max_steps=(state.progress.step if state is not None else 0) + steps_per_trial,
        min_steps=None,
        min_epochs=None,
        max_time=None,
        limit_train_batches=1.0,
        limit_val_batches=steps_per_trial,
        num_sanity_val_steps=0,
    )

    def fits(size: int) -> bool:
        attrs.set_attr(batch_arg_name, size, model, datamodule)
        try:
            inner.fit(
                model,
                val_dataloaders=val_dataloaders,
                datamodule=datamodule,
                state=state,
                seed=seed,
            )
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            del exc
            _free_memory()
            say(f"Batch size {size} failed (out of memory)")
            return False
        say(f"Batch size {size} succeeded")
        return True

    def grown(size: int, new: int) -> int:
        """``new``, capped at the dataset's length as Lightning caps it (``size`` itself
        when that changes nothing: the search is over)."""
        if length is not None and new >= length:
            new = max(length, 1)
            if new <= size:
                say(f"The batch size {size} is greater or equal than the length of your dataset.")
                return size
        return new

    start = grown(0, init_val)
    best = (
        _power(fits, grown, start, max_trials)
        if mode == "power"
        else _binsearch(fits, grown, start, max_trials)
    )
    if best is None:
        attrs.set_attr(batch_arg_name, init_val, model, datamodule)
        raise RuntimeError(
            f"scale_batch_size: no batch size from {init_val} down to 1 fits in memory"
        )
    attrs.set_attr(batch_arg_name, best, model, datamodule)
    say(f"Finished batch size finder, will continue with full run using batch size {best}")
    return best


def _power(fits: Any, grown: Any, size: int, max_trials: int) -> int | None:
    """Double from ``size`` until a trial fails; before any success, halve instead.
    ``grown(size, new)`` caps a new size (``size`` back: nothing left to try)."""
    best = None
    for _ in range(max_trials):
        if fits(size):
            best = size
            new = grown(size, size * 2)
            if new == size:
                break
            size = new
        else:
            if best is not None or size == 1:
                break
            size //= 2
    return best


def _binsearch(fits: Any, grown: Any, size: int, max_trials: int) -> int | None:
    """Double until a trial fails, then bisect between the largest success and the
    smallest failure (halving first while nothing has fit)."""
    low, high, best = 0, None, None
    for _ in range(max_trials):
        if fits(size):
            best = low = size
            if high is None:
                new = grown(size, size * 2)
                if new == size:
                    break
                size = new
            else:
                if high - low <= 1:
                    break
                size = (low + high) // 2
        else:
            high = size
            if high - low <= 1:
                break
            size = (low + high) // 2 if best is not None else max(size // 2, 1)
            if size == high:
                break
    return best
