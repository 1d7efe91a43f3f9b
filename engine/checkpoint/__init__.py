"""Checkpoints: the whole ``TrainState`` to any fsspec URL, atomically and safely.

``save(state, url, metadata=...)`` / ``load(url, target=...)`` write and read a state with
its metadata (``files``); writes are atomic (``storage``: rename, or a commit marker on
object stores); loading never unpickles objects (``codec``: plain data only, ``@struct``
classes rebuilt by name; ``safe_load``: one guarded ``torch.load``). A target checks what the
model and optimizer decide and takes the run's position from the file (``matching``).
``find_latest(folder)`` / ``load_latest(folders)`` / ``read_latest(folders)`` pick the
checkpoint with the furthest recorded progress that loads (``discover``; ``ranked`` orders
them by the small record ``read_record`` reads), the latter two with its decoded state or
its payload for ``load_payload``; ``load_module(url, template)`` gives the trained module of
a checkpoint (``engine.to_module`` of its weights); ``AsyncCheckpointer``
writes in a background thread (``background``); ``export_state_dict`` / ``load_weights``
exchange plain ``state_dict``s (``interop``). ``sharded.save`` / ``sharded.load`` write and read
sharded states (FSDP) as one ``torch.distributed.checkpoint`` file per rank, reloadable at
any world size (``sharded``; its pickled DCP index read by ``dcp_metadata``).
"""

from . import sharded, storage
from .background import AsyncCheckpointer
from .codec import CheckpointError, decode, encode
from .discover import candidates, find_latest, load_latest, ranked, read_latest
from .files import (
    FORMAT,
    FORMAT_VERSION,
    check_plain,
    conform,
    load,
    load_metadata,
    load_module,
    load_payload,
    read,
    read_record,
    save,
    versions,
)
from .interop import export_state_dict, load_weights, read_state_dict
from .storage import (
    MARKER_SUFFIX,
    is_committed,
    modified_time,
    remove,
    remove_partial,
    write_atomic,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER_SUFFIX",
    "AsyncCheckpointer",
    "CheckpointError",
    "candidates",
    "check_plain",
    "conform",
    "decode",
    "encode",
    "export_state_dict",
    "find_latest",
    "is_committed",
    "load",
    "load_metadata",
    "load_module",
    "load_latest",
    "load_payload",
    "load_weights",
    "modified_time",
    "ranked",
    "read",
    "read_latest",
    "read_record",
    "read_state_dict",
    "remove",
    "remove_partial",
    "save",
    "sharded",
    "storage",
    "versions",
    "write_atomic",
]
