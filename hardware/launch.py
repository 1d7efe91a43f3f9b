"""Run a function on several ranks of this machine: ``torchrun`` for notebooks and tests.

``launch(fn, nprocs, *args)`` starts ``nprocs`` fresh processes (``spawn``), gives each the
variables ``torchrun`` would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` =
127.0.0.1, ``MASTER_PORT`` = a free port), initialises the default process group in each
(``backend``, collective ``timeout``), runs ``fn(rank, *args)`` and returns every rank's
result in rank order. ``fn``, ``args`` and the results must be picklable (``fn`` defined at
the top level of an importable module, or of the script being run).

Failures: if a rank raises, exits or is killed, the other ranks get ``grace`` seconds to end
on their own (so a peer's collective error is reported too), then are terminated, and
``LaunchError`` names each failed rank with its exception and traceback (or the signal that
killed it). ``max_seconds`` bounds the whole run (``LaunchTimeout``). Processes never outlive
the call: survivors are terminated (SIGTERM, then SIGKILL), and on Linux every worker is
killed by the kernel if the launching process dies (``hardware.pdeathsig``). Forming the
group is bounded by ``timeout`` (``hardware.group``).

A rank that returns writes its result, destroys its group, runs what exit runs
(multiprocessing's and threading's exit hooks, the join of its non-daemon threads, the
``atexit`` handlers), flushes its open files and ends with ``os._exit(0)``, skipping the
interpreter's teardown, which can abort a finished gloo rank (see ``_exit_cleanly``).

Threads: each worker runs ``torch.set_num_threads(threads)``; by default 1 unless
``OMP_NUM_THREADS`` is set, as ``torchrun`` does, so ranks do not fight over cores.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import multiprocessing.util
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .group import form_group
from .pdeathsig import die_with_parent
from .process_env import ProcessEnv

__all__ = ["LaunchError", "LaunchTimeout", "free_port", "launch"]

_STOP_WAIT = 3.0  # seconds between SIGTERM and SIGKILL when stopping a worker


class LaunchError(RuntimeError):
    """One or more ranks of a launch failed; ``failures`` maps each such rank to why."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures
        self.rank = next(iter(failures), None)


class LaunchTimeout(LaunchError, TimeoutError):
    """The launch ran past ``max_seconds``; the ranks still running were killed."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- worker side


def _write(path: str, payload: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    args: tuple[Any, ...],
    port: int,
    backend: str,
    timeout: float,
    threads: int | None,
    out_dir: str,
    parent_pid: int,
) -> None:
    die_with_parent(parent_pid)
    env = ProcessEnv(rank, nprocs, rank, nprocs, "127.0.0.1", port)
    os.environ.update(env.to_environ())
    if threads is not None:
        torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        if "nccl" in backend and torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU per rank
        try:
            form_group(backend, env, timeout)
        except RuntimeError as err:
            raise RuntimeError(
                f"rank {rank}: could not form the process group of {nprocs} ranks within "
                f"{timeout:g} s: {err}"
            ) from err
        result = fn(rank, *args)
        try:
            _write(path, ("ok", result))
        except Exception as err:
            raise TypeError(
                f"the result of rank {rank} ({type(result).__name__}) cannot be pickled: {err}"
            ) from err
    except BaseException as err:  # report everything, KeyboardInterrupt and SystemExit too
        with contextlib.suppress(Exception):
            _write(path, ("error", type(err).__name__, str(err), traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a dead peer can hang it
    if dist.is_initialized():
        dist.destroy_process_group()
    _exit_cleanly()


def _exit_cleanly() -> None:
    """End a worker whose result is written, without the interpreter's teardown.

    A gloo worker thread may still be freeing a finished collective's tensors (their
    Python objects need the GIL) when the process exits; if the interpreter is finalising
    by then, that thread is stopped inside C++ and the process aborts (SIGABRT) although
    the rank succeeded. ``destroy_process_group`` does not prevent it while a DeviceMesh
    still holds the group. So do what exit would do, in its order, while the interpreter is
    whole: multiprocessing's exit function (its finalizers, child processes), threading's
    shutdown (its exit hooks, which stop idle executor workers, then the join of the
    non-daemon threads), the ``atexit`` handlers; then collect reference cycles and flush
    every file still open for writing (module teardown would have closed them), and
    ``os._exit(0)``. A failure in these steps is printed, not raised: the rank succeeded.
    """
    try:
        multiprocessing.util._exit_function()
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        gc.collect()
        _flush_open_files()
    except BaseException:  # report, and still exit 0: the rank succeeded
        with contextlib.suppress(Exception):
            traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _flush_open_files() -> None:
    """Flush every file object still open for writing (``os._exit`` would drop buffers)."""
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()


# ---------------------------------------------------------------------- launcher side


def _check(fn: Any, nprocs: Any, timeout: Any, max_seconds: Any, grace: Any, threads: Any):
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    for name, value, allow_none in (
        ("timeout", timeout, False),
        ("max_seconds", max_seconds, True),
        ("grace", grace, False),
    ):
        if value is None and allow_none:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or value < 0 or (name != "grace" and value == 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    hint = ""
    if exitcode == 1:
        hint = (
            " (it failed before running fn, see its stderr: a function defined in a notebook "
            "or an interactive session cannot be imported by the spawned ranks; put it in a "
            "module)"
        )
    return f"exited with code {exitcode} without reporting a result{hint}"


def _read(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def _stop(procs: list[Any]) -> None:
    """Terminate every live worker, then kill the ones that ignore it; reap all."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + _STOP_WAIT
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
            p.join(_STOP_WAIT)
    for p in procs:
        with contextlib.suppress(Exception):
            p.close()


def _supervise(procs: list[Any], max_seconds: float | None, grace: float) -> tuple[list, bool]:
    """Wait for the workers; return the ranks in the order they ended badly, and whether
    ``max_seconds`` ran out (ranks still alive on return are for the caller to stop)."""
    pending = {p.sentinel: rank for rank, p in enumerate(procs)}
    bad: list[int] = []
    run_end = None if max_seconds is None else time.monotonic() + max_seconds
    grace_end: float | None = None
    while pending:
        ends = [t for t in (run_end, grace_end) if t is not None]
        left = None if not ends else max(0.0, min(ends) - time.monotonic())
        for sentinel in wait(list(pending), timeout=left):
            rank = pending.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                bad.append(rank)
                if grace_end is None:
                    grace_end = time.monotonic() + grace
        now = time.monotonic()
        if pending and grace_end is not None and now >= grace_end:
            return bad, False
        if pending and run_end is not None and now >= run_end:
            return bad, True
    return bad, False


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
    max_seconds: float | None = None,
    grace: float = 5.0,
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nprocs`` local ranks; their results in rank order.

    ``backend`` and ``timeout`` (seconds any collective may wait) set up the default process
    group each rank starts with (``hardware.ddp()`` adopts it). ``max_seconds`` bounds the
    whole run; ``grace`` is how long the others may take to end on their own after one rank
    fails. Raises ``LaunchError`` (or ``LaunchTimeout``) naming the failed ranks.
    """
    _check(fn, nprocs, timeout, max_seconds, grace, threads)
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        threads = 1
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="purestep-launch-") as out_dir:
        procs: list[Any] = []
        try:
            port = free_port()
            for rank in range(nprocs):
                p = ctx.Process(
                    target=_worker,
                    args=(
                        fn,
                        rank,
                        nprocs,
                        args,
                        port,
                        backend,
                        timeout,
                        threads,
                        out_dir,
                        os.getpid(),
                    ),
                    name=f"purestep-rank{rank}",
                )
                try:
                    p.start()
                except (pickle.PicklingError, AttributeError, TypeError) as err:
                    raise TypeError(
                        "fn and args must be picklable to reach the spawned ranks: define fn "
                        f"at the top level of a module (not a lambda or a local function): {err}"
                    ) from err
                procs.append(p)
            bad, timed_out = _supervise(procs, max_seconds, grace)
            still_running = [r for r, p in enumerate(procs) if p.is_alive()]
            exitcodes = [p.exitcode for p in procs]
        finally:
            _stop(procs)
        outcomes = [_read(os.path.join(out_dir, f"rank{r}.pkl")) for r in range(nprocs)]
    silent = [r for r, o in enumerate(outcomes) if o is None and exitcodes[r] == 0]
    bad += [r for r in silent if r not in bad]
    if not bad and not still_running:
        return [outcome[1] for outcome in outcomes]
    failures: dict[int, str] = {}
    details: list[str] = []
    for rank in bad:
        outcome = outcomes[rank]
        if outcome is not None and outcome[0] == "error":
            _, name, message, tb = outcome
            failures[rank] = f"{name}: {message}"
            details.append(f"--- rank {rank} traceback ---\n{tb.rstrip()}")
        else:
            failures[rank] = _describe_exit(exitcodes[rank])
    for rank in still_running:
        failures[rank] = (
            f"still running after {max_seconds:g} s (killed)"
            if timed_out
            else f"still running {grace:g} s after another rank failed (terminated)"
        )
    lines = [f"rank {rank}: {why}" for rank, why in failures.items()]
    if timed_out:
        head = f"launch of {nprocs} ranks ran past max_seconds={max_seconds:g}"
        raise LaunchTimeout("\n".join([head, *lines, *details]), failures)
    head = f"rank {bad[0]} of {nprocs} failed ({failures[bad[0]]})"
    raise LaunchError("\n".join([head, *lines, *details]), failures)
