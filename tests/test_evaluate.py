"""loops.evaluate: run_evaluation, validate and test called directly (no Trainer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from purestep import engine
from purestep.engine import metrics, optim
from purestep.loops import log
from purestep.loops.callbacks import LambdaCallback
from purestep.loops.config import LoopConfig
from purestep.loops.data import source
from purestep.loops.driver import Driver
from purestep.loops.evaluate import run_evaluation, test, validate
from purestep.loops.events import EVENTS, TEST_EVENTS, VALIDATE_EVENTS, Requests, Stage
from purestep.loops.loggers import MemoryLogger


def model():
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def fn(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": metrics.Accuracy.of(logits, y)}


def dataset(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)


def pieces():
    net = model()
    return engine.init(net, optim.identity()), engine.eval_step(net, fn)


def recorder():
    events = []

    def handler(event):
        return lambda ctx: events.append((event, ctx.stage, ctx.batch_idx, ctx.dataloader_idx))

    return events, LambdaCallback(name="rec", **{e: handler(e) for e in EVENTS})


def test_validate_event_order_and_values():
    state, step = pieces()
    events, cb = recorder()
    data = dataset(5)
    _, results = validate(state, step, source(data, batch_size=2), callbacks=[cb])
    names = [e[0] for e in events]
    assert names == [
        "setup",
        "on_validation_start",
        "on_validation_epoch_start",
        *["on_validation_batch_start", "on_validation_batch_end"] * 3,
        "on_validation_epoch_end",
        "on_validation_end",
        "teardown",
    ]
    assert set(names) <= set(VALIDATE_EVENTS)
    assert {e[1] for e in events[1:-1]} == {"validate"} and events[0][1] is None
    whole = step(state, data)
    # batches 2, 2, 1: a batch-size weighted mean of the loss, exact accuracy
    assert results[0]["val_loss"] == pytest.approx(float(whole["loss"]), rel=1e-6)
    assert results[0]["val_acc"] == pytest.approx(float(whole["acc"].compute()), abs=1e-7)


def test_test_event_order_and_prefix():
    state, step = pieces()
    events, cb = recorder()
    logger = MemoryLogger()
    _, results = test(
        state, step, source(dataset(4), batch_size=4), callbacks=[cb], loggers=[logger]
    )
    assert [e[0] for e in events] == [
        "setup",
        "on_test_start",
        "on_test_epoch_start",
        "on_test_batch_start",
        "on_test_batch_end",
        "on_test_epoch_end",
        "on_test_end",
        "teardown",
    ]
    assert {e[0] for e in events} <= set(TEST_EVENTS)
    assert sorted(results[0]) == ["test_acc", "test_loss"]
    assert logger.metrics == [(0, {**results[0], "epoch": 0})]
    assert logger.status == "success"


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(2, [2, 2]), (0.5, [1, 2]), (1.0, [3, 4]), (0, [])],
)
def test_limit_val_batches_per_dataloader(limit, expected):
    state, step = pieces()
    events, cb = recorder()
    sources = [source(dataset(6), batch_size=2), source(dataset(8), batch_size=2)]
    config = LoopConfig.create(limit_val_batches=limit)
    _, results = validate(state, step, sources, config=config, callbacks=[cb])
    counts = [
        sum(1 for e in events if e[0] == "on_validation_batch_end" and e[3] == i) for i in (0, 1)
    ]
    if not expected:
        assert results == [] and [e[0] for e in events] == ["setup", "teardown"]
    else:
        assert counts == expected
        assert [sorted(r) for r in results] == [
            [f"val_acc/dataloader_idx_{i}", f"val_loss/dataloader_idx_{i}"] for i in (0, 1)
        ]


def test_epoch_end_logs_join_every_result_and_the_logged_row():
    state, step = pieces()
    logger = MemoryLogger()
    cb = LambdaCallback(
        name="extra", on_validation_epoch_end=lambda ctx: Requests(log={"score": 2.0})
    )
    sources = [source(dataset(4), batch_size=2), source(dataset(2), batch_size=2)]
    _, results = validate(state, step, sources, callbacks=[cb], loggers=[logger])
    assert all(r["score"] == 2.0 for r in results) and len(results) == 2
    assert len(logger.metrics) == 1
    _, row = logger.metrics[0]
    assert row["score"] == 2.0 and "val_loss/dataloader_idx_1" in row and row["epoch"] == 0


def test_run_evaluation_sanity_logs_nothing_and_counts_nothing():
    state, step = pieces()
    logger = MemoryLogger()
    driver = Driver(fn="fit", loggers=[logger])

    def on_step(apply, batch):
        x, _ = batch
        return {"s": log(x.sum(), on_step=True)}

    step = engine.eval_step(model(), on_step)
    sources = [source(dataset(4), batch_size=2)]
    state, results = run_evaluation(
        state, step, sources, stage=Stage.SANITY_CHECK, driver=driver, max_batches=[2]
    )
    assert logger.metrics == [] and results == [{"val_s_epoch": results[0]["val_s_epoch"]}]
    assert state.loop.callback_metrics == {}
    state, _ = run_evaluation(
        state, step, sources, stage=Stage.VALIDATE, driver=driver, max_batches=[2]
    )
    state, _ = run_evaluation(
        state, step, sources, stage=Stage.VALIDATE, driver=driver, max_batches=[2]
    )
    assert [s for s, row in logger.metrics if "val_s_step" in row] == [0, 1, 2, 3]
    assert set(state.loop.callback_metrics) == {"val_s", "val_s_epoch"}


def test_run_evaluation_argument_errors():
    state, step = pieces()
    driver = Driver(fn="validate")
    with pytest.raises(ValueError, match="stage must be"):
        run_evaluation(state, step, [], stage="predict", driver=driver, max_batches=[])
    with pytest.raises(ValueError, match="1 sources but 2 batch limits"):
        run_evaluation(
            state, step, [source(dataset(2))], stage="validate", driver=driver, max_batches=[1, 1]
        )


def test_failures_in_validate():
    state, step = pieces()
    logger = MemoryLogger()
    seen = []

    def boom(ctx):
        raise RuntimeError("eval failed")

    cb = LambdaCallback(
        name="boom", on_validation_batch_end=boom, on_exception=lambda ctx: seen.append(1)
    )
    driver = Driver(fn="validate", callbacks=[cb], loggers=[logger])
    with pytest.raises(RuntimeError, match="eval failed"):
        validate(state, step, source(dataset(2)), driver=driver)
    assert seen == [1] and logger.status == "failed" and driver.status == "interrupted"

    def ctrl_c(ctx):
        raise KeyboardInterrupt

    cb = LambdaCallback(name="k", on_validation_batch_end=ctrl_c)
    driver = Driver(fn="validate", callbacks=[cb], loggers=[logger], printer=lambda s: None)
    _, results = validate(state, step, source(dataset(2)), driver=driver)
    assert results == [] and logger.status == "interrupted"


@settings(max_examples=25)
@given(
    n=st.integers(1, 17),
    batch_size=st.integers(1, 6),
    loaders=st.integers(1, 3),
)
def test_epoch_values_equal_whole_data_values(n, batch_size, loaders):
    """However the data is batched, the epoch mean of a per-batch mean and a merged
    accuracy equal the values over the whole dataset."""
    state, step = pieces()
    data = [dataset(n, seed=i) for i in range(loaders)]
    sources = [source(d, batch_size=batch_size) for d in data]
    _, results = validate(state, step, sources)
    for i, d in enumerate(data):
        whole = step(state, d)
        suffix = f"/dataloader_idx_{i}" if loaders > 1 else ""
        assert results[i]["val_loss" + suffix] == pytest.approx(float(whole["loss"]), rel=1e-5)
        assert results[i]["val_acc" + suffix] == float(whole["acc"].compute())
