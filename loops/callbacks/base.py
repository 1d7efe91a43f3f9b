"""The callback contract: pure handlers over the callback's own state.

A callback is an object with a ``key`` (its name in ``TrainState.callbacks``), an ``init()``
that gives its initial state (any pytree; saved in checkpoints with the rest of the state),
and handlers named after the loop events (``loops.events``). Each handler takes
``(state, ctx)`` — its own state and a read-only ``Context`` — and returns
``(new_state, Requests)``. Handlers must not perform effects (printing, writing files,
touching loggers): they ask for them through ``Requests`` and the driver carries them out.
The base class handles every event by returning its state unchanged and asking for nothing;
subclasses override the events they care about (the loops skip the rest cheaply).

Two checkpoint hooks (Lightning's names) let a callback add data beside its state, which
checkpoints hold anyway: ``on_save_checkpoint(state, ctx)`` returns plain data for the file
(tensors, numbers, strings, containers; None adds nothing), called on the primary process
(rank 0) only for every full checkpoint written (Lightning calls it on every rank), so it
must not call collectives, and an error in it on rank 0 leaves the other ranks waiting
until the collective timeout; ``on_load_checkpoint(state, data, ctx)`` gets it back when
``fit`` resumes from that file and returns the callback's new state (no ``Requests``: a
restore asks for no effects). Both stay pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from purestep.engine.state import TrainState

from ..events import DEFAULT_HANDLERS, NOTHING, Context, Requests

__all__ = ["Callback", "init_states"]


class Callback:
    """Base class of pure callbacks. Override ``init`` and the events you need.

    ``name``: the key of this callback's state in ``TrainState.callbacks`` (default: the
    class name); give two instances of one class different names. ``monitoring``: run after
    the other callbacks at ``on_train_epoch_end`` / ``on_validation_end`` (early stopping and
    checkpointing set it, so they see what the others logged).
    """

    name: str | None = None
    monitoring: bool = False

    @property
    def key(self) -> str:
        return self.name or type(self).__name__

    def init(self) -> Any:
        """The callback's state at the start of a run (a pytree; ``{}`` when stateless)."""
        return {}

    def setup(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_save_checkpoint(self, state: Any, ctx: Context) -> Any:
        """Extra plain data for a full checkpoint being written (None: nothing).

        Called on rank 0 only, while the other ranks wait in a barrier (Lightning calls it
        on every rank): it must not call collectives, and an error raised here leaves the
        other ranks waiting until the collective timeout."""
        return None

    def on_load_checkpoint(self, state: Any, data: Any, ctx: Context) -> Any:
        """The callback's state after ``fit`` resumes from a checkpoint holding ``data``
        (what ``on_save_checkpoint`` returned)."""
        return state

    def on_fit_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_sanity_check_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_sanity_check_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_train_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_train_epoch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_train_batch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_before_optimizer_step(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_train_batch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_train_epoch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_train_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_fit_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def teardown(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_exception(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_validation_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_validation_epoch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_validation_batch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_validation_batch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_validation_epoch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_validation_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_test_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_test_epoch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_test_batch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_test_batch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_test_epoch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_test_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_predict_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_predict_epoch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_predict_batch_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_predict_batch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_predict_epoch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING

    def on_predict_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return state, NOTHING


# ``loops.events.handles``: a callback that keeps one of the handlers above handles nothing
setattr(Callback, DEFAULT_HANDLERS, True)


def init_states(callbacks: Sequence[Callback], state: TrainState) -> TrainState:
    """``state`` with an initial state for every callback that does not have one yet.

    States already present (restored from a checkpoint) are kept. Two callbacks with the same
    key are refused: their states would collide.
    """
    seen: dict[str, Callback] = {}
    for cb in callbacks:
        if not hasattr(cb, "key") or not callable(getattr(cb, "init", None)):
            raise TypeError(
                f"{type(cb).__name__} is not a callback: it needs a `key` and an `init()`; "
                "subclass loops.callbacks.Callback"
            )
        if cb.key in seen:
            raise ValueError(
                f"two callbacks share the key {cb.key!r} ({type(seen[cb.key]).__name__} and "
                f"{type(cb).__name__}); give one of them a different `name=`"
            )
        seen[cb.key] = cb
    missing = {cb.key: cb.init() for cb in callbacks if cb.key not in state.callbacks}
    if not missing:
        return state
    return state.replace(callbacks={**state.callbacks, **missing})
