"""``Trainer.validate`` / ``test`` / ``predict``: what to evaluate (a state, a task, a module,
a checkpoint's weights), on which data, and the run over ``loops.evaluate`` /
``loops.predict``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from purestep import engine
from purestep.engine import optim, user_errors
from purestep.engine.state import TrainState

from . import lightning
from .evaluate import evaluate as run_evaluate
from .events import Stage
from .predict import predict as run_predict
from .task import DataModule, Task, default_predict, restore_task_data
from .trainer_data import data_for, data_seed, eval_arguments, eval_data
from .trainer_run import TrainerStatus, check_hooks, driver_for, printer, run_context

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["eval_target", "evaluate", "from_checkpoint", "predict", "results_table"]


def eval_target(
    trainer: Trainer,
    model: Any,
    fn: Any,
    state: TrainState | None,
    method: str,
    ckpt_path: str | None = None,
) -> tuple[Task, TrainState]:
    """The task and state an evaluation runs: ``model`` may be a ``TrainState`` (with the last
    fitted task), a ``Task``, an ``nn.Module`` (with ``fn``) or None (the last fitted task);
    the state defaults to the last fitted one, else a fresh one of the task's model. A
    Lightning-style module runs as its ``LightningTask`` (the fitted one, if it was fitted)."""
    model = lightning.adapt(model, trainer)
    if isinstance(model, TrainState):
        if state is not None:
            raise TypeError("pass the state once (positionally or as state=)")
        state, model = model, None
    fitted = trainer._task
    if model is None:
        task = fitted
        if task is None:
            raise ValueError(
                "no model: pass a Task or an nn.Module (with fn=...), or call fit() first"
            )
    elif isinstance(model, Task):
        task = model
    elif isinstance(model, nn.Module):
        if fn is None and fitted is not None and fitted.get_model() is model:
            task = fitted
        elif fn is None:
            raise TypeError("an nn.Module needs fn=(apply, batch) -> loss/metrics to evaluate")
        else:  # checked as what it is, before Task.wrap checks it as a loss function
            user_errors.check_signature(fn, f"{method} fn")
            if method == "predict_step":
                task = Task.wrap(model, fn, optim.identity(), predict_fn=fn)
            else:
                task = Task.wrap(model, fn, optim.identity())
    else:
        raise TypeError(
            f"expected a TrainState, a Task or an nn.Module, got {type(model).__name__}"
        )
    if isinstance(task, lightning.LightningTask):  # the fitted one too: self.log, self.trainer
        task.attach(trainer)
    if state is None:
        if trainer.train_state is not None and task is fitted:
            state = trainer.train_state
        elif trainer._torn and task is fitted and ckpt_path is None:
            raise RuntimeError(
                f"{method.removesuffix('_step')}: the last fit failed inside an in-place "
                "optimizer update and left no whole state to use; pass ckpt_path= (e.g. "
                "'last') or a state"
            )
        else:
            state = engine.init(task.get_model(), optim.identity(), strategy=trainer.strategy)
    return task, state


def from_checkpoint(
    trainer: Trainer,
    ckpt_path: str | None,
    state: TrainState,
    fn: str,
    *,
    task: Task | None = None,
    datamodule: DataModule | None = None,
) -> TrainState:
    """``state`` with the weights of ``ckpt_path`` ("best", "last" or a path), if given;
    the checkpoint's data goes back to ``task`` and ``datamodule`` (``on_load_checkpoint``,
    ``load_state_dict``), before the stage's ``prepare_data`` and ``setup``."""
    if ckpt_path is None:
        return state
    checkpointing = trainer.checkpointing
    url = checkpointing.resolve(
        ckpt_path, trainer.callbacks, trainer._latest, fn=fn, say=printer(trainer)
    )
    if url is None:
        raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no checkpoint found")
    state, meta = checkpointing.load_for_eval(url, state, with_metadata=True)
    restore_task_data(meta, task, datamodule, url=url)
    return state


def evaluate(
    trainer: Trainer,
    stage: str,
    model: Any,
    dataloaders: Any,
    datamodule: DataModule | None,
    state: TrainState | None,
    fn: Any,
    verbose: bool,
    ckpt_path: str | None = None,
) -> list[dict[str, float]]:
    """What ``Trainer.validate`` (``stage=Stage.VALIDATE``) and ``Trainer.test`` do."""
    name = "validate" if stage == Stage.VALIDATE else "test"
    method = "validation_step" if stage == Stage.VALIDATE else "test_step"
    dataloaders, datamodule = eval_arguments(dataloaders, datamodule, name)
    task, state = eval_target(trainer, model, fn, state, method, ckpt_path)
    check_hooks(task, trainer.callbacks)  # now, not when the event comes
    state = from_checkpoint(trainer, ckpt_path, state, name, task=task, datamodule=datamodule)
    if not task.has(method):
        raise NotImplementedError(f"{type(task).__name__} does not define {method}()")
    getter = "val_dataloader" if stage == Stage.VALIDATE else "test_dataloader"
    load = data_for(trainer, task, name, dataloaders, datamodule, getter)
    task.setup(name)
    dataloaders = load()  # after setup, as Lightning asks for them
    strategy = trainer.strategy
    net = strategy.convert_model(task.get_model())
    sources = eval_data(dataloaders, data_seed(state), strategy=strategy)
    if not sources:
        raise ValueError(
            f"{name} needs data: pass dataloaders or a datamodule, or define {getter}() on the Task"
        )
    step = engine.eval_step(net, getattr(task, method), strategy=strategy)
    driver = driver_for(trainer, name, task, net)
    try:
        with run_context(trainer):
            _, results = run_evaluate(stage, state, step, sources, driver=driver)
    finally:
        trainer.status = driver.status
        _detach(task)
    if trainer.status != TrainerStatus.FINISHED:
        return []
    task.teardown(name)
    if datamodule is not None:
        datamodule.teardown(name)
    if verbose:
        driver.say(results_table(name, results))
    return results


def predict(
    trainer: Trainer,
    model: Any,
    dataloaders: Any,
    datamodule: DataModule | None,
    state: TrainState | None,
    fn: Any,
    return_predictions: bool,
    ckpt_path: str | None,
) -> Any:
    """What ``Trainer.predict`` does (see there)."""
    dataloaders, datamodule = eval_arguments(dataloaders, datamodule, "predict")
    if isinstance(model, nn.Module) and fn is None:
        is_fitted = trainer._task is not None and trainer._task.get_model() is model
        if not is_fitted:
            fn = default_predict
    task, state = eval_target(trainer, model, fn, state, "predict_step", ckpt_path)
    check_hooks(task, trainer.callbacks)
    state = from_checkpoint(trainer, ckpt_path, state, "predict", task=task, datamodule=datamodule)
    load = data_for(trainer, task, "predict", dataloaders, datamodule, "predict_dataloader")
    task.setup("predict")
    dataloaders = load()  # after setup, as Lightning asks for them
    strategy = trainer.strategy
    net = strategy.convert_model(task.get_model())
    sources = eval_data(dataloaders, data_seed(state), strategy=strategy)
    if not sources:
        raise ValueError(
            "predict needs data: pass dataloaders or a datamodule, or define "
            "predict_dataloader() on the Task"
        )
    step = engine.predict_step(net, task.predict_step, strategy=strategy)
    driver = driver_for(trainer, "predict", task, net)
    try:
        with run_context(trainer):
            _, outputs = run_predict(state, step, sources, driver=driver, keep=return_predictions)
    finally:
        trainer.status = driver.status
        _detach(task)
    if trainer.status != TrainerStatus.FINISHED:
        return None
    task.teardown("predict")
    if datamodule is not None:
        datamodule.teardown("predict")
    if not return_predictions:
        return None
    trainer.predictions = outputs[0] if len(outputs) == 1 else outputs
    return trainer.predictions


def _detach(task: Task) -> None:
    """A Lightning-style module gets its own ``self.log`` back after a run."""
    if isinstance(task, lightning.LightningTask):
        task.detach()


def results_table(name: str, results: Sequence[dict[str, float]]) -> str:
    """The table ``verbose=True`` prints: one row per metric of every dataloader."""
    rows = [(k, v) for r in results for k, v in r.items()]
    if not rows:
        return f"{name}: no metrics"
    width = max(len(f"{name} metric"), *(len(k) for k, _ in rows))
    lines = [f"{name} metric".ljust(width + 2) + "value", "-" * (width + 14)]
    lines += [f"{k.ljust(width + 2)}{v:.6g}" for k, v in rows]
    return "\n".join(lines)
