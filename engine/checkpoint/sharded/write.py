"""Writing a sharded checkpoint: every rank's shard through DCP, then rank 0 commits it.

``save`` is called by every rank (a collective when a process group exists; also works in
one process without one). A failure raises on every rank alike (``failures``) and leaves
the checkpoint there before as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..codec import CheckpointError
from ..storage import _no_space
from . import commit
from . import folder as layout
from .failures import (
    _agree,
    _describe,
    _distributed,
    _failure,
    _quiet,
    _raise,
    _ran_out_of_space,
    _rank,
)
from .folder import MANIFEST, SHARDED_FORMAT, SHARDED_VERSION, _fsync_dir
from .skeleton import _record, _tensors_of

#: What is left after a failed save that removed its temporary folder.
_INTACT = "its temporary folder was removed; the checkpoint there before is intact"


def save(state: Any, path: str | os.PathLike, *, metadata: Mapping[str, Any] | None = None) -> None:
    """Write ``state`` as a sharded checkpoint folder at ``path`` (every rank calls this;
    ``metadata`` is taken from rank 0), by the commit protocol of the package docstring."""
    path = os.path.abspath(os.fspath(path))
    if "://" in os.fspath(path):
        raise CheckpointError(f"sharded checkpoints are written to local folders, not {path}")
    parent = os.path.dirname(path)
    rank = _rank()
    skeleton, tensors = _tensors_of(state)
    # hidden, named with the writer's identity: discovery lists it only once committed, and
    # once its writer is gone ``recover`` finishes or deletes it
    name = os.path.basename(path)
    temp = _agree(os.path.join(parent, commit._temp_name(name)) if rank == 0 else None)
    error, cause = None, None
    if rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            if os.path.lexists(temp):
                shutil.rmtree(temp)
            os.makedirs(temp)
        except Exception as err:
            cause = err
            written = isinstance(err, OSError)
            message = f"cannot create {temp}: {type(err).__name__}: {err}"
            outcome = "the checkpoint there before is intact"
            error = _failure(err, path, message, outcome, written=written)
    error = _agree(error)
    if error:
        _raise(error, cause)
    _write_shards(tensors, temp, path)
    commit._reached("written", path)
    if rank == 0:
        try:
            _describe_into(temp, skeleton, state, metadata)
            commit._reached("described", path)
            commit._commit(temp, path)
            commit._place(temp, path)
        except Exception as err:  # whatever it is, every rank must hear of it
            cause, error = err, _commit_failure(err, path)
            commit._abandon(temp)  # ``_place`` put the version before back if it retired it
    error = _agree(error)
    if error:
        _raise(error, cause)


def _commit_failure(err: Exception, path: str) -> tuple[int | None, str]:
    """What every rank raises for rank 0's failed commit of ``path`` (``_failure``): it says
    where the version before is when it could not be put back at ``path``."""
    outcome = _INTACT
    if isinstance(err, commit._Stranded):
        outcome = (
            "its temporary folder was removed; the checkpoint there before is kept, hidden, "
            f"at {err.retired}, where discovery finds it and the next cleanup puts it back"
        )
    message = f"committing the sharded checkpoint {path} failed: {type(err).__name__}: {err}"
    return _failure(err, path, message, outcome, written=isinstance(err, OSError))


def _describe_into(
    temp: str, skeleton: Any, state: Any, metadata: Mapping[str, Any] | None
) -> None:
    """Write ``purestep.json`` (format, versions, world size, progress record, the state's
    skeleton, the metadata) into the temporary folder ``temp``."""
    from ..files import versions

    meta_skeleton, meta_tensors = _tensors_of(dict(metadata or {}))
    if meta_tensors:
        raise CheckpointError("sharded checkpoint metadata may not hold tensors")
    manifest = {
        "format": SHARDED_FORMAT,
        "version": SHARDED_VERSION,
        "versions": versions(),
        "world_size": dist.get_world_size() if _distributed() else 1,
        "record": _record(state),
        "state": skeleton,
        "metadata": meta_skeleton,
    }
    layout._write_file(os.path.join(temp, MANIFEST), json.dumps(manifest).encode())
    _fsync_dir(temp)


def _write_shards(tensors: dict[str, torch.Tensor], temp: str, path: str) -> None:
    """Every rank's ``tensors`` into the folder ``temp`` through DCP.

    DCP gathers every rank's write results on rank 0 and broadcasts a failure to all of
    them as a ``CheckpointException``, which derives from ``BaseException`` (``except
    Exception`` misses it). Every rank raises it here as ``OSError(ENOSPC)`` when a disk ran
    full, else as a ``CheckpointError`` naming ``path`` and each failed rank's error; rank 0
    then removes ``temp`` (no rank writes into it any more). A failure outside DCP's
    agreement (one rank's own, before its collectives) is raised by that rank alone, and
    ``temp`` is left for cleanup once the launcher has ended the others."""
    import torch.distributed.checkpoint as dcp  # about a second to import: only when used
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(temp), no_dist=not _distributed())
        return
    except CheckpointException as err:  # every rank has it: DCP agreed on it
        failure: BaseException = err
        agreed = True
    except Exception as err:  # this rank's alone
        failure, agreed = err, not _distributed()
    full = _ran_out_of_space(failure, os.path.dirname(path))
    if agreed:
        if _rank() == 0:
            commit._abandon(temp)  # before the agreement: gone on every rank that raises
        full = _agree(full)  # rank 0's disk check decides: every rank raises alike
        outcome = _INTACT
    else:
        outcome = (
            "its temporary folder is removed once its writers are gone; the checkpoint "
            "there before is intact"
        )
    if full:
        raise _no_space(path, outcome) from failure
    raise CheckpointError(
        f"writing the sharded checkpoint {path} failed: {_describe(failure)} ({outcome})"
    ) from failure
