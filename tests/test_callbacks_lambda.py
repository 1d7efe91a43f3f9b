"""LambdaCallback: validation of event names, dispatch of the given functions only."""

from __future__ import annotations

import pytest
from torch import nn

from purestep import engine
from purestep.engine import optim
from purestep.loops.callbacks import LambdaCallback, init_states
from purestep.loops.callbacks.base import Callback
from purestep.loops.events import EVENTS, Context, Requests, dispatch


def _state(callbacks):
    return init_states(callbacks, engine.init(nn.Linear(2, 1), optim.sgd(0.1)))


def _ctx(state):
    return Context(stage="train", fn="fit", state=state)


def test_given_functions_run_at_their_events():
    seen = []

    def on_end(ctx):
        seen.append(ctx.state.progress.epoch)
        return Requests(stop=True, messages=("bye",))

    cb = LambdaCallback(on_train_epoch_end=on_end, on_train_start=lambda ctx: None)
    state = _state([cb])
    _, req = dispatch("on_train_epoch_end", [cb], state, _ctx(state))
    assert req == Requests(stop=True, messages=("bye",)) and seen == [0]
    new, req = dispatch("on_train_start", [cb], state, _ctx(state))
    assert not req and new.callbacks == state.callbacks


def test_only_given_events_are_overridden():
    cb = LambdaCallback(on_validation_end=lambda ctx: None)
    assert type(cb).on_validation_end is not Callback.on_validation_end
    assert type(cb).on_train_epoch_end is Callback.on_train_epoch_end
    assert isinstance(cb, LambdaCallback) and type(cb).__name__ == "LambdaCallback"
    # an event it does not handle costs nothing (dispatch skips it, state untouched)
    state = _state([cb])
    assert dispatch("on_train_epoch_end", [cb], state, _ctx(state)) == (state, Requests())


def test_every_event_is_accepted():
    cb = LambdaCallback(**{e: (lambda ctx: None) for e in EVENTS})
    state = _state([cb])
    for event in EVENTS:
        assert not dispatch(event, [cb], state, _ctx(state))[1]


def test_unknown_event_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"on_train_epoch_ends.*valid events are.*on_fit_start"):
        LambdaCallback(on_train_epoch_ends=lambda ctx: None)


def test_handler_must_be_callable_and_return_requests():
    with pytest.raises(TypeError, match="on_fit_start"):
        LambdaCallback(on_fit_start=3)
    cb = LambdaCallback(on_fit_start=lambda ctx: {"stop": True})
    state = _state([cb])
    with pytest.raises(TypeError, match="Requests or None"):
        dispatch("on_fit_start", [cb], state, _ctx(state))


def test_names_keep_several_apart():
    a = LambdaCallback(name="a", on_fit_start=lambda ctx: Requests(messages=("a",)))
    b = LambdaCallback(name="b", on_fit_start=lambda ctx: Requests(messages=("b",)))
    state = _state([a, b])
    assert set(state.callbacks) == {"a", "b"}
    assert dispatch("on_fit_start", [a, b], state, _ctx(state))[1].messages == ("a", "b")
    with pytest.raises(ValueError, match="share the key 'LambdaCallback'"):
        _state([LambdaCallback(), LambdaCallback()])


def test_subclasses_keep_their_class():
    class Mine(LambdaCallback):
        def init(self):
            return {"n": 0}

    cb = Mine(on_fit_start=lambda ctx: None)
    assert isinstance(cb, Mine) and cb.init() == {"n": 0} and cb.key == "Mine"
