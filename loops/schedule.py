"""Every loop decision, as a pure function of counters, the ``LoopConfig`` and data sizes.

How many batches an epoch has, when to validate, when an accumulation window ends, when to
log, reload or stop: each rule is one small function here, with Lightning's exact semantics
(quirks included; see each docstring), so a loop driver only sequences effects and never
re-implements a rule. Everything works on plain ints and floats; an unsized (iterable)
dataset has length ``math.inf``.

Vocabulary of the counters (Lightning's names in brackets):

* ``epoch``: 0-based index of the epoch being run [``current_epoch``];
* ``epochs_done``: epochs whose batches have all run [``epoch_progress.current.processed``];
  between epochs it equals the index of the next epoch;
* ``batch_idx``: 0-based batch index inside the epoch; ``total_batch_idx``: across epochs;
* ``global_step``: optimizer steps taken so far (``Progress.step``);
* ``batches_that_stepped``: training batches that ended in an optimizer step, counted
  *after* the batch's validation [``_batches_that_stepped``]; the loggers' x-axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from .config import DEFAULT_MAX_EPOCHS, LIMIT_FLAGS, LoopConfig

__all__ = [
    "Verdict",
    "accumulation_factor",
    "can_stop_early",
    "checkpoint_on_train_epoch_end",
    "early_stopping_on_train_epoch_end",
    "epoch_done",
    "estimated_stepping_batches",
    "eval_batches",
    "evaluation_skipped",
    "few_batches_warning",
    "fit_done",
    "is_last_batch",
    "is_optimizer_step",
    "is_val_epoch",
    "limit_for",
    "logger_step",
    "num_batches",
    "reached",
    "sanity_batches",
    "sanity_check_sets_val_reload",
    "sequential_order",
    "should_log_step",
    "should_reload",
    "should_run_sanity_check",
    "should_validate",
    "startup_messages",
    "train_batches",
    "training_skipped",
    "val_check_batch",
    "validation_enabled",
]

Count = int | float  # an int, or math.inf for "unbounded"

_STAGE_PREFIX = {
    "train": "train",
    "val": "val",
    "validate": "val",
    "validation": "val",
    "sanity_check": "val",
    "test": "test",
    "predict": "predict",
}


class Verdict(NamedTuple):
    """A stop decision and a message for the user (empty when there is nothing to say).

    Unpacks as ``(done, reason)``; its truth value is ``done`` (not the tuple's length).
    """

    done: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.done


def reached(current: int, maximum: int) -> bool:
    """Whether a counter hit its maximum; a maximum of -1 means no limit."""
    return maximum != -1 and current >= maximum


# --------------------------------------------------------------------------- batch counts


def _prefix(stage: str) -> str:
    try:
        return _STAGE_PREFIX[stage]
    except KeyError:
        raise ValueError(
            f"unknown stage {stage!r}; expected one of {', '.join(map(repr, _STAGE_PREFIX))}"
        ) from None


def limit_for(config: LoopConfig, stage: str) -> int | float:
    """The batch limit that applies to ``stage`` ("train", "val"/"sanity_check", "test",
    "predict")."""
    return getattr(config, LIMIT_FLAGS[_prefix(stage)])


def num_batches(length: Count, limit: int | float, stage: str) -> Count:
    """Batches one loader yields under ``limit`` (Lightning's rule, truncation included).

    ``length`` 0 gives 0. An int limit caps the count: ``min(length, limit)``. A float limit
    takes ``int(length * limit)`` (truncation, not rounding) of a sized loader; an unsized
    loader (``length = inf``) accepts only ``1.0`` (everything) or an int. A positive
    fraction that leaves less than one batch is an error naming the stage's flag.
    """
    prefix = _prefix(stage)
    if not (length == math.inf or (isinstance(length, int) and length >= 0)):
        raise ValueError(
            f"the {prefix} data length must be an int >= 0 or math.inf, got {length!r}"
        )
    if length == 0:
        return 0
    flag = f"limit_{prefix}_batches"
    if isinstance(limit, int):
        return min(length, limit)
    if length == math.inf:
        if limit != 1.0:
            raise ValueError(
                f"`{flag}={limit!r}`: the {prefix} data has no length, so the limit must be "
                "1.0 (all of it) or an int (a number of batches)."
            )
        return math.inf
    count = int(length * limit)
    if count == 0 and limit > 0:
        raise ValueError(
            f"`{flag}={limit!r}` of the {prefix} data ({length} batches) is less than one "
            f"batch. Increase `{flag}`, to at least {1.0 / length} (or pass an int)."
        )
    return count


def train_batches(config: LoopConfig, length: Count) -> Count:
    """Batches per training epoch for training data of ``length`` batches."""
    return num_batches(length, config.limit_train_batches, "train")


def eval_batches(config: LoopConfig, stage: str, lengths: Sequence[Count]) -> tuple[Count, ...]:
    """Batches per loader of an evaluation stage ("val", "test", "predict")."""
    limit = limit_for(config, stage)
    return tuple(num_batches(length, limit, stage) for length in lengths)


def evaluation_skipped(max_batches: Sequence[Count]) -> bool:
    """An evaluation with no batches at all is skipped entirely: no events fire."""
    return sum(max_batches) == 0


def training_skipped(config: LoopConfig) -> bool:
    """``limit_train_batches == 0``: fit never asks for training data and runs no epoch
    (setup, the sanity check and the fit start/end events still happen)."""
    return config.limit_train_batches == 0


def is_last_batch(batch_idx: int, num_training_batches: Count) -> bool:
    """Whether ``batch_idx`` is the last batch of a sized epoch (an unsized loader learns it
    from its iterator instead)."""
    return batch_idx + 1 == num_training_batches


def sequential_order(config: LoopConfig) -> bool:
    """With ``overfit_batches`` the training data (and, during fit, the validation data) is
    read unshuffled, in dataset order, so every epoch sees the same first batches."""
    return config.overfit_batches > 0


# --------------------------------------------------------------------------- sanity check


def validation_enabled(config: LoopConfig, has_val_data: bool = True) -> bool:
    """Validation exists in fit when there is validation data and ``limit_val_batches > 0``."""
    return has_val_data and config.limit_val_batches > 0


def should_run_sanity_check(
    config: LoopConfig, *, enabled: bool, resumed: bool = False, mid_epoch: bool = False
) -> bool:
    """Whether fit starts with a sanity check of the validation loop.

    It runs when validation is enabled and ``num_sanity_val_steps > 0``, unless the loop is
    restarting: resumed from a checkpoint taken mid-epoch, or any checkpoint when
    ``max_steps`` is set (Lightning's quirk: an epoch-end checkpoint re-runs it).
    """
    restarting = resumed and (mid_epoch or config.max_steps != -1)
    return enabled and config.num_sanity_val_steps > 0 and not restarting


def sanity_batches(
    config: LoopConfig, max_batches_per_loader: Sequence[Count]
) -> tuple[Count, ...]:
    """Batches the sanity check runs per validation loader: ``min(num_sanity_val_steps, n)``."""
    steps = config.num_sanity_val_steps
    return tuple(min(steps, n) for n in max_batches_per_loader)


def sanity_check_sets_val_reload(config: LoopConfig, epoch: int) -> bool:
    """Whether loading the validation data for the sanity check counts as its (re)load of
    ``epoch`` for ``reload_dataloaders_every_n_epochs``: only if ``epoch`` validates."""
    return is_val_epoch(config, epoch)


# --------------------------------------------------------------------------- validation


def val_check_batch(config: LoopConfig, num_training_batches: Count) -> Count:
    """Every how many training batches validation runs (``math.inf``: at epoch end only).

    The unit is training batches, not optimizer steps. An int ``val_check_interval`` is used
    as is, and must not exceed the epoch's batches while ``check_val_every_n_epoch`` is set
    (unless validation is off: ``limit_val_batches=0``). A float takes
    ``max(1, int(num_training_batches * interval))`` (truncation, so a fraction that does not
    divide the epoch skips the epoch-end validation); an unsized epoch accepts only 1.0.
    With no training batches there is nothing to count: ``math.inf``.
    """
    interval = config.val_check_interval
    if num_training_batches == 0:
        return math.inf
    if isinstance(interval, int):
        if (
            interval > num_training_batches
            and config.check_val_every_n_epoch is not None
            and config.limit_val_batches > 0
        ):
            raise ValueError(
                f"`val_check_interval={interval}` must be less than or equal to the number of "
                f"training batches ({num_training_batches}). To turn validation off set "
                "`limit_val_batches=0`; to count batches across epochs set "
                "`check_val_every_n_epoch=None`."
            )
        return interval
    if num_training_batches == math.inf:
        if interval != 1.0:
            raise ValueError(
                f"`val_check_interval={interval!r}`: the training data has no length, so the "
                "interval must be 1.0 (end of epoch) or an int (a number of batches)."
            )
        return math.inf
    return max(1, int(num_training_batches * interval))


def is_val_epoch(config: LoopConfig, epoch: int, enabled: bool = True) -> bool:
    """Whether validation may run during ``epoch`` (0-based): every
    ``check_val_every_n_epoch``-th epoch (so with 2: epochs 1, 3, 5, ...), or every epoch
    when it is None."""
    every = config.check_val_every_n_epoch
    return enabled and (every is None or (epoch + 1) % every == 0)


def should_validate(
    config: LoopConfig,
    *,
    epoch: int,
    batch_idx: int,
    total_batch_idx: int,
    is_last_batch: bool,
    val_check_batch: Count,
    should_stop: bool = False,
    can_stop_early: bool = False,
    enabled: bool = True,
    iterator_mode: bool = False,
) -> bool:
    """Whether validation runs right after this training batch (Lightning's per-batch rule).

    Only in validation epochs. Then, in this order: the last batch of an epoch with no
    batch-count interval (or of a loop fed by the data iterator) validates; a stop request
    that may be honoured now (``can_stop_early``) validates at once, even mid-epoch; an int
    ``limit_train_batches`` with no batch-count interval validates every that many batches;
    otherwise validation runs when ``(counter + 1) % val_check_batch == 0``, where the
    counter is ``batch_idx`` (or ``total_batch_idx`` when ``check_val_every_n_epoch`` is
    None). That modulo *replaces* the end-of-epoch default, so a non-dividing interval skips
    the last batch. Reaching ``max_steps`` gets no special validation.
    """
    if not is_val_epoch(config, epoch, enabled):
        return False
    unbounded = val_check_batch == math.inf
    if is_last_batch and (unbounded or iterator_mode):
        return True
    if should_stop and can_stop_early:
        return True
    limit = config.limit_train_batches
    if isinstance(limit, int) and unbounded:
        return limit > 0 and (batch_idx + 1) % limit == 0
    if not unbounded:
        counter = total_batch_idx if config.check_val_every_n_epoch is None else batch_idx
        return (counter + 1) % val_check_batch == 0
    return is_last_batch


# --------------------------------------------------------------------------- stopping


def can_stop_early(config: LoopConfig, epochs_done: int, global_step: int) -> bool:
    """Whether a stop request may be honoured: ``min_epochs`` and ``min_steps`` are met."""
    epochs_ok = epochs_done >= config.min_epochs if config.min_epochs else True
    steps_ok = global_step >= config.min_steps if config.min_steps else True
    return epochs_ok and steps_ok


def fit_done(
    config: LoopConfig,
    *,
    num_training_batches: Count,
    global_step: int,
    epochs_done: int,
    should_stop: bool,
) -> Verdict:
    """Whether fit ends before starting another epoch, and why (checked before each epoch).

    In order: no training batches; ``max_steps`` reached; ``max_epochs`` reached; a stop
    request once ``can_stop_early``. The maxima win over ``min_epochs``/``min_steps``.
    """
    if num_training_batches == 0:
        return Verdict(True, "fit stopped: there are no training batches.")
    if reached(global_step, config.max_steps):
        return Verdict(True, f"fit stopped: max_steps={config.max_steps} reached.")
    if reached(epochs_done, config.max_epochs):
        return Verdict(True, f"fit stopped: max_epochs={config.max_epochs} reached.")
    if should_stop and can_stop_early(config, epochs_done, global_step):
        return Verdict(True, "fit stopped: a stop was requested.")
    return Verdict(False)


def epoch_done(
    config: LoopConfig,
    *,
    batches_done: int,
    num_training_batches: Count,
    is_last_batch: bool,
    global_step: int,
    epochs_done: int,
    should_stop: bool,
    validation_done: bool = True,
) -> Verdict:
    """Whether the training epoch ends before another batch (checked before every batch).

    It ends when its batches are exhausted (``batches_done == num_training_batches`` or the
    last batch was seen) or ``max_steps`` is reached — once any validation due has run —
    or on a stop request that ``can_stop_early`` allows. A request that must wait for
    ``min_epochs``/``min_steps`` keeps the epoch going and comes with a message saying so.
    """
    exhausted = (
        reached(global_step, config.max_steps)
        or batches_done == num_training_batches
        or is_last_batch
    )
    if exhausted and validation_done:
        return Verdict(True)
    if should_stop:
        if can_stop_early(config, epochs_done, global_step):
            return Verdict(True)
        return Verdict(
            False,
            "A stop was requested but the required "
            f"min_epochs={config.min_epochs!r} or min_steps={config.min_steps!r} "
            "has not been reached yet; training continues.",
        )
    return Verdict(False)


def early_stopping_on_train_epoch_end(config: LoopConfig) -> bool:
    """Where early stopping checks when not told: at train-epoch end if validation runs once
    per epoch (``val_check_interval == 1.0`` and ``check_val_every_n_epoch == 1``), else at
    validation end. Lightning's comparison is by value, so an int interval of 1 counts too."""
    return config.val_check_interval == 1.0 and config.check_val_every_n_epoch == 1


def checkpoint_on_train_epoch_end(config: LoopConfig, *, has_val_batches: bool) -> bool:
    """Where checkpointing saves when not told: never at train-epoch end unless every epoch
    validates (``check_val_every_n_epoch == 1``); then at train-epoch end when there is no
    validation data, else only if validation runs once per epoch (interval ``== 1.0``)."""
    if config.check_val_every_n_epoch != 1:
        return False
    return not has_val_batches or config.val_check_interval == 1.0


# --------------------------------------------------------------------------- accumulation


def accumulation_factor(config: LoopConfig, epoch: int) -> int:
    """Batches per optimizer step in ``epoch``: the factor of the largest scheduled epoch
    ``<= epoch`` (``{0: 1}`` is implied before the first scheduled epoch)."""
    constant = config.accumulate_grad_batches
    if type(constant) is int:
        return constant
    factor = 1
    for first_epoch, value in config.accumulation_schedule:
        if first_epoch > epoch:
            break
        factor = value
    return factor


def is_optimizer_step(
    batch_idx: int, factor: int, num_training_batches: Count, is_last_batch: bool
) -> bool:
    """Whether this batch closes an accumulation window and steps the optimizer.

    On ``(batch_idx + 1) % factor == 0`` or on the epoch's last batch (the epoch's batches
    after limits), so a short final window still steps; windows restart every epoch.
    """
    return (batch_idx + 1) % factor == 0 or batch_idx + 1 == num_training_batches or is_last_batch


# --------------------------------------------------------------------------- logging


def should_log_step(
    config: LoopConfig, batches_that_stepped: int, should_stop: bool, *, accumulating: bool = False
) -> bool:
    """Whether this batch's step metrics go to the loggers (decided at the batch's end,
    before validation and before ``batches_that_stepped`` counts this batch).

    Never on an accumulation batch; always under ``fast_dev_run``; never when
    ``log_every_n_steps == 0``; else when ``(batches_that_stepped + 1) % log_every_n_steps
    == 0`` or a stop was requested.
    """
    if accumulating:
        return False
    if config.fast_dev_run:
        return True
    every = config.log_every_n_steps
    if every == 0:
        return False
    return (batches_that_stepped + 1) % every == 0 or should_stop


def logger_step(batches_that_stepped: int, *, at: str = "batch", explicit: object = None) -> int:
    """The x-axis value a row of metrics is written at.

    ``explicit``: a ``"step"`` value the user logged wins (as an int). Otherwise
    ``batches_that_stepped`` — not yet counting the current batch at ``at="batch"`` (step
    metrics) and ``at="validation"`` (validation during fit), so a training row lands at
    ``global_step - 1``; at ``at="epoch_end"`` (epoch-level training metrics, after the
    last batch was counted) one less, so it shares the epoch's last training row's step.
    """
    if explicit is not None:
        return int(explicit)  # type: ignore[call-overload]
    if at in ("batch", "validation"):
        return batches_that_stepped
    if at == "epoch_end":
        return batches_that_stepped - 1
    raise ValueError(f"unknown at={at!r}; expected 'batch', 'validation' or 'epoch_end'")


def few_batches_warning(
    config: LoopConfig, num_training_batches: Count, has_loggers: bool
) -> str | None:
    """The warning for an epoch shorter than ``log_every_n_steps`` (with loggers, outside
    ``fast_dev_run``), or None."""
    if not has_loggers or config.fast_dev_run or num_training_batches >= config.log_every_n_steps:
        return None
    return (
        f"The training data has {num_training_batches} batches per epoch, fewer than "
        f"log_every_n_steps={config.log_every_n_steps}; step metrics are logged at most every "
        "that many optimizer steps. Lower log_every_n_steps to see them more often."
    )


def startup_messages(config: LoopConfig) -> tuple[str, ...]:
    """What fit tells the user when it starts: the ``max_epochs`` default taking effect and
    ``fast_dev_run`` mode."""
    messages = []
    if "max_epochs" not in config.flags and config.max_epochs == DEFAULT_MAX_EPOCHS:
        messages.append(
            f"max_epochs was not set, so fit runs at most {DEFAULT_MAX_EPOCHS} epochs. "
            "Pass max_epochs=-1 to train without an epoch limit."
        )
    if config.fast_dev_run:
        messages.append(
            f"fast_dev_run: every loop runs {config.fast_dev_run} batch(es); logging and "
            "checkpointing are suppressed."
        )
    return tuple(messages)


# --------------------------------------------------------------------------- data reloads


def should_reload(config: LoopConfig, epoch: int, last_reload_epoch: int | None) -> bool:
    """Whether a loader must be (re)built at ``epoch``: it never was (``last_reload_epoch``
    None), or ``reload_dataloaders_every_n_epochs = n > 0`` and ``n`` epochs passed since.
    Several validations in one epoch thus reload at most once."""
    if last_reload_epoch is None:
        return True
    every = config.reload_dataloaders_every_n_epochs
    return every > 0 and epoch - last_reload_epoch >= every


# --------------------------------------------------------------------------- estimates


def estimated_stepping_batches(config: LoopConfig, num_training_batches: Count) -> Count:
    """Optimizer steps the whole fit will take, for schedules that need a total.

    Unlimited epochs: ``max_steps`` (``inf`` when that is unset too). Unsized epochs:
    ``max_steps`` as is — Lightning's quirk: -1 when it is unset. Otherwise the sum over
    ``max(max_epochs, 1)`` epochs of ``ceil(batches / factor(epoch))``, capped by
    ``max_steps``. (Lightning uses the current factor for all epochs; an accumulation
    schedule, which Lightning has no flag for, is summed epoch by epoch.)
    """
    if config.max_epochs == -1:
        return math.inf if config.max_steps == -1 else config.max_steps
    if num_training_batches == math.inf:
        return config.max_steps
    epochs = max(config.max_epochs, 1)
    if isinstance(config.accumulate_grad_batches, int):
        total = math.ceil(num_training_batches / config.accumulate_grad_batches) * epochs
    else:
        total = sum(
            math.ceil(num_training_batches / accumulation_factor(config, e)) for e in range(epochs)
        )
    return min(total, config.max_steps) if config.max_steps != -1 else total
