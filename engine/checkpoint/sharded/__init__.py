"""Sharded checkpoints: every rank writes its own shard through ``torch.distributed.checkpoint``.

A sharded checkpoint is a folder (``folder``)::

    run.ckpt/
      __0_0.distcp  __1_0.distcp ...   each rank's tensors (DCP's FileSystemWriter)
      .metadata                        DCP's index of them (a pickle; read safely, below)
      purestep.json                    format, versions, the state's structure, the metadata
      COMMITTED                        written last: the checkpoint is complete

``save(state, path, metadata=...)`` (``write``) is called by every rank (a collective when
a process group exists; also works in one process without one). The state is encoded as
for an ordinary checkpoint (``codec.encode``: plain data, ``@struct`` classes by name); its
tensors (DTensor shards and plain tensors alike) go to DCP, the rest to ``purestep.json`` as
JSON (``skeleton``). A folder without ``COMMITTED`` is refused: a reader never takes a
half-written checkpoint.

**The commit protocol: a committed state of ``path`` exists at every instant** (``commit``).
Everything is written into a hidden temporary folder beside ``path``, named with its
writer's identity (``.run.ckpt.tmp-<host>-<pid>-<start>-<random>``, as ``storage`` names
temporary files). The steps, each one a point where a save may be killed (``COMMIT_STEPS``):

1. ``written``: every rank's ``dcp.save`` has returned (DCP writes ``.metadata`` after
   gathering every rank's results);
2. ``described``: rank 0 has written ``purestep.json`` into the temporary folder;
3. ``committed``: rank 0 has written ``COMMITTED`` into the temporary folder: a small JSON
   record ``{"name": "run.ckpt", "sequence": n, "time_ns": t}`` naming the checkpoint it is
   a version of, ``n`` one more than any committed version of that name beside it. From
   here the hidden folder is the newest committed state of ``run.ckpt``;
4. ``retired``: an entry already at ``path`` (the version before: a folder or a plain
   file) is renamed to a hidden temporary name of this writer;
5. ``placed``: the temporary folder is renamed to ``path``;
6. ``unmarked``: the retired folder's ``COMMITTED`` is removed; the folder is deleted;
   so are the name's older hidden versions whose writers are not provably alive.

Versions of a name are ordered (``versions``) by ``(sequence, modification time of
COMMITTED)``; a plain checkpoint file at ``path`` against a folder by its modification
time against that of the folder's ``COMMITTED`` (one clock: the file server's). A hidden
folder's claim to a name is believed only when its own name was made from exactly that
name. ``newest(path)`` is the entry holding the newest committed version: ``path`` itself,
or between steps 3 and 5 the hidden folder. Discovery (``discover``, ``newest_in``) takes
that hidden folder in place of the name, and a Trainer counts the name as taken (a fresh
run writes ``last-v1.ckpt`` beside it), so a kill at any step leaves a run that resumes
from its newest committed state. Cleanup (``cleanup.recover``, run only by the writer,
``fit``) finishes an interrupted commit of a writer that is gone (steps 4 to 6 again),
then deletes the gone writers' hidden folders that hold no newest committed state, marker
first. A folder holding the newest committed state of a name is never deleted. A live
writer's folders are never touched by cleanup (``storage.writer_alive``; one whose writer
cannot be checked only once untouched for ``STALE_AFTER_S``). ``replace_with_file`` puts a
plain file in place of a sharded folder by the same steps (a DDP run resumed from an FSDP
run's ``last.ckpt``).

A save that fails (not killed) raises on every rank (``failures``) and leaves ``path`` as
it was: the version before is put back if it was retired (where even that fails, the
error says where it is kept, hidden, and discovery finds it there), the new folder is
removed. Any error of rank 0's commit is agreed on, so no rank waits for another. A disk
that ran full, in DCP's writes on any rank or in rank 0's commit, is ``OSError(ENOSPC)``
naming the checkpoint, as ``storage`` raises for a plain file (only an error of a write is
checked against a nearly full disk); DCP reports a failed write as its
``CheckpointException``, a ``BaseException``, which is caught (the ranks agree on it
through DCP, so rank 0 then removes the temporary folder); any other failure is a
``CheckpointError`` naming the checkpoint and each failed rank's error. A rank that dies
mid-save leaves the temporary folder (uncommitted and hidden) for cleanup.

``load(path, target=None)``, ``load_parts(path, parts, target)`` and ``peek(path)``
(``read``) read it back at any world size, laid out like ``target``, its parts compared
with the target's by key path.

**Safety: no code runs from a checkpoint.** ``purestep.json`` and ``COMMITTED`` are JSON
(bounded reads), ``purestep.json`` decoded by ``codec.decode`` (registered ``@struct``
classes only). DCP's ``.metadata`` pickle is read by ``dcp_metadata.SafeReader`` (only
DCP's metadata classes are resolved; data files must be this folder's; tensor entries
only); tensor data is read by DCP with ``torch.load(weights_only=True)``. A name recorded
in a marker is a plain file name from which the hidden folder's own name was made, so
cleanup moves folders only within their folder. Local filesystems only.

Modules: ``folder`` (the files of a folder), ``skeleton`` (state <-> JSON and DCP keys),
``failures`` (errors agreed across ranks), ``versions`` (ordering a name's versions),
``commit`` (the protocol's steps), ``cleanup`` (what killed writers left; deletion),
``write`` (``save``), ``read`` (``load``, ``load_parts``, ``peek``). Tests that stop a save
at a step replace ``commit._reached`` / ``commit._temp_name``, ``folder._write_file`` or
``read._read_tensors`` in their own module (this package does not re-export them, so a
patch of ``sharded._reached`` fails loudly instead of silently not applying).
"""

from __future__ import annotations

from .cleanup import Recovery, recover, remove, remove_hidden, remove_partial
from .commit import COMMIT_STEPS, REPLACE_STEPS, replace_with_file
from .folder import (
    COMMIT_FILE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
    SHARDED_FORMAT,
    SHARDED_VERSION,
    is_committed,
    is_sharded_checkpoint,
    read_manifest,
    read_record,
)
from .read import load, load_parts, peek
from .skeleton import MODEL_SECTIONS
from .versions import newest, newest_in
from .write import save

__all__ = [
    "COMMIT_FILE",
    "COMMIT_STEPS",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "MAX_MARKER_BYTES",
    "MODEL_SECTIONS",
    "REPLACE_STEPS",
    "SHARDED_FORMAT",
    "SHARDED_VERSION",
    "Recovery",
    "is_committed",
    "is_sharded_checkpoint",
    "load",
    "load_parts",
    "newest",
    "newest_in",
    "peek",
    "read_manifest",
    "read_record",
    "recover",
    "remove",
    "remove_hidden",
    "remove_partial",
    "replace_with_file",
    "save",
]
