"""``DeviceStatsMonitor``: CPU (psutil) and CUDA memory statistics, logged like metrics."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.loops import Trainer
from purestep.loops.callbacks import DeviceStatsMonitor, device_stats
from purestep.loops.loggers import MemoryLogger

psutil = pytest.importorskip("psutil")


def loader(n: int, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=batch_size)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def trainer(logger, **flags) -> Trainer:
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("enable_checkpointing", False)
    t = Trainer(logger=logger, **flags)
    t._printer = lambda s: None
    return t


def test_cpu_stats_are_this_process_and_the_system():
    stats = device_stats.cpu_stats()
    rss = psutil.Process(os.getpid()).memory_info().rss
    # the same process, read moments apart: within 64 MiB of each other
    assert abs(stats["process_rss_bytes"] - rss) < 64 * 2**20
    assert 0 <= stats["cpu_vm_percent"] <= 100 and 0 <= stats["cpu_swap_percent"] <= 100
    assert stats["process_cpu_percent"] >= 0 and stats["cpu_percent"] >= 0


def test_logged_at_batch_start_and_end_when_the_logging_rule_says():
    logger = MemoryLogger()
    t = trainer(
        logger,
        max_epochs=1,
        log_every_n_steps=2,
        limit_val_batches=4,
        num_sanity_val_steps=1,
        callbacks=[DeviceStatsMonitor()],
    )
    t.fit(net(), loss, optim.sgd(0.1), loader(24), loader(16))  # 6 train batches, 4 val
    key = "DeviceStatsMonitor.on_train_batch_end/process_rss_bytes"
    # end of batch i: i + 1 batches have stepped, logged at logger step i when (i + 1) % 2 == 0
    assert [s for s, _ in logger.history(key)] == [1, 3, 5]
    start = logger.history("DeviceStatsMonitor.on_train_batch_start/cpu_percent")
    assert [s for s, _ in start] == [1, 3, 5]  # before batch i + 1 steps: logger step i + 1
    assert all(v > 0 for _, v in logger.history(key))
    val = logger.history("DeviceStatsMonitor.on_validation_batch_end/cpu_vm_percent")
    assert len(val) == 4 // 2  # every second validation batch; none in the sanity check
    assert key not in t.callback_metrics and key in t.logged_metrics


def test_filter_keys_and_cpu_stats_off():
    logger = MemoryLogger()
    monitor = DeviceStatsMonitor(filter_keys={"process_rss_bytes", "no_such_stat"})
    t = trainer(logger, max_epochs=1, log_every_n_steps=1, callbacks=[monitor])
    with pytest.warns(UserWarning, match="no_such_stat"):
        t.fit(net(), loss, optim.sgd(0.1), loader(8))
    names = {k.split("/", 1)[1] for _, row in logger.metrics for k in row if "Device" in k}
    assert names == {"process_rss_bytes"}
    quiet = MemoryLogger()
    t = trainer(quiet, max_epochs=1, log_every_n_steps=1, callbacks=[DeviceStatsMonitor(False)])
    t.fit(net(), loss, optim.sgd(0.1), loader(8))  # on the CPU with cpu_stats=False: nothing
    assert not any("DeviceStatsMonitor" in k for _, row in quiet.metrics for k in row)


def test_refused_without_loggers_and_bad_arguments():
    t = trainer(False, max_epochs=1, callbacks=[DeviceStatsMonitor()])
    with pytest.raises(ValueError, match="logger=False"):
        t.fit(net(), loss, optim.sgd(0.1), loader(8))
    with pytest.raises(TypeError, match="cpu_stats"):
        DeviceStatsMonitor(cpu_stats="yes")
    with pytest.raises(TypeError, match="filter_keys"):
        DeviceStatsMonitor(filter_keys="cpu_percent")


def test_a_missing_psutil_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install psutil"):
        device_stats.cpu_stats()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_statistics():
    logger = MemoryLogger()
    t = trainer(
        logger,
        max_epochs=1,
        log_every_n_steps=1,
        accelerator="gpu",
        devices=1,
        callbacks=[DeviceStatsMonitor(cpu_stats=True)],
    )
    t.fit(net(), loss, optim.sgd(0.1), loader(8))
    rows = logger.history("DeviceStatsMonitor.on_train_batch_end/allocated_bytes.all.current")
    assert rows and all(v > 0 for _, v in rows)
    assert logger.history("DeviceStatsMonitor.on_train_batch_end/process_rss_bytes")
