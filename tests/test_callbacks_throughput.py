"""``Throughput`` and ``ThroughputMonitor``: rates over a window, logged like other metrics,
and never part of the training state (clock readings are effects)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.engine.tree import assert_trees_equal
from purestep.loops import Trainer
from purestep.loops.callbacks import DeviceStatsMonitor, Throughput, ThroughputMonitor
from purestep.loops.loggers import MemoryLogger


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def loader(n: int, batch_size: int = 4) -> DataLoader:
    return DataLoader(data(n), batch_size=batch_size)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


class FakeClock:
    """Each reading is one second after the previous one."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def trainer(logger, **flags) -> Trainer:
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("enable_checkpointing", False)
    t = Trainer(logger=logger, **flags)
    t._printer = lambda s: None
    return t


# ---------------------------------------------------------------------- the arithmetic


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(2, 6),
    extra=st.integers(0, 5),
    dt=st.floats(0.01, 5.0),
    size=st.integers(1, 64),
    length=st.integers(1, 16),
    world=st.integers(1, 4),
)
def test_rates_over_a_full_window_are_the_totals_over_time(window, extra, dt, size, length, world):
    tp = Throughput(world_size=world, window_size=window)
    n = window + extra
    for i in range(1, n + 1):
        tp.update(time=i * dt, batches=i, samples=i * size, lengths=i * length, flops=10.0)
    out = tp.compute()
    assert out["time"] == n * dt and out["batches"] == n and out["samples"] == n * size
    assert out["device/batches_per_sec"] == pytest.approx(1 / dt, rel=1e-9)
    assert out["device/samples_per_sec"] == pytest.approx(size / dt, rel=1e-9)
    # Lightning's items: samples per second times the average length per batch
    assert out["device/items_per_sec"] == pytest.approx(size * length / dt, rel=1e-9)
    assert out["device/flops_per_sec"] == pytest.approx(10.0 / dt, rel=1e-9)
    if world > 1:
        assert out["samples_per_sec"] == pytest.approx(world * size / dt, rel=1e-9)
        assert out["batches_per_sec"] == pytest.approx(world / dt, rel=1e-9)
    else:
        assert "samples_per_sec" not in out


def test_no_rates_before_the_window_is_full_and_running_totals_only():
    tp = Throughput(window_size=3, available_flops=100.0)
    assert tp.compute() == {}
    tp.update(time=1.0, batches=1, samples=4, items=7)
    tp.update(time=2.0, batches=2, samples=8, items=14)
    assert "device/samples_per_sec" not in tp.compute()
    tp.update(time=3.0, batches=3, samples=12, items=21, flops=50.0)
    out = tp.compute()
    assert out["device/items_per_sec"] == 7.0 and out["items"] == 21
    with pytest.raises(ValueError, match="must not decrease"):
        tp.update(time=4.0, batches=2, samples=16)
    with pytest.raises(ValueError, match="window_size"):
        Throughput(window_size=1)
    with pytest.raises(ValueError, match="not both"):
        ThroughputMonitor(length_fn=len, items_fn=len)
    with pytest.raises(TypeError, match="function of the batch"):
        ThroughputMonitor(batch_size_fn=4)


# ---------------------------------------------------------------------- the monitor


def test_training_throughput_is_logged_at_the_logger_steps():
    logger = MemoryLogger()
    monitor = ThroughputMonitor(window_size=3, items_fn=lambda b: 3 * len(b[0]), clock=FakeClock())
    t = trainer(logger, max_epochs=1, log_every_n_steps=2, callbacks=[monitor])
    t.fit(net(), loss, optim.sgd(0.1), loader(32))  # 8 batches of 4
    assert t.monitors == [monitor] and monitor not in t.callbacks
    # logged when log_every_n_steps says (the logger step + 1 divisible by 2), at that step
    steps = [s for s in range(8) if (s + 1) % 2 == 0]
    assert [s for s, _ in logger.history("train/batches")] == steps
    assert [v for _, v in logger.history("train/batches")] == [s + 1 for s in steps]
    assert [v for _, v in logger.history("train/samples")] == [4 * (s + 1) for s in steps]
    rates = logger.history("train/device/samples_per_sec")
    assert [s for s, _ in rates] == [s for s in steps if s + 1 >= 3]  # once the window is full
    assert all(v == 4.0 for _, v in rates)  # 4 samples per one-second batch
    assert all(v == 12.0 for _, v in logger.history("train/device/items_per_sec"))
    assert "train/device/samples_per_sec" in t.logged_metrics
    assert "train/device/samples_per_sec" not in t.callback_metrics  # not the loop's values


def test_validation_time_is_not_training_time():
    logger = MemoryLogger()
    monitor = ThroughputMonitor(window_size=4, clock=FakeClock())
    t = trainer(
        logger,
        max_epochs=1,
        log_every_n_steps=1,
        val_check_interval=2,
        num_sanity_val_steps=1,
        callbacks=[monitor],
    )
    t.fit(net(), loss, optim.sgd(0.1), loader(32), loader(12))
    train = logger.history("train/device/batches_per_sec")
    assert len(train) == 8 - 3 and all(v == 1.0 for _, v in train)
    times = [v for _, v in logger.history("train/time")]
    assert times == [float(i) for i in range(1, 9)]  # one second per batch, validation aside
    val = logger.history("validate/batches")
    # three batches per validation, four validations; its own step axis: its batch count
    assert [s for s, _ in val] == list(range(1, 13))
    assert [v for _, v in val] == [1, 2, 3] * 4  # each validation measured anew
    assert all(not k.startswith("sanity") for _, row in logger.metrics for k in row)


def test_test_and_predict_are_measured_from_their_start():
    logger = MemoryLogger()
    monitor = ThroughputMonitor(window_size=2, clock=FakeClock())
    t = trainer(logger, log_every_n_steps=1, callbacks=[monitor])
    t.test(net(), loader(20), fn=loss, verbose=False)
    rates = logger.history("test/device/samples_per_sec")
    assert [s for s, _ in rates] == [2, 3, 4, 5] and all(v == 4.0 for _, v in rates)
    t.predict(net(), loader(12))
    assert [s for s, _ in logger.history("predict/batches")] == [1, 2, 3]


@pytest.mark.bitwise
def test_monitors_leave_the_training_state_alone():
    def run(callbacks):
        t = trainer(MemoryLogger(), max_epochs=2, callbacks=callbacks)
        return t.fit(net(), loss, optim.adam(1e-2), loader(16), loader(8))

    plain = run([])
    monitored = run([ThroughputMonitor(window_size=2), DeviceStatsMonitor()])
    for name, p in plain.params.items():
        assert torch.equal(p, monitored.params[name]), name
    assert_trees_equal(plain, monitored)


def test_only_monitors_returns_are_logged():
    """A plain observer's return value means nothing (the progress bar's protocol); a
    ``Monitor``'s is logged."""
    from purestep import engine
    from purestep.loops import Driver, LoopConfig, fit
    from purestep.loops.profiling import Monitor

    class Plain:
        events = frozenset({"on_train_batch_end"})

        def on_event(self, event, ctx):
            return True  # not metrics: must not be logged or break the run

    class Counting(Monitor):
        events = frozenset({"on_train_batch_end"})

        def on_event(self, event, ctx):
            return {"seen": float(ctx.batch_idx)}

    logger = MemoryLogger()
    config = LoopConfig.create({"max_epochs": 1, "num_sanity_val_steps": 0})
    driver = Driver(fn="fit", config=config, observers=[Plain(), Counting()], loggers=[logger])
    model = net()
    state = engine.init(model, optim.sgd(0.1), seed=0)
    fit(state, engine.train_step(model, loss, optim.sgd(0.1)), data(8), driver=driver)
    assert [v for _, v in logger.history("seen")] == [float(i) for i in range(8)]
