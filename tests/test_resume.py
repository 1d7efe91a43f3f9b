"""Kill a run at an arbitrary point, resume it in a fresh process, and get the same bits.

``tests/resume_job.py`` trains with shuffling, dropout, DataLoader workers with per-sample
augmentation, gradient accumulation, an LR schedule, early stopping and a top-k checkpoint
policy. Each case SIGKILLs it at a chosen event (mid-epoch inside an accumulation window,
during validation, late in the run) or preempts it with SIGTERM, launches the same command
again with ``ckpt_path="last"``, and compares the final ``TrainState`` (a digest of every
leaf, so equal digests mean ``torch.equal`` leaves) and the whole ``metrics.csv`` with an
uninterrupted run: no step lost or doubled in the logs.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import run_job

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "resume_job.py"

pytestmark = [pytest.mark.timeout(300), pytest.mark.bitwise]


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return run_job(JOB, folder, *args)


def _digest(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("digest="), result.stdout
    return last


def _ran_batches(result: subprocess.CompletedProcess) -> int:
    return _ran_batches_of(result.stdout)


def _csv(folder: Path) -> str:
    files = sorted(folder.glob("runs/lightning_logs/version_*/metrics.csv"))
    assert len(files) == 1, files  # a resumed run writes into the checkpoint's version
    return files[0].read_text()


def _ran_batches_of(stdout: str) -> int:
    line = next(ln for ln in stdout.splitlines() if "ran_batches=" in ln)
    return int(line.rsplit("ran_batches=", 1)[1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    result = _run(folder)
    return _digest(result), _csv(folder), result.stdout


@pytest.mark.parametrize(
    "kill",
    [
        "train:5",  # mid-epoch, inside an accumulation window (batch 5 of a 3-batch window)
        "val:4",  # in the middle of the first validation (val:1-2 are the sanity check)
        "train:30",  # second epoch, after early stopping and top-k bookkeeping started
    ],
)
def test_a_killed_run_resumes_bitwise(tmp_path, reference, kill):
    killed = _run(tmp_path, "--kill", kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _run(tmp_path, "--resume")
    digest, csv, full = reference
    assert "Restored the training state from" in resumed.stderr
    assert 0 < _ran_batches(resumed) < _ran_batches_of(full)  # it continued, not restarted
    assert _digest(resumed) == digest
    assert _csv(tmp_path) == csv


def test_preemption_checkpoints_exits_75_and_resumes_bitwise(tmp_path, reference):
    preempted = _run(tmp_path, "--signal", "train:12")
    assert preempted.returncode == 75, preempted.stderr[-2000:]
    assert "Preempted: checkpoint written to" in preempted.stderr
    assert any(tmp_path.glob("runs/lightning_logs/version_0/checkpoints/last.ckpt"))
    resumed = _run(tmp_path, "--resume")
    digest, csv, full = reference
    assert _ran_batches(resumed) == _ran_batches_of(full) - 12
    assert _digest(resumed) == digest
    assert _csv(tmp_path) == csv


def test_resuming_a_finished_run_changes_nothing(tmp_path, reference):
    first = _run(tmp_path)
    again = _run(tmp_path, "--resume")
    assert _ran_batches(again) == 0
    assert _digest(first) == _digest(again) == reference[0]
    assert _csv(tmp_path) == reference[1]
