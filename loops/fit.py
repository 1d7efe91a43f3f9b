"""``fit``: epochs of pure train steps with validation, callbacks and logging in between.

The composition follows Lightning's fit loop event by event (see ``loops.events``), with
every decision taken by a pure function of ``loops.schedule`` over the counters in the
state. Checkpoints requested by callbacks are written only at commit points — after a batch
is fully processed (step, logging, validation) and after an epoch ends — so a run resumed
from any checkpoint continues exactly where the saved state says: the epoch and batch come
from ``Progress``, the epoch's metric accumulators, the stop request, the values callbacks
see and the data reload epochs from the loop state. On Ctrl-C the exception handlers run,
the status becomes "interrupted" and the latest state is returned.

One batch is a short sequence of named phases (``FitLoop._batch``); the data and its
reloads are ``loops.fit_data``, the gradient checks ``loops.gradient_checks``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from purestep.engine.state import TrainState
from purestep.engine.tree import map as tree_map

from . import aggregate, loop_state, schedule
from .callbacks.base import init_states
from .driver import Driver, prepare
from .evaluate import run_evaluation
from .events import BatchPosition, Stage
from .fit_data import FitData, numbered
from .gradient_checks import GradientChecks, NonFiniteLossError, grad_norm_type
from .interrupts import InterruptGuard
from .profiling import ProfiledTrainStep, section
from .schedulers import LRSchedulers

__all__ = ["FitLoop", "NonFiniteLossError", "fit", "grad_norm_type"]


_BATCH_EVENTS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


class FitLoop(FitData):
    """One ``fit`` run; ``run(state)`` returns the final state. ``state`` is always the latest.

    ``step``: an ``engine.train_step`` (the loop uses its ``backward`` / ``apply`` halves so
    that ``on_before_optimizer_step`` sees the gradients); its ``accumulate`` must agree with
    the config's ``accumulate_grad_batches``. ``train`` and each of ``val`` are ``loops.data``
    batch streams; ``reload_train`` / ``reload_val`` (optional) build them, when they are not
    given and when ``reload_dataloaders_every_n_epochs`` says so. ``eval_step``: an
    ``engine.eval_step``; without it there is no validation. ``hparams`` are sent to the
    loggers after ``on_fit_start``. ``log_loss=False``: the step's loss is not logged as
    ``train_loss`` (only its metrics are; a Lightning-style module logs what ``self.log``
    names).

    ``donate=True``: the optimizer updates write the parameters and optimizer state in place
    (``step.donating(backward=False)``), like a hand-written loop — one copy of the state
    instead of two during a step, and faster; results are bitwise the same. The caller's
    state is never written: ``run(state)`` first copies its parameters and optimizer state
    (``run(state, owned=True)`` skips the copy for a state made for this run, as the Trainer
    does). The price: a state a callback was shown is overwritten by the next update (copy
    what you keep), and the exception handlers see the latest state instead of the last
    commit point (see ``Driver.handle_exception``). Ctrl-C is held back during an in-place
    update, so it always returns a whole state; after a failure inside one, ``state`` is
    None (the loop has no whole state to offer). An asynchronous checkpointer given to the
    driver must copy what it writes (``AsyncCheckpointer(copy="always")``).
    """

    def __init__(
        self,
        step: Any,
        train: Any = None,
        *,
        driver: Driver,
        config: Any,
        val: Sequence[Any] | None = (),
        eval_step: Any = None,
        reload_train: Callable[[], Any] | None = None,
        reload_val: Callable[[], Sequence[Any]] | None = None,
        hparams: dict[str, Any] | None = None,
        donate: bool = False,
        schedulers: Sequence[Any] = (),
        track_grad_norm: Any = -1,
        terminate_on_nan: bool = False,
        log_loss: bool = True,
    ) -> None:
        self._multi = bool(getattr(step, "multi", False))
        self.log_loss = log_loss
        if self._multi:
            donate = False  # several optimizers' updates are threaded: no in-place update
        elif not (hasattr(step, "backward") and hasattr(step, "apply")):
            raise TypeError(
                "fit needs a train step built by engine.train_step (with backward/apply), "
                f"got {type(step).__name__}"
            )
        if train is None and reload_train is None:
            raise ValueError("FitLoop needs training data: pass train or reload_train")
        if donate and not hasattr(step, "donating"):
            raise TypeError(
                f"FitLoop(donate=True) needs a step with donating() (engine.train_step builds "
                f"one); {type(step).__name__} has none: pass donate=False"
            )
        self.step = step
        self.eval_step = eval_step
        self.driver = driver
        self.config = config
        self.hparams = hparams
        self.donate = donate
        self.schedulers = LRSchedulers(schedulers, multi=self._multi)
        self.checks = GradientChecks(
            driver,
            terminate_on_nan=bool(terminate_on_nan),
            grad_norm_p=grad_norm_type(track_grad_norm),
            where=self._where,
        )
        self._batch_idx = 0
        # The step the batches run (set by run): ``step``, or ``step.donating(backward=False)``.
        self._stepper = step
        self._guard = InterruptGuard()
        # Whether anything listens to the three per-batch events (set by run: callbacks and
        # observers are fixed for a run); the batch skips the calls nobody hears.
        self._heard = (True, True, True)
        self.state: TrainState | None = None
        self._told_min = False
        self._factor = 1  # this epoch's accumulation factor (set by _epoch)
        self._init_data(train, val, reload_train, reload_val)

    def _record(self, **changes: Any) -> None:
        self.state = self.state.replace(loop=self.state.loop.replace(**changes))

    def _check_accumulation(self, epoch: int) -> None:
        want = schedule.accumulation_factor(self.config, epoch)
        have = getattr(self.step, "accumulate", None)
        if callable(have):
            have = have(self.state.progress)
        if have is not None and have != want:
            raise ValueError(
                f"the train step accumulates {have} micro-batch(es) per optimizer step but "
                f"accumulate_grad_batches gives {want} in epoch {epoch}; build the step with "
                "engine.train_step(..., accumulate=...) matching the loop config"
            )

    # ------------------------------------------------------------------ the run

    def run(self, state: TrainState, *, owned: bool = False) -> TrainState:
        """Run fit from ``state``; the final state (the latest one after Ctrl-C).

        ``owned``: with ``donate``, ``state`` was made for this run and may be written in
        place (otherwise its parameters and optimizer state are copied first).
        """
        drv = self.driver
        drv.set_default_extra(model=getattr(self.step, "model", None), num_loggers=len(drv.loggers))
        state = loop_state.ready(state)  # the loop state, in place once for the whole run
        if self.donate and not owned:
            state = state.replace(params=_copied(state.params), opt_state=_copied(state.opt_state))
        self._stepper = self.step.donating(backward=False) if self.donate else self.step
        if self._multi:  # one MultiStep runs the batch: its optimizers' halves are inside
            self._stepper = self.step
        if drv.profiler is not None:  # time the step's halves (unprofiled: the step itself)
            self._stepper = ProfiledTrainStep(self._stepper, drv.profiler)
        if self.schedulers:
            self.schedulers.check(state)
            state = self.schedulers.init(state)
            named = {c.optimizer: c.name for c in self.schedulers.configs if c.name}
            if named:  # LearningRateMonitor logs under the scheduler's name
                drv.set_default_extra(lr_scheduler_names=named)
        self.state = init_states(drv.callbacks, state)
        drv.status = "running"
        drv.torn = drv.past_commit = False
        drv.end_epoch = False  # nothing of an earlier run's batches
        drv.position = drv.train_position = None
        drv.logger_step = self.state.progress.step
        drv.last_commit = self.state
        self._heard = tuple(bool(drv.handlers(e) or drv.watchers(e)) for e in _BATCH_EVENTS)
        epoch = self.state.progress.epoch
        if (
            self.val is not None
            and self.state.loop.last_val_reload is None
            and schedule.sanity_check_sets_val_reload(self.config, epoch)
        ):
            self._record(last_val_reload=epoch)  # data given to the loop: loaded "now"
        drv.start_profiling()  # ended by finalize, on every way out of the try below
        try:
            if self.donate:
                self._guard.install()
            self._run()
        except KeyboardInterrupt as exc:
            # the exception handlers see the last committed state; fit returns the latest
            self._guard.uninstall()
            drv.handle_exception(self.state, exc)
            if drv.torn:  # a half-written state is never returned (see _apply)
                self.state = None
                raise
            return self.state
        except BaseException as exc:
            self._guard.uninstall()
            drv.handle_exception(self.state, exc)
            if drv.torn:
                self.state = None
            raise
        finally:
            self._guard.uninstall()
        drv.status = "finished"
        drv.finalize("success")
        return self.state

    def _fire(self, event: str, **fields: Any) -> None:
        self.state = self.driver.fire(event, self.state, **fields)

    def _fit_done(self) -> schedule.Verdict:
        p = self.state.progress
        if p.batch_in_epoch > 0:  # resumed mid-epoch: the epoch finishes first
            return schedule.Verdict(False)
        return schedule.fit_done(
            self.config,
            num_training_batches=self.num_train,
            global_step=p.step,
            epochs_done=p.epoch,
            should_stop=self.state.loop.should_stop,
        )

    def _run(self) -> None:
        drv, c = self.driver, self.config
        drv.stage = None
        self._fire("setup")
        self._fire("on_fit_start")
        p = self.state.progress
        resumed = p.total_batches > 0 or p.epoch > 0 or p.step > 0
        if self.hparams and not resumed:  # a resumed run's loggers have them already
            drv.log_hyperparams(self.hparams)
        if schedule.should_run_sanity_check(
            c, enabled=self.enable_val, resumed=resumed, mid_epoch=p.batch_in_epoch > 0
        ):
            self._sanity_check()
        drv.stage = Stage.TRAIN
        if schedule.training_skipped(c):
            self.num_train = 0
        else:
            self._ensure_train(p.epoch)
        verdict = self._fit_done()
        if verdict:  # nothing to train: Lightning skips the training events entirely
            if verdict.reason:
                drv.say(verdict.reason)
        else:
            drv.start_clock()
            self._fire("on_train_start")
            while True:
                verdict = self._fit_done()
                if verdict:
                    if verdict.reason:
                        drv.say(verdict.reason)
                    break
                with section(drv.profiler, "run_training_epoch"):
                    self._epoch()
            self._fire("on_train_end")
        drv.stage = None
        self._fire("on_fit_end")
        self._fire("teardown")
        drv.commit(self.state)

    def _sanity_check(self) -> None:
        """A few validation batches before training, to fail early. It leaves the callbacks'
        states as it found them: a run resumed from an epoch-end checkpoint checks again
        (Lightning's rule), and must still end exactly like the uninterrupted run."""
        drv = self.driver
        before = self.state.callbacks
        kept_before = self.state.loop  # and the steps' kept accumulators
        drv.stage = Stage.SANITY_CHECK
        self._fire("on_sanity_check_start")
        self._ensure_val(self.state.progress.epoch, sanity=True)
        self.state, _ = run_evaluation(
            self.state,
            self.eval_step,
            self.val,
            stage=Stage.SANITY_CHECK,
            driver=drv,
            max_batches=schedule.sanity_batches(self.config, self.val_max),
        )
        self._fire("on_sanity_check_end")
        self.state = self.state.replace(callbacks=before)
        self._record(train_epoch=kept_before.train_epoch, train_specs=kept_before.train_specs)
        drv.stage = None

    # ------------------------------------------------------------------ one epoch

    def _epoch(self) -> None:
        drv, c = self.driver, self.config
        p = self.state.progress
        epoch, start = p.epoch, p.batch_in_epoch
        if self.schedulers:  # the epoch's learning rates, before anyone looks at them
            self._request(self.schedulers.epoch_start(self.state))
        if start == 0:
            self._ensure_train(epoch)
            self._record_kept_only()
            self._check_accumulation(epoch)
            self._fire("on_train_epoch_start", num_batches=self.num_train)
        else:
            self._check_accumulation(epoch)
        num = self.num_train
        self._factor = schedule.accumulation_factor(c, epoch)  # one per epoch
        batches = self.train.iterate(epoch, start)
        if drv.profiler is not None:
            batches = drv.profiler.profile_iterable(batches, "[FitLoop].train_dataloader_next")
        batches = numbered(batches, start, num)
        batch_idx, is_last = start - 1, False
        while True:
            _refuse_end_epoch(drv, "on_train_epoch_start")
            p = self.state.progress
            verdict = schedule.epoch_done(
                c,
                batches_done=batch_idx + 1,
                num_training_batches=num,
                is_last_batch=is_last,
                global_step=p.step,
                epochs_done=p.epoch,
                should_stop=self.state.loop.should_stop,
            )
            if verdict.reason and not self._told_min:
                drv.say(verdict.reason)
                self._told_min = True
            if verdict:
                break
            item = next(batches, None)
            if item is None:
                break
            batch_idx, batch, is_last = item
            with section(drv.profiler, "run_training_batch"):
                ended = self._batch(batch, batch_idx, is_last, epoch)
            if ended:  # an end_epoch request at the batch's start: the rest is skipped
                break
            _refuse_end_epoch(drv, "on_train_batch_end")
            if not is_last:
                drv.commit(self.state)
        self._epoch_end(epoch)

    def _batch(self, batch: Any, batch_idx: int, is_last: bool, epoch: int) -> bool:
        """Process one training batch: events, step, logging, validation when due. Returns
        True, having done nothing more, when ``on_train_batch_start`` asked to end the
        epoch (``Requests(end_epoch=True)``; every process agrees on it)."""
        self._batch_idx = batch_idx
        samples_before = self.state.progress.samples
        if self._start_batch(batch, batch_idx, is_last):
            return True
        out = self._optimize(batch, batch_idx, is_last)
        to_log = self._record_step_values(out, samples_before)
        self._end_batch(batch, batch_idx, is_last, out)
        self._log_step(to_log, epoch, out)
        self._validate_if_due(epoch, batch_idx, is_last)
        if self.schedulers:
            metrics = self.state.loop.callback_metrics
            self.state, requests = self.schedulers.batch_end(self.state, metrics, out.stepped)
            self._request(requests)
        self.driver.logger_step = self.state.progress.step
        return False

    # ------------------------------------------------------------------ a batch's phases

    def _start_batch(self, batch: Any, batch_idx: int, is_last: bool) -> bool:
        """The schedulers' batch start, the batch's position and ``on_train_batch_start``;
        True when a callback asked to end the epoch here."""
        drv, num = self.driver, self.num_train
        if self.schedulers:
            self._request(self.schedulers.batch_start(self.state))
        drv.position = drv.train_position = BatchPosition(
            batch_idx, 0, num, 1, is_last, self.state.progress
        )
        if not self._heard[0]:
            return False
        self.state = drv.fire(
            "on_train_batch_start", self.state, batch=batch, batch_idx=batch_idx, num_batches=num
        )
        if drv.world_size > 1 and drv.handlers("on_train_batch_start"):
            # one rank's request ends every rank's epoch (only handlers can ask: every
            # rank has the same callbacks, so all take this collective or none)
            drv.end_epoch = drv.strategy.reduce_flag(drv.end_epoch, "any")
        if not drv.end_epoch:
            return False
        drv.end_epoch = False
        drv.train_position = drv.position._replace(is_last=True)  # Lightning's flag
        return True

    def _optimize(self, batch: Any, batch_idx: int, is_last: bool) -> Any:
        """The train step on ``batch`` (the update too when it closes an accumulation
        window); leaves the new state in ``self.state`` and returns the step's output.
        One optimizer: backward, checks, ``on_before_optimizer_step``, update. Several (or
        manual optimization): the ``MultiStep`` runs them, calling back between each
        backward and its update."""
        close = schedule.is_optimizer_step(batch_idx, self._factor, self.num_train, is_last)
        self.checks.start_batch()
        if self._multi:
            self.state, out = self._run_optimizers(batch, batch_idx, close)
        else:
            self.state, out = self._run_optimizer(batch, batch_idx, close)
        return out

    def _run_optimizer(self, batch: Any, batch_idx: int, close: bool) -> tuple[TrainState, Any]:
        """One optimizer: its backward, and its update when the window closes."""
        state, grads = self._stepper.backward(self.state, batch, end_window=close)
        state = self._before_update(state, grads, batch, batch_idx)
        if not grads.ready:
            return state, grads.output
        return self._apply(state, grads)

    def _run_optimizers(self, batch: Any, batch_idx: int, close: bool) -> tuple[TrainState, Any]:
        """Several optimizers, or manual optimization: one ``MultiStep`` run of the batch."""
        drv = self.driver

        def before_update(view, grads, index, name):
            extra = {"optimizer_idx": index, "optimizer_name": name}
            return self._before_update(view, grads, batch, batch_idx, extra)

        before_step = None
        if getattr(self.step, "manual", False) and self.schedulers.has_step_schedules():

            def before_step(view, index, name):
                requests = self.schedulers.step_start(view, name)
                return drv.carry_out(view, requests) if requests else view

        return self._stepper.run(
            self.state,
            batch,
            batch_idx=batch_idx,
            end_window=close,
            before_update=before_update,
            before_step=before_step,
        )

    def _record_step_values(self, out: Any, samples_before: int) -> dict[str, Any]:
        """The step's loss and metrics into the loop state (the values callbacks see, the
        epoch accumulators) and the progress bar; what to log for this step."""
        state = self.state
        samples = state.progress.samples - samples_before  # this batch's
        loop = state.loop
        if not self.log_loss or out.loss is None:  # None: the step skipped its batch
            values = out.metrics
        elif out.metrics:
            values = {"loss": out.loss, **out.metrics}
        else:
            values = {"loss": out.loss}
        plain = aggregate.plain_step_values(values, Stage.TRAIN, loop.train_specs)
        if plain is not None:  # the usual batch: nothing to accumulate, no new names
            to_log, bar, to_callbacks = plain
            loop = loop.replace(callback_metrics={**loop.callback_metrics, **to_callbacks})
        else:
            resolved = aggregate.resolve(values, Stage.TRAIN)
            to_log, bar, to_callbacks = aggregate.step_values(resolved)
            loop = loop.replace(
                train_epoch=aggregate.accumulate(loop.train_epoch, resolved, samples),
                train_specs=_merged_specs(loop.train_specs, resolved),
                callback_metrics={**loop.callback_metrics, **to_callbacks},
            )
        self.state = state.replace(loop=loop)
        self.driver.progress_bar_metrics.update(bar)
        return to_log

    def _end_batch(self, batch: Any, batch_idx: int, is_last: bool, out: Any) -> None:
        """``on_train_batch_end``, at Lightning's logger step; the ranks agree on a stop."""
        drv = self.driver
        p = self.state.progress
        # Lightning's logger x-axis: batches that stepped, not yet counting this one.
        drv.logger_step = p.step - 1 if out.stepped else p.step
        if self._heard[2]:
            self.state = drv.fire(
                "on_train_batch_end",
                self.state,
                batch=batch,
                batch_idx=batch_idx,
                outputs=out,
                num_batches=self.num_train,
                is_last_batch=is_last,
            )
        if drv.world_size > 1:
            self._agree_on_stop()

    def _log_step(self, to_log: dict[str, Any], epoch: int, out: Any) -> None:
        """The step's row (with the gradient norms) when the logging interval says so."""
        drv = self.driver
        if self.checks.norms:
            to_log = {**to_log, **self.checks.norms}
        if to_log and schedule.should_log_step(
            self.config, drv.logger_step, self.state.loop.should_stop, accumulating=not out.stepped
        ):
            drv.log_metrics({**to_log, "epoch": epoch}, drv.logger_step)

    def _validate_if_due(self, epoch: int, batch_idx: int, is_last: bool) -> None:
        """Validation inside the epoch, where the validation schedule puts it."""
        c, p = self.config, self.state.progress
        if self.enable_val and schedule.should_validate(
            c,
            epoch=epoch,
            batch_idx=batch_idx,
            total_batch_idx=p.total_batches - 1,
            is_last_batch=is_last,
            val_check_batch=self.val_check_batch,
            should_stop=self.state.loop.should_stop,
            can_stop_early=schedule.can_stop_early(c, p.epoch, p.step),
        ):
            self._validate(epoch)
            self._agree_on_stop()  # validation callbacks (early stopping) may have asked

    def _request(self, requests: Any) -> None:
        """Carry out a scheduler's requests (the driver does, as for callbacks')."""
        if requests:
            self.state = self.driver.carry_out(self.state, requests)

    # ------------------------------------------------------------------ inside a step

    def _before_update(
        self,
        view: TrainState,
        grads: Any,
        batch: Any,
        batch_idx: int,
        extra: dict[str, Any] | None = None,
    ) -> TrainState:
        """Between a backward pass and its update: the non-finite checks, the gradient norms
        and ``on_before_optimizer_step`` (``extra``: which of several optimizers)."""
        checks = self.checks
        if checks.terminate_on_nan:
            checks.check_loss(grads.output.loss)
        if not grads.ready:
            return view
        if checks.inspects_gradients:
            checks.inspect(grads)
        if self._heard[1]:
            fields = {"extra": extra} if extra is not None else {}
            view = self.driver.fire(
                "on_before_optimizer_step",
                view,
                batch=batch,
                batch_idx=batch_idx,
                outputs=grads,
                num_batches=self.num_train,
                **fields,
            )
        return view

    def _where(self) -> str:
        p = self.state.progress
        return f"epoch {p.epoch}, batch {self._batch_idx}, global step {p.step}"

    def _apply(self, state: TrainState, grads: Any) -> tuple[TrainState, Any]:
        """The optimizer update; in place when donating.

        An update in place consumes the last commit point (its tensors are the ones
        written): the driver forgets it (``past_commit``) and marks the state torn until the
        update returns, and Ctrl-C waits for that (``InterruptGuard``).
        """
        if not self.donate:
            return self._stepper.apply(state, grads)
        drv, guard = self.driver, self._guard
        guard.enter()
        drv.torn = True
        drv.last_commit = None
        drv.past_commit = True
        state, out = self._stepper.apply(state, grads)
        self.state = state
        drv.torn = False
        guard.leave()  # a Ctrl-C held back during the update is raised here
        return state, out

    def _agree_on_stop(self) -> None:
        """Under several processes, a stop any process requests stops them all (at the same
        batch, so their states and checkpoints stay consistent)."""
        drv = self.driver
        if drv.world_size > 1:
            loop = self.state.loop
            agreed = drv.strategy.reduce_flag(loop.should_stop, "any")
            if agreed != loop.should_stop:
                self._record(should_stop=agreed)

    def _record_kept_only(self) -> None:
        """A new training epoch's accumulators: none, but the kept ones (``aggregate.keep``:
        state the steps keep across epochs; those that end with the training epoch,
        ``aggregate.drop_ended``, are dropped)."""
        loop = self.state.loop
        kept = aggregate.kept(loop.train_epoch, loop.train_specs, ending=Stage.TRAIN)
        self._record(train_epoch=kept)

    def _validate(self, epoch: int) -> None:
        self._ensure_val(epoch)
        self.state, _ = run_evaluation(
            self.state,
            self.eval_step,
            self.val,
            stage=Stage.VALIDATE,
            driver=self.driver,
            max_batches=self.val_max,
        )

    def _epoch_end(self, epoch: int) -> None:
        drv = self.driver
        loop = self.state.loop
        accumulated = aggregate.reported(loop.train_epoch, loop.train_specs)
        if drv.world_size > 1:  # epoch values cover every process's batches
            accumulated = drv.strategy.sync_metrics(accumulated)
        to_log, bar, to_callbacks = aggregate.epoch_values(accumulated, loop.train_specs)
        self._record(callback_metrics={**loop.callback_metrics, **to_callbacks})
        drv.progress_bar_metrics.update(bar)
        # Epoch rows share the step of the epoch's last training row (Lightning's quirk).
        row_step = max(self.state.progress.step - 1, 0)
        drv.logger_step = row_step
        with drv.collecting() as logged_by_callbacks:
            self._fire("on_train_epoch_end", num_batches=self.num_train)
        self._agree_on_stop()
        if self.schedulers:
            metrics = self.state.loop.callback_metrics
            self.state, requests = self.schedulers.epoch_end(self.state, metrics)
            self._request(requests)
        row = {**to_log, **logged_by_callbacks}
        if row:
            drv.log_metrics({**row, "epoch": epoch}, row_step)
        p = self.state.progress
        # The loop's accumulation window closes with the epoch; manual optimization's
        # per-optimizer windows count that optimizer's calls and stay open across it.
        keep = getattr(self.step, "manual", False)
        self.state = self.state.replace(
            progress=p.replace(epoch=p.epoch + 1, batch_in_epoch=0, micro_step=0),
            grad_accum=self.state.grad_accum if keep else None,
        )
        self._record_kept_only()
        drv.logger_step = self.state.progress.step
        drv.commit(self.state)


def _refuse_end_epoch(driver: Driver, event: str) -> None:
    """An end_epoch request that came from an event other than ``on_train_batch_start``."""
    if driver.end_epoch:
        driver.end_epoch = False
        raise ValueError(
            f"Requests(end_epoch=True) came from {event} (or another event there): it is "
            "honoured at on_train_batch_start only, where it ends the epoch before that batch "
            "(Lightning's on_train_batch_start returning -1); ask for it there, or request a "
            "stop (Requests(stop=True)) to end training"
        )


def _copied(tree: Any) -> Any:
    """``tree`` with every tensor copied (the state a donating loop may write in place)."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _merged_specs(
    known: dict[str, aggregate.MetricSpec], resolved: dict[str, tuple[aggregate.MetricSpec, Any]]
) -> dict[str, aggregate.MetricSpec]:
    """``known`` with this batch's specs; the same dict when nothing changed (the usual)."""
    for name, (spec, _) in resolved.items():
        if known.get(name) is not spec:
            return {**known, **aggregate.specs_of(resolved)}
    return known


def fit(
    state: TrainState,
    step: Any,
    train: Any,
    *,
    val: Any = (),
    eval_step: Any = None,
    config: Any = None,
    callbacks: Sequence[Any] = (),
    loggers: Sequence[Any] = (),
    observers: Sequence[Any] = (),
    driver: Driver | None = None,
    hparams: dict[str, Any] | None = None,
    donate: bool = False,
) -> TrainState:
    """Train ``state`` with ``step`` on ``train`` (validating with ``eval_step`` on ``val``).

    ``train`` and ``val`` may be datasets, tensors, DataLoaders or ``loops.data`` streams
    (``val`` may be a list of them); ``config`` is a ``LoopConfig`` (defaults when None);
    ``driver`` replaces the one built from ``callbacks``, ``loggers`` and ``observers``.
    ``donate``: update the loop's own state in place (see ``FitLoop``; ``state`` itself is
    never written). Returns the final state.
    """
    from .data import Batches, as_list, source

    driver, config = prepare(
        "fit", driver, config, callbacks=callbacks, loggers=loggers, observers=observers
    )
    train = train if isinstance(train, Batches) else source(train)
    val_sources = as_list(val) if val is not None and not _empty(val) else []
    loop = FitLoop(
        step,
        train,
        driver=driver,
        config=config,
        val=val_sources,
        eval_step=eval_step,
        hparams=hparams,
        donate=donate,
    )
    return loop.run(state)


def _empty(data: Any) -> bool:
    return isinstance(data, (list, tuple, dict)) and len(data) == 0
