"""Two optimizers, killed with SIGKILL mid-run and resumed: bitwise the uninterrupted run.

``tests/multi_optim_job.py`` trains with two optimizers (automatic mode with gradient
accumulation, a per-step schedule and ``ReduceLROnPlateau``; manual mode with the
discriminator stepped twice per batch and accumulating over its own 3-call window, its
per-step schedule moved before each call), with dropout and shuffling, a checkpoint after
every batch. The manual run is SIGKILLed inside an
open accumulation window, the automatic one fails there with an exception (in this process,
to keep the test short); each resumes from ``last``.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import run_job

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "multi_optim_job.py"

pytestmark = [pytest.mark.timeout(300), pytest.mark.bitwise]


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return run_job(JOB, folder, *args)


def _lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


def _in_process(folder: Path, monkeypatch, capsys, *args: str) -> list[str]:
    """The job's ``main`` in this process (no interpreter start: the reference run)."""
    import runpy

    import torch

    folder.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(folder)
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(JOB))["main"](list(args))
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out.strip().splitlines()


def _check(lines: list[str], full: list[str], tmp_path: Path, run: str) -> None:
    assert lines[-1] == full[-1]  # the digest of the whole final TrainState
    assert lines[-2].split(" ran_batches")[0] == full[-2].split(" ran_batches")[0]
    csv = sorted((tmp_path / run).glob("runs/lightning_logs/version_*/metrics.csv"))
    ref = sorted((tmp_path / "full").glob("runs/lightning_logs/version_*/metrics.csv"))
    assert len(csv) == 1 and csv[0].read_text() == ref[0].read_text()


def test_a_killed_manual_two_optimizer_run_resumes_bitwise(tmp_path, monkeypatch, capsys):
    full = _in_process(tmp_path / "full", monkeypatch, capsys, "--mode", "manual")
    killed = _run(tmp_path / "run", "--mode", "manual", "--kill", "7")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _run(tmp_path / "run", "--mode", "manual", "--resume")
    assert "Restored the training state from" in resumed.stderr
    lines = _lines(resumed)
    # killed in batch 7's end event, before its commit: batches 7..30 run again
    assert "ran_batches=24" in lines[-2]
    _check(lines, full, tmp_path, "run")


def test_a_crashed_automatic_two_optimizer_run_resumes_bitwise(tmp_path, monkeypatch, capsys):
    full = _in_process(tmp_path / "full", monkeypatch, capsys, "--mode", "auto")
    assert "head_lr=[0.1]" not in full[-2]  # the plateau scheduler did reduce the rate
    with pytest.raises(RuntimeError, match="crash at batch 8"):
        _in_process(tmp_path / "run", monkeypatch, capsys, "--mode", "auto", "--crash", "8")
    lines = _in_process(tmp_path / "run", monkeypatch, capsys, "--mode", "auto", "--resume")
    _check(lines, full, tmp_path, "run")
