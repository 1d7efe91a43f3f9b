"""SLURM auto-requeue for a fit: checkpoint, ``scontrol requeue``, exit 0 (Lightning's semantics).

A SLURM job asked for a warning signal before its time limit (``#SBATCH
--signal=USR1@90``: SIGUSR1 90 s before it) is told to stop; Lightning's
``SLURMEnvironment(auto_requeue=True)`` then saves a checkpoint and puts the job back in the
queue, so the next allocation continues it. Here the fit's preemption handling
(``loops.resume``) does the stopping: the signal only sets a flag, every rank agrees at the
next commit point to stop there (``reduce_flag``: any rank's signal stops all), and
``last.ckpt`` is written. Then ``SlurmRequeue.after_checkpoint``: the ranks agree whether any
of them got the requeue signal (SIGTERM, which SLURM sends to cancel, only preempts); rank 0
runs ``scontrol requeue <job id>`` (``hardware.slurm.requeue``: no shell; a failure is a
logged error, the checkpoint is already on disk); the ranks agree on rank 0's result, and
every process exits with code 0 (``loops.resume.Requeued``) if SLURM took the job, else with the
preemption's 75. The requeued job starts the same command, whose ``ckpt_path="last"``
resumes bitwise.

It applies when the fit's strategy was made with a ``SLURMEnvironment`` whose
``auto_requeue`` is on (``hardware.ddp()`` / ``fsdp()`` detected it or were given it), or,
for a one-process strategy, when a SLURM job is detected from the environment; and only
while preemption handling is on (``Trainer(preemption_signals=())`` turns both off). The
requeue signal is caught beside the preemption signals.
"""

from __future__ import annotations

import os
from typing import Any

from purestep.hardware import slurm
from purestep.hardware.cluster import SLURMEnvironment, detect

__all__ = ["SlurmRequeue"]


class SlurmRequeue:
    """A fit's auto-requeue: which signal asks for it, and what follows the checkpoint."""

    def __init__(self, environment: SLURMEnvironment, strategy: Any) -> None:
        self.environment = environment
        self.strategy = strategy

    @property
    def signal(self) -> int:
        """The signal that asks for the requeue (SIGUSR1 by default)."""
        return self.environment.requeue_signal

    @classmethod
    def for_fit(cls, strategy: Any, signals: tuple[int, ...]) -> SlurmRequeue | None:
        """The requeue of a fit under ``strategy``, or None where it does not apply (see
        the module docstring); ``signals``: the fit's preemption signals."""
        if not signals:
            return None
        if hasattr(strategy, "cluster"):
            environment = strategy.cluster  # what formed the group (None: formed by hand)
        else:
            environment = detect()  # one process: the job's own environment
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return None
        return cls(environment, strategy)

    def after_checkpoint(self, signum: int | None, driver: Any, path: str) -> str | None:
        """Every rank, after the preemption checkpoint is written (``signum``: the signal
        this rank got): the job id if any rank got the requeue signal and SLURM requeued
        the job (the caller raises ``loops.resume.Requeued``, exit code 0), else None (it
        exits as for a preemption)."""
        strategy, several = self.strategy, driver.world_size > 1
        asked = signum == self.signal
        if several:
            asked = strategy.reduce_flag(asked, "any")
        if not asked:
            return None
        job = slurm.job_id(os.environ) or "?"
        done = slurm.requeue(os.environ) if strategy.is_primary else True
        if several:
            done = strategy.reduce_flag(done, "all")  # rank 0's answer, on every rank
        if not done:
            driver.say(
                f"SLURM auto-requeue of job {job} failed (see the error logged above); the "
                f"checkpoint {path} is written: resubmit the job with ckpt_path='last'"
            )
            return None
        driver.say(
            f"Requeued SLURM job {job}: checkpoint written to {path}; exiting with code 0. "
            "The requeued job resumes with ckpt_path='last'."
        )
        return job
