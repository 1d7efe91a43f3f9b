"""Profilers and monitors under DDP on 2 CPU ranks (gloo): each rank writes its own report,
named with its rank, and only rank 0 logs the monitors' figures (the job-wide rates too)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep import hardware
from purestep.engine import optim
from purestep.loops import Trainer
from purestep.loops.callbacks import ThroughputMonitor
from purestep.loops.loggers import MemoryLogger
from purestep.loops.profiling import SimpleProfiler, parse_report
from tests.helpers import mlp

pytestmark = pytest.mark.timeout(120)


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _rank_main(rank: int, folder: str) -> dict:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
    logger = MemoryLogger()
    trainer = Trainer(
        max_epochs=1,
        strategy=hardware.ddp(),
        profiler=SimpleProfiler(dirpath=folder),
        callbacks=[ThroughputMonitor(window_size=2)],
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer._printer = lambda s: None
    state = trainer.fit(mlp(seed=0), _loss, optim.sgd(0.1), DataLoader(data, batch_size=4))
    with open(trainer.profiler.report_path, encoding="utf-8") as f:
        rows = parse_report(f.read())
    return {
        "path": trainer.profiler.report_path,
        "steps": state.progress.step,
        "training_step": rows["training_step"]["Num calls"],
        "fetches": rows["[FitLoop].train_dataloader_next"]["Num calls"],
        "logged": [dict(row) for _, row in logger.metrics],
    }


def test_each_rank_reports_its_own_actions_and_rank_zero_logs(tmp_path):
    ranks = hardware.launch(_rank_main, 2, str(tmp_path), max_seconds=100, timeout=30)
    for rank, got in enumerate(ranks):
        assert got["path"] == os.path.join(str(tmp_path), f"fit-profile-{rank}.txt")
        # 32 samples, batches of 4, two ranks: 4 batches each
        assert got["steps"] == got["training_step"] == got["fetches"] == 4
    assert ranks[1]["logged"] == []
    rates = [row for row in ranks[0]["logged"] if "train/samples_per_sec" in row]
    assert rates  # the job-wide rate: both ranks' samples
    for row in rates:
        assert row["train/samples_per_sec"] == pytest.approx(
            2 * row["train/device/samples_per_sec"], rel=1e-9
        )
