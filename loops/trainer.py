"""``Trainer``: the Lightning-shaped facade over the pure steps and loop compositions.

``Trainer(**flags)`` takes Lightning's flags with Lightning's semantics. ``fit`` returns the
final ``TrainState``; ``validate`` and ``test`` return one metrics dict per dataloader;
``predict`` returns the predictions (per dataloader when there are several). Models come as
a ``Task`` or as plain pieces: ``trainer.fit(model, loss_fn, optimizer, train, val)``. Data
comes as DataLoaders, datasets, tensors or a ``DataModule``; the Trainer re-creates loaders
on its deterministic order (seeded from the state's key), so the run is a pure function of
the seed. Everything else — what happens at each step, each event, each decision — is done
by ``engine`` steps, ``loops.schedule`` decisions and ``loops.fit`` / ``loops.evaluate`` /
``loops.predict``, which users can call directly.

Where this differs from Lightning on purpose: ``fit`` returns the state (Lightning returns
None) and returns it after Ctrl-C too (Lightning exits with ``SystemExit(1)``); ``Task`` and
``DataModule`` ``setup`` run before the callbacks' ``setup`` (the callbacks' handlers need
the state, which needs the model the task's ``setup`` may build) and their ``teardown``
after the callbacks'; flags for features this engine does not have are not accepted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from purestep import engine, hardware
from purestep.engine import optim, rng
from purestep.engine.state import TrainState

from . import loop_state, schedule
from .callbacks import ModelCheckpoint, ModelSummary, ProgressBar, Timer
from .config import FLAG_NAMES, LoopConfig
from .data import Batches, as_list, combine, source
from .data.source import is_tensor_tuple
from .driver import Driver
from .driver import print_message as _say
from .evaluate import evaluate
from .events import Stage
from .fit import FitLoop
from .loggers import create_loggers
from .predict import predict as run_predict
from .resume import Checkpointing
from .task import DataModule, Task, default_predict, task_callback
from .trainer_args import add_argparse_args, defaults_from_env, from_argparse_args

__all__ = ["Trainer", "TrainerStatus"]


class TrainerStatus:
    """``trainer.status`` values."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


#: The modes ``multiple_trainloader_mode`` accepts (fit cannot run "sequential").
TRAIN_MODES = ("max_size_cycle", "min_size", "max_size")


def _entry_point(fn: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a Trainer method as a run: ``trainer.fn`` and status "running" while it runs,
    status "interrupted" if anything fails, whatever the loop reported otherwise."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: Trainer, *args: Any, **kwargs: Any) -> Any:
            self.fn = fn
            self.status = TrainerStatus.RUNNING
            try:
                return method(self, *args, **kwargs)
            except BaseException:
                self.status = TrainerStatus.INTERRUPTED
                raise

        return run

    return wrap


class Trainer:
    """Fit, validate, test and predict with Lightning's flags (see the module docstring).

    Loop flags (``max_epochs`` ... ``reload_dataloaders_every_n_epochs``) mean what they
    mean in Lightning (``loops.config.LoopConfig`` checks them). ``accumulate_grad_batches``
    may also be a dict ``{epoch: factor}`` (Lightning's GradientAccumulationScheduler).
    ``precision``, ``accelerator``, ``devices`` and ``strategy`` choose the hardware
    strategy (``hardware.from_flags``). Every flag not passed explicitly may come from a
    ``PURESTEP_TRAINER_<FLAG>`` environment variable.

    ``donate_state`` (default True): fit's optimizer updates write the parameters and
    optimizer state in place, as a hand-written PyTorch loop does — one copy of them instead
    of two during a step, and faster; results are bitwise the same and a state passed to
    ``fit(state=...)`` is copied first, never written (see ``loops.fit.FitLoop``). With it, a state
    shown to a callback is overwritten by the next step (copy what you keep) and
    ``on_exception`` sees the latest state rather than the last commit point; False keeps
    every state immutable.
    """

    @defaults_from_env
    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: Any = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        fast_dev_run: int | bool = False,
        accumulate_grad_batches: int | dict[int, int] = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        reload_dataloaders_every_n_epochs: int = 0,
        enable_progress_bar: bool | None = None,
        enable_model_summary: bool | None = None,
        enable_checkpointing: bool | None = None,
        default_root_dir: str | os.PathLike[str] | None = None,
        logger: Any = None,
        callbacks: Any = None,
        precision: str | int | None = None,
        accelerator: str = "auto",
        devices: Any = "auto",
        strategy: Any = "auto",
        deterministic: bool | str | None = None,
        detect_anomaly: bool = False,
        multiple_trainloader_mode: str = "max_size_cycle",
        async_checkpoint: bool = False,
        preemption_signals: Sequence[int] | None = None,
        donate_state: bool = True,
    ) -> None:
        loop_flags = {
            "max_epochs": max_epochs,
            "min_epochs": min_epochs,
            "max_steps": max_steps,
            "min_steps": min_steps,
            "max_time": max_time,
            "limit_train_batches": limit_train_batches,
            "limit_val_batches": limit_val_batches,
            "limit_test_batches": limit_test_batches,
            "limit_predict_batches": limit_predict_batches,
            "overfit_batches": overfit_batches,
            "val_check_interval": val_check_interval,
            "check_val_every_n_epoch": check_val_every_n_epoch,
            "num_sanity_val_steps": 2 if num_sanity_val_steps is None else num_sanity_val_steps,
            "log_every_n_steps": 50 if log_every_n_steps is None else log_every_n_steps,
            "fast_dev_run": fast_dev_run,
            "accumulate_grad_batches": accumulate_grad_batches,
            "gradient_clip_val": gradient_clip_val,
            "gradient_clip_algorithm": gradient_clip_algorithm or "norm",
            "reload_dataloaders_every_n_epochs": reload_dataloaders_every_n_epochs,
        }
        missing = set(FLAG_NAMES) ^ set(loop_flags)
        if missing:  # a flag added to LoopConfig must be added here too
            raise RuntimeError(f"Trainer and LoopConfig flags disagree: {sorted(missing)}")
        self.config = LoopConfig.create(loop_flags)
        if multiple_trainloader_mode not in TRAIN_MODES:
            hint = (
                " (fit cannot run 'sequential')"
                if multiple_trainloader_mode == "sequential"
                else ""
            )
            raise ValueError(
                f"multiple_trainloader_mode must be one of {', '.join(map(repr, TRAIN_MODES))}, "
                f"got {multiple_trainloader_mode!r}{hint}"
            )
        if not (
            deterministic is None or isinstance(deterministic, bool) or deterministic == "warn"
        ):
            raise ValueError(
                f"deterministic must be True, False, None or 'warn', got {deterministic!r}"
            )
        if not isinstance(detect_anomaly, bool):
            raise TypeError(f"detect_anomaly must be a bool, got {detect_anomaly!r}")
        for name, value in (
            ("enable_progress_bar", enable_progress_bar),
            ("enable_model_summary", enable_model_summary),
            ("enable_checkpointing", enable_checkpointing),
        ):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {value!r}")
        self.strategy = hardware.from_flags(accelerator, devices, strategy, precision)
        self.enable_progress_bar = enable_progress_bar is not False
        self.enable_model_summary = enable_model_summary is not False
        self.enable_checkpointing = enable_checkpointing is not False
        self.default_root_dir = os.fspath(default_root_dir) if default_root_dir else os.getcwd()
        self.deterministic = deterministic
        self.detect_anomaly = detect_anomaly
        self.multiple_trainloader_mode = multiple_trainloader_mode
        self.callbacks = _as_callbacks(callbacks)
        given = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
        if given and not self.enable_checkpointing:
            raise ValueError(
                "Trainer(enable_checkpointing=False) but a ModelCheckpoint is in callbacks: "
                "remove it or enable checkpointing"
            )
        if self.enable_checkpointing and not given:
            self.callbacks.append(ModelCheckpoint())
        self.loggers = (
            []
            if self.config.fast_dev_run
            else create_loggers(True if logger is None else logger, self.default_root_dir)
        )
        if not isinstance(async_checkpoint, bool):
            raise TypeError(f"async_checkpoint must be a bool, got {async_checkpoint!r}")
        if not isinstance(donate_state, bool):
            raise TypeError(f"donate_state must be a bool, got {donate_state!r}")
        self.donate_state = donate_state
        self.checkpointing = Checkpointing(
            strategy=self.strategy,
            loggers=self.loggers,
            config=self.config,
            root_dir=self.default_root_dir,
            async_save=async_checkpoint,
            # an asynchronous write must not read tensors the next in-place update writes
            async_copy="always" if donate_state else "auto",
            **({} if preemption_signals is None else {"signals": tuple(preemption_signals)}),
        )
        self.status = TrainerStatus.INITIALIZING
        self.fn: str | None = None
        self.train_state: TrainState | None = None
        self.predictions: Any = None
        self._driver: Driver | None = None
        self._task: Task | None = None
        self._loop: FitLoop | None = None
        # Whether the last fit failed inside an in-place update (it left no whole state).
        self._torn = False
        # Effects a test (or an embedding application) may replace.
        self._clock: Callable[[], float] = time.monotonic
        self._printer: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ argparse

    @classmethod
    def add_argparse_args(cls, parser):
        """Add a ``--<flag>`` option for every Trainer flag to an ``argparse`` parser."""
        return add_argparse_args(cls.__init__, parser)

    @classmethod
    def from_argparse_args(cls, args, **overrides: Any) -> Trainer:
        """A Trainer from parsed command-line arguments (``overrides`` win)."""
        return from_argparse_args(cls, args, **overrides)

    # ------------------------------------------------------------------ state properties

    @property
    def stage(self) -> str | None:
        """What the running loop does ("train", "sanity_check", "validate", ...), else None."""
        return self._driver.stage if self._driver is not None else None

    @property
    def interrupted(self) -> bool:
        return self.status == TrainerStatus.INTERRUPTED

    @property
    def _latest(self) -> TrainState | None:
        if self._loop is not None and self._loop.state is not None:
            return self._loop.state
        return self.train_state

    @property
    def current_epoch(self) -> int:
        state = self._latest
        return state.progress.epoch if state is not None else 0

    @property
    def global_step(self) -> int:
        state = self._latest
        return state.progress.step if state is not None else 0

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest values callbacks see (Lightning's ``callback_metrics``)."""
        state = self._latest
        return dict(loop_state.get(state).callback_metrics) if state is not None else {}

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        if self._driver is None:
            return {}
        return {k: float(v) for k, v in self._driver.progress_bar_metrics.items()}

    @property
    def should_stop(self) -> bool:
        state = self._latest
        return loop_state.get(state).should_stop if state is not None else False

    @property
    def logger(self) -> Any:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        """The first logger's run folder, else ``default_root_dir``."""
        if self.loggers and self.loggers[0].log_dir is not None:
            return self.loggers[0].log_dir
        return self.default_root_dir

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_primary

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps the configured fit will take (needs a fit in progress or done)."""
        if self._loop is None or self._loop.num_train is None:
            raise RuntimeError("estimated_stepping_batches needs the training data: call fit()")
        return schedule.estimated_stepping_batches(self.config, self._loop.num_train)

    # ------------------------------------------------------------------ building blocks

    def _resolve_task(self, model: Any, loss_fn: Any, optimizer: Any) -> Task:
        if isinstance(model, Task):
            if loss_fn is not None or optimizer is not None:
                raise TypeError(
                    "a Task brings its own steps and optimizer; pass data by keyword "
                    "(train_dataloaders=..., val_dataloaders=...)"
                )
            return model
        if isinstance(model, nn.Module):
            if loss_fn is None or optimizer is None:
                raise TypeError(
                    "fit(model, loss_fn, optimizer, train, val): a plain nn.Module needs a "
                    "loss function and an engine.optim optimizer (or wrap them in a Task)"
                )
            return Task.wrap(model, loss_fn, optimizer)
        raise TypeError(f"expected a Task or an nn.Module, got {type(model).__name__}")

    def _optimizer(self, task: Task) -> Any:
        opt = task.configure_optimizers()
        if not (hasattr(opt, "init") and hasattr(opt, "update")):
            raise TypeError(
                "configure_optimizers() must return an engine.optim transform, got "
                f"{type(opt).__name__}"
            )
        clip = self.config.gradient_clip_val
        if clip:  # 0 and None mean no clipping, as in Lightning
            if self.config.gradient_clip_algorithm == "norm":
                opt = optim.chain(optim.clip_by_global_norm(clip), opt)
            else:
                opt = optim.chain(optim.clip_by_value(clip), opt)
        return opt

    def _callbacks(self, task: Task | None, fn: str, driver_messages: list[str]) -> list[Any]:
        """Lightning's callback order: the user's, then the ones flags add, checkpointing
        callbacks last; the task's handlers run after every callback (as a LightningModule's
        hooks do; the monitoring ones still run after it at epoch and validation end)."""
        cbs = list(self.callbacks)
        if self.config.max_time is not None:
            if any(isinstance(cb, Timer) for cb in cbs):
                driver_messages.append(
                    "Ignoring Trainer(max_time=...): the callbacks already contain a Timer."
                )
            else:
                cbs.append(Timer(duration=self.config.max_time, interval="step"))
        if (
            fn == "fit"
            and self.enable_model_summary
            and not any(isinstance(cb, ModelSummary) for cb in cbs)
        ):
            cbs.append(ModelSummary())
        checkpointing = [cb for cb in cbs if getattr(cb, "checkpointing", False)]
        cbs = [cb for cb in cbs if cb not in checkpointing] + checkpointing
        if task is not None:
            cbs.append(task_callback(task))
        return cbs

    def _observers(self) -> list[Any]:
        return [ProgressBar()] if self.enable_progress_bar else []

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first ``ModelCheckpoint`` among the callbacks (None without one)."""
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    @property
    def best_model_path(self) -> str:
        """The checkpoint callback's best path after fit ("" before any save)."""
        cb, state = self.checkpoint_callback, self._latest
        if cb is None or state is None:
            return ""
        return state.callbacks.get(cb.key, {}).get("best_model_path", "")

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        """Write the latest training state (or its weights) to ``path``, as callbacks do."""
        state = self._latest
        if state is None:
            raise RuntimeError("there is no training state to save yet: call fit() first")
        driver = self._driver or Driver(fn="fit", config=self.config, strategy=self.strategy)
        payload = (
            {"weights_only": True, "params": state.params, "buffers": state.buffers}
            if weights_only
            else state
        )
        self.checkpointing.save(payload, path, driver)
        self.checkpointing.wait()

    def _shared_log_dir(self) -> str:
        """The run folder rank 0 chose (every process names files after it)."""
        if self.strategy.world_size == 1:
            return self.log_dir
        chosen = self.log_dir if self.strategy.is_primary else None
        return self.strategy.broadcast_object(chosen, 0)

    def _driver_for(self, fn: str, task: Task | None, model: nn.Module | None) -> Driver:
        messages: list[str] = []
        driver = Driver(
            fn=fn,
            callbacks=self._callbacks(task, fn, messages),
            loggers=self.loggers,
            observers=self._observers(),
            config=self.config,
            strategy=self.strategy,
            log_dir=self._shared_log_dir(),
            checkpointer=self.checkpointing.save,
            remover=self.checkpointing.remove,
            linker=self.checkpointing.link,
            flush=self.checkpointing.wait,
            exists=_exists,
            clock=self._clock,
            extra={"model": model, "num_loggers": len(self.loggers)},
            **({"printer": self._printer} if self._printer is not None else {}),
        )
        for message in messages:
            driver.say(message)
        self._driver = driver
        return driver

    def _data_seed(self, state: TrainState) -> int:
        return rng.fold_in(state.rng, rng.Purpose.DATA)

    def _shard(self, seed: int) -> dict[str, int]:
        return {"seed": seed, "rank": self.strategy.rank, "world_size": self.strategy.world_size}

    def _train_data(self, data: Any, seed: int) -> Batches:
        if data is None:
            raise ValueError("fit needs training data: pass train_dataloaders or a datamodule")
        if isinstance(data, (dict, list)) or (
            isinstance(data, tuple) and not is_tensor_tuple(data)
        ):
            batches: Batches = combine(data, self.multiple_trainloader_mode, **self._shard(seed))
        else:
            batches = source(data, **self._shard(seed))
        if schedule.sequential_order(self.config):
            batches = batches.with_options(shuffle=False)
        return batches

    def _eval_data(self, data: Any, seed: int, *, sequential: bool = False) -> list[Batches]:
        if data is None:
            return []
        sources = as_list(data, **self._shard(seed))
        if sequential:
            sources = [s.with_options(shuffle=False) for s in sources]
        return sources

    @contextlib.contextmanager
    def _run_context(self) -> Iterator[None]:
        """``deterministic`` and ``detect_anomaly`` for the duration of a run, then restored."""
        previous_det = torch.are_deterministic_algorithms_enabled()
        previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
        previous_anomaly = torch.is_anomaly_enabled()
        previous_anomaly_nan = torch.is_anomaly_check_nan_enabled()
        try:
            if self.deterministic is not None:
                torch.use_deterministic_algorithms(
                    bool(self.deterministic), warn_only=self.deterministic == "warn"
                )
            if self.detect_anomaly:
                torch.autograd.set_detect_anomaly(True)
            yield
        finally:
            # restore only what was changed: the first use_deterministic_algorithms call of
            # a process imports a large part of torch (seconds)
            if self.deterministic is not None:
                torch.use_deterministic_algorithms(previous_det, warn_only=previous_warn)
            if self.detect_anomaly:
                torch.autograd.set_detect_anomaly(previous_anomaly, check_nan=previous_anomaly_nan)

    # ------------------------------------------------------------------ fit

    @_entry_point("fit")
    def fit(
        self,
        model: Task | nn.Module,
        loss_fn: Any = None,
        optimizer: Any = None,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        *,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
        state: TrainState | None = None,
        seed: int = 0,
    ) -> TrainState:
        """Train and return the final ``TrainState`` (the latest one after Ctrl-C).

        ``ckpt_path``: resume from a checkpoint — a path, or ``"last"`` (the newest
        checkpoint of this run that reads; starts fresh when there is none, so relaunching
        the same command after a preemption resumes it).

        ``fit(task, train_dataloaders=..., val_dataloaders=...)``, ``fit(task,
        datamodule=dm)`` or ``fit(model, loss_fn, optimizer, train, val)``. ``state``
        continues from an existing state (e.g. a restored checkpoint); otherwise the state
        is built from the model with ``seed``. Validation runs when the task defines
        ``validation_step`` and there is validation data.
        """
        task = self._resolve_task(model, loss_fn, optimizer)
        if datamodule is not None and not isinstance(datamodule, DataModule):
            raise TypeError(f"datamodule must be a DataModule, got {type(datamodule).__name__}")
        if datamodule is not None and (
            train_dataloaders is not None or val_dataloaders is not None
        ):
            raise TypeError("pass either dataloaders or a datamodule, not both")
        if train_dataloaders is None and (
            datamodule is None or not _overrides(datamodule, "train_dataloader")
        ):
            raise ValueError(
                "fit needs training data: pass train_dataloaders or a datamodule that defines "
                "train_dataloader()"
            )
        self._task = task
        self._loop = None
        if datamodule is not None:
            datamodule.prepare_data()
            datamodule.setup("fit")
        task.setup("fit")
        net = self.strategy.convert_model(task.get_model())
        opt = self._optimizer(task)
        owned = state is None  # built here: the loop may update it in place without a copy
        if state is None:
            state = engine.init(net, opt, seed=seed, strategy=self.strategy)
        elapsed = 0.0
        say = self._printer or _say
        url = self.checkpointing.resolve(ckpt_path, self.callbacks, None, fn="fit", say=say)
        if url is not None:
            state, meta = self.checkpointing.restore(url, state)
            elapsed = float(meta.get("elapsed", 0.0))
            say(f"Restored the training state from {url}")
        seed_key = self._data_seed(state)
        config = self.config

        def train_loader() -> Batches:
            data = train_dataloaders
            if datamodule is not None:
                data = datamodule.train_dataloader()
            return self._train_data(data, seed_key)

        def val_loaders() -> list[Batches]:
            data = val_dataloaders
            if datamodule is not None:
                data = datamodule.val_dataloader()
            return self._eval_data(data, seed_key, sequential=schedule.sequential_order(config))

        has_val_data = val_dataloaders is not None or (
            datamodule is not None and _overrides(datamodule, "val_dataloader")
        )
        validates = task.has("validation_step") and has_val_data
        step = engine.train_step(
            net,
            task.training_step,
            opt,
            strategy=self.strategy,
            accumulate=(
                config.accumulate_grad_batches
                if isinstance(config.accumulate_grad_batches, int)
                else lambda p: schedule.accumulation_factor(config, p.epoch)
            ),
            grad_norm=False,  # nothing in the loops reads it; callbacks see the gradients
        )
        evaluate_step = (
            engine.eval_step(net, task.validation_step, strategy=self.strategy)
            if validates
            else None
        )
        driver = self._driver_for("fit", task, net)
        driver.elapsed_offset = elapsed
        if url is not None:
            driver.extra["resumed_from"] = url
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
            donate=self.donate_state,
        )
        self._loop = loop
        try:
            with self._run_context(), self.checkpointing.preemption(driver, driver.callbacks):
                state = loop.run(state, owned=owned)
        finally:
            self.checkpointing.wait()
            self.status = driver.status
            self._torn = driver.torn
            if driver.torn:  # failed inside an in-place update: no whole state to offer
                self.train_state = None
            else:
                self.train_state = loop.state if loop.state is not None else state
        if self.status == TrainerStatus.FINISHED:
            task.teardown("fit")
            if datamodule is not None:
                datamodule.teardown("fit")
        return state

    # ------------------------------------------------------------------ evaluate / predict

    def _eval_target(
        self,
        model: Any,
        fn: Any,
        state: TrainState | None,
        method: str,
        ckpt_path: str | None = None,
    ) -> tuple[Task, TrainState]:
        if isinstance(model, TrainState):
            if state is not None:
                raise TypeError("pass the state once (positionally or as state=)")
            state, model = model, None
        if model is None:
            task = self._task
            if task is None:
                raise ValueError(
                    "no model: pass a Task or an nn.Module (with fn=...), or call fit() first"
                )
        elif isinstance(model, Task):
            task = model
        elif isinstance(model, nn.Module):
            if fn is None and self._task is not None and self._task.get_model() is model:
                task = self._task
            elif fn is None:
                raise TypeError("an nn.Module needs fn=(apply, batch) -> loss/metrics to evaluate")
            elif method == "predict_step":
                task = Task.wrap(model, fn, optim.identity(), predict_fn=fn)
            else:
                task = Task.wrap(model, fn, optim.identity())
        else:
            raise TypeError(
                f"expected a TrainState, a Task or an nn.Module, got {type(model).__name__}"
            )
        if state is None:
            if self.train_state is not None and task is self._task:
                state = self.train_state
            elif self._torn and task is self._task and ckpt_path is None:
                raise RuntimeError(
                    f"{method.removesuffix('_step')}: the last fit failed inside an in-place "
                    "optimizer update and left no whole state to use; pass ckpt_path= (e.g. "
                    "'last') or a state"
                )
            else:
                state = engine.init(task.get_model(), optim.identity(), strategy=self.strategy)
        return task, state

    def _from_checkpoint(self, ckpt_path: str | None, state: TrainState, fn: str) -> TrainState:
        """``state`` with the weights of ``ckpt_path`` ("best", "last" or a path), if given."""
        if ckpt_path is None:
            return state
        say = self._printer or _say
        url = self.checkpointing.resolve(ckpt_path, self.callbacks, self._latest, fn=fn, say=say)
        if url is None:
            raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no checkpoint found")
        return self.checkpointing.load_for_eval(url, state)

    def _data_for(
        self, name: str, dataloaders: Any, datamodule: DataModule | None, getter: str
    ) -> Any:
        if datamodule is not None and dataloaders is not None:
            raise TypeError("pass either dataloaders or a datamodule, not both")
        if datamodule is not None:
            datamodule.prepare_data()
            datamodule.setup(name)
            dataloaders = getattr(datamodule, getter)()
        return dataloaders

    def _evaluate(
        self,
        stage: str,
        model: Any,
        dataloaders: Any,
        datamodule: DataModule | None,
        state: TrainState | None,
        fn: Any,
        verbose: bool,
        ckpt_path: str | None = None,
    ) -> list[dict[str, float]]:
        name = "validate" if stage == Stage.VALIDATE else "test"
        method = "validation_step" if stage == Stage.VALIDATE else "test_step"
        task, state = self._eval_target(model, fn, state, method, ckpt_path)
        state = self._from_checkpoint(ckpt_path, state, name)
        if not task.has(method):
            raise NotImplementedError(f"{type(task).__name__} does not define {method}()")
        getter = "val_dataloader" if stage == Stage.VALIDATE else "test_dataloader"
        dataloaders = self._data_for(name, dataloaders, datamodule, getter)
        task.setup(name)
        net = self.strategy.convert_model(task.get_model())
        sources = self._eval_data(dataloaders, self._data_seed(state))
        if not sources:
            raise ValueError(f"{name} needs data: pass dataloaders or a datamodule")
        step = engine.eval_step(net, getattr(task, method), strategy=self.strategy)
        driver = self._driver_for(name, task, net)
        try:
            with self._run_context():
                _, results = evaluate(stage, state, step, sources, driver=driver)
        finally:
            self.status = driver.status
        if self.status != TrainerStatus.FINISHED:
            return []
        task.teardown(name)
        if datamodule is not None:
            datamodule.teardown(name)
        if verbose:
            driver.say(_results_table(name, results))
        return results

    @_entry_point("validate")
    def validate(
        self,
        model: Any = None,
        dataloaders: Any = None,
        *,
        datamodule: DataModule | None = None,
        state: TrainState | None = None,
        fn: Any = None,
        verbose: bool = True,
        ckpt_path: str | None = None,
    ) -> list[dict[str, float]]:
        """Evaluate on validation data; one dict of epoch-level metrics per dataloader.

        ``model`` is a ``TrainState`` (evaluated with the last fitted task), a ``Task``, or
        an ``nn.Module`` with ``fn``; ``state`` defaults to the last fitted state.
        ``ckpt_path``: evaluate the weights of a checkpoint ("best", "last" or a path).
        """
        return self._evaluate(
            Stage.VALIDATE, model, dataloaders, datamodule, state, fn, verbose, ckpt_path
        )

    @_entry_point("test")
    def test(
        self,
        model: Any = None,
        dataloaders: Any = None,
        *,
        datamodule: DataModule | None = None,
        state: TrainState | None = None,
        fn: Any = None,
        verbose: bool = True,
        ckpt_path: str | None = None,
    ) -> list[dict[str, float]]:
        """Evaluate on test data; one dict of epoch-level metrics per dataloader."""
        return self._evaluate(
            Stage.TEST, model, dataloaders, datamodule, state, fn, verbose, ckpt_path
        )

    @_entry_point("predict")
    def predict(
        self,
        model: Any = None,
        dataloaders: Any = None,
        *,
        datamodule: DataModule | None = None,
        state: TrainState | None = None,
        fn: Any = None,
        return_predictions: bool = True,
        ckpt_path: str | None = None,
    ) -> Any:
        """Predictions: a list of per-batch outputs, or one such list per dataloader.

        ``model`` as for ``validate``; an ``nn.Module`` without ``fn`` predicts
        ``module(inputs)`` (the first element of tuple batches). ``None`` when
        ``return_predictions=False`` or after Ctrl-C.
        """
        if isinstance(model, nn.Module) and fn is None:
            is_fitted = self._task is not None and self._task.get_model() is model
            if not is_fitted:
                fn = default_predict
        task, state = self._eval_target(model, fn, state, "predict_step", ckpt_path)
        state = self._from_checkpoint(ckpt_path, state, "predict")
        dataloaders = self._data_for("predict", dataloaders, datamodule, "predict_dataloader")
        task.setup("predict")
        net = self.strategy.convert_model(task.get_model())
        sources = self._eval_data(dataloaders, self._data_seed(state))
        if not sources:
            raise ValueError("predict needs data: pass dataloaders or a datamodule")
        step = engine.predict_step(net, task.predict_step, strategy=self.strategy)
        driver = self._driver_for("predict", task, net)
        try:
            with self._run_context():
                _, outputs = run_predict(
                    state, step, sources, driver=driver, keep=return_predictions
                )
        finally:
            self.status = driver.status
        if self.status != TrainerStatus.FINISHED:
            return None
        task.teardown("predict")
        if datamodule is not None:
            datamodule.teardown("predict")
        if not return_predictions:
            return None
        self.predictions = outputs[0] if len(outputs) == 1 else outputs
        return self.predictions


def _overrides(obj: Any, method: str) -> bool:
    return getattr(type(obj), method, None) is not getattr(DataModule, method)


def _exists(url: str) -> bool:
    """Whether a file exists on any fsspec filesystem (for checkpoint version suffixes)."""
    from purestep.engine.checkpoint import storage

    return storage.exists(url)


def _as_callbacks(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        callbacks = [callbacks]
    for cb in callbacks:
        if not (hasattr(cb, "key") and callable(getattr(cb, "init", None))):
            raise TypeError(
                f"{type(cb).__name__} is not a callback (subclass loops.callbacks.Callback)"
            )
    return list(callbacks)


def _results_table(name: str, results: Sequence[dict[str, float]]) -> str:
    rows = [(k, v) for r in results for k, v in r.items()]
    if not rows:
        return f"{name}: no metrics"
    width = max(len(f"{name} metric"), *(len(k) for k, _ in rows))
    lines = [f"{name} metric".ljust(width + 2) + "value", "-" * (width + 14)]
    lines += [f"{k.ljust(width + 2)}{v:.6g}" for k, v in rows]
    return "\n".join(lines)
