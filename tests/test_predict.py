"""loops.predict: predict and run_prediction called directly (no Trainer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from purestep import engine
from purestep.engine import optim
from purestep.loops.callbacks import LambdaCallback
from purestep.loops.config import LoopConfig
from purestep.loops.data import source
from purestep.loops.driver import Driver
from purestep.loops.events import EVENTS, PREDICT_EVENTS, Requests
from purestep.loops.loggers import MemoryLogger
from purestep.loops.predict import predict, run_prediction


def pieces(fn=None):
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    state = engine.init(net, optim.identity())
    step = engine.predict_step(net, fn) if fn else engine.predict_step(net)
    return net, state, step


def inputs(n, seed=0):
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))


def recorder():
    events = []

    def handler(event):
        return lambda ctx: events.append((event, ctx.stage, ctx.batch_idx, ctx.dataloader_idx))

    return events, LambdaCallback(name="rec", **{e: handler(e) for e in EVENTS})


def test_predict_event_order_and_outputs():
    net, state, step = pieces()
    events, cb = recorder()
    x = inputs(5)
    _, outputs = predict(state, step, source(x, batch_size=2), callbacks=[cb])
    assert [e[0] for e in events] == [
        "setup",
        "on_predict_start",
        "on_predict_epoch_start",
        *["on_predict_batch_start", "on_predict_batch_end"] * 3,
        "on_predict_epoch_end",
        "on_predict_end",
        "teardown",
    ]
    assert {e[0] for e in events} <= set(PREDICT_EVENTS)
    assert all(e[1] == "predict" for e in events[1:-1])
    assert len(outputs) == 1 and [o.shape for o in outputs[0]] == [(2, 2), (2, 2), (1, 2)]
    with torch.no_grad():
        expected = [net(x[i : i + 2]) for i in range(0, 5, 2)]
    assert all(torch.equal(a, b) for a, b in zip(outputs[0], expected))


def test_several_datasets_limits_and_keep():
    _, state, step = pieces()
    events, cb = recorder()
    data = [source(inputs(4), batch_size=2), source(inputs(6, 1), batch_size=2)]
    config = LoopConfig.create(limit_predict_batches=2)
    _, outputs = predict(state, step, data, config=config, callbacks=[cb])
    assert [len(o) for o in outputs] == [2, 2]
    assert [e[3] for e in events if e[0] == "on_predict_batch_end"] == [0, 0, 1, 1]
    seen = []
    cb = LambdaCallback(name="see", on_predict_batch_end=lambda ctx: seen.append(ctx.outputs))
    _, kept = predict(state, step, data, callbacks=[cb], keep=False)
    assert kept == [[], []] and len(seen) == 5


def test_no_batches_fires_no_prediction_events():
    _, state, step = pieces()
    events, cb = recorder()
    config = LoopConfig.create(limit_predict_batches=0)
    _, outputs = predict(state, step, source(inputs(4)), config=config, callbacks=[cb])
    assert outputs == [[]] and [e[0] for e in events] == ["setup", "teardown"]


def test_structured_predictions_are_moved_to_the_cpu_and_detached():
    _, state, step = pieces(lambda apply, x: {"y": apply(x), "n": x.shape[0]})
    _, outputs = predict(state, step, source(inputs(3), batch_size=3))
    out = outputs[0][0]
    assert out["n"] == 3 and out["y"].device.type == "cpu" and not out["y"].requires_grad


def test_run_prediction_restores_the_stage_and_checks_limits():
    _, state, step = pieces()
    driver = Driver(fn="predict")
    driver.stage = "outer"
    run_prediction(state, step, [source(inputs(2))], driver=driver, max_batches=[1])
    assert driver.stage == "outer"
    with pytest.raises(ValueError, match="1 sources but 2 batch limits"):
        run_prediction(state, step, [source(inputs(2))], driver=driver, max_batches=[1, 1])


def test_failures_run_on_exception_and_finalize_loggers():
    _, state, step = pieces()
    logger = MemoryLogger()
    seen = []

    def boom(ctx):
        raise ValueError("bad batch")

    cb = LambdaCallback(
        name="boom",
        on_predict_batch_start=boom,
        on_exception=lambda ctx: seen.append(ctx.exception),
    )
    with pytest.raises(ValueError, match="bad batch"):
        predict(state, step, source(inputs(2)), callbacks=[cb], loggers=[logger])
    assert len(seen) == 1 and logger.status == "failed"


def test_callbacks_see_the_model_when_called_directly():
    net, state, step = pieces()
    seen = {}

    def probe(ctx):
        seen.update(ctx.extra)
        return Requests()

    predict(state, step, source(inputs(2)), callbacks=[LambdaCallback(name="p", setup=probe)])
    assert seen["model"] is net and seen["num_loggers"] == 0
