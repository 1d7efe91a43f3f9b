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

This module holds the class, its flags and properties; the runs' work is in
``trainer_fit`` (fit), ``trainer_eval`` (validate / test / predict), ``trainer_data`` (data
assembly), ``trainer_run`` (status, callbacks, driver and torch settings every run shares)
and ``trainer_properties`` (the read-only attributes the Trainer inherits).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from purestep.engine.compile import compile_options
from purestep.engine.state import TrainState

from .callbacks import ModelCheckpoint, ProgressBar, ProgressBarBase
from .config import FLAG_NAMES, LoopConfig
from .driver import Driver
from .events import Stage
from .profiling import Monitor, Profiler, resolve
from .task import DataModule, Task
from .trainer_args import add_argparse_args, defaults_from_env, from_argparse_args
from .trainer_properties import TrainerProperties
from .trainer_run import TrainerStatus, entry_point

# What runs need (the hardware strategies, the loggers, the loops, checkpoint I/O, the
# tuner) is imported when a Trainer is built or run: the command line reads this class's
# signature for ``--help`` without paying for them (and no ``TYPE_CHECKING`` imports
# here: jsonargparse runs them to resolve the signature's annotations).

__all__ = ["Trainer", "TrainerStatus"]


class Trainer(TrainerProperties):
    """Fit, validate, test and predict with Lightning's flags (see the module docstring).

    Loop flags (``max_epochs`` ... ``reload_dataloaders_every_n_epochs``) mean what they
    mean in Lightning (``loops.config.LoopConfig`` checks them). ``accumulate_grad_batches``
    may also be a dict ``{epoch: factor}`` (Lightning's GradientAccumulationScheduler).
    ``precision``, ``accelerator``, ``devices`` and ``strategy`` choose the hardware
    strategy (``hardware.from_flags``). Every flag not passed explicitly may come from a
    ``PURESTEP_TRAINER_<FLAG>`` environment variable (``loops.trainer_args``). A Lightning
    flag spelt otherwise here is refused naming its replacement (``LIGHTNING_FLAGS``).

    ``donate_state`` (default True): fit's optimizer updates write the parameters and
    optimizer state in place, as a hand-written PyTorch loop does — one copy of them instead
    of two during a step, and faster; results are bitwise the same and a state passed to
    ``fit(state=...)`` is copied first, never written (see ``loops.fit.FitLoop``). With it, a state
    shown to a callback is overwritten by the next step (copy what you keep) and
    ``on_exception`` sees the latest state rather than the last commit point; False keeps
    every state immutable.

    ``compile`` (default False): True, an ``engine.compile.CompileOptions`` or a dict of its
    fields compiles fit's train and validation steps whole (``engine.compile``: forward,
    backward and optimizer update as one graph; compile time is paid on the first batches).

    ``track_grad_norm`` (Lightning's; -1: off): log the p-norm of each parameter's gradient
    (``grad_<p>_norm/<name>``) and of all of them (``grad_<p>_norm_total``) at each logged
    step, from the gradients the optimizer uses. ``terminate_on_nan``: stop with
    ``NonFiniteLossError`` at the first non-finite loss or gradient, before that update.

    ``prepare_data_per_node`` (default True): the DataModule's ``prepare_data`` (and the
    task's, if it has one) runs on local rank 0 of every node; False: on global rank 0 only.
    A ``prepare_data_per_node`` attribute of the DataModule or the task wins over the flag.
    The other ranks wait for it before any ``setup`` (``trainer_data.prepare_data``).

    ``callbacks`` may hold one progress bar (a ``ProgressBarBase``: ``ProgressBar(
    refresh_rate=N)``, ``RichProgressBar()``), used instead of the default bar; it is an
    observer, kept as ``progress_bar_callback`` rather than in ``callbacks``. Passing one
    with ``enable_progress_bar=False``, or two, is an error. Monitors
    (``ThroughputMonitor``, ``DeviceStatsMonitor``: ``loops.profiling.Monitor``) are
    observers too, kept in ``monitors``.

    ``profiler``: ``"simple"``, ``"advanced"``, ``"pytorch"`` or a ``loops.profiling.
    Profiler`` (``trainer.profiler``; a ``PassThroughProfiler`` without one) times the loops'
    actions and reports at the end of each run. ``inference_mode`` (default True): evaluation
    and prediction steps run under ``torch.inference_mode()``, else ``torch.no_grad()``.
    ``benchmark``: ``torch.backends.cudnn.benchmark`` for the runs (None: as it is, off under
    ``deterministic=True`` or ``"warn"``), restored after each.

    Read-only properties, with Lightning's meanings: ``status``, ``stage``, ``interrupted``,
    ``current_epoch``, ``global_step``, ``callback_metrics``, ``logged_metrics`` (latest
    value of each metric sent to the loggers), ``progress_bar_metrics``, ``should_stop``,
    ``log_dir``, ``best_model_path``, ``estimated_stepping_batches``; ``checkpoint_callback``
    / ``checkpoint_callbacks``, ``early_stopping_callback`` / ``early_stopping_callbacks``,
    ``progress_bar_callback``; ``num_training_batches`` (per epoch, ``inf`` before fit),
    ``num_val_batches`` / ``num_test_batches`` / ``num_predict_batches`` (one count per
    dataloader, after the ``limit_*`` flags), ``num_sanity_val_steps`` (as computed) and
    ``num_sanity_val_batches``; ``world_size``, ``global_rank``, ``local_rank``,
    ``node_rank``, ``is_global_zero``.
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
        prepare_data_per_node: bool = True,
        async_checkpoint: bool = False,
        preemption_signals: Sequence[int] | None = None,
        donate_state: bool = True,
        profiler: str | Profiler | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        track_grad_norm: int | float | str = -1,
        terminate_on_nan: bool = False,
        compile: bool | dict | None = False,
        auto_lr_find: bool | str = False,
        auto_scale_batch_size: bool | str = False,
    ) -> None:
        from purestep import hardware

        from .fit import grad_norm_type
        from .loggers import create_loggers
        from .resume import Checkpointing
        from .trainer_data import TRAIN_MODES
        from .tuning.flags import check_auto_flags

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
        if not isinstance(prepare_data_per_node, bool):
            raise TypeError(f"prepare_data_per_node must be a bool, got {prepare_data_per_node!r}")
        if benchmark is not None and not isinstance(benchmark, bool):
            raise TypeError(f"benchmark must be a bool or None, got {benchmark!r}")
        if benchmark and deterministic:
            warnings.warn(
                f"Trainer(deterministic={deterministic!r}, benchmark=True): cuDNN's autotuner "
                "picks algorithms by timing, so convolutions may not be deterministic; pass "
                "benchmark=None (deterministic then turns it off) or False",
                UserWarning,
                stacklevel=3,
            )
        if not isinstance(inference_mode, bool):
            raise TypeError(f"inference_mode must be a bool, got {inference_mode!r}")
        # Lightning: the run's profiler (``trainer.profiler``; a PassThroughProfiler without one)
        self.profiler = resolve(profiler)
        self.benchmark = benchmark
        self.inference_mode = inference_mode
        self.strategy = hardware.from_flags(accelerator, devices, strategy, precision)
        self.enable_progress_bar = enable_progress_bar is not False
        self.enable_model_summary = enable_model_summary is not False
        self.enable_checkpointing = enable_checkpointing is not False
        self.default_root_dir = os.fspath(default_root_dir) if default_root_dir else os.getcwd()
        self.deterministic = deterministic
        self.detect_anomaly = detect_anomaly
        self.multiple_trainloader_mode = multiple_trainloader_mode
        self.prepare_data_per_node = prepare_data_per_node
        given_callbacks = _as_list(callbacks)
        bars = [cb for cb in given_callbacks if isinstance(cb, ProgressBarBase)]
        if len(bars) > 1:
            raise ValueError(
                f"callbacks hold {len(bars)} progress bars "
                f"({', '.join(type(b).__name__ for b in bars)}); pass one"
            )
        if bars and enable_progress_bar is False:
            raise ValueError(
                f"Trainer(enable_progress_bar=False) but a {type(bars[0]).__name__} is in "
                "callbacks: remove it or enable the progress bar"
            )
        # The bar in use (the one given, or the default one): an observer the runs draw
        # with, not one of the pure callbacks in ``self.callbacks``.
        self._progress_bar: ProgressBarBase | None = (
            bars[0] if bars else ProgressBar() if self.enable_progress_bar else None
        )
        # Monitors (throughput, device stats) observe and log, like the bar: not callbacks.
        self.monitors: list[Monitor] = [cb for cb in given_callbacks if isinstance(cb, Monitor)]
        self.callbacks = _as_callbacks(
            [cb for cb in given_callbacks if not isinstance(cb, (ProgressBarBase, Monitor))]
        )
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
        # The default logger (``logger`` not given) is left out of an evaluation of a
        # checkpoint while it has no run folder yet (trainer_run.run_logs): set per run.
        self._default_logger = logger is None
        self._skips_loggers = False
        self._run_ckpt_path: str | None = None  # the ckpt_path of the current (or last) run
        if not isinstance(async_checkpoint, bool):
            raise TypeError(f"async_checkpoint must be a bool, got {async_checkpoint!r}")
        if not isinstance(donate_state, bool):
            raise TypeError(f"donate_state must be a bool, got {donate_state!r}")
        self.donate_state = donate_state
        # what tune() runs (Lightning 1.5's flags; loops.tuning)
        self.auto_lr_find, self.auto_scale_batch_size = check_auto_flags(
            auto_lr_find, auto_scale_batch_size
        )
        self.track_grad_norm = grad_norm_type(track_grad_norm)
        if not isinstance(terminate_on_nan, bool):
            raise TypeError(f"terminate_on_nan must be a bool, got {terminate_on_nan!r}")
        self.terminate_on_nan = terminate_on_nan
        # fit's train and validation steps compiled whole (engine.compile); None: eager
        self.compile = compile_options(compile)
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
        self._loop: Any = None  # the loops.fit.FitLoop of the current (or last) fit
        # Batches per dataloader of the latest evaluations, by kind (trainer_run.BatchCounts).
        self._num_batches: dict[str, list[int | float]] = {}
        # Whether the last fit failed inside an in-place update (it left no whole state).
        self._torn = False
        # Effects a test (or an embedding application) may replace.
        self._clock: Callable[[], float] = time.monotonic
        self._printer: Callable[[str], None] | None = None
        # Observers every run's driver gets besides the bar and the monitors (the command
        # line's config writer: loops.command_line).
        self._observers: list[Any] = []

    # ------------------------------------------------------------------ argparse

    @classmethod
    def add_argparse_args(cls, parser):
        """Add a ``--<flag>`` option for every Trainer flag to an ``argparse`` parser."""
        return add_argparse_args(cls.__init__, parser)

    @classmethod
    def from_argparse_args(cls, args, **overrides: Any) -> Trainer:
        """A Trainer from parsed command-line arguments (``overrides`` win)."""
        return from_argparse_args(cls, args, **overrides)

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

    # ------------------------------------------------------------------ fit

    @entry_point("fit")
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
        seed: int | None = None,
    ) -> TrainState:
        """Train and return the final ``TrainState`` (the latest one after Ctrl-C).

        ``ckpt_path``: resume from a checkpoint — a path, or ``"last"`` (the newest
        checkpoint of this run that reads; starts fresh when there is none, so relaunching
        the same command after a preemption resumes it).

        ``fit(task, train_dataloaders, val_dataloaders)`` (positional or by keyword, as in
        Lightning: with a Task the arguments after it are its data), ``fit(task, dm)`` or
        ``fit(task, datamodule=dm)``, ``fit(task)`` with the task's own
        ``train_dataloader()`` / ``val_dataloader()``, or ``fit(model, loss_fn, optimizer,
        train, val)`` for a plain ``nn.Module`` (``loss_fn`` and ``optimizer`` only go with
        one; a DataModule in place of the train dataloaders is the datamodule). ``state``
        continues from an existing state (e.g. a restored checkpoint); otherwise the state
        is built from the model with ``seed``: the run key behind every draw of the run
        (dropout, data order, workers, augmentations) and the key a model that
        ``configure_model`` builds here is initialised under. ``seed=None`` (the default)
        takes the seed ``seed_everything`` recorded, else 0. Validation runs when the task defines
        ``validation_step`` and there is validation data.
        """
        from . import trainer_fit

        self._run_ckpt_path = ckpt_path
        return trainer_fit.fit(
            self,
            model,
            loss_fn,
            optimizer,
            train_dataloaders,
            val_dataloaders,
            datamodule=datamodule,
            ckpt_path=ckpt_path,
            state=state,
            seed=seed,
        )

    # ------------------------------------------------------------------ evaluate / predict

    @entry_point("validate")
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
        ``dataloaders`` may be a ``DataModule`` (``validate(task, dm)``, as in Lightning;
        the same for ``test`` and ``predict``).
        ``ckpt_path``: evaluate the weights of a checkpoint ("best", "last" or a path).
        """
        from . import trainer_eval

        self._run_ckpt_path = ckpt_path
        return trainer_eval.evaluate(
            self, Stage.VALIDATE, model, dataloaders, datamodule, state, fn, verbose, ckpt_path
        )

    @entry_point("test")
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
        from . import trainer_eval

        self._run_ckpt_path = ckpt_path
        return trainer_eval.evaluate(
            self, Stage.TEST, model, dataloaders, datamodule, state, fn, verbose, ckpt_path
        )

    @entry_point("predict")
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
        from . import trainer_eval

        self._run_ckpt_path = ckpt_path
        return trainer_eval.predict(
            self, model, dataloaders, datamodule, state, fn, return_predictions, ckpt_path
        )

    # ------------------------------------------------------------------ tune

    def tune(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        *,
        datamodule: DataModule | None = None,
        state: TrainState | None = None,
        seed: int | None = None,
        scale_batch_size_kwargs: dict[str, Any] | None = None,
        lr_find_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """What ``auto_scale_batch_size`` and ``auto_lr_find`` ask for, in that order
        (Lightning 1.5's ``tune``): ``{"scale_batch_size": size, "lr_find": LRFinder}``,
        only the entries the flags ask for. Both search on a private trainer and leave this
        one and ``state`` as they were (``loops.tuning.Tuner``)."""
        from .tuning import tune

        return tune(
            self,
            model,
            train_dataloaders,
            val_dataloaders,
            datamodule=datamodule,
            state=state,
            seed=seed,
            scale_batch_size_kwargs=scale_batch_size_kwargs,
            lr_find_kwargs=lr_find_kwargs,
        )


def _as_list(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        return [callbacks]
    return list(callbacks)


def _as_callbacks(callbacks: list[Any]) -> list[Any]:
    for cb in callbacks:
        if not (hasattr(cb, "key") and callable(getattr(cb, "init", None))):
            raise TypeError(
                f"{type(cb).__name__} is not a callback (subclass loops.callbacks.Callback; "
                "a progress bar subclasses loops.callbacks.ProgressBarBase)"
            )
    return list(callbacks)
