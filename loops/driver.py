"""The effectful edge of a loop: fires events and carries out what callbacks request.

The loop compositions (``fit``, ``validate``, ``test``, ``predict``) are written in terms of
pure steps, pure decisions and this one object. A ``Driver`` builds the read-only ``Context``
of each event, lets observers (the progress bar) see it, dispatches it to the pure callbacks
and then carries out their ``Requests``: stop (recorded in the loop state), log (to the
loggers and to the values callbacks see), save / remove / link checkpoint files (queued and
written at the next commit point, so a checkpoint always holds a state the loop can resume
from exactly), and messages (printed on the primary process). It also owns the clock:
elapsed training time is the driver's, restored from checkpoint metadata on resume.

Logging follows Lightning: values callbacks log during the sanity check are dropped;
values logged inside ``collecting()`` (the loops use it around the epoch-end events) are
handed back to the loop, which writes them in the same row as the epoch's aggregated values;
everything else is written at once at ``logger_step``.
"""

from __future__ import annotations

import contextlib
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from purestep.engine.optim.multi import set_hyperparams
from purestep.engine.state import TrainState

from . import aggregate, loop_state
from .callbacks.base import Callback
from .events import NOTHING, BatchPosition, Context, Requests, Stage, dispatch, handlers_for
from .profiling import Monitor
from .profiling import active as _active_profiler
from .profiling import section as _section

__all__ = ["Driver", "prepare", "print_message"]


def prepare(
    fn: str,
    driver: Driver | None,
    config: Any,
    *,
    callbacks: Sequence[Callback] = (),
    loggers: Sequence[Any] = (),
    observers: Sequence[Any] = (),
) -> tuple[Driver, Any]:
    """The driver and config a plain ``loops.fit`` / ``evaluate`` / ``predict`` call runs
    with: the given driver (its config must agree with ``config``) or one built from the
    callbacks, loggers and observers; Lightning's default config when none is given."""
    from .config import default_config

    if driver is None:
        config = config if config is not None else default_config()
        driver = Driver(
            fn=fn, callbacks=callbacks, loggers=loggers, observers=observers, config=config
        )
    elif config is not None and driver.config is not None and config != driver.config:
        raise ValueError(
            "the config given differs from the driver's: the loop and its callbacks would "
            "follow different flags; pass one of them"
        )
    config = config if config is not None else driver.config
    if config is None:
        config = default_config()
        driver.config = config
    return driver, config


def print_message(text: str) -> None:
    """Show a line on stderr without breaking a progress bar."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


class Driver:
    """Carries out a loop's effects; see the module docstring.

    ``fn``: the entry point ("fit", "validate", "test", "predict"). ``checkpointer(state,
    path, driver)`` writes a checkpoint (the Trainer passes one that writes atomically with
    metadata); without one, save requests are an error. ``remover(path)`` / ``linker(target,
    link)`` carry out remove and link requests (primary process only); ``flush()`` waits for
    asynchronous writes (called before removals and links). ``exists`` tells
    callbacks whether a file exists. ``printer`` shows messages; ``clock`` is the time source
    of ``elapsed()`` (inject a fake one in tests). ``extra`` is merged into every context's
    ``extra`` (the loops add ``"model"``, the module template, and ``"num_loggers"``).

    Mutable attributes the loops set: ``stage`` (the running ``Stage`` or None),
    ``status`` ("initializing", "running", "finished", "interrupted"), ``logger_step`` (the
    x-axis value of rows written now), ``progress_bar_metrics``.
    """

    def __init__(
        self,
        *,
        fn: str,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Any] = (),
        observers: Sequence[Any] = (),
        config: Any = None,
        strategy: Any = None,
        log_dir: str | None = None,
        checkpointer: Callable[[TrainState, str, Driver], None] | None = None,
        remover: Callable[[str], None] | None = None,
        linker: Callable[[str, str], None] | None = None,
        flush: Callable[[], None] | None = None,
        exists: Callable[[str], bool] | None = None,
        printer: Callable[[str], None] = print_message,
        clock: Callable[[], float] = time.monotonic,
        elapsed_offset: float = 0.0,
        extra: Mapping[str, Any] | None = None,
        profiler: Any = None,
        inference_mode: bool = True,
    ) -> None:
        self.fn = fn
        self.callbacks = callbacks
        self.loggers = list(loggers)
        self.observers = list(observers)
        self.config = config
        self.strategy = strategy
        self.log_dir = log_dir
        self.checkpointer = checkpointer
        self.remover = remover
        self.linker = linker
        self.flush = flush
        self.exists = exists
        self.printer = printer
        self.clock = clock
        self.elapsed_offset = elapsed_offset
        self.extra = dict(extra or {})
        # A loops.profiling.Profiler that measures (None: the loops run unprofiled paths).
        self.profiler = _active_profiler(profiler)
        self._labels: dict[tuple[str, str, str], str] = {}
        # Evaluation steps under torch.inference_mode() (else torch.no_grad()): Lightning's
        # Trainer(inference_mode=...).
        self.inference_mode = inference_mode
        self.stage: str | None = None
        # The batch the running loop is at (each loop sets it before the batch's start event).
        self.position: BatchPosition | None = None
        # The training batch a fit is at (an evaluation inside it leaves it as it is).
        self.train_position: BatchPosition | None = None
        # Set by an end_epoch request; the training loop ends the epoch and clears it (the
        # request is honoured at on_train_batch_start only).
        self.end_epoch = False
        self.status = "initializing"
        self.progress_bar_metrics: dict[str, torch.Tensor] = {}
        self._bar_view = types.MappingProxyType(self.progress_bar_metrics)
        self.pending: list[Requests] = []
        self.logger_step = 0
        self.last_commit: TrainState | None = None
        # Set by a loop while a donated update writes its state in place: a failure then
        # leaves a torn state, which is never saved (see handle_exception).
        self.torn = False
        # Set by a loop whose in-place update consumed the last commit point; cleared by the
        # next commit. Until then the latest state is past any commit point.
        self.past_commit = False
        # Called with (state, driver) at every commit point, before queued saves: the
        # Trainer checks for preemption here; a hook may raise to end the run.
        self.commit_hooks: list[Callable[[TrainState, Driver], None]] = []
        self._started: float | None = None
        self._collectors: list[dict[str, torch.Tensor]] = []

    # ------------------------------------------------------------------ identity and time

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """The callbacks, in dispatch order (assign a new sequence to change them)."""
        return self._callbacks

    @callbacks.setter
    def callbacks(self, callbacks: Sequence[Callback]) -> None:
        self._callbacks = tuple(callbacks)
        self._handlers: dict[str, list[Callback]] = {}
        self._watchers: dict[str, list[Any]] = {}

    def handlers(self, event: str) -> list[Callback]:
        """The callbacks that handle ``event``, in dispatch order (cached per event)."""
        found = self._handlers.get(event)
        if found is None:
            found = self._handlers[event] = handlers_for(event, self._callbacks)
        return found

    def handles(self, event: str) -> bool:
        """Whether any callback handles ``event``."""
        return bool(self.handlers(event))

    def watchers(self, event: str) -> list[Any]:
        """The observers interested in ``event`` (an observer's ``events`` attribute names
        the events it watches; without one it watches all). Cached per event."""
        found = self._watchers.get(event)
        if found is None:
            found = self._watchers[event] = [
                o for o in self.observers if getattr(o, "events", None) is None or event in o.events
            ]
        return found

    @property
    def strategy(self) -> Any:
        """The hardware strategy; setting it also sets ``rank`` and ``world_size`` (plain
        attributes: the loops read them several times per batch)."""
        return self._strategy

    @strategy.setter
    def strategy(self, strategy: Any) -> None:
        self._strategy = strategy
        self.rank: int = getattr(strategy, "rank", 0)
        self.world_size: int = getattr(strategy, "world_size", 1)

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    def start_clock(self) -> None:
        """Start measuring training time (on top of any time restored from a checkpoint)."""
        self._started = self.clock()

    def elapsed(self) -> float:
        """Seconds of training so far, including time restored from a checkpoint."""
        if self._started is None:
            return self.elapsed_offset
        return self.elapsed_offset + (self.clock() - self._started)

    def set_default_extra(self, **values: Any) -> None:
        """Give ``extra`` entries the caller did not set (the loops add the model template
        and the number of loggers this way, so callbacks see them however they are run)."""
        for key, value in values.items():
            self.extra.setdefault(key, value)

    # ------------------------------------------------------------------ events

    def context(self, state: TrainState, **fields: Any) -> Context:
        """The read-only view of the loop that callbacks get (``fields`` fill the rest)."""
        if state.loop is None:  # a custom loop's first state has none yet
            state = loop_state.ready(state)
        loop = state.loop
        extra = {**self.extra, "progress_bar_metrics": self._bar_view}
        extra.update(fields.pop("extra", {}))
        return Context(
            stage=fields.pop("stage", self.stage),
            fn=self.fn,
            state=state,
            metrics=types.MappingProxyType(loop.callback_metrics),
            should_stop=loop.should_stop,
            elapsed=self.elapsed(),
            config=self.config,
            log_dir=self.log_dir,
            world_size=self.world_size,
            rank=self.rank,
            exists=self.exists,
            extra=extra,
            **fields,
        )

    def fire(self, event: str, state: TrainState, **fields: Any) -> TrainState:
        """Announce ``event``: observers see it, callbacks handle it, requests are carried out.

        Events that no callback handles and no observer watches cost no context.
        """
        handlers = self._handlers.get(event)  # the caches, read inline: this runs per batch
        if handlers is None:
            handlers = self.handlers(event)
        watchers = self._watchers.get(event)
        if watchers is None:
            watchers = self.watchers(event)
        if not handlers and not watchers:
            return state
        ctx = self.context(state, **fields)
        state = ctx.state  # with its loop state filled in (a custom loop's first state)
        prof = self.profiler
        for observer in watchers:
            if prof is None:
                said = observer.on_event(event, ctx)
            else:
                with prof.profile(self._label("[Observer]", type(observer).__name__, event)):
                    said = observer.on_event(event, ctx)
            # a monitor's measurements (other observers' return values mean nothing)
            if said is not None and isinstance(observer, Monitor):
                self._log_observed(said)
        if not handlers:
            return state
        if prof is None:
            state, requests = dispatch(event, self.callbacks, state, ctx, handlers=handlers)
        else:
            state, requests = self._dispatch_profiled(event, state, ctx, handlers)
        if requests:
            state = self.carry_out(state, requests)
        return state

    def _label(self, kind: str, name: str, event: str) -> str:
        label = self._labels.get((kind, name, event))
        if label is None:
            label = self._labels[(kind, name, event)] = f"{kind}{name}.{event}"
        return label

    def _dispatch_profiled(
        self, event: str, state: TrainState, ctx: Context, handlers: Sequence[Callback]
    ) -> tuple[TrainState, Requests]:
        """``dispatch``, each callback's handler timed as ``[Callback]<key>.<event>``."""
        merged = NOTHING
        for cb in handlers:
            with self.profiler.profile(self._label("[Callback]", cb.key, event)):
                state, requests = dispatch(event, self.callbacks, state, ctx, handlers=(cb,))
            if requests is not NOTHING:
                merged = merged | requests
        return state, merged

    def _log_observed(self, said: Any) -> None:
        """Log what an observer returned: metrics, or ``(metrics, step)``."""
        if isinstance(said, tuple):
            metrics, step = said
        else:
            metrics, step = said, None
        if metrics and self.stage != Stage.SANITY_CHECK:
            self.log_metrics(metrics, self.logger_step if step is None else step)

    def evaluation_mode(self) -> contextlib.AbstractContextManager[Any]:
        """What evaluation and prediction steps run under: ``torch.inference_mode()``, or
        ``torch.no_grad()`` with ``inference_mode=False`` (Lightning's flag)."""
        return torch.inference_mode() if self.inference_mode else torch.no_grad()

    # ------------------------------------------------------------------ profiling

    def start_profiling(self) -> None:
        """A run starts: the profiler learns its stage, rank and run folder."""
        if self.profiler is not None:
            self.profiler.setup(
                self.fn,
                self.rank if self.world_size > 1 else None,
                self.log_dir,
                primary=self.is_primary,
                printer=self.printer,
            )

    def end_profiling(self) -> None:
        """A run ends (finished or not): the profiler's report, then its teardown."""
        prof = self.profiler
        if prof is not None:
            try:
                prof.describe()
            finally:
                prof.teardown(self.fn)

    def carry_out(self, state: TrainState, requests: Requests) -> TrainState:
        """Do what callbacks asked: stop, log, change hyper-parameters, replace kept
        accumulators, queue file work, print."""
        log = requests.log if self.stage != Stage.SANITY_CHECK else {}
        if requests.hyperparams and self.stage != Stage.SANITY_CHECK:
            state = state.replace(opt_state=set_hyperparams(state.opt_state, requests.hyperparams))
        if requests.weights:
            state = _put_weights(state, requests.weights)
        if (requests.kept or requests.stop or log) and state.loop is None:
            state = loop_state.ready(state)
        if requests.kept:
            loop = state.loop
            acc, specs = aggregate.put_kept(loop.train_epoch, loop.train_specs, requests.kept)
            state = state.replace(loop=loop.replace(train_epoch=acc, train_specs=specs))
        if requests.stop or log:
            loop = state.loop
            changes: dict[str, Any] = {}
            if requests.stop and not loop.should_stop:
                changes["should_stop"] = True
            if log:
                values = {k: _as_tensor(v) for k, v in log.items()}
                changes["callback_metrics"] = {**loop.callback_metrics, **values}
                if self._collectors:
                    self._collectors[-1].update(values)
                else:
                    self.log_metrics(values, self.logger_step)
            if changes:
                state = state.replace(loop=loop.replace(**changes))
        if requests.save or requests.save_weights or requests.remove or requests.link:
            self.pending.append(
                Requests(
                    save=requests.save,
                    save_weights=requests.save_weights,
                    remove=requests.remove,
                    link=requests.link,
                )
            )
        for message in requests.messages:
            self.say(message)
        if requests.end_epoch:
            if self.stage != Stage.TRAIN:
                raise ValueError(
                    "Requests(end_epoch=True) ends a training epoch: ask for it at "
                    f"on_train_batch_start, not during {self.stage or 'setup'!r}"
                )
            self.end_epoch = True
        return state

    def say(self, text: str) -> None:
        """Show a line to the user (primary process only)."""
        if self.is_primary:
            self.printer(text)

    # ------------------------------------------------------------------ logging

    @contextlib.contextmanager
    def collecting(self) -> Iterator[dict[str, torch.Tensor]]:
        """Hold back the values callbacks log in this block; the loop writes them itself."""
        collected: dict[str, torch.Tensor] = {}
        self._collectors.append(collected)
        try:
            yield collected
        finally:
            self._collectors.pop()

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Send ``metrics`` to every logger at ``step`` (primary process only)."""
        if not metrics or not self.is_primary:
            return
        prof = self.profiler
        for logger in self.loggers:
            if prof is None:
                logger.log_metrics(metrics, step)
                logger.save()
            else:
                with prof.profile(self._label("[Logger]", type(logger).__name__, "log_metrics")):
                    logger.log_metrics(metrics, step)
                    logger.save()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Send the run's hyper-parameters to every logger (primary process only)."""
        if not self.is_primary:
            return
        for logger in self.loggers:
            logger.log_hyperparams(params)
            logger.save()

    def finalize(self, status: str) -> None:
        """Close the loggers with ``status`` ("success", "failed" or "interrupted"), after
        the profiler's report (the loggers are closed even if the report fails). Every
        logger is closed even if one before it fails; the first failure is raised after."""
        try:
            self.end_profiling()
        finally:
            if self.is_primary:
                first: BaseException | None = None
                for logger in self.loggers:
                    try:
                        logger.finalize(status)
                    except Exception as err:  # the others still flush and close
                        first = first or err
                if first is not None:
                    raise first

    # ------------------------------------------------------------------ checkpoints

    def commit(self, state: TrainState, *, hooks: bool = True) -> None:
        """Write the checkpoints requested since the last commit, then remove and link files.

        Called by the loops only at points they can resume from exactly (after a batch is
        fully processed, after an epoch ends), so every checkpoint holds such a state. The
        state is remembered as ``last_commit``; then the ``commit_hooks`` run (preemption;
        not on the exception path, where they could wait on processes that are not there).
        Removals and links wait until the queued writes are done (``flush``), so an evicted
        checkpoint is never deleted before its replacement is on disk.
        Under several processes a point inside an open accumulation window is not a commit
        point (each process holds its own partial gradients): the work waits for the next;
        and every process carries out rank 0's requests (callbacks may decide differently on
        values that differ between processes, such as clocks and per-rank step metrics).
        """
        if self.world_size > 1 and state.progress.micro_step != 0:
            return
        self.last_commit = state
        self.past_commit = False
        if not self.pending and self.world_size == 1:  # the usual batch: nothing queued
            if hooks:
                for hook in self.commit_hooks:
                    hook(state, self)
            return
        pending, self.pending = self.pending, []
        if self.world_size > 1:
            # every process does rank 0's file work, so their barriers and states match
            work = [(r.save, r.save_weights, r.remove, r.link) for r in pending]
            work = self.strategy.broadcast_object(work, 0)
            pending = [Requests(save=a, save_weights=b, remove=c, link=d) for a, b, c, d in work]
        for requests in pending:
            paths = (*requests.save, *requests.save_weights)
            if paths and self.checkpointer is None:
                raise RuntimeError(
                    f"a callback asked to save {list(paths)} but this loop has no "
                    "checkpointer; pass one to the Driver (the Trainer does)"
                )
            for path in requests.save:
                with _section(self.profiler, "save_checkpoint"):
                    self.checkpointer(state, path, self)
            for path in requests.save_weights:
                with _section(self.profiler, "save_checkpoint"):
                    self.checkpointer(_weights_only(state), path, self)
        if pending and self.flush is not None:
            self.flush()
        for requests in pending:
            for target, link in requests.link:
                if self.linker is not None and self.is_primary:
                    self.linker(target, link)
            for path in requests.remove:
                if self.remover is not None and self.is_primary:
                    self.remover(path)
        if hooks:
            for hook in self.commit_hooks:
                hook(state, self)

    # ------------------------------------------------------------------ stand-alone runs

    def run(
        self,
        state: TrainState,
        body: Callable[[TrainState], tuple[TrainState, Any]],
        *,
        interrupted: Any = None,
    ) -> tuple[TrainState, Any]:
        """A stand-alone stage (validate, test, predict): ``setup``, ``body``, ``teardown``,
        with Lightning's interrupt handling and the loggers finalized. Returns ``(state,
        result)``; after Ctrl-C the latest state and ``interrupted``."""
        from .callbacks.base import init_states

        state = init_states(self.callbacks, state)
        self.status = "running"
        self.start_profiling()
        try:
            self.stage = None
            state = self.fire("setup", state)
            state, result = body(state)
            state = self.fire("teardown", state)
            self.commit(state)
        except KeyboardInterrupt as exc:
            return self.handle_exception(state, exc), interrupted
        except BaseException as exc:
            self.handle_exception(state, exc)
            raise
        self.status = "finished"
        self.finalize("success")
        return state, result

    # ------------------------------------------------------------------ failures

    def handle_exception(self, state: TrainState, exc: BaseException) -> TrainState:
        """Lightning's interrupt handling: status "interrupted", ``on_exception`` for every
        callback, then the loggers finalized ("interrupted" for Ctrl-C, else "failed").

        The handlers see the last committed state — the latest one the loop can resume from
        exactly — and the files they ask for are written with it (work queued by the batch
        that failed is dropped: it described a state that was never committed). A loop that
        donates its state to the step consumes the last commit with each update (its
        ``last_commit`` is None and ``past_commit`` True then): the handlers see ``state``,
        the latest whole state, and a checkpoint saved from it (said so) continues after the
        interrupted batch rather than redoing it.
        If the failure struck inside such an update (``torn``), ``state`` is half-written:
        the handlers still run, but nothing is saved from it. After a failure other than
        Ctrl-C the stage is reset to None; after Ctrl-C it stays, as in Lightning. The
        caller re-raises or returns; this returns the state the handlers saw, after
        ``on_exception``.
        """
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        self.status = "interrupted"
        if isinstance(exc, KeyboardInterrupt):
            self.say("Detected KeyboardInterrupt, attempting graceful shutdown ...")
        base = self.last_commit if self.last_commit is not None else state
        self.pending = []
        try:
            state = self.fire("on_exception", base, exception=exc)
            if self.pending and self.torn:
                self.say(
                    "not saving the checkpoint(s) requested on this exception: it struck while "
                    "the optimizer was updating the state in place, so the state is incomplete; "
                    "resume from the last checkpoint saved before it (Trainer(donate_state="
                    "False) keeps the last commit point intact, at the cost of a second copy "
                    "of the state during each step)"
                )
            elif self.pending:
                if self.past_commit:
                    self.say(
                        "the checkpoint(s) requested on this exception hold the latest state: "
                        "past the last commit point (the optimizer step of the interrupted "
                        "batch is in it, that batch's logging and validation are not), so a "
                        "run resumed from one continues with the next batch; "
                        "Trainer(donate_state=False) saves the last commit point instead"
                    )
                self.commit(state, hooks=False)
        finally:
            self.pending = []
            self.finalize("interrupted" if interrupted else "failed")
            if not interrupted:
                self.stage = None
        return state


def _put_weights(state: TrainState, weights: Mapping[str, Any]) -> TrainState:
    """``state`` with a ``weights`` request's parameters and buffers, copied (so a later
    in-place update of the state never writes into a callback's own tensors) onto the
    devices of the state's (an average kept on the CPU, or loaded there from a checkpoint);
    names the state does not have, and tensors of another shape or dtype than the state's,
    are refused."""
    changes: dict[str, Any] = {}
    for kind in ("params", "buffers"):
        given = weights.get(kind) or {}
        have = getattr(state, kind)
        unknown = sorted(set(given) - set(have))
        if unknown:
            raise KeyError(f"a weights request names {kind} the state does not have: {unknown}")
        for k, v in given.items():
            if not isinstance(v, torch.Tensor) or (v.shape, v.dtype) != (
                have[k].shape,
                have[k].dtype,
            ):
                raise ValueError(
                    f"a weights request gives {kind[:-1]} {k!r} as "
                    f"{_described(v)}; the state holds {_described(have[k])}"
                )
        if given:
            changes[kind] = {**have, **{k: _placed(v, have[k]) for k, v in given.items()}}
    other = sorted(set(weights) - {"params", "buffers"})
    if other:
        raise KeyError(f"a weights request holds {other}; it takes 'params' and 'buffers'")
    return state.replace(**changes) if changes else state


def _placed(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A copy of ``value`` on ``like``'s device."""
    value = value.detach()
    return value.to(like.device) if value.device != like.device else value.clone()


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _weights_only(state: TrainState) -> dict[str, Any]:
    """What a weights-only checkpoint holds: parameters and buffers (no optimizer, no loop)."""
    return {"weights_only": True, "params": state.params, "buffers": state.buffers}


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.tensor(float(value))
