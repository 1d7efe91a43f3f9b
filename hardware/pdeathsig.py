"""End a child process together with its parent (Linux ``PR_SET_PDEATHSIG``; elsewhere a no-op).

A process started for a run (a rank of ``hardware.launch``, a DataLoader worker) must not
outlive the process that started it: an orphan keeps its CPU, its memory and the job's
stdout (which hangs anything waiting for the output to close). ``die_with_parent`` asks the
kernel to SIGKILL the caller when its parent dies, then checks that the parent is still
alive, which closes the race of a parent that died before the request was made.

The kernel's "parent" is the *thread* that started the child: a child started from a
thread that ends before the process does is killed at that moment. Call it only in
children started by a long-lived thread (the main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent", "is_running"]

_PR_SET_PDEATHSIG = 1


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel (a zombie then counts as alive)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; best effort).

    ``parent_pid`` is the process that started this one; if it is already gone when the
    request takes effect, this process exits at once (``os._exit(1)``). Elsewhere than
    Linux nothing happens.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(signal.SIGKILL)), 0, 0, 0)
    # The parent may have died before the request: this process was re-parented then (a
    # forkserver parent differs from parent_pid too, hence the second test).
    if os.getppid() != parent_pid and not is_running(parent_pid):
        os._exit(1)
