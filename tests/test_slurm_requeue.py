"""SLURM auto-requeue: checkpoint, ``scontrol requeue``, exit 0, and a bitwise resume.

Two nodes are simulated on this machine: two processes started with the variables ``srun``
sets (and none of torchrun's), a stand-in ``scontrol`` first on ``PATH`` that records its
arguments, all traffic on 127.0.0.1 (the first host of ``SLURM_NODELIST``; gloo on ``lo``).
They train together under ``Trainer(strategy="ddp")``; rank 1 gets SIGUSR1 mid-epoch; the
checkpoint is written, rank 0 requeues the job, both exit 0; the job started again with
``ckpt_path="last"`` ends with the parameters of a run that was never interrupted. In one
process: a failing ``scontrol`` is a logged error and the preemption's exit code 75 with the
checkpoint written; SIGTERM (SLURM's cancel) only preempts; ``auto_requeue=False`` and
``preemption_signals=()`` turn it off.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep import hardware
from purestep.engine import optim
from purestep.hardware import slurm
from purestep.hardware.cluster import SLURMEnvironment
from purestep.loops import Trainer
from purestep.loops.callbacks import LambdaCallback
from purestep.loops.resume import PREEMPTED_EXIT_CODE, Preempted, Requeued
from purestep.loops.slurm_requeue import SlurmRequeue
from tests.helpers import mlp

JOB = Path(__file__).with_name("slurm_job.py")
ROOT = JOB.parent.parent
JOB_ID = "4242"
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _stand_in_scontrol(folder: Path, exit_code: int = 0) -> Path:
    """A ``scontrol`` that appends its arguments to ``scontrol.log`` beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{folder / "scontrol.log"}"\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder / "scontrol.log"


def _slurm_vars(rank: int, port: int, bin_dir: Path) -> dict[str, str]:
    """What srun sets for task ``rank`` of a 2-node job with one task per node."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_")) and k not in _LAUNCHER_VARS
    }
    env.update(
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NAME="train",
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID="0",
        SLURM_NODEID=str(rank),
        SLURM_TASKS_PER_NODE="1(x2)",
        SLURM_NODELIST="127.0.0.1,localhost",  # rank 0's host first: traffic stays local
        MASTER_PORT=str(port),  # SLURM's own port (18242 from the job id) is not xdist-safe
        GLOO_SOCKET_IFNAME="lo",
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    return env


def _job(folder: Path, bin_dir: Path, out: Path, *args: str) -> list[subprocess.CompletedProcess]:
    """Both tasks of the job, run to the end (60 s at most), leftovers killed."""
    folder.mkdir(parents=True, exist_ok=True)
    port = hardware.free_port()
    procs = []
    try:
        for rank in range(2):
            cmd = [sys.executable, str(JOB), "--out", str(out), *args]
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=folder,
                    env=_slurm_vars(rank, port, bin_dir),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        results = []
        for proc in procs:
            output, _ = proc.communicate(timeout=60)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, output))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _ok(results: list[subprocess.CompletedProcess]) -> None:
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout}"


def _ran(result: subprocess.CompletedProcess) -> int:
    """The train batches a task ran (its last ``ran_batches=`` line)."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("ran_batches=")]
    return int(lines[-1].split("=")[1])


@pytest.mark.slow
@pytest.mark.bitwise
@pytest.mark.timeout(200)
@pytest.mark.xdist_group("processes")
def test_two_node_job_requeues_on_sigusr1_and_resumes_bitwise(tmp_path):
    bin_dir = tmp_path / "bin"
    log = _stand_in_scontrol(bin_dir)

    reference = _job(tmp_path / "reference", bin_dir, tmp_path / "reference.pt")
    _ok(reference)
    assert "rank=1 cluster=SLURMEnvironment" in reference[1].stdout
    assert not log.exists()  # no signal, no requeue

    job = tmp_path / "job"
    first = _job(job, bin_dir, tmp_path / "first.pt", "--signal-rank", "1", "--signal-batch", "5")
    _ok(first)  # both ranks exit 0 after the requeue
    assert log.read_text() == f"requeue {JOB_ID}\n"  # rank 0 only, once
    assert "Requeued SLURM job 4242" in first[0].stdout
    assert not (tmp_path / "first.pt").exists()  # stopped before the end
    assert (job / "run" / "checkpoints" / "last.ckpt").exists()

    again = _job(job, bin_dir, tmp_path / "again.pt", "--resume", "--explicit")
    _ok(again)
    assert "rank=0 cluster=SLURMEnvironment" in again[0].stdout  # from plugins=[...]
    for rank in range(2):  # resumed where the requeue stopped it, not started over
        assert _ran(first[rank]) == 5
        assert _ran(again[rank]) == _ran(reference[rank]) - 5 == 11
    assert log.read_text() == f"requeue {JOB_ID}\n"
    want = torch.load(tmp_path / "reference.pt")
    got = torch.load(tmp_path / "again.pt")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


# --------------------------------------------------------------------------- one process


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _fit_signalled(signum: int, **flags) -> None:
    def send(ctx):
        if ctx.batch_idx == 1:
            os.kill(os.getpid(), signum)

    trainer = Trainer(
        max_epochs=1,
        default_root_dir="run",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LambdaCallback(on_train_batch_end=send)],
        **flags,
    )
    trainer.fit(mlp(), _loss, optim.sgd(0.1), _data(), seed=0)


@pytest.fixture
def slurm_job(tmp_path, monkeypatch):
    """This process as the one task of a SLURM job (no torchrun variables), with a
    stand-in scontrol; yields a function that makes the stand-in fail."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")) or name in (*_LAUNCHER_VARS, "MASTER_ADDR"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", JOB_ID)
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_requeue_in_one_process_exits_0_after_the_checkpoint(slurm_job):
    log = _stand_in_scontrol(slurm_job)
    with pytest.raises(Requeued) as caught:
        _fit_signalled(signal.SIGUSR1)
    assert caught.value.code == 0
    assert log.read_text() == f"requeue {JOB_ID}\n"
    assert Path(caught.value.path).exists()


def test_a_failing_scontrol_is_logged_and_the_run_exits_as_preempted(slurm_job, caplog):
    log = _stand_in_scontrol(slurm_job, exit_code=1)
    with caplog.at_level(logging.ERROR), pytest.raises(Preempted) as caught:
        _fit_signalled(signal.SIGUSR1)
    assert not isinstance(caught.value, Requeued)
    assert caught.value.code == PREEMPTED_EXIT_CODE
    assert Path(caught.value.path).exists()  # the checkpoint survives the failure
    assert log.read_text() == f"requeue {JOB_ID}\n"
    assert f"`scontrol requeue {JOB_ID}` exited with 1" in caplog.text


def test_scontrol_missing_is_a_logged_error(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with caplog.at_level(logging.ERROR):
        assert slurm.requeue({"SLURM_JOB_ID": "7"}) is False
    assert "`scontrol requeue 7`: scontrol is not on PATH" in caplog.text
    with caplog.at_level(logging.ERROR):
        assert slurm.requeue({}) is False
    assert "SLURM_JOB_ID is not set" in caplog.text


def test_sigterm_only_preempts(slurm_job):
    log = _stand_in_scontrol(slurm_job)
    with pytest.raises(Preempted) as caught:
        _fit_signalled(signal.SIGTERM)
    assert not isinstance(caught.value, Requeued)
    assert not log.exists()


def test_requeue_is_off_without_auto_requeue_or_preemption(slurm_job):
    single = hardware.single_device("cpu")
    assert SlurmRequeue.for_fit(single, (signal.SIGTERM,)) is not None  # detected
    assert SlurmRequeue.for_fit(single, ()) is None  # preemption_signals=()
    # a strategy made with a cluster environment (what hardware.ddp() keeps as .cluster)
    off = SimpleNamespace(cluster=SLURMEnvironment(auto_requeue=False))
    assert SlurmRequeue.for_fit(off, (signal.SIGTERM,)) is None
    usr2 = SimpleNamespace(cluster=SLURMEnvironment(requeue_signal=signal.SIGUSR2))
    assert SlurmRequeue.for_fit(usr2, (signal.SIGTERM,)).signal == signal.SIGUSR2
    by_hand = SimpleNamespace(cluster=None)  # a group formed by hand: no launcher
    assert SlurmRequeue.for_fit(by_hand, (signal.SIGTERM,)) is None


def test_array_jobs_requeue_their_task():
    env = {"SLURM_JOB_ID": "101", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm.requeue_command(env) == ["scontrol", "requeue", "100_3"]
    assert slurm.requeue_command({"SLURM_JOB_ID": "101"}) == ["scontrol", "requeue", "101"]
