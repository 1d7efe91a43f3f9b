"""SLURM's own formats and commands: host lists, tasks per node, the job id, ``scontrol requeue``.

SLURM writes the nodes of a job as a compressed host list (``SLURM_NODELIST``:
``node[01-04,07],gpu7``) and the tasks per node in its repeat notation
(``SLURM_TASKS_PER_NODE``: ``2(x3),1``). ``expand_hostlist`` / ``first_host`` and
``tasks_per_node`` read them; ``master_port`` derives the rendezvous port from the job id
as Lightning does (its last four digits + 15000, so every task computes the same port
without talking); ``requeue`` asks SLURM to put the job back in the queue
(``scontrol requeue <id>``, an array task as ``<array id>_<task id>``), with a logged error
rather than an exception when that fails.
"""

from __future__ import annotations

import itertools
import logging
import re
import subprocess
from collections.abc import Mapping

__all__ = [
    "DEFAULT_PORT",
    "INTERACTIVE_JOB_NAMES",
    "expand_hostlist",
    "first_host",
    "job_id",
    "master_port",
    "requeue",
    "requeue_command",
    "tasks_per_node",
]

log = logging.getLogger(__name__)

#: The port when the job has no id (Lightning's).
DEFAULT_PORT = 12910
#: Job names of an interactive allocation (``srun --job-name=interactive --pty bash``): the
#: processes are then started by hand, so SLURM does not count as their launcher.
INTERACTIVE_JOB_NAMES = ("bash", "interactive")

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top(text: str, what: str) -> list[str]:
    """``text`` split at commas (and spaces) outside brackets."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{what} {text!r} has a ']' without its '['")
        if depth == 0 and char in ", ":
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth:
        raise ValueError(f"{what} {text!r} has a '[' without its ']'")
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_range(body: str, nodelist: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]`` (zero padding kept, as SLURM writes it)."""
    out = []
    for item in body.split(","):
        match = _RANGE.match(item)
        if match is None:
            raise ValueError(f"SLURM host list {nodelist!r}: {item!r} is not a number or a range")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"SLURM host list {nodelist!r}: range {item!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return out


def _expand_one(pattern: str, nodelist: str) -> list[str]:
    """One host pattern (``rack[1-2]-n[01-02]``) -> its host names, in SLURM's order."""
    pieces = re.split(r"\[([^\]]*)\]", pattern)
    choices = []
    for i, piece in enumerate(pieces):
        choices.append(_expand_range(piece, nodelist) if i % 2 else [piece])
    return ["".join(names) for names in itertools.product(*choices)]


def expand_hostlist(nodelist: str) -> list[str]:
    """Every host of a SLURM host list (``SLURM_NODELIST``), in order:
    ``"node[01-03,07],gpu1"`` -> ``["node01", "node02", "node03", "node07", "gpu1"]``."""
    hosts = [
        h
        for part in _split_top(nodelist.strip(), "SLURM host list")
        for h in _expand_one(part, nodelist)
    ]
    if not hosts:
        raise ValueError(f"SLURM host list {nodelist!r} names no host")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: where rank 0 runs, the run's master address."""
    first = _split_top(nodelist.strip(), "SLURM host list")
    if not first:
        raise ValueError(f"SLURM host list {nodelist!r} names no host")
    return _expand_one(first[0], nodelist)[0]


def tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks per node (``SLURM_TASKS_PER_NODE``): ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.split(","):
        match = _REPEAT.match(item.strip())
        if match is None:
            raise ValueError(
                f"SLURM_TASKS_PER_NODE={text!r}: {item!r} is not a count or 'count(xrepeat)'"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def master_port(environ: Mapping[str, str]) -> int:
    """The rendezvous port: ``MASTER_PORT`` if set, else the last four digits of
    ``SLURM_JOB_ID`` + 15000 (every task of the job computes the same), else 12910."""
    if "MASTER_PORT" in environ:
        raw = environ["MASTER_PORT"]
        if not raw.strip().isdigit():
            raise ValueError(f"environment variable MASTER_PORT={raw!r} is not an integer")
        return int(raw)
    job = environ.get("SLURM_JOB_ID")
    if job is None:
        return DEFAULT_PORT
    digits = job.strip()[-4:]
    if not digits.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job!r} does not end in digits; set MASTER_PORT")
    return int(digits) + 15000


def job_id(environ: Mapping[str, str]) -> str | None:
    """The id ``scontrol`` knows the job by: ``<array job id>_<task id>`` for an array
    task, else ``SLURM_JOB_ID`` (None when neither is set)."""
    array = environ.get("SLURM_ARRAY_JOB_ID")
    if array and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{array}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID") or None


def requeue_command(environ: Mapping[str, str]) -> list[str]:
    """``["scontrol", "requeue", <job id>]``; ``RuntimeError`` without a job id."""
    job = job_id(environ)
    if job is None:
        raise RuntimeError("cannot requeue: SLURM_JOB_ID is not set (is this a SLURM job?)")
    return ["scontrol", "requeue", job]


def requeue(environ: Mapping[str, str], timeout: float = 30.0) -> bool:
    """Run ``scontrol requeue <job id>`` (no shell); return whether SLURM accepted it.

    A failure (no job id, no ``scontrol`` on ``PATH``, a non-zero exit, no answer within
    ``timeout`` seconds) is logged as an error naming the command and returns ``False``:
    the caller has already written its checkpoint, and the job can be resubmitted by hand.
    The default ``timeout`` stays below a process group's default 60 s, which the other
    ranks wait on for rank 0's answer.
    """
    try:
        argv = requeue_command(environ)
    except RuntimeError as err:
        log.error("SLURM auto-requeue failed: %s", err)
        return False
    command = " ".join(argv)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        log.error("SLURM auto-requeue failed: `%s`: scontrol is not on PATH", command)
        return False
    except subprocess.TimeoutExpired:
        log.error("SLURM auto-requeue failed: `%s` did not finish within %g s", command, timeout)
        return False
    except OSError as err:
        log.error("SLURM auto-requeue failed: `%s` could not run: %s", command, err)
        return False
    if done.returncode != 0:
        output = (done.stderr or done.stdout or "").strip()
        log.error(
            "SLURM auto-requeue failed: `%s` exited with %d%s",
            command,
            done.returncode,
            f": {output}" if output else "",
        )
        return False
    log.info("Requeued SLURM job %s", argv[-1])
    return True
