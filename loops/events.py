"""Named loop events, what a callback sees at each one, what it may ask for, and dispatch.

The loops announce events in the order a PyTorch Lightning user knows (``FIT_EVENTS`` and
friends list them). At each one, every callback's handler of that name receives its own
state (kept in ``TrainState.callbacks[callback.key]``) and a read-only ``Context``, and
returns its new state and ``Requests`` — stop, log these values, save a checkpoint here,
delete that file, print this line. The callbacks stay pure; ``dispatch`` threads their states
through the training state and merges their requests, and the loop driver carries them out.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from purestep.engine.state import Progress, TrainState

__all__ = [
    "EVENTS",
    "FIT_EVENTS",
    "PREDICT_EVENTS",
    "TEST_EVENTS",
    "VALIDATE_EVENTS",
    "BatchPosition",
    "Context",
    "Requests",
    "Stage",
    "dispatch",
    "handlers_for",
    "handles",
]


class Stage:
    """What the loop is doing (``Context.stage``), with Lightning's names."""

    TRAIN = "train"
    SANITY_CHECK = "sanity_check"
    VALIDATE = "validate"
    TEST = "test"
    PREDICT = "predict"


_EVAL_EVENTS = (
    "on_{s}_start",
    "on_{s}_epoch_start",
    "on_{s}_batch_start",
    "on_{s}_batch_end",
    "on_{s}_epoch_end",
    "on_{s}_end",
)


def _eval(stage: str) -> tuple[str, ...]:
    return tuple(e.format(s=stage) for e in _EVAL_EVENTS)


VALIDATE_EVENTS = ("setup", *_eval("validation"), "teardown")
TEST_EVENTS = ("setup", *_eval("test"), "teardown")
PREDICT_EVENTS = ("setup", *_eval("predict"), "teardown")
FIT_EVENTS = (
    "setup",
    "on_fit_start",
    "on_sanity_check_start",
    *_eval("validation"),
    "on_sanity_check_end",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
)
EVENTS = tuple(
    dict.fromkeys((*FIT_EVENTS, *VALIDATE_EVENTS, *TEST_EVENTS, *PREDICT_EVENTS, "on_exception"))
)


@dataclasses.dataclass(frozen=True)
class Requests:
    """What callbacks ask the driver to do; ``a | b`` merges two sets of requests in order.

    ``stop``: end training at the next point the loop may stop (``min_epochs``/``min_steps``
    still apply); ``log``: values to send to the loggers and to the metrics callbacks see
    (written at once as their own row at the current logger step, as Lightning's callbacks
    write directly to loggers; values logged at epoch-end events join the epoch's row);
    ``save``: checkpoint files to write with the current state; ``save_weights``: files to
    write with the weights only (parameters and buffers); ``remove``: files to delete after
    the saves; ``link``: ``(target, link)`` pairs (``link`` points at ``target``);
    ``messages``: lines to show the user; ``hyperparams``: injected optimizer
    hyper-parameters to change before the next step, ``{"lr": 0.01}`` or, with several
    optimizers, ``{"<optimizer>/lr": 0.01}`` (a float, or one per parameter group; see
    ``engine.optim.set_hyperparams``), which is how schedulers and metric-driven callbacks
    change a learning rate; ``weights``: parameters and/or buffers to put into the training
    state, ``{"params": {name: tensor}, "buffers": {name: tensor}}`` (copied by the driver;
    how weight-averaging callbacks swap averaged weights in and out); ``end_epoch``: at
    ``on_train_batch_start`` only (elsewhere an error), skip this batch and the rest of the
    epoch (Lightning's ``on_train_batch_start`` returning -1), every process alike; the epoch
    then ends as usual, without the end-of-epoch validation its last batch would have run,
    and an open accumulation window is dropped; ``kept``: kept accumulators
    (``loops.aggregate.keep``) to replace, by name, or to drop (``None``), which is how a
    Lightning-style module's hooks reset or update its torchmetrics states (the later
    request wins per name).
    """

    stop: bool = False
    log: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    save: tuple[str, ...] = ()
    save_weights: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    link: tuple[tuple[str, str], ...] = ()
    messages: tuple[str, ...] = ()
    hyperparams: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    weights: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    end_epoch: bool = False
    kept: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)

    def __or__(self, other: Requests) -> Requests:
        if not other:
            return self
        if not self:
            return other
        return Requests(
            stop=self.stop or other.stop,
            log={**self.log, **other.log},
            save=self.save + other.save,
            save_weights=self.save_weights + other.save_weights,
            remove=self.remove + other.remove,
            link=self.link + other.link,
            messages=self.messages + other.messages,
            hyperparams={**self.hyperparams, **other.hyperparams},
            weights=_merged_weights(self.weights, other.weights),
            end_epoch=self.end_epoch or other.end_epoch,
            kept={**self.kept, **other.kept},
        )

    def __bool__(self) -> bool:
        return bool(
            self.stop
            or self.log
            or self.save
            or self.save_weights
            or self.remove
            or self.link
            or self.messages
            or self.hyperparams
            or self.weights
            or self.end_epoch
            or self.kept
        )


def _merged_weights(a: Mapping[str, Any], b: Mapping[str, Any]) -> Mapping[str, Any]:
    """Two ``weights`` requests in order: per kind (params, buffers), the later tensor wins."""
    if not a or not b:
        return b or a
    return {k: {**a.get(k, {}), **b.get(k, {})} for k in dict.fromkeys((*a, *b))}


_EMPTY: Mapping[str, Any] = types.MappingProxyType({})
NOTHING = Requests()


class BatchPosition(NamedTuple):
    """Where a loop is: the batch it is about to process (``Driver.position``).

    Every loop sets it before a batch's start event, so code that runs inside a step (a
    Lightning-style ``training_step(batch, batch_idx)``) can read its batch index without
    an event per batch. ``num_batches``: the batches this epoch or this dataloader's
    evaluation runs; ``loaders``: how many dataloaders the stage runs; ``is_last``: whether
    it is the last of them (known ahead for unsized data too); ``progress``: the state's
    counters at the batch's start (what a step reads as the epoch and global step).
    """

    batch_idx: int
    dataloader_idx: int
    num_batches: Any
    loaders: int
    is_last: bool
    progress: Progress


@dataclasses.dataclass(frozen=True)
class Context:
    """A read-only view of the loop at an event (never modify what it holds).

    ``stage``: a ``Stage`` value (``None`` outside a running stage, e.g. at setup);
    ``fn``: the entry point (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``);
    ``state``: the training state at this point (under a fit that updates in place, the
    Trainer's default ``donate_state``, its tensors are overwritten by the next optimizer
    step: copy what you keep, e.g. ``engine.tree.map(torch.clone, ctx.state.params)``);
    ``progress``: its ``Progress``;
    ``metrics``: the latest logged values (Lightning's ``callback_metrics``), floats;
    ``batch``, ``batch_idx``, ``dataloader_idx``, ``outputs``: at batch events;
    ``num_batches``: batches this epoch/evaluation will run (per dataloader for evaluation);
    ``is_last_batch``; ``should_stop``: whether a stop has been requested;
    ``elapsed``: seconds of training so far (by the driver's clock; includes time restored
    from a checkpoint); ``config``: the loop configuration; ``log_dir``: the run folder of the
    first logger (or the root folder); ``world_size`` and ``rank``; ``exists``: a function
    telling whether a file exists (for callbacks that name files); ``exception``: at
    ``on_exception``; ``extra``: anything else a custom loop passes.
    """

    stage: str | None
    fn: str
    state: TrainState
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    batch: Any = None
    batch_idx: int | None = None
    dataloader_idx: int = 0
    outputs: Any = None
    num_batches: Any = None
    is_last_batch: bool = False
    should_stop: bool = False
    elapsed: float = 0.0
    config: Any = None
    log_dir: str | None = None
    world_size: int = 1
    rank: int = 0
    exists: Callable[[str], bool] | None = None
    exception: BaseException | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def progress(self) -> Progress:
        return self.state.progress

    @property
    def epoch(self) -> int:
        return self.state.progress.epoch

    @property
    def global_step(self) -> int:
        return self.state.progress.step

    def replace(self, **changes: Any) -> Context:
        return dataclasses.replace(self, **changes)


#: Set (True) in the namespace of a class whose event handlers all do nothing (the base
#: ``loops.callbacks.Callback``): a callback that keeps its handler handles no such event.
DEFAULT_HANDLERS = "_handlers_do_nothing"


def handles(callback: Any, event: str) -> bool:
    """Whether ``callback`` handles ``event``: the class nearest it in its type's MRO that
    defines the handler is not one whose handlers do nothing (``DEFAULT_HANDLERS``: the base
    class's, so the loops skip callbacks that keep them)."""
    for klass in type(callback).__mro__:
        own = vars(klass)
        if event in own:
            return own[event] is not None and not own.get(DEFAULT_HANDLERS, False)
    return False


def handlers_for(event: str, callbacks: Sequence[Any]) -> list[Any]:
    """The callbacks that handle ``event``, in the order they run: list order, except that at
    ``on_train_epoch_end`` the "monitoring" callbacks (early stopping, checkpointing) run
    after the others (the task's handler included), as in Lightning, so they see what the
    others logged."""
    found = [cb for cb in callbacks if handles(cb, event)]
    if event == "on_train_epoch_end":
        found.sort(key=lambda cb: bool(getattr(cb, "monitoring", False)))
    return found


def dispatch(
    event: str,
    callbacks: Sequence[Any],
    state: TrainState,
    ctx: Context,
    *,
    handlers: Sequence[Any] | None = None,
) -> tuple[TrainState, Requests]:
    """Run ``event`` on every callback that handles it; thread their states; merge requests.

    ``handlers``: ``handlers_for(event, callbacks)`` when the caller has it cached.
    """
    if handlers is None:
        handlers = handlers_for(event, callbacks)
    if not handlers:
        return state, NOTHING
    merged = NOTHING
    for cb in handlers:
        key = cb.key
        states = state.callbacks
        if key not in states:
            raise KeyError(
                f"callback {key!r} has no state in TrainState.callbacks; initialise the "
                "callbacks' states with loops.callbacks.init_states(callbacks, state)"
            )
        seen = ctx if ctx.state is state else ctx.replace(state=state)
        result = getattr(cb, event)(states[key], seen)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Requests)):
            raise TypeError(
                f"{type(cb).__name__}.{event} must return (state, Requests), got {result!r}"
            )
        new, requests = result
        if new is not states[key]:
            state = state.replace(callbacks={**states, key: new})
        if requests is not NOTHING:
            merged = merged | requests
    return state, merged
