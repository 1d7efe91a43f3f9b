"""loops.fit / FitLoop: event order, Lightning's validation, stopping, accumulation and
logging rules, checked against hand-written expectations and against the pure simulator
``loops.testing.simulate_fit`` (property test)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from purestep import engine
from purestep.engine import optim
from purestep.engine.tree import assert_trees_equal
from purestep.loops import log, schedule, testing
from purestep.loops.callbacks import Callback, LambdaCallback, Timer
from purestep.loops.config import LoopConfig
from purestep.loops.data import source
from purestep.loops.driver import Driver
from purestep.loops.events import EVENTS, FIT_EVENTS, Requests
from purestep.loops.fit import FitLoop, fit
from purestep.loops.loggers import MemoryLogger

# --------------------------------------------------------------------------- helpers


def tiny(n: int, batch_size: int = 1, width: int = 1):
    """A Linear model, its loss, and ``n`` batches of unshuffled data."""
    torch.manual_seed(0)
    net = nn.Linear(width, 1)
    x = torch.arange(n * batch_size * width, dtype=torch.float32).reshape(-1, width) / 10
    y = x.sum(1, keepdim=True) * 0.5
    return net, (x, y)


def mse(apply, batch):
    x, y = batch
    return F.mse_loss(apply(x), y)


def setup(n_train, *, config, batch_size=1, accumulate=None, opt=None, net_width=1):
    net, data = tiny(n_train, batch_size, net_width)
    opt = opt or optim.sgd(0.05)
    if accumulate is None:
        accumulate = lambda p: schedule.accumulation_factor(config, p.epoch)
    state = engine.init(net, opt, seed=0)
    step = engine.train_step(net, mse, opt, accumulate=accumulate)
    evaluate = engine.eval_step(net, mse)
    train = source(data, batch_size=batch_size)
    return state, step, evaluate, train


class Recorder:
    """Records every event as ``(event, stage, epoch, batch_idx, dataloader_idx)``."""

    def __init__(self):
        self.events: list[tuple] = []
        self.callback = LambdaCallback(
            name="recorder", **{e: self._record(e) for e in EVENTS if e != "on_exception"}
        )

    def _record(self, event):
        def handler(ctx):
            self.events.append((event, ctx.stage, ctx.epoch, ctx.batch_idx, ctx.dataloader_idx))

        return handler

    def names(self):
        return [e[0] for e in self.events]


def stop_at(total_batch_index: int) -> Callback:
    """Request a stop at the end of the training batch with this index across epochs."""
    seen = []

    def on_train_batch_end(ctx):
        seen.append(ctx.batch_idx)
        if len(seen) - 1 == total_batch_index:
            return Requests(stop=True)
        return None

    return LambdaCallback(name="stopper", on_train_batch_end=on_train_batch_end)


def run(
    n_train,
    n_val=(2,),
    *,
    callbacks=(),
    loggers=(),
    batch_size=1,
    **flags,
):
    config = LoopConfig.create(**flags)
    state, step, evaluate, train = setup(n_train, config=config, batch_size=batch_size)
    val_data = [source(tiny(n, batch_size)[1], batch_size=batch_size) for n in n_val]
    rec = Recorder()
    final = fit(
        state,
        step,
        train,
        val=val_data,
        eval_step=evaluate if n_val else None,
        config=config,
        callbacks=[rec.callback, *callbacks],
        loggers=loggers,
    )
    return final, rec


def train_batches(rec):
    return [(e[2], e[3]) for e in rec.events if e[0] == "on_train_batch_end"]


def validations(rec):
    """``(epoch, batch_idx)`` of the training batch each in-fit validation followed."""
    out, last = [], None
    for event, stage, epoch, batch_idx, _ in rec.events:
        if event == "on_train_batch_end":
            last = (epoch, batch_idx)
        if event == "on_validation_start" and stage == "validate":
            out.append(last)
    return out


def steps(rec):
    return [(e[2], e[3]) for e in rec.events if e[0] == "on_before_optimizer_step"]


# --------------------------------------------------------------------------- event order


def _val_block(stage, batches):
    block = [("on_validation_start", stage), ("on_validation_epoch_start", stage)]
    for _ in range(batches):
        block += [("on_validation_batch_start", stage), ("on_validation_batch_end", stage)]
    return [*block, ("on_validation_epoch_end", stage), ("on_validation_end", stage)]


def test_fit_event_order_matches_lightning():
    # 4 batches, val_check_interval=0.5 -> validation after batch idx 1 and 3 (the last).
    _, rec = run(4, (3,), max_epochs=2, val_check_interval=0.5, num_sanity_val_steps=2)
    expected = [("setup", None), ("on_fit_start", None), ("on_sanity_check_start", "sanity_check")]
    expected += _val_block("sanity_check", 2)
    expected += [("on_sanity_check_end", "sanity_check"), ("on_train_start", "train")]
    for _epoch in range(2):
        expected.append(("on_train_epoch_start", "train"))
        for batch_idx in range(4):
            expected += [
                ("on_train_batch_start", "train"),
                ("on_before_optimizer_step", "train"),
                ("on_train_batch_end", "train"),
            ]
            if batch_idx in (1, 3):
                expected += _val_block("validate", 3)
        expected.append(("on_train_epoch_end", "train"))
    expected += [("on_train_end", "train"), ("on_fit_end", None), ("teardown", None)]
    assert [(e[0], e[1]) for e in rec.events] == expected
    assert set(rec.names()) <= set(FIT_EVENTS)


def test_fit_without_validation_and_no_batches_skips_training_events():
    _, rec = run(3, (), max_epochs=0)
    assert rec.names() == ["setup", "on_fit_start", "on_fit_end", "teardown"]
    _, rec = run(3, (2,), max_epochs=2, limit_train_batches=0)
    # sanity check still runs, the training events do not (Lightning's skip)
    assert "on_sanity_check_start" in rec.names()
    assert "on_train_start" not in rec.names() and "on_train_end" not in rec.names()


def test_fit_on_exception_order_and_reraise():
    logger = MemoryLogger()
    seen = []

    def boom(ctx):
        if ctx.batch_idx == 1:
            raise RuntimeError("boom")

    cb = LambdaCallback(
        name="boom",
        on_train_batch_end=boom,
        on_exception=lambda ctx: seen.append((ctx.stage, type(ctx.exception).__name__)),
    )
    config = LoopConfig.create(max_epochs=1)
    state, step, _, train = setup(4, config=config)
    driver = Driver(fn="fit", callbacks=[cb], loggers=[logger], config=config)
    with pytest.raises(RuntimeError, match="boom"):
        fit(state, step, train, config=config, driver=driver)
    assert seen == [("train", "RuntimeError")]
    assert driver.status == "interrupted" and driver.stage is None
    assert logger.status == "failed"


def test_fit_keyboard_interrupt_returns_latest_state():
    logger = MemoryLogger()
    seen = []

    def interrupt(ctx):
        if ctx.batch_idx == 2:
            raise KeyboardInterrupt

    cb = LambdaCallback(
        name="ctrl_c", on_train_batch_end=interrupt, on_exception=lambda ctx: seen.append(1)
    )
    config = LoopConfig.create(max_epochs=3)
    state, step, _, train = setup(5, config=config)
    driver = Driver(fn="fit", callbacks=[cb], loggers=[logger], config=config, printer=seen.append)
    final = fit(state, step, train, config=config, driver=driver)
    assert final.progress.step == 3 and final.progress.epoch == 0
    assert 1 in seen and driver.status == "interrupted" and driver.stage == "train"
    assert logger.status == "interrupted"


# --------------------------------------------------------------------------- property


def _trace(config, n_train, n_val, stop_index):
    state, step, evaluate, train = setup(n_train, config=config)
    val = [source(tiny(n)[1]) for n in n_val]
    rec = Recorder()
    logger = MemoryLogger()
    callbacks = [rec.callback] + ([stop_at(stop_index)] if stop_index is not None else [])
    driver = Driver(
        fn="fit", callbacks=callbacks, loggers=[logger], config=config, printer=lambda s: None
    )
    final = fit(state, step, train, val=val, eval_step=evaluate, config=config, driver=driver)
    sanity = {}
    for event, stage, _, _, dl in rec.events:
        if event == "on_validation_batch_end" and stage == "sanity_check":
            sanity[dl] = sanity.get(dl, 0) + 1
    logged = [s for s, row in logger.metrics if "train_loss" in row]
    return final, rec, sanity, logged


@settings(max_examples=60)
@given(
    config=testing.configs(
        max_epochs=st.integers(1, 3),
        max_steps=st.sampled_from([-1, -1, -1, 0, 2, 5, 9]),
        max_time=None,
        fast_dev_run=st.sampled_from([False, False, False, 1, 2]),
    ),
    n_train=st.integers(2, 6),
    n_val=st.lists(st.integers(2, 3), min_size=1, max_size=2),
    stop_index=st.one_of(st.none(), st.integers(0, 12)),
)
def test_fit_takes_the_decisions_of_the_simulator(config, n_train, n_val, stop_index):
    """Batches run, optimizer steps, validations, logged steps, sanity batches, epochs and
    global step all equal those of ``loops.testing.simulate_fit``."""
    try:
        expected = testing.simulate_fit(config, n_train, stop_index, val_batches=tuple(n_val))
    except ValueError as err:
        with pytest.raises(ValueError, match=str(err)[:20].replace("(", r"\(").replace("[", r"\[")):
            _trace(config, n_train, n_val, stop_index)
        return
    final, rec, sanity, logged = _trace(config, n_train, n_val, stop_index)
    assert tuple(train_batches(rec)) == expected.batches
    assert tuple(steps(rec)) == expected.steps
    assert tuple(validations(rec)) == expected.validations
    assert tuple(logged) == expected.logged_steps
    expected_sanity = {i: n for i, n in enumerate(expected.sanity_batches) if n}
    assert sanity == expected_sanity
    assert final.progress.step == expected.global_step
    assert final.progress.epoch == expected.epochs


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("n_train", "flags", "expected"),
    [
        (7, {"val_check_interval": 0.5}, [(0, 2), (0, 5)]),  # not after the last batch
        (10, {"val_check_interval": 0.25}, [(0, 1), (0, 3), (0, 5), (0, 7), (0, 9)]),
        (5, {"val_check_interval": 0.0}, [(0, i) for i in range(5)]),
        (4, {"val_check_interval": 2}, [(0, 1), (0, 3)]),
        (10, {"max_steps": 3}, []),  # max_steps mid-epoch: no final validation
        (3, {"limit_val_batches": 0}, []),
    ],
)
def test_validation_points_one_epoch(n_train, flags, expected):
    _, rec = run(n_train, (2,), max_epochs=1, num_sanity_val_steps=0, **flags)
    assert validations(rec) == expected


def test_validation_counts_batches_across_epochs_when_check_val_every_n_epoch_is_none():
    _, rec = run(4, max_epochs=3, val_check_interval=3, check_val_every_n_epoch=None)
    # total batches 3, 6, 9, 12 -> total idx 2, 5, 8, 11
    assert validations(rec) == [(0, 2), (1, 1), (2, 0), (2, 3)]


def test_check_val_every_n_epoch_validates_odd_epochs():
    _, rec = run(2, max_epochs=4, check_val_every_n_epoch=2)
    assert validations(rec) == [(1, 1), (3, 1)]


def test_limit_val_batches_zero_means_no_sanity_and_no_validation_events():
    _, rec = run(3, max_epochs=2, limit_val_batches=0)
    assert not any("validation" in n or "sanity" in n for n in rec.names())


def test_accumulation_does_not_change_the_validation_unit():
    # val_check_interval counts batches, not optimizer steps
    _, rec = run(4, max_epochs=1, val_check_interval=2, accumulate_grad_batches=2)
    assert validations(rec) == [(0, 1), (0, 3)]
    assert steps(rec) == [(0, 1), (0, 3)]


def test_stop_request_validates_immediately_when_minimums_are_met():
    _, rec = run(6, max_epochs=3, callbacks=[stop_at(2)], num_sanity_val_steps=0)
    assert validations(rec) == [(0, 2)]
    assert train_batches(rec) == [(0, 0), (0, 1), (0, 2)]
    assert rec.names().count("on_train_epoch_end") == 1


# --------------------------------------------------------------------------- stopping


def test_max_epochs_and_max_steps():
    final, rec = run(3, (), max_epochs=2)
    assert final.progress.epoch == 2 and final.progress.step == 6
    final, rec = run(3, (), max_steps=4)
    assert train_batches(rec) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert final.progress.step == 4 and final.progress.epoch == 2  # the cut epoch still ends


def test_min_epochs_overrides_an_early_stop_request():
    # stop requested at step 2 of epoch 0 with min_epochs=2: epochs 0 and 1 run fully
    final, rec = run(4, (), max_epochs=5, min_epochs=2, callbacks=[stop_at(1)])
    assert train_batches(rec) == [(e, i) for e in range(2) for i in range(4)]
    assert final.progress.epoch == 2


def test_min_steps_overrides_an_early_stop_request():
    # 4 batches per epoch, stop requested at the end of epoch 1, min_steps=10: epoch 2 ends
    # after batch idx 1 (global step 10) with an immediate validation.
    final, rec = run(4, (2,), max_epochs=5, min_steps=10, callbacks=[stop_at(7)])
    assert train_batches(rec)[-1] == (2, 1)
    assert final.progress.step == 10
    assert validations(rec)[-1] == (2, 1)


def test_a_stop_requested_at_epoch_start_ends_the_epoch_before_its_first_batch():
    def stop_in_epoch_one(ctx):
        return Requests(stop=True) if ctx.epoch == 1 else None

    cb = LambdaCallback(name="stop", on_train_epoch_start=stop_in_epoch_one)
    final, rec = run(3, (2,), max_epochs=4, callbacks=[cb], num_sanity_val_steps=0)
    assert train_batches(rec) == [(0, 0), (0, 1), (0, 2)]
    assert rec.names().count("on_train_epoch_end") == 2  # the empty epoch still ends
    assert final.progress.epoch == 2 and final.progress.step == 3


def test_min_message_is_shown_once():
    messages = []
    config = LoopConfig.create(max_epochs=5, min_epochs=2)
    state, step, _, train = setup(4, config=config)
    driver = Driver(fn="fit", callbacks=[stop_at(0)], config=config, printer=messages.append)
    fit(state, step, train, config=config, driver=driver)
    assert sum("min_epochs=2" in m for m in messages) == 1


def test_max_time_with_a_fake_clock():
    now = [0.0]

    def tick(ctx):
        now[0] += 10.0

    config = LoopConfig.create(max_epochs=3)
    state, step, _, train = setup(5, config=config)
    rec = Recorder()
    driver = Driver(
        fn="fit",
        callbacks=[
            rec.callback,
            LambdaCallback(name="tick", on_train_batch_start=tick),
            Timer(duration=25, interval="step"),
        ],
        config=config,
        clock=lambda: now[0],
        printer=lambda s: None,
    )
    final = fit(state, step, train, config=config, driver=driver)
    # elapsed at the end of batch k is 10 * (k + 1): the limit is hit after batch 2
    assert train_batches(rec) == [(0, 0), (0, 1), (0, 2)]
    assert final.progress.step == 3


# --------------------------------------------------------------------------- accumulation


def _torch_accumulation(net, data, batch_size, factors, epochs, lr, momentum):
    model = nn.Linear(net.in_features, 1)
    model.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, foreach=True)
    x, y = data
    n = math.ceil(len(x) / batch_size)
    for epoch in range(epochs):
        k = factors(epoch)
        for i in range(n):
            xb, yb = (
                x[i * batch_size : (i + 1) * batch_size],
                y[i * batch_size : (i + 1) * batch_size],
            )
            loss = F.mse_loss(model(xb), yb)
            (loss / k if k > 1 else loss).backward()
            if (i + 1) % k == 0 or i + 1 == n:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("accumulate", [3, {0: 1, 1: 3}])
@pytest.mark.bitwise
def test_accumulation_equals_a_hand_written_torch_loop_bitwise(accumulate):
    config = LoopConfig.create(max_epochs=2, accumulate_grad_batches=accumulate)
    net, data = tiny(7, batch_size=2, width=3)
    opt = optim.sgd(0.05, momentum=0.9)
    state = engine.init(net, opt, seed=0)
    step = engine.train_step(
        net, mse, opt, accumulate=lambda p: schedule.accumulation_factor(config, p.epoch)
    )
    rec = Recorder()
    final = fit(state, step, source(data, batch_size=2), config=config, callbacks=[rec.callback])
    expected = _torch_accumulation(
        net, data, 2, lambda e: schedule.accumulation_factor(config, e), 2, 0.05, 0.9
    )
    assert_trees_equal(final.params, expected)
    windows = {e: [i for (ep, i) in steps(rec) if ep == e] for e in (0, 1)}
    factor1 = schedule.accumulation_factor(config, 1)
    assert windows[1] == [i for i in range(7) if (i + 1) % factor1 == 0 or i == 6]
    assert final.grad_accum is None and final.progress.micro_step == 0


def test_step_accumulation_must_agree_with_the_config():
    config = LoopConfig.create(max_epochs=1, accumulate_grad_batches=2)
    state, step, _, train = setup(4, config=config, accumulate=1)
    with pytest.raises(ValueError, match="accumulate_grad_batches gives 2"):
        fit(state, step, train, config=config)


# --------------------------------------------------------------------------- logging


def test_logger_rows_and_steps_follow_lightning():
    # 10 batches, N=2, log_every_n_steps=3: train rows at steps 2, 5, 8; validation and
    # epoch rows at the step of the epoch's last training batch (4 and 9).
    logger = MemoryLogger()
    final, _ = run(
        10,
        (2,),
        loggers=[logger],
        max_epochs=2,
        accumulate_grad_batches=2,
        log_every_n_steps=3,
    )
    assert final.progress.step == 10
    assert [s for s, row in logger.metrics if "train_loss" in row] == [2, 5, 8]
    assert [s for s, row in logger.metrics if "val_loss" in row] == [4, 9]
    epochs = [row["epoch"] for s, row in logger.metrics if "train_loss" in row]
    assert epochs == [0, 1, 1]


def test_sanity_check_logs_nothing_and_leaves_callback_metrics_alone():
    logger = MemoryLogger()
    seen = {}

    def at_sanity_end(ctx):
        seen["metrics"] = dict(ctx.metrics)
        seen["bar"] = dict(ctx.extra["progress_bar_metrics"])

    def log_in_validation(ctx):
        return Requests(log={"from_callback": 1.0})

    cb = LambdaCallback(
        name="probe",
        on_sanity_check_end=at_sanity_end,
        on_validation_epoch_end=log_in_validation,
    )
    config = LoopConfig.create(max_epochs=0, num_sanity_val_steps=2)
    state, step, evaluate, train = setup(3, config=config)
    fit(
        state,
        step,
        train,
        val=source(tiny(3)[1]),
        eval_step=evaluate,
        config=config,
        callbacks=[cb],
        loggers=[logger],
    )
    assert seen == {"metrics": {}, "bar": {}}
    assert logger.metrics == []


def test_callbacks_see_the_model_and_number_of_loggers_when_fit_is_called_directly():
    seen = {}
    cb = LambdaCallback(name="probe", on_fit_start=lambda ctx: seen.update(ctx.extra))
    config = LoopConfig.create(max_epochs=1)
    state, step, _, train = setup(2, config=config)
    fit(state, step, train, config=config, callbacks=[cb], loggers=[MemoryLogger()])
    assert seen["model"] is step.model and seen["num_loggers"] == 1


def test_epoch_end_callback_logs_share_the_epoch_row():
    logger = MemoryLogger()
    cb = LambdaCallback(
        name="epoch_logger", on_train_epoch_end=lambda ctx: Requests(log={"custom": 7.0})
    )
    run(3, (), loggers=[logger], callbacks=[cb], max_epochs=2, log_every_n_steps=1)
    rows = [(s, row) for s, row in logger.metrics if "custom" in row]
    assert rows == [(2, {"custom": 7.0, "epoch": 0}), (5, {"custom": 7.0, "epoch": 1})]


# --------------------------------------------------------------------------- data


class Unsized:
    """An iterable of ready-made batches with no length."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_unsized_training_data_knows_its_last_batch():
    config = LoopConfig.create(max_epochs=2, accumulate_grad_batches=2)
    net, (x, y) = tiny(5)
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    step = engine.train_step(net, mse, opt, accumulate=2)
    data = source(Unsized([(x[i : i + 1], y[i : i + 1]) for i in range(5)]), batch_size=None)
    assert data.num_batches == math.inf
    rec = Recorder()
    final = fit(
        state,
        step,
        data,
        val=source((x, y)),
        eval_step=engine.eval_step(net, mse),
        config=config,
        callbacks=[rec.callback],
    )
    # the short last window (batch 4) steps, and the epoch-end validation runs
    assert steps(rec) == [(e, i) for e in (0, 1) for i in (1, 3, 4)]
    assert validations(rec) == [(0, 4), (1, 4)]
    assert final.progress.step == 6


def test_reload_functions_follow_reload_dataloaders_every_n_epochs():
    calls = []
    config = LoopConfig.create(
        max_epochs=4, reload_dataloaders_every_n_epochs=1, check_val_every_n_epoch=2
    )
    state, step, evaluate, train = setup(2, config=config)

    def reload_train():
        calls.append("train")
        return train

    def reload_val():
        calls.append("val")
        return [source(tiny(2)[1])]

    driver = Driver(fn="fit", config=config)
    loop = FitLoop(
        step,
        None,
        driver=driver,
        config=config,
        val=None,
        eval_step=evaluate,
        reload_train=reload_train,
        reload_val=reload_val,
    )
    loop.run(state)
    # Lightning: val for the sanity check first, train every epoch, val again at the
    # validations of epochs 1 and 3 (the sanity load does not count: epoch 0 does not
    # validate).
    assert calls == ["val", "train", "train", "val", "train", "train", "val"]


def test_fit_loop_refuses_a_step_without_backward_and_missing_data():
    config = LoopConfig.create()
    driver = Driver(fn="fit", config=config)
    with pytest.raises(TypeError, match="engine.train_step"):
        FitLoop(lambda s, b: (s, None), source(torch.zeros(2, 1)), driver=driver, config=config)
    _, step, _, _ = setup(2, config=config)
    with pytest.raises(ValueError, match="needs training data"):
        FitLoop(step, None, driver=driver, config=config)


def test_checkpoints_are_written_at_commit_points_only():
    written = []

    def checkpointer(state, path, driver):
        p = state.progress
        written.append((path, p.epoch, p.batch_in_epoch, p.step))

    def save_each_batch(ctx):
        return Requests(save=(f"b{ctx.epoch}-{ctx.batch_idx}",))

    cb = LambdaCallback(
        name="saver",
        on_train_batch_end=save_each_batch,
        on_train_epoch_end=lambda ctx: Requests(save=(f"e{ctx.epoch}",)),
    )
    config = LoopConfig.create(max_epochs=1)
    state, step, _, train = setup(3, config=config)
    driver = Driver(fn="fit", callbacks=[cb], config=config, checkpointer=checkpointer)
    fit(state, step, train, config=config, driver=driver)
    # mid-epoch saves hold the state after the batch; the last batch's save waits for the
    # epoch end (the state after an epoch is the one a run resumes from exactly)
    assert written == [
        ("b0-0", 0, 1, 1),
        ("b0-1", 0, 2, 2),
        ("b0-2", 1, 0, 3),
        ("e0", 1, 0, 3),
    ]


@pytest.mark.bitwise
def test_resuming_from_a_mid_epoch_commit_matches_an_uninterrupted_run():
    config = LoopConfig.create(max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=1)
    saved = {}

    def checkpointer(state, path, driver):
        saved[path] = (state, driver.loggers[0].state()["rows"])

    def train_step_values(apply, batch):
        x, _ = batch
        return mse(apply, batch), {"xm": log(x.mean(), on_step=True, on_epoch=True)}

    cb = LambdaCallback(
        name="saver",
        on_train_batch_end=lambda ctx: Requests(save=("mid",)) if ctx.batch_idx == 2 else None,
    )
    net, data = tiny(5)
    opt = optim.sgd(0.05)
    step = engine.train_step(net, train_step_values, opt, accumulate=2)
    logger = MemoryLogger()
    driver = Driver(
        fn="fit", callbacks=[cb], loggers=[logger], config=config, checkpointer=checkpointer
    )
    full = fit(engine.init(net, opt), step, source(data), config=config, driver=driver)
    mid, rows = saved["mid"]
    assert mid.progress.batch_in_epoch == 3 and mid.progress.micro_step == 1
    resumed_logger = MemoryLogger()
    resumed = fit(mid, step, source(data), config=config, callbacks=[cb], loggers=[resumed_logger])
    assert_trees_equal(resumed, full)
    # the epoch means include the batches before the checkpoint (accumulators in the state)
    assert resumed_logger.metrics == logger.metrics[rows:]


@settings(max_examples=10)
@given(stop_index=st.integers(0, 8))
@pytest.mark.bitwise
def test_resuming_after_a_stop_request_matches(stop_index):
    """A checkpoint taken right after a stop request still ends the run where the
    uninterrupted one ended (the request lives in the state)."""
    config = LoopConfig.create(max_epochs=3, min_epochs=1)
    saved = {}
    cb = LambdaCallback(name="saver", on_train_batch_end=lambda ctx: Requests(save=("last",)))
    state, step, _, train = setup(3, config=config)
    driver = Driver(
        fn="fit",
        callbacks=[cb, stop_at(stop_index)],
        config=config,
        checkpointer=lambda s, p, d: saved.__setitem__(p, s),
        printer=lambda s: None,
    )
    full = fit(state, step, train, config=config, driver=driver)
    resumed = fit(saved["last"], step, train, config=config, callbacks=[cb])
    assert resumed.progress.epoch == full.progress.epoch
    assert resumed.progress.step == full.progress.step
    assert_trees_equal(resumed.params, full.params)


def test_a_driver_and_a_different_config_are_refused():
    from purestep.loops import Driver, LoopConfig, fit

    driver = Driver(fn="fit", config=LoopConfig.create(max_epochs=1))
    model = torch.nn.Linear(4, 2)
    opt = optim.sgd(0.1)
    step = engine.train_step(model, lambda apply, b: apply(b[0]).pow(2).mean(), opt)
    data = (torch.randn(8, 4), torch.randn(8, 2))
    with pytest.raises(ValueError, match="differs from the driver's"):
        fit(
            engine.init(model, opt),
            step,
            data,
            driver=driver,
            config=LoopConfig.create(max_epochs=2),
        )
