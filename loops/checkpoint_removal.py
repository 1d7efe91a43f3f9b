"""Deleting an evicted checkpoint: only what this run's checkpoint folder holds.

On local disks only a regular file inside its checkpoint folder (by real path: a template
with folders writes to subfolders, and one may be a symlink out), or a symlink there to
such a file (``save_last="link"``), is deleted; anything else is left alone with a warning
(a checkpoint folder may hold what this run did not write). A sharded checkpoint goes with
the hidden versions of its name that killed saves left (``sharded.remove_hidden``).
"""

from __future__ import annotations

import os
import warnings

from purestep.engine import checkpoint as ck

__all__ = ["remove_checkpoint"]


def remove_checkpoint(path: str, folder: str) -> None:
    """Delete the evicted checkpoint ``path`` of the checkpoint folder ``folder`` (see the
    module docstring); what is not this run's to delete is left with a warning."""
    local = ck.storage.filesystem(path)[1] if ck.storage.is_local_url(path) else None
    if local is not None and _sharded_name(local):
        # a sharded checkpoint (FSDP): only a committed purestep folder of this run's
        real = os.path.realpath(ck.storage.filesystem(folder)[1])
        parent = os.path.realpath(os.path.dirname(local))
        if not _inside(parent, real):
            warnings.warn(
                f"not deleting {path}: its folder is {parent}, outside the checkpoint "
                f"folder {real}",
                stacklevel=3,
            )
            return
        try:
            if ck.sharded.is_sharded_checkpoint(local):
                ck.sharded.remove(local)
            else:  # only hidden versions: a cut-short commit holds its newest state
                ck.sharded.remove_hidden(local)
        except ck.CheckpointError as err:
            warnings.warn(f"not deleting {path}: {err}", stacklevel=3)
        return
    if local is not None:
        reason = _not_ours(local, ck.storage.filesystem(folder)[1])
        if reason:
            warnings.warn(f"not deleting {path}: {reason}", stacklevel=3)
            return
    ck.remove(path)
    if local is not None:  # sharded versions a save cut short left: none comes back
        ck.sharded.remove_hidden(local)


def _not_ours(path: str, folder: str | None = None) -> str | None:
    """Why the local file ``path`` is not one to delete (None: a regular file, a missing
    one, or a symlink to a regular file, in the checkpoint folder ``folder``, its own
    folder by default). "In" is by real path: a subfolder that is a symlink out is not."""
    root = os.path.realpath(folder or os.path.dirname(path) or ".")
    parent = os.path.realpath(os.path.dirname(path) or ".")
    if not _inside(parent, root):
        return f"its folder is {parent}, outside the checkpoint folder {root}"
    if os.path.islink(path):
        target = os.path.realpath(path)
        if not _inside(os.path.dirname(target), root):
            return f"it is a symbolic link to {target}, outside {root}"
        return None if os.path.isfile(target) else "it links to no regular file"
    if os.path.lexists(path) and not os.path.isfile(path):
        return "it is not a regular file"
    return None


def _inside(path: str, root: str) -> bool:
    """Whether the real path ``path`` is ``root`` or under it."""
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives
        return False


def _inside(path: str, root: str) -> bool:
    """Whether the real path ``path`` is ``root`` or under it."""
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives
        return False


def _sharded_name(local: str) -> bool:
    """Whether the local checkpoint path ``local`` is a sharded checkpoint to delete as a
    folder: a sharded folder (not a symlink), or no entry at all while the name's newest
    committed state is a hidden folder beside it (``engine.checkpoint.sharded.newest``)."""
    if os.path.islink(local):
        return False
    if ck.sharded.is_sharded_checkpoint(local):
        return True
    return not os.path.lexists(local) and ck.sharded.newest(local) is not None
