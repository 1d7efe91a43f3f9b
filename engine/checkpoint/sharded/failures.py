"""Errors the ranks of a sharded save agree on, so that every rank raises alike.

Rank 0 alone writes the manifest and commits: what fails there is described once
(``_failure``: an errno and a message), sent to every rank (``_agree``) and raised by each
(``_raise``; rank 0 chains it to the error itself). DCP reports a failed read or write as
its ``CheckpointException`` (a ``BaseException``) carrying each rank's error: ``_failures``
unpacks it, ``_describe`` names them. A disk that ran full is ``OSError(ENOSPC)`` with
``storage``'s out-of-space text, as for a plain checkpoint file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist

from .. import storage
from ..codec import CheckpointError


def _distributed() -> bool:
    """Whether a process group is running (the save and load are then collectives)."""
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _distributed() else 0


def _agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (identity without a process group)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process when no group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _failures(err: BaseException) -> list[tuple[int | None, BaseException]]:
    """``(rank, error)`` of each rank's error that a DCP ``CheckpointException`` carries;
    ``[(None, err)]`` for any other error."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, Mapping) and failures:
        found = []
        for rank, wrapped in failures.items():
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(inner, BaseException):
                found.append((rank, inner))
        if found:
            return found
    return [(None, err)]


def _describe(err: BaseException) -> str:
    """Each failed rank's error in one line each (DCP's own text holds their tracebacks)."""
    return "; ".join(
        (f"rank {rank}: " if rank is not None else "") + f"{type(e).__name__}: {e}"
        for rank, e in _failures(err)
    )


def _ran_out_of_space(err: BaseException, folder: str, *, written: bool = True) -> bool:
    """Whether a failed save ran out of space (on any rank, for a DCP
    ``CheckpointException``): ``ENOSPC`` in an error's chain, or, for an error of a write
    (``written``: DCP's writes, a file's write or rename) that does not say why, a local
    disk left almost full, as ``storage`` tells it for a file. Another error (a
    ``TypeError`` of the manifest, say) is never taken for a full disk."""
    if not written:
        return any(storage._space_error_in_chain(e) for _, e in _failures(err))
    fs = storage.filesystem(folder or ".")[0]
    return any(storage._out_of_space(e, fs, folder) for _, e in _failures(err))


def _failure(
    err: BaseException, path: str, message: str, outcome: str, *, written: bool = True
) -> tuple[int | None, str]:
    """``(errno, message)`` that every rank raises for rank 0's failed save of ``path``:
    ``ENOSPC`` and ``storage``'s out-of-space text when the disk ran full (see
    ``_ran_out_of_space``), else no errno and ``message``; both say ``outcome`` (what is
    left of the checkpoint)."""
    if _ran_out_of_space(err, os.path.dirname(path), written=written):
        return errno.ENOSPC, storage._no_space(path, outcome).strerror
    return None, f"{message} ({outcome})"


def _raise(error: tuple[int | None, str], cause: BaseException | None = None) -> None:
    """Raise what ``_failure`` described: ``OSError`` with its errno, else ``CheckpointError``,
    chained to ``cause`` (rank 0's own error; the other ranks have none)."""
    code, message = error
    raise (OSError(code, message) if code else CheckpointError(message)) from cause
