"""``Trainer.fit``: the task and optimizer, the resume, the steps and the ``FitLoop``.

Everything here runs once per fit; the per-batch work is the loop's (``loops.fit``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from purestep import engine
from purestep.engine import rng
from purestep.engine.optim import GradientTransformation
from purestep.engine.state import TrainState

from . import lightning, schedule
from .fit import FitLoop
from .optimization import optimization
from .seeding import resolve_seed
from .task import DataModule, Task, is_datamodule, restore_callback_data, restore_task_data
from .trainer_data import (
    AheadOfTime,
    attach_datamodule,
    check_fit_data,
    data_seed,
    fit_data,
    loader_source,
    prepare_data,
)
from .trainer_run import TrainerStatus, check_hooks, driver_for, printer, run_context

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["fit", "fit_arguments", "fit_optimizer", "fit_task", "seeded_model"]

_TASK_DATA = (
    "the arguments after a Task are its data, as in Lightning: fit(task, train_dataloaders, "
    "val_dataloaders) or fit(task, datamodule)"
)


def _step_piece(value: Any) -> str | None:
    """What ``value`` is when it is a loss function or an optimizer rather than data:
    ``"an optimizer"``, ``"a loss function"``, else None."""
    if value is None or is_datamodule(value):
        return None
    if isinstance(value, (GradientTransformation, torch.optim.Optimizer)) or (
        hasattr(value, "init") and hasattr(value, "update")
    ):
        return "an optimizer"
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
        return "an optimizer"
    if callable(value) and not isinstance(value, nn.Module):
        return "a loss function"
    return None


def fit_arguments(
    model: Any, loss_fn: Any, optimizer: Any, train: Any, val: Any, datamodule: Any
) -> tuple[Any, Any, Any, Any, Any]:
    """``fit``'s arguments as Lightning reads them: ``(loss_fn, optimizer, train, val,
    datamodule)``. With a ``Task`` the second and third positional arguments are the train
    and validation dataloaders; a ``DataModule`` in place of the train dataloaders is the
    datamodule (Lightning's ``isinstance(train_dataloaders, LightningDataModule)``). A plain
    ``nn.Module`` keeps ``fit(module, loss_fn, optimizer, train, val)``."""
    if isinstance(model, Task) and (loss_fn is not None or optimizer is not None):
        for given in (loss_fn, optimizer):
            kind = _step_piece(given)
            if kind is not None:
                raise TypeError(
                    f"fit({type(model).__name__}, ...) got {kind} ({given!r:.60}): a Task "
                    "brings its own steps and optimizer (training_step, configure_optimizers()); "
                    + _TASK_DATA
                )
        if train is not None or val is not None:
            raise TypeError(
                "fit(task, ...) got dataloaders both positionally and as "
                "train_dataloaders=/val_dataloaders=; " + _TASK_DATA
            )
        loss_fn, optimizer, train, val = None, None, loss_fn, optimizer
    if is_datamodule(train):
        if datamodule is not None:
            raise TypeError(
                f"fit got two DataModules, {type(train).__name__} in place of the train "
                f"dataloaders and {type(datamodule).__name__} as datamodule=; pass one"
            )
        if val is not None:
            raise TypeError(
                f"fit got a DataModule ({type(train).__name__}) and val_dataloaders: the "
                "DataModule brings its own val_dataloader(); pass either one"
            )
        train, datamodule = None, train
    return loss_fn, optimizer, train, val, datamodule


def fit_task(model: Any, loss_fn: Any, optimizer: Any) -> Task:
    """The ``Task`` to train: ``model`` itself, or a plain module wrapped with its pieces."""
    if isinstance(model, Task):
        if loss_fn is not None or optimizer is not None:
            raise TypeError(
                "a Task brings its own steps and optimizer (training_step, "
                "configure_optimizers()): pass no loss_fn or optimizer; " + _TASK_DATA
            )
        return model
    if isinstance(model, nn.Module):
        if is_datamodule(loss_fn) or is_datamodule(optimizer):
            raise TypeError(
                "fit(model, loss_fn, optimizer, ...): a plain nn.Module needs a loss function "
                "and an optimizer before its data; pass the DataModule after them or as "
                "datamodule=: fit(model, loss_fn, optimizer, datamodule=dm) (or wrap the "
                "pieces in a Task: fit(task, dm))"
            )
        if loss_fn is None or optimizer is None:
            raise TypeError(
                "fit(model, loss_fn, optimizer, train, val): a plain nn.Module needs a "
                "loss function and an engine.optim optimizer (or wrap them in a Task)"
            )
        return Task.wrap(model, loss_fn, optimizer)
    raise TypeError(f"expected a Task or an nn.Module, got {type(model).__name__}")


def seeded_model(task: Task, seed: int) -> nn.Module:
    """The task's template; one that ``configure_model`` builds now is built with torch's
    generators scoped to the seed's key (``rng.Purpose.MODEL``), so its initial weights are
    a function of fit's seed, as everything else in the run is. A model built before fit
    (in ``__init__``) drew from the global generators: ``seed_everything`` fixes those."""
    if task.model is not None:
        return task.get_model()
    with rng.scope(rng.fold_in(rng.key(seed), rng.Purpose.MODEL)):
        return task.get_model()


def fit_optimizer(task: Task, config: Any) -> Any:
    """The task's optimizer, behind the clipping ``gradient_clip_val`` asks for (one
    optimizer; several are read by ``loops.optimization``)."""
    return optimization(task, task.get_model(), config).optimizer


def fit(
    trainer: Trainer,
    model: Task | nn.Module,
    loss_fn: Any,
    optimizer: Any,
    train_dataloaders: Any,
    val_dataloaders: Any,
    *,
    datamodule: DataModule | None,
    ckpt_path: str | None,
    state: TrainState | None,
    seed: int | None,
) -> TrainState:
    """What ``Trainer.fit`` does (see there)."""
    seed = resolve_seed(seed)
    model = lightning.adapt(model, trainer)  # a Lightning-style module runs as a LightningTask
    loss_fn, optimizer, train_dataloaders, val_dataloaders, datamodule = fit_arguments(
        model, loss_fn, optimizer, train_dataloaders, val_dataloaders, datamodule
    )
    task = fit_task(model, loss_fn, optimizer)
    check_hooks(task, trainer.callbacks)  # now, not when the event comes
    has_val_data = check_fit_data(train_dataloaders, val_dataloaders, datamodule, task)
    trainer._task = task
    trainer._loop = None
    attach_datamodule(trainer, datamodule)
    prepare_data(trainer, task, datamodule)
    if datamodule is not None:
        datamodule.setup("fit")
    task.setup("fit")
    strategy = trainer.strategy
    net = strategy.convert_model(seeded_model(task, seed))
    train_source = AheadOfTime(
        loader_source(train_dataloaders, datamodule, task, "train_dataloader")
    )
    trainer._train_ahead = train_source  # estimated_stepping_batches in configure_optimizers
    plan = optimization(task, net, trainer.config)
    if trainer.compile is not None and plan.multi:
        raise ValueError(
            "Trainer(compile=...) does not support several optimizers or manual "
            f"optimization ({type(task).__name__}: optimizers {plan.names}, "
            f"automatic_optimization={not plan.manual}); use compile=False, or one "
            "optimizer with automatic optimization"
        )
    opt = plan.optimizer
    owned = state is None  # built here: the loop may update it in place without a copy
    if state is None:
        state = engine.init(net, opt, seed=seed, strategy=strategy)
    elapsed = 0.0
    say = printer(trainer)
    checkpointing = trainer.checkpointing
    checkpointing.task, checkpointing.datamodule = task, datamodule  # their save hooks
    url = checkpointing.resolve(ckpt_path, trainer.callbacks, None, fn="fit", say=say)
    meta: dict[str, Any] = {}
    if url is not None:
        state, meta = checkpointing.restore(url, state)
        elapsed = float(meta.get("elapsed", 0.0))
        # after setup, before the dataloaders are made (Lightning's order)
        restore_task_data(meta, task, datamodule, url=url)
        say(f"Restored the training state from {url}")
    config = trainer.config
    train_loader, val_loaders = fit_data(
        train_dataloaders,
        val_dataloaders,
        datamodule,
        data_seed(state),
        strategy=strategy,
        mode=trainer.multiple_trainloader_mode,
        config=config,
        task=task,
        train_source=train_source,
    )
    validates = task.has("validation_step") and has_val_data
    step = plan.train_step(
        net,
        task.training_step,
        strategy=strategy,
        accumulate=(
            config.accumulate_grad_batches
            if isinstance(config.accumulate_grad_batches, int)
            else lambda p: schedule.accumulation_factor(config, p.epoch)
        ),
    )
    evaluate_step = (
        engine.eval_step(net, task.validation_step, strategy=strategy) if validates else None
    )
    if trainer.compile is not None:
        step = engine.compile.compiled(step, trainer.compile)
        if evaluate_step is not None:
            evaluate_step = engine.compile.compiled(evaluate_step, trainer.compile)
    driver = driver_for(trainer, "fit", task, net)
    if not plan.multi:  # what SWA's BatchNorm pass runs as the forward (loops.callbacks.swa)
        driver.extra["training_step"] = task.training_step
    elif not plan.manual:  # several optimizers: the first one's step, backward skipped

        def first_optimizer_step(apply: Any, batch: Any) -> Any:
            return task.training_step(apply, batch, 0)

        driver.extra["training_step"] = first_optimizer_step
    driver.elapsed_offset = elapsed
    if url is not None:  # the callbacks' on_load_checkpoint, now that they are known
        state = restore_callback_data(meta, driver.callbacks, state, driver.context, url=url)
    checkpointing.check_writable(driver.callbacks, state, driver.log_dir, say=say)  # before step 1
    if url is not None:  # where it is now: cleanup may have moved a hidden newest state
        driver.extra["resumed_from"] = checkpointing.current(url)
    for message in schedule.startup_messages(config):
        driver.say(message)
    if has_val_data and not task.has("validation_step"):
        driver.say(
            f"{type(task).__name__} defines no validation_step: the validation data is "
            "not used (define validation_step to validate during fit)"
        )
    loop = FitLoop(
        step,
        None,
        driver=driver,
        config=config,
        val=None if validates else (),
        eval_step=evaluate_step,
        reload_train=train_loader,
        reload_val=val_loaders if validates else None,
        hparams=task.hparams or None,
        log_loss=getattr(task, "log_loss", True),
        donate=trainer.donate_state,
        schedulers=plan.schedulers,
        track_grad_norm=trainer.track_grad_norm,
        terminate_on_nan=trainer.terminate_on_nan,
    )
    trainer._loop = loop
    try:
        with run_context(trainer), checkpointing.preemption(driver, driver.callbacks):
            state = loop.run(state, owned=owned)
    finally:
        checkpointing.wait()
        trainer.status = driver.status
        trainer._torn = driver.torn
        if driver.torn:  # failed inside an in-place update: no whole state to offer
            trainer.train_state = None
        else:
            trainer.train_state = loop.state if loop.state is not None else state
        if isinstance(task, lightning.LightningTask):
            task.detach()  # also when the run failed: the module gets its own log back
    if isinstance(task, lightning.LightningTask) and trainer.train_state is not None:
        task.finish_fit(trainer.train_state)  # Lightning's module holds the trained weights
    if trainer.status == TrainerStatus.FINISHED:
        task.teardown("fit")
        if datamodule is not None:
            datamodule.teardown("fit")
    return state
