"""What every Trainer run shares: its status, its callbacks in Lightning's order, its driver
(the one place effects happen) and the torch settings it runs under.

Functions of the ``Trainer`` they serve (``loops.trainer``), kept apart so that ``fit`` and
the evaluation entry points (``trainer_fit``, ``trainer_eval``) build their runs the same way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from purestep.engine import user_errors

from .callbacks import Callback, LambdaCallback, ModelCheckpoint, ModelSummary, Timer
from .driver import Driver
from .driver import print_message as _say
from .events import EVENTS, Stage, handles
from .task import Task, task_callback

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = [
    "TrainerStatus",
    "bind_views",
    "check_hooks",
    "driver_for",
    "entry_point",
    "local_log_dir",
    "printer",
    "run_logs",
    "run_context",
    "strategy_scope",
]


class TrainerStatus:
    """``trainer.status`` values."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


def entry_point(fn: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a Trainer method as a run: ``trainer.fn`` and status "running" while it runs,
    status "interrupted" if anything fails, whatever the loop reported otherwise; the whole
    run inside the strategy's ``run_scope`` (``strategy_scope``)."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: Trainer, *args: Any, **kwargs: Any) -> Any:
            self.fn = fn
            self.status = TrainerStatus.RUNNING
            self._skips_loggers = False  # decided anew for this run (run_logs)
            try:
                with strategy_scope(self.strategy):
                    return method(self, *args, **kwargs)
            except BaseException:
                self.status = TrainerStatus.INTERRUPTED
                raise

        return run

    return wrap


def strategy_scope(strategy: Any) -> contextlib.AbstractContextManager[Any]:
    """What a strategy sets up for one run and tears down after it, success or failure
    (``hardware.DDP.run_scope``: under ``Trainer(strategy="ddp")`` the process group is
    formed for each run and destroyed at its end); nothing for other strategies."""
    scope = getattr(strategy, "run_scope", None)
    return scope() if scope is not None else contextlib.nullcontext()


def printer(trainer: Trainer) -> Callable[[str], None]:
    """Where the run's messages go (a test or an embedding application may replace it)."""
    return trainer._printer or _say


def run_callbacks(
    trainer: Trainer, task: Task | None, fn: str, driver_messages: list[str]
) -> list[Any]:
    """Lightning's callback order: the user's, then the ones flags add, checkpointing
    callbacks last; the task's handlers run after every callback (as a LightningModule's
    hooks do; the monitoring ones still run after it at epoch and validation end)."""
    cbs = list(trainer.callbacks)
    configured = task.configured_callbacks() if hasattr(task, "configured_callbacks") else []
    if configured:  # Lightning's configure_callbacks: they replace the trainer's of their type
        kinds = {type(cb) for cb in configured}
        cbs = [cb for cb in cbs if type(cb) not in kinds] + configured
    if trainer.config.max_time is not None:
        if any(isinstance(cb, Timer) for cb in cbs):
            driver_messages.append(
                "Ignoring Trainer(max_time=...): the callbacks already contain a Timer."
            )
        else:
            cbs.append(Timer(duration=trainer.config.max_time, interval="step"))
    if (
        fn == "fit"
        and trainer.enable_model_summary
        and not any(isinstance(cb, ModelSummary) for cb in cbs)
    ):
        cbs.append(ModelSummary())
    checkpointing = [cb for cb in cbs if getattr(cb, "checkpointing", False)]
    cbs = [cb for cb in cbs if cb not in checkpointing] + checkpointing
    if task is not None:
        cbs.append(task_callback(task))
    return cbs


# ---------------------------------------------------------------------- hook signatures

_HANDLER = "its own state and a read-only loops.events.Context; it returns (state, Requests)"
#: Callback methods the loops call, beside the events: name -> (arguments, what they are).
_CALLBACK_HOOKS = {
    **{event: (("state", "ctx"), _HANDLER) for event in EVENTS},
    "init": ((), "no arguments; it returns the callback's initial state"),
    "on_save_checkpoint": (
        ("state", "ctx"),
        "its own state and a Context; it returns plain data for the file (or None)",
    ),
    "on_load_checkpoint": (
        ("state", "data", "ctx"),
        "its own state, what on_save_checkpoint returned and a Context; it returns the "
        "callback's new state",
    ),
}
_TASK_HANDLER = (
    "the task's own state (from init_state(), else {}) and a read-only loops.events.Context; "
    "it returns (state, Requests) (a pure function, where a LightningModule's hook changes "
    "the module)"
)
#: Task methods the loops call later in a run: name -> (arguments, what they are).
_TASK_HOOKS = {
    **{e: (("state", "ctx"), _TASK_HANDLER) for e in EVENTS if e not in ("setup", "teardown")},
    "setup": (("stage",), 'the stage ("fit", "validate", "test" or "predict")'),
    "teardown": (("stage",), 'the stage ("fit", "validate", "test" or "predict")'),
    "init_state": ((), "no arguments; it returns the state its hooks start from"),
    "on_save_checkpoint": ((), "no arguments; it returns plain data for the file (or None)"),
    "on_load_checkpoint": (("data",), "what on_save_checkpoint returned"),
}


def _expected(name: str, args: tuple[str, ...]) -> str:
    return f"{name}({', '.join(('self', *args))})"


def check_hooks(task: Task | None, callbacks: list[Any]) -> None:
    """Refuse, when a run starts, a Task hook or a callback handler that cannot take the
    arguments the loops will pass it (``user_errors.check_call``): the error names the
    class, the hook, the signature found and the one expected, where the call itself would
    fail only when the event comes (after an epoch, say)."""
    if task is not None:
        for name, (args, explain) in _TASK_HOOKS.items():
            hook = getattr(task, name, None)
            if callable(hook):
                label = f"{type(task).__qualname__}.{name}"
                user_errors.check_call(hook, args, label, _expected(name, args), explain)
    for cb in callbacks:
        _check_callback(cb)


def _check_callback(cb: Any) -> None:
    """One callback's handlers (those it overrides) and, for a ``LambdaCallback``, its
    functions (``fn(ctx)``)."""
    cls = type(cb).__qualname__
    if isinstance(cb, LambdaCallback):
        for event, fn in cb.handlers.items():
            label = f"LambdaCallback({event}={user_errors.describe_function(fn)})"
            explain = "the read-only loops.events.Context; it returns Requests or None"
            user_errors.check_call(fn, ("ctx",), label, f"{event}(ctx)", explain)
        return
    for name, (args, explain) in _CALLBACK_HOOKS.items():
        if name in EVENTS:
            overridden = handles(cb, name)
        else:
            overridden = getattr(type(cb), name, None) is not getattr(Callback, name, None)
        hook = getattr(cb, name, None) if overridden else None
        if callable(hook):
            user_errors.check_call(hook, args, f"{cls}.{name}", _expected(name, args), explain)


def local_log_dir(trainer: Trainer) -> str:
    """This process's own run folder: its first logger's, else ``default_root_dir`` (under
    DDP only rank 0's is where files go; see ``shared_log_dir``)."""
    if trainer.loggers and trainer.loggers[0].log_dir is not None:
        return trainer.loggers[0].log_dir
    return trainer.default_root_dir


#: The entry points that only evaluate (they need no run folder of their own).
EVALUATIONS = ("validate", "test", "predict")


def run_logs(trainer: Trainer, fn: str) -> bool:
    """Whether a run of ``fn`` sends its values to the trainer's loggers: always, except
    an evaluation of a checkpoint (validate, test or predict with ``ckpt_path``) on a
    Trainer whose default logger (``logger`` not given; not ``logger=True``, not a given
    logger) has no run folder yet. Such a run creates no version folder and logs nothing,
    as with ``logger=False`` (its results are returned, printed and kept in
    ``logged_metrics``): a script evaluating a live run's checkpoints every few seconds
    with a fresh Trainer each time would otherwise leave a folder per call. Unless the run
    writes into the run folder anyway (a ``PredictionWriter`` without ``output_dir``, a
    profiler without ``dirpath``, the CLI's ``config.yaml``: ``uses_run_folder``): then it
    gets its own version folder and logs there, as before. Without ``ckpt_path`` a fresh
    Trainer's evaluation logs as Lightning's does (a version folder)."""
    if fn not in EVALUATIONS or trainer._run_ckpt_path is None or not trainer._default_logger:
        return True
    first = trainer._loggers[0] if trainer._loggers else None
    if first is None or getattr(first, "picked", True):
        return True  # no logger, or its folder is settled: log into that one folder
    return any(_uses_run_folder(writer, fn) for writer in _run_folder_writers(trainer))


def _run_folder_writers(trainer: Trainer) -> list[Any]:
    """What may write into a run's folder by default: the callbacks, monitors, observers
    (the CLI's config writer) and the profiler."""
    return [
        *trainer.callbacks,
        *trainer.monitors,
        *getattr(trainer, "_observers", ()),
        trainer.profiler,
    ]


def _uses_run_folder(writer: Any, fn: str) -> bool:
    """``writer.uses_run_folder(fn)`` where it has one (else it writes none by default)."""
    uses = getattr(writer, "uses_run_folder", None)
    return bool(uses(fn)) if callable(uses) else False


def _not_logged(fn: str, ckpt_path: Any) -> str:
    """The line a run that leaves the default logger out prints."""
    return (
        f"{fn}(ckpt_path={ckpt_path!r}) is not logged: the Trainer's default logger has no "
        "run folder yet, so no version folder is created for this evaluation; pass "
        "logger=True to log it"
    )


def _claim_folders(trainer: Trainer) -> list[int | str | None]:
    """Claim the run folders of the trainer's file loggers (``FolderLogger.claim``: a
    version only read is created exclusively now) and return their versions (None for
    loggers without folders). The main process only; the others take these versions."""
    from .loggers.base import FolderLogger

    versions: list[int | str | None] = []
    for logger in trainer._loggers:
        if isinstance(logger, FolderLogger):
            logger.claim()
            versions.append(logger.version)
        else:
            versions.append(None)
    return versions


def _take_folders(trainer: Trainer, versions: list[int | str | None]) -> None:
    """Make this (non-main) process's file loggers name the versions the main process
    claimed, so ``trainer.logger.version`` / ``log_dir`` agree on every rank."""
    from .loggers.base import FolderLogger

    for logger, version in zip(trainer._loggers, versions):
        if isinstance(logger, FolderLogger) and version is not None:
            logger.take_version(version)


def _trusted_root(trainer: Trainer, log_dir: str, logs: bool) -> str:
    """The folder at or above ``log_dir`` whose own path is the user's choice: the first
    logger's ``root_dir`` (``save_dir/name``) when the run logs into its folder, else
    ``log_dir`` itself. Writers into the run folder refuse links below it."""
    first = trainer._loggers[0] if logs and trainer._loggers else None
    root = getattr(first, "root_dir", None)
    if isinstance(root, str) and root:
        stem = root.rstrip("/\\")
        if log_dir == root or any(log_dir.startswith(stem + sep) for sep in {"/", os.sep}):
            return root
    return log_dir


def shared_log_dir(trainer: Trainer, fn: str | None = None) -> tuple[str, bool]:
    """``(the run folder rank 0 chose, whether the run of fn logs: run_logs)`` (every
    process names files after the folder; a collective under DDP, so all ranks agree on
    both). A run that logs claims its loggers' run folders on the main process
    (``FolderLogger.claim``, the strategy's primary process, whatever ``RANK`` says), and
    the other processes' loggers take rank 0's versions. The driver keeps the folder
    (``Driver.log_dir``): ``Trainer.log_dir`` and every checkpoint path built from the
    callbacks' bookkeeping take it from there. A run that does not log names its files
    after ``default_root_dir``."""
    strategy = trainer.strategy

    def choose() -> tuple[str, bool, list[int | str | None]]:
        logs = fn is None or run_logs(trainer, fn)
        if not logs:
            return trainer.default_root_dir, False, []
        versions = _claim_folders(trainer)
        first = trainer._loggers[0] if trainer._loggers else None
        log_dir = getattr(first, "log_dir", None)
        return (log_dir if log_dir is not None else trainer.default_root_dir), True, versions

    if strategy.world_size == 1:
        log_dir, logs, _ = choose()
        return log_dir, logs
    chosen = strategy.broadcast_object(choose() if strategy.is_primary else None, 0)
    log_dir, logs, versions = chosen
    if not strategy.is_primary:
        _take_folders(trainer, versions)
    return log_dir, logs


class TrainerDriver(Driver):
    """The Trainer's driver: a ``Driver`` that also keeps the latest value of every metric
    it sent to the loggers (``Trainer.logged_metrics``; on every rank, loggers or not)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logged_metrics: dict[str, torch.Tensor] = {}

    def log_metrics(self, metrics: Any, step: int) -> None:
        for name, value in metrics.items():
            if name != "epoch":  # added to each row for the loggers, as in Lightning
                self.logged_metrics[name] = (
                    value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
                )
        super().log_metrics(metrics, step)


class BatchCounts:
    """An observer that writes down how many batches each evaluation runs per dataloader
    (``Trainer.num_val_batches`` / ``num_test_batches`` / ``num_predict_batches`` and the
    sanity check's), from the ``num_batches`` of its start event."""

    events = frozenset({"on_validation_start", "on_test_start", "on_predict_start"})

    def __init__(self, counts: dict[str, list[Any]]) -> None:
        self.counts = counts

    def on_event(self, event: str, ctx: Any) -> None:
        key = Stage.SANITY_CHECK if ctx.stage == Stage.SANITY_CHECK else event[3 : -len("_start")]
        self.counts[key] = list(ctx.num_batches or [])


#: The ``BatchCounts`` entries each entry point counts anew.
_COUNTED_BY = {
    "fit": ("validation", Stage.SANITY_CHECK),
    "validate": ("validation",),
    "test": ("test",),
    "predict": ("predict",),
}


def driver_for(trainer: Trainer, fn: str, task: Task | None, model: nn.Module | None) -> Driver:
    """A new driver for a run of ``fn``, remembered as the trainer's current one."""
    messages: list[str] = []
    checkpointing = trainer.checkpointing
    counts = trainer._num_batches
    for key in _COUNTED_BY.get(fn, ()):
        counts[key] = []  # this run counts them anew
    bar = trainer.progress_bar_callback
    log_dir, logs = shared_log_dir(trainer, fn)
    loggers = trainer._loggers if logs else []
    if not logs:
        messages.append(_not_logged(fn, trainer._run_ckpt_path))
    trainer._skips_loggers = not logs
    root = _trusted_root(trainer, log_dir, logs)
    use_root = getattr(trainer.profiler, "use_log_root", None)
    if callable(use_root):
        use_root(root)
    driver = TrainerDriver(
        fn=fn,
        callbacks=run_callbacks(trainer, task, fn, messages),
        loggers=loggers,
        observers=[
            *([bar] if bar is not None else []),
            BatchCounts(counts),
            *trainer.monitors,
            *getattr(trainer, "_observers", ()),
        ],
        config=trainer.config,
        strategy=trainer.strategy,
        log_dir=log_dir,
        checkpointer=checkpointing.save,
        remover=checkpointing.remove,
        linker=checkpointing.link,
        flush=checkpointing.wait,
        exists=_exists,
        clock=trainer._clock,
        extra={"model": model, "num_loggers": len(loggers), "log_root": root},
        profiler=trainer.profiler,
        inference_mode=trainer.inference_mode,
        **({"printer": trainer._printer} if trainer._printer is not None else {}),
    )
    for message in messages:
        driver.say(message)
    trainer._driver = driver
    bind_views(trainer)
    return driver


def bind_views(trainer: Trainer) -> None:
    """Point the bookkeeping attributes of the trainer's ``ModelCheckpoint`` callbacks
    (``best_model_path`` ...) at this trainer's latest state and run folder: a run shows
    them from its start, and after it until the callback runs with another trainer. The
    trainer is held weakly, and nothing in a run reads these views."""
    ref = weakref.ref(trainer)
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint):
            cb.bind_view(functools.partial(_bookkeeping, ref, cb.key))


def _bookkeeping(ref: weakref.ref[Trainer], key: str) -> tuple[Any, str | None]:
    """``(the callback state under key, the run folder)`` of the trainer ``ref`` names, as
    it is now (``(None, None)`` without a state)."""
    trainer = ref()
    state = trainer._latest if trainer is not None else None
    if state is None:
        return None, None
    return state.callbacks.get(key), trainer.log_dir


@contextlib.contextmanager
def run_context(trainer: Trainer) -> Iterator[None]:
    """``deterministic``, ``detect_anomaly`` and ``benchmark`` (``torch.backends.cudnn.
    benchmark``; left as it is when None, except that ``deterministic=True`` or ``"warn"``
    turns it off, as in Lightning) for the duration of a run, then restored."""
    deterministic, detect_anomaly = trainer.deterministic, trainer.detect_anomaly
    benchmark = trainer.benchmark
    if benchmark is None and deterministic:  # True or "warn", as in Lightning
        benchmark = False
    previous_benchmark = torch.backends.cudnn.benchmark
    previous_det = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    previous_anomaly = torch.is_anomaly_enabled()
    previous_anomaly_nan = torch.is_anomaly_check_nan_enabled()
    try:
        if deterministic is not None:
            if deterministic:
                # deterministic cuBLAS needs a fixed workspace (as Lightning sets it): set
                # before any CUDA matmul, kept for the process, never overriding the user's
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(
                bool(deterministic), warn_only=deterministic == "warn"
            )
        if detect_anomaly:
            torch.autograd.set_detect_anomaly(True)
        if benchmark is not None:
            torch.backends.cudnn.benchmark = benchmark
        yield
    finally:
        # restore only what was changed: the first use_deterministic_algorithms call of
        # a process imports a large part of torch (seconds)
        if deterministic is not None:
            torch.use_deterministic_algorithms(previous_det, warn_only=previous_warn)
        if detect_anomaly:
            torch.autograd.set_detect_anomaly(previous_anomaly, check_nan=previous_anomaly_nan)
        torch.backends.cudnn.benchmark = previous_benchmark


def _exists(url: str) -> bool:
    """Whether a checkpoint name is taken, on any fsspec filesystem (for checkpoint version
    suffixes): a file or folder is there, or, on a local disk, a sharded save cut short left
    the name's newest committed state in a hidden folder beside it (``sharded.newest``):
    a fresh run writing that name would order after it and the killed run's state would
    be replaced, so the name counts as taken."""
    from purestep.engine.checkpoint import sharded, storage

    if storage.exists(url):
        return True
    return storage.is_local_url(url) and sharded.newest(storage.filesystem(url)[1]) is not None
