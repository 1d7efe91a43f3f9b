"""Checkpoints: the whole ``TrainState`` to any fsspec URL, atomically and safely.

``save(state, url, metadata=...)`` / ``load(url, target=...)`` write and read a state with
its metadata (``files``); writes are atomic (``storage``: rename, or a commit marker on
object stores); loading never unpickles objects (``codec``: plain data only, ``@struct``
classes rebuilt by name; ``safe_load``: one guarded ``torch.load``). A target checks what the
model and optimizer decide and takes the run's position from the file (``matching``).
``find_latest(folder)`` / ``read_latest(folders)`` pick the newest checkpoint that reads
(``discover``), the latter with its payload for ``load_payload``; ``AsyncCheckpointer``
writes in a background thread (``background``); ``export_state_dict`` / ``load_weights``
exchange plain ``state_dict``s (``interop``).
"""

from . import storage
from .background import AsyncCheckpointer
from .codec import CheckpointError, decode, encode
from .discover import candidates, find_latest, modified_time, read_latest
from .files import (
    FORMAT,
    FORMAT_VERSION,
    conform,
    load,
    load_metadata,
    load_payload,
    read,
    save,
    versions,
)
from .interop import export_state_dict, load_weights, read_state_dict
from .storage import MARKER_SUFFIX, is_committed, remove, remove_partial, write_atomic

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER_SUFFIX",
    "AsyncCheckpointer",
    "CheckpointError",
    "candidates",
    "conform",
    "decode",
    "encode",
    "export_state_dict",
    "find_latest",
    "is_committed",
    "load",
    "load_metadata",
    "load_payload",
    "load_weights",
    "modified_time",
    "read",
    "read_latest",
    "read_state_dict",
    "remove",
    "remove_partial",
    "save",
    "storage",
    "versions",
    "write_atomic",
]
