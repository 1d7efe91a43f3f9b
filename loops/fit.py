"""``fit``: epochs of pure train steps with validation, callbacks and logging in between.

The composition follows Lightning's fit loop event by event (see ``loops.events``), with
every decision taken by a pure function of ``loops.schedule`` over the counters in the
state. Checkpoints requested by callbacks are written only at commit points — after a batch
is fully processed (step, logging, validation) and after an epoch ends — so a run resumed
from any checkpoint continues exactly where the saved state says: the epoch and batch come
from ``Progress``, the epoch's metric accumulators, the stop request, the values callbacks
see and the data reload epochs from the loop state. On Ctrl-C the exception handlers run,
the status becomes "interrupted" and the latest state is returned.

Data may be given ready (``train``, ``val``) or as functions that build it
(``reload_train``, ``reload_val``), which the loop calls when it first needs the data and
again as ``reload_dataloaders_every_n_epochs`` says (Lightning's lazy loading: validation
data is built for the sanity check, before the training data).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from purestep.engine.state import TrainState
from purestep.engine.tree import map as tree_map

from . import aggregate, loop_state, schedule
from .callbacks.base import init_states
from .data import length
from .driver import Driver, prepare
from .evaluate import run_evaluation
from .events import BatchPosition, Stage
from .interrupts import InterruptGuard
from .profiling import ProfiledTrainStep, section
from .schedulers import LRSchedulers

__all__ = ["FitLoop", "NonFiniteLossError", "fit", "grad_norm_type"]


class NonFiniteLossError(ValueError):
    """``terminate_on_nan``: a loss or gradient was NaN or infinite (raised before the
    optimizer update it would have fed, so the state and the last checkpoint are whole)."""


def grad_norm_type(value: Any) -> float | None:
    """Lightning's ``track_grad_norm``: -1 (off) -> None, else the p of the p-norm (a
    positive number or ``"inf"``) as a float (None stays None)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.lower() != "inf":
            raise ValueError(f"track_grad_norm must be -1, a p > 0 or 'inf', got {value!r}")
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"track_grad_norm must be -1, a p > 0 or 'inf', got {value!r}")
    if value == -1:
        return None
    if not value > 0:
        raise ValueError(f"track_grad_norm must be -1, a p > 0 or 'inf', got {value!r}")
    return float(value)


_BATCH_EVENTS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


def _numbered(batches: Iterator[Any], start: int, num: int | float) -> Iterator[Any]:
    """``(batch_idx, batch, is_last)`` from ``start``; an unsized epoch (``num = inf``)
    looks one batch ahead to know its last batch, as Lightning's prefetcher does."""
    if num != math.inf:
        for batch_idx, batch in zip(range(start, int(num)), batches):
            yield batch_idx, batch, batch_idx + 1 == num
        return
    it = iter(batches)
    sentinel = object()
    current = next(it, sentinel)
    batch_idx = start
    while current is not sentinel:
        following = next(it, sentinel)
        yield batch_idx, current, following is sentinel
        current, batch_idx = following, batch_idx + 1


class FitLoop:
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
        self.train = train
        self.val = list(val) if val is not None else None
        self.eval_step = eval_step
        self.driver = driver
        self.config = config
        self.reload_train = reload_train
        self.reload_val = reload_val
        self.hparams = hparams
        self.donate = donate
        self.schedulers = LRSchedulers(schedulers, multi=self._multi)
        self.grad_norm_p = grad_norm_type(track_grad_norm)
        self.terminate_on_nan = bool(terminate_on_nan)
        self._grad_norm_values: dict[str, torch.Tensor] = {}
        self._batch_idx = 0
        # The step the batches run (set by run): ``step``, or ``step.donating(backward=False)``.
        self._stepper = step
        self._guard = InterruptGuard()
        # Whether anything listens to the three per-batch events (set by run: callbacks and
        # observers are fixed for a run); the batch skips the calls nobody hears.
        self._heard = (True, True, True)
        self.state: TrainState | None = None
        self.num_train: int | float | None = None
        self.val_max: list[int | float] = []
        self.val_check_batch: int | float = math.inf
        has_val_data = bool(self.val) or (self.val is None and reload_val is not None)
        self.enable_val = eval_step is not None and schedule.validation_enabled(
            config, has_val_data
        )
        self._told_min = False
        self._warned_few = False
        self._factor = 1  # this epoch's accumulation factor (set by _epoch)
        if not self.enable_val:
            driver.extra["num_val_batches"] = 0
        if self.train is not None:
            self._measure_train()
        if self.val is not None:
            self._measure_val()

    # ------------------------------------------------------------------ data

    def _measure_train(self) -> None:
        c = self.config
        self.num_train = schedule.train_batches(c, length(self.train))
        # weight averaging recomputes BatchNorm statistics over the training data at the end
        self.driver.extra["train_data"] = (self.train, self.num_train)
        if self.enable_val:
            self.val_check_batch = schedule.val_check_batch(c, self.num_train)
        message = schedule.few_batches_warning(c, self.num_train, bool(self.driver.loggers))
        if message and not self._warned_few:
            self.driver.say(message)
            self._warned_few = True

    def _measure_val(self) -> None:
        lengths = [length(v) for v in self.val]
        self.val_max = list(schedule.eval_batches(self.config, "val", lengths))
        # checkpointing decides where to save from whether there is validation data
        self.driver.extra["num_val_batches"] = sum(self.val_max) if self.enable_val else 0

    def _record(self, **changes: Any) -> None:
        loop = loop_state.get(self.state)
        self.state = loop_state.put(self.state, loop.replace(**changes))

    def _ensure_train(self, epoch: int) -> None:
        """Build the training data if missing, or rebuild it when the reload rule says so.

        Data given to the loop counts as loaded at the first epoch it serves. Data built only
        because it is missing (a resumed run) does not move the recorded reload epoch, so a
        resumed run reloads when the uninterrupted one would.
        """
        last = loop_state.get(self.state).last_train_reload
        if self.train is None:
            self.train = self.reload_train()
            self._measure_train()
            if last is None:
                self._record(last_train_reload=epoch)
        elif last is None:
            self._record(last_train_reload=epoch)
        elif self.reload_train is not None and schedule.should_reload(self.config, epoch, last):
            self.train = self.reload_train()
            self._measure_train()
            self._record(last_train_reload=epoch)

    def _ensure_val(self, epoch: int, sanity: bool = False) -> None:
        """The validation counterpart of ``_ensure_train``, with Lightning's rule for what a
        load counts as: data loaded for the sanity check (or given to the loop) counts as
        ``epoch``'s load only if ``epoch`` validates; otherwise the first validation loads
        the data again when a reload function exists."""
        c = self.config
        last = loop_state.get(self.state).last_val_reload
        missing = self.val is None
        due = not sanity and self.reload_val is not None and schedule.should_reload(c, epoch, last)
        if not (missing or due):
            return
        self.val = list(self.reload_val())
        self._measure_val()
        first = last is None and (not sanity or schedule.sanity_check_sets_val_reload(c, epoch))
        if due or first:
            self._record(last_val_reload=epoch)

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
            and loop_state.get(self.state).last_val_reload is None
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
            should_stop=loop_state.get(self.state).should_stop,
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
        kept_before = loop_state.get(self.state)  # and the steps' kept accumulators
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
        batches = _numbered(batches, start, num)
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
                should_stop=loop_state.get(self.state).should_stop,
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
        drv, c = self.driver, self.config
        num = self.num_train
        heard_start, heard_before, heard_end = self._heard
        self._batch_idx = batch_idx
        samples_before = self.state.progress.samples
        if self.schedulers:
            self._request(self.schedulers.batch_start(self.state))
        drv.position = drv.train_position = BatchPosition(
            batch_idx, 0, num, 1, is_last, self.state.progress
        )
        if heard_start:
            self.state = drv.fire(
                "on_train_batch_start",
                self.state,
                batch=batch,
                batch_idx=batch_idx,
                num_batches=num,
            )
            if drv.world_size > 1 and drv.handlers("on_train_batch_start"):
                # one rank's request ends every rank's epoch (only handlers can ask: every
                # rank has the same callbacks, so all take this collective or none)
                drv.end_epoch = drv.strategy.reduce_flag(drv.end_epoch, "any")
            if drv.end_epoch:
                drv.end_epoch = False
                drv.train_position = drv.position._replace(is_last=True)  # Lightning's flag
                return True
        close = schedule.is_optimizer_step(batch_idx, self._factor, num, is_last)
        if self._grad_norm_values:
            self._grad_norm_values = {}
        if self._multi:

            def before_update(view, grads, index, name):
                return self._before_update(view, grads, batch, batch_idx, index, name)

            before_step = None
            if getattr(self.step, "manual", False) and self.schedulers.has_step_schedules():

                def before_step(view, index, name):
                    requests = self.schedulers.step_start(view, name)
                    return drv.carry_out(view, requests) if requests else view

            state, out = self._stepper.run(
                self.state,
                batch,
                batch_idx=batch_idx,
                end_window=close,
                before_update=before_update,
                before_step=before_step,
            )
        else:
            state, grads = self._stepper.backward(self.state, batch, end_window=close)
            if self.terminate_on_nan:
                self._check_finite_loss(grads.output.loss)
            if grads.ready:
                if self.terminate_on_nan or self.grad_norm_p is not None:
                    self._inspect_gradients(grads)
                if heard_before:
                    state = drv.fire(
                        "on_before_optimizer_step",
                        state,
                        batch=batch,
                        batch_idx=batch_idx,
                        outputs=grads,
                        num_batches=num,
                    )
                state, out = self._apply(state, grads)
            else:
                out = grads.output

        samples = state.progress.samples - samples_before  # this batch's
        loop = loop_state.get(state)
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
        self.state = loop_state.put(state, loop)
        drv.progress_bar_metrics.update(bar)
        p = self.state.progress
        # Lightning's logger x-axis: batches that stepped, not yet counting this one.
        drv.logger_step = p.step - 1 if out.stepped else p.step
        if heard_end:
            self.state = drv.fire(
                "on_train_batch_end",
                self.state,
                batch=batch,
                batch_idx=batch_idx,
                outputs=out,
                num_batches=num,
                is_last_batch=is_last,
            )
        if drv.world_size > 1:
            self._agree_on_stop()
        should_stop = loop_state.get(self.state).should_stop
        if self._grad_norm_values:
            to_log = {**to_log, **self._grad_norm_values}
        if to_log and schedule.should_log_step(
            c, drv.logger_step, should_stop, accumulating=not out.stepped
        ):
            drv.log_metrics({**to_log, "epoch": epoch}, drv.logger_step)
        if self.enable_val and schedule.should_validate(
            c,
            epoch=epoch,
            batch_idx=batch_idx,
            total_batch_idx=p.total_batches - 1,
            is_last_batch=is_last,
            val_check_batch=self.val_check_batch,
            should_stop=should_stop,
            can_stop_early=schedule.can_stop_early(c, p.epoch, p.step),
        ):
            self._validate(epoch)
            self._agree_on_stop()  # validation callbacks (early stopping) may have asked
        if self.schedulers:
            metrics = loop_state.get(self.state).callback_metrics
            self.state, requests = self.schedulers.batch_end(self.state, metrics, out.stepped)
            self._request(requests)
        drv.logger_step = self.state.progress.step
        return False

    def _request(self, requests: Any) -> None:
        """Carry out a scheduler's requests (the driver does, as for callbacks')."""
        if requests:
            self.state = self.driver.carry_out(self.state, requests)

    # ------------------------------------------------------------------ inside a step

    def _before_update(
        self, view: TrainState, grads: Any, batch: Any, batch_idx: int, index: int, name: str
    ) -> TrainState:
        """Between one optimizer's backward and its update (several optimizers): the
        non-finite checks, the gradient norms and ``on_before_optimizer_step``."""
        if self.terminate_on_nan:
            self._check_finite_loss(grads.output.loss)
        if not grads.ready:
            return view
        if self.terminate_on_nan or self.grad_norm_p is not None:
            self._inspect_gradients(grads)
        if self._heard[1]:
            view = self.driver.fire(
                "on_before_optimizer_step",
                view,
                batch=batch,
                batch_idx=batch_idx,
                outputs=grads,
                num_batches=self.num_train,
                extra={"optimizer_idx": index, "optimizer_name": name},
            )
        return view

    def _where(self) -> str:
        p = self.state.progress
        return f"epoch {p.epoch}, batch {self._batch_idx}, global step {p.step}"

    def _check_finite_loss(self, loss: torch.Tensor | None) -> None:
        """``terminate_on_nan``'s check of the step's loss, agreed across ranks (one small
        all-reduce a step): a NaN on one rank stops every rank with the same error, naming
        the rank, instead of leaving the others to fail in their next collective."""
        bad = loss is not None and not bool(torch.isfinite(loss).all())
        drv = self.driver
        if drv.world_size > 1:
            if not drv.strategy.reduce_flag(bad, "any"):
                return
            seen = drv.strategy.all_gather_object(loss.item() if bad else None)
            found = [(r, v) for r, v in enumerate(seen) if v is not None]
        elif not bad:
            return
        else:
            found = [(None, loss.item())]
        where = ", ".join(f"{v} on rank {r}" if r is not None else f"{v}" for r, v in found)
        raise NonFiniteLossError(
            f"terminate_on_nan: the loss returned by the training step is {where} "
            f"({self._where()}); training stopped before the optimizer update, so the "
            "state and the last checkpoint hold no NaN"
        )

    def _inspect_gradients(self, grads: Any) -> None:
        """``track_grad_norm``'s norms of the gradients the optimizer is about to use and
        ``terminate_on_nan``'s check of them (before the update)."""
        values = grads.grads
        if not values:  # a skipped batch: no gradients to look at
            return
        names = list(values)
        tensors = list(values.values())
        # A float16 overflow (``grads.finite`` False) is the loss scaler's routine: the
        # update is skipped and the scale lowered, so it is no reason to stop.
        drv = self.driver
        if self.terminate_on_nan and getattr(grads, "finite", True):
            finite = [bool(torch.isfinite(t).all()) for t in tensors]
            # sharded gradients (FSDP): a NaN may sit in one rank's shard only; every rank
            # stops together, not one while the others wait in the next collective
            stop = not all(finite)
            if drv.world_size > 1:
                stop = drv.strategy.reduce_flag(stop, "any")
            if stop:
                bad = [n for n, ok in zip(names, finite) if not ok]
                if drv.world_size > 1:  # name the ranks whose gradients (or shards) hold it
                    held = drv.strategy.all_gather_object(bool(bad))
                    ranks = [r for r, b in enumerate(held) if b]
                    bad = f"{bad or 'the shards of another rank'} (on rank(s) {ranks})"
                raise NonFiniteLossError(
                    f"terminate_on_nan: detected nan and/or inf values in the gradients of "
                    f"{bad} ({self._where()}); training stopped before the optimizer update, "
                    "so the state and the last checkpoint hold no NaN"
                )
        p = self.grad_norm_p
        if p is None:
            return
        sharded = getattr(drv.strategy, "gradient_norms", None)  # FSDP: of whole gradients
        norms = sharded(tensors, p) if sharded is not None else torch._foreach_norm(tensors, p)
        prefix = f"grad_{p}_norm"
        found = self._grad_norm_values
        found.pop(f"{prefix}_total", None)
        found.update({f"{prefix}/{n}": v.detach() for n, v in zip(names, norms)})
        # the norm of every gradient of the batch (several optimizers: all of theirs)
        stacked = torch.stack([v.float() for v in found.values()])
        found[f"{prefix}_total"] = torch.linalg.vector_norm(stacked, p)

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
            loop = loop_state.get(self.state)
            agreed = drv.strategy.reduce_flag(loop.should_stop, "any")
            if agreed != loop.should_stop:
                self._record(should_stop=agreed)

    def _record_kept_only(self) -> None:
        """A new training epoch's accumulators: none, but the kept ones (``aggregate.keep``:
        state the steps keep across epochs; those that end with the training epoch,
        ``aggregate.drop_ended``, are dropped)."""
        loop = loop_state.get(self.state)
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
        loop = loop_state.get(self.state)
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
            metrics = loop_state.get(self.state).callback_metrics
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
