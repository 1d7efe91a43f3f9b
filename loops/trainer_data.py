"""Data assembly for the Trainer: DataLoaders, datasets, tensors and ``DataModule`` hooks
turned into the loops' ``Batches`` sources, on the deterministic order.

Every source is re-created on an order seeded from the state's key (``data_seed``) and
sharded by the strategy's rank and world size, so a run is a pure function of the seed.
Nothing here runs per batch: sources are built once per run (or per reload).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from purestep.engine import rng
from purestep.engine.state import TrainState

from . import schedule
from .data import Batches, as_list, combine, source
from .data.source import is_tensor_tuple
from .task import DataModule, datamodule_base, is_datamodule

__all__ = [
    "TRAIN_MODES",
    "attach_datamodule",
    "check_fit_data",
    "data_for",
    "data_seed",
    "eval_arguments",
    "eval_data",
    "fit_data",
    "loader_source",
    "overrides",
    "prepare_data",
    "task_defines",
    "train_data",
]

#: The modes ``multiple_trainloader_mode`` accepts (fit cannot run "sequential").
TRAIN_MODES = ("max_size_cycle", "min_size", "max_size")


def overrides(obj: Any, method: str) -> bool:
    """Whether a data module defines ``method`` itself (e.g. ``val_dataloader``), not its
    base class (``DataModule``, or Lightning's, whose defaults raise or do nothing), or
    holds it as an instance attribute (``LightningDataModule.from_datasets``)."""
    if callable(vars(obj).get(method)) if hasattr(obj, "__dict__") else False:
        return True
    return getattr(type(obj), method, None) is not getattr(datamodule_base(obj), method, None)


def task_defines(task: Any, method: str) -> bool:
    """Whether a Task defines the dataloader hook ``method`` (``train_dataloader``,
    ``val_dataloader``, ...), as a LightningModule may: ``Task`` itself has none."""
    return task is not None and callable(getattr(task, method, None))


def loader_source(
    given: Any, datamodule: DataModule | None, task: Any, method: str
) -> Callable[[], Any] | None:
    """Who supplies one kind of dataloader, Lightning's precedence: the dataloaders passed
    to the call, else the DataModule's ``method`` when it defines it, else the Task's own
    ``method``; None when nobody does. What it returns is asked again at each reload."""
    if given is not None:
        return lambda: given
    if datamodule is not None and overrides(datamodule, method):
        return getattr(datamodule, method)
    if task_defines(task, method):
        return getattr(task, method)
    return None


def data_seed(state: TrainState) -> int:
    """The seed of every data order of a run: a pure function of the state's key."""
    return rng.fold_in(state.rng, rng.Purpose.DATA)


def _shard(strategy: Any, seed: int) -> dict[str, int]:
    # the strategy's own split when it has one (tensor parallelism: one model's ranks read
    # the same batches, so the data is split by replica, not by rank)
    options = getattr(strategy, "data_options", None)
    if options is None:
        return {"seed": seed, "rank": strategy.rank, "world_size": strategy.world_size}
    return {"seed": seed, **options()}


def train_data(data: Any, seed: int, *, strategy: Any, mode: str, config: Any) -> Batches:
    """The training source: one loader, or several combined with ``mode``
    (``multiple_trainloader_mode``); in order when the loop flags need it (overfitting)."""
    if data is None:
        raise ValueError(
            "fit needs training data: pass train_dataloaders or a datamodule, or define "
            "train_dataloader() on the Task"
        )
    if isinstance(data, (dict, list)) or (isinstance(data, tuple) and not is_tensor_tuple(data)):
        batches: Batches = combine(data, mode, **_shard(strategy, seed))
    else:
        batches = source(data, **_shard(strategy, seed))
    if schedule.sequential_order(config):
        batches = batches.with_options(shuffle=False)
    return batches


def eval_data(data: Any, seed: int, *, strategy: Any, sequential: bool = False) -> list[Batches]:
    """One source per evaluation dataloader (none for ``None``)."""
    if data is None:
        return []
    sources = as_list(data, **_shard(strategy, seed))
    if sequential:
        sources = [s.with_options(shuffle=False) for s in sources]
    return sources


def _per_node(owner: Any, trainer_flag: bool) -> bool:
    """Whether ``owner`` (a DataModule or a Task) prepares once per node: its own
    ``prepare_data_per_node`` attribute when it sets one, else the Trainer's flag."""
    own = getattr(owner, "prepare_data_per_node", None)
    if own is None:
        return trainer_flag
    if not isinstance(own, bool):
        raise TypeError(
            f"{type(owner).__name__}.prepare_data_per_node must be True or False, got {own!r}"
        )
    return own


#: A LightningDataModule's hooks the Trainer does not call (batches are placed by the
#: strategy; there is no transfer step to hook into).
_NOT_CALLED = (
    "transfer_batch_to_device",
    "on_before_batch_transfer",
    "on_after_batch_transfer",
    "on_exception",
)


def attach_datamodule(trainer: Any, datamodule: Any) -> None:
    """A ``LightningDataModule`` gets ``self.trainer`` as Lightning sets it (a read-only view
    of the run, as a LightningModule's, its counters those of the latest state), and
    overridden hooks this Trainer never calls are reported; a purestep ``DataModule`` is
    left as it is."""
    if datamodule is None or datamodule_base(datamodule) is DataModule:
        return
    from .lightning.trainer_view import TrainerView

    datamodule.trainer = TrainerView(trainer, live=True)
    ignored = [h for h in _NOT_CALLED if overrides(datamodule, h)]
    if ignored:
        warnings.warn(
            f"{type(datamodule).__name__} overrides {ignored}, which purestep.Trainer does not "
            "call (the strategy places each batch): do that work in the dataset, the "
            "collate function or the step (and handle failures in a callback's on_exception)",
            UserWarning,
            stacklevel=3,
        )


def prepare_data(trainer: Any, task: Any, datamodule: DataModule | None) -> None:
    """Run ``datamodule.prepare_data()`` (and the task's, if it has one) where it belongs,
    then let every rank go on together.

    Once per node (on local rank 0) when ``prepare_data_per_node`` is True (the default),
    once overall (on global rank 0) when False; the DataModule's or the Task's own
    ``prepare_data_per_node`` attribute wins over ``Trainer(prepare_data_per_node=...)``.
    With several processes every rank then waits for the others (a collective: bounded
    by the strategy's timeout, ``hardware.ddp(timeout=...)``), so no rank's ``setup`` starts
    before the data is prepared; a failure on one rank is raised on every rank.
    """
    hooks = []
    if datamodule is not None and overrides(datamodule, "prepare_data"):
        hooks.append((datamodule, datamodule.prepare_data))
    task_hook = getattr(task, "prepare_data", None) if task is not None else None
    if callable(task_hook):
        hooks.append((task, task_hook))
    if not hooks:
        return
    local_zero, global_zero = trainer.local_rank == 0, trainer.global_rank == 0
    failure: BaseException | None = None
    try:
        for owner, hook in hooks:
            if local_zero if _per_node(owner, trainer.prepare_data_per_node) else global_zero:
                hook()
    except Exception as err:
        failure = err
    if trainer.world_size > 1:
        # the barrier: every rank reports whether its preparation failed
        outcome = None if failure is None else f"{type(failure).__name__}: {failure}"
        failed = [
            (rank, why)
            for rank, why in enumerate(trainer.strategy.all_gather_object(outcome))
            if why is not None
        ]
        if failed and failure is None:
            rank, why = failed[0]
            raise RuntimeError(f"prepare_data failed on rank {rank}: {why}")
    if failure is not None:
        raise failure


def eval_arguments(
    dataloaders: Any, datamodule: DataModule | None, name: str
) -> tuple[Any, DataModule | None]:
    """``(dataloaders, datamodule)`` of ``validate`` / ``test`` / ``predict`` (``name``) as
    Lightning reads them: a ``DataModule`` passed as the dataloaders is the datamodule."""
    if not is_datamodule(dataloaders):
        return dataloaders, datamodule
    if datamodule is not None:
        raise TypeError(
            f"{name} got two DataModules, {type(dataloaders).__name__} in place of the "
            f"dataloaders and {type(datamodule).__name__} as datamodule=; pass one"
        )
    return None, dataloaders


def data_for(
    trainer: Any,
    task: Any,
    name: str,
    dataloaders: Any,
    datamodule: DataModule | None,
    getter: str,
) -> Callable[[], Any]:
    """The dataloaders of an evaluation run, to ask for once the task is set up: runs
    ``prepare_data`` (above, the task's too) and ``datamodule.setup(name)`` now, and returns
    what gives the ones passed, else ``datamodule.<getter>()``, else the Task's own
    ``<getter>()`` (None when nobody defines one)."""
    if datamodule is not None and dataloaders is not None:
        raise TypeError("pass either dataloaders or a datamodule, not both")
    attach_datamodule(trainer, datamodule)
    prepare_data(trainer, task, datamodule)
    if datamodule is not None:
        datamodule.setup(name)
    load = loader_source(dataloaders, datamodule, task, getter)
    return load if load is not None else lambda: None


class AheadOfTime:
    """A training-data source that may be asked early, once: ``configure_optimizers`` may
    read ``trainer.estimated_stepping_batches`` (OneCycleLR's ``total_steps``) before the
    loop starts, as in Lightning. ``peek()`` asks the source and keeps the answer; the
    loop's first call takes that answer, later calls (reloads) ask the source again, so a
    ``train_dataloader()`` hook runs as often as without the early look."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self.source = source
        self._kept: list[Any] = []
        self._used = False

    def peek(self) -> Any:
        if not self._kept:
            self._kept.append(self.source())
        return self._kept[0]

    def __call__(self) -> Any:
        if not self._used:
            self._used = True
            return self.peek()
        return self.source()


def check_fit_data(train: Any, val: Any, datamodule: DataModule | None, task: Any = None) -> bool:
    """Refuse fit data that cannot train; return whether there is validation data (passed,
    the DataModule's or the Task's own ``val_dataloader``)."""
    if datamodule is not None and not is_datamodule(datamodule):
        raise TypeError(
            "datamodule must be a DataModule (purestep's or a LightningDataModule), got "
            f"{type(datamodule).__name__}"
        )
    if datamodule is not None and (train is not None or val is not None):
        raise TypeError("pass either dataloaders or a datamodule, not both")
    if loader_source(train, datamodule, task, "train_dataloader") is None:
        raise ValueError(
            "fit needs training data: pass train_dataloaders, or a datamodule that defines "
            "train_dataloader(), or define train_dataloader() on the Task"
        )
    return loader_source(val, datamodule, task, "val_dataloader") is not None


def fit_data(
    train: Any,
    val: Any,
    datamodule: DataModule | None,
    seed: int,
    *,
    strategy: Any,
    mode: str,
    config: Any,
    task: Any = None,
    train_source: Callable[[], Any] | None = None,
) -> tuple[Callable[[], Batches], Callable[[], list[Batches]]]:
    """fit's ``(train_loader, val_loaders)``: what the loop calls at the start and at each
    reload (``reload_dataloaders_every_n_epochs``), asking the owner (the datamodule, or
    the Task's own hooks) again each time. ``train_source``: who supplies the training
    data, when the caller already asked (``AheadOfTime``)."""
    if train_source is None:
        train_source = loader_source(train, datamodule, task, "train_dataloader")
    val_source = loader_source(val, datamodule, task, "val_dataloader")

    def train_loader() -> Batches:
        data = train_source() if train_source is not None else None
        return train_data(data, seed, strategy=strategy, mode=mode, config=config)

    def val_loaders() -> list[Batches]:
        data = val_source() if val_source is not None else None
        return eval_data(
            data, seed, strategy=strategy, sequential=schedule.sequential_order(config)
        )

    return train_loader, val_loaders
