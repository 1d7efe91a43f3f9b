"""Checkpoint I/O for the Trainer: writing with metadata, finding and restoring, preemption.

``Checkpointing`` is what the Trainer hands the loop driver as its checkpointer. A
checkpoint holds the whole ``TrainState`` plus metadata: library versions, the loop flags,
the elapsed training time (the driver's clock, which a resumed run continues) and each
logger's resume state (so a resumed run's logs end as if never interrupted), and the fit's
task hparams and checkpoint hooks' data (``loops.task``: ``saved_data``; the restoring side
is ``restore_task_data`` / ``restore_callback_data``). Only the primary process writes (and
runs the save hooks); the others wait at a barrier. A sharded state (``hardware.fsdp``) is
written by every rank, each its own shard (``engine.checkpoint.sharded``: a folder, rank 0
commits it, so that a committed version of its name exists at every instant), and restored
laid out like the fresh state, at any world size; ``"last"`` finds committed sharded
folders (checked, not read, by rank 0; every rank then loads its shard), a name's newest
committed state included where a killed save left it in a hidden folder (an explicit path
resolves to it too, with a message; rank 0 resolves it for every rank, so no two ranks
load shards of two versions), and an evicted one is deleted only if it is a committed
purestep folder inside its checkpoint folder, together with the hidden versions of its
name (nothing evicted comes back). A plain save over a sharded folder (an FSDP run's
``last.ckpt``, resumed without FSDP) replaces it so that a committed state of the name
exists at every instant (``sharded.replace_with_file``). ``load_for_eval`` reads only the
parameters and buffers of a sharded folder (``sharded.load_parts``), so a fresh
evaluation state, which has no optimizer state, loads it at any world size.

``resolve(ckpt_path)`` turns ``"last"`` (the checkpoint with the furthest recorded progress
that loads as a ``TrainState``, searched in the checkpoint folders, across the loggers'
version folders; ``engine.checkpoint.load_latest``), ``"best"`` (the checkpoint
callback's best path) or a path into a URL; a path that is no file is an error naming the
keywords (and the one it is close to: "lastt" -> did you mean 'last'?). ``restore`` loads
a checkpoint for resuming (``engine.checkpoint.conform`` against a fresh state): the
parameters, buffers, optimizer and loss-scaler state must match the model and optimizer
being trained and land on their devices; everything else (progress, key, callback and loop
state, the open accumulation window) comes from the file. A checkpoint ``resolve`` already
read to validate it is not read again by ``restore`` / ``load_for_eval``.

Only ``fit`` (the writer) cleans up: its primary process first finishes the sharded
commits that killed writers cut short (``engine.checkpoint.sharded.recover``: a name's
newest committed state, left hidden, is moved to the name), then removes the temporary
files and folders of writers that are gone (``engine.checkpoint.storage.remove_partial``:
a live writer's file, this run's or another process's, is never touched, nor a folder
holding a name's newest committed state) from the folders ``"last"`` searches, from its
checkpoint folders before its first step (``check_writable``, which first checks that it
can write them) and from a folder before it first writes there. ``validate``/``test``/
``predict`` never delete, so they may read a live run's folder, or a read-only one.

Preemption: during ``fit``, SIGTERM and SIGUSR1 (configurable) only set a flag; at the next
commit point (the end of the current batch) the run writes ``last.ckpt`` in its checkpoint
folder and exits with ``PREEMPTED_EXIT_CODE`` (75, "try again later"). Launching the same
command again with ``ckpt_path="last"`` resumes from it. In a SLURM job with auto-requeue
(``hardware.SLURMEnvironment``), the requeue signal also makes rank 0 run ``scontrol
requeue`` after the checkpoint, and every process exits 0 (``loops.slurm_requeue``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from purestep.engine import checkpoint as ck
from purestep.engine import tree
from purestep.engine.state import TrainState

from . import loop_state
from .callbacks.checkpoint import ModelCheckpoint
from .checkpoint_removal import remove_checkpoint
from .ckpt_path import CKPT_KEYWORDS, missing_checkpoint, resumable
from .slurm_requeue import SlurmRequeue
from .task import saved_data

__all__ = ["CKPT_KEYWORDS", "PREEMPTED_EXIT_CODE", "Checkpointing", "Preempted", "Requeued"]

PREEMPTED_EXIT_CODE = 75


#: Where a DDP checkpoint holds every rank's epoch accumulators (``TrainState.extra``).
RANK_ACCUMULATORS = "loop_ranks"


class Preempted(SystemExit):
    """Raised (as a ``SystemExit`` with code 75) after a preemption checkpoint is written."""

    def __init__(self, path: str, signum: int) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.path = path
        self.signum = signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"preempted by {name}: checkpoint written to {self.path}"


class Requeued(Preempted):
    """A ``Preempted`` that exits with code 0: SLURM requeued the job (``loops.slurm_requeue``)."""

    def __init__(self, path: str, signum: int, job: str) -> None:
        super().__init__(path, signum)
        SystemExit.__init__(self, 0)
        self.job = job

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"requeued SLURM job {self.job} on {name}: checkpoint written to {self.path}"


class Checkpointing:
    """The Trainer's checkpoint writer and finder (see the module docstring)."""

    def __init__(
        self,
        *,
        strategy: Any,
        loggers: Sequence[Any],
        config: Any,
        root_dir: str,
        async_save: bool = False,
        async_copy: str = "auto",
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
    ) -> None:
        self.strategy = strategy
        self.loggers = list(loggers)
        self.config = config
        self.root_dir = root_dir
        self.signals = tuple(signals)
        # ``async_copy``: what an asynchronous write copies before returning (see
        # engine.checkpoint.AsyncCheckpointer); "always" when the loop updates in place.
        self.saver = ck.AsyncCheckpointer(copy=async_copy) if async_save else None
        self._signal: int | None = None
        self._logger_cache: tuple[Any, list[Any]] | None = None
        # The checkpoint ``resolve`` read to validate it, kept for the restore that follows.
        self._resolved: tuple[str, Any, dict[str, Any]] | None = None
        self._cleaned: set[str] = set()  # folders cleaned of what killed writers left
        # hidden folder -> the name cleanup moved it to (a sharded commit it finished)
        self._moved: dict[str, str] = {}
        self._save_folders: list[str] = []  # this fit's checkpoint folders (check_writable)
        # The fit's task and datamodule (``fit`` sets them): their hooks' data and the
        # task's hparams go into every checkpoint's metadata (``task.saved_data``).
        self.task: Any = None
        self.datamodule: Any = None

    # ------------------------------------------------------------------ writing

    def metadata(
        self, driver: Any, *, weights_only: bool = False, state: Any = None
    ) -> dict[str, Any]:
        """The checkpoint's metadata; with the ``state`` being saved, also the hooks' data
        (``hparams``, ``hooks``: see ``loops.task``), taken once per file written."""
        meta = {
            "fn": driver.fn,
            "flags": self.config.flags,
            "elapsed": driver.elapsed(),
            "loggers": self._logger_states(driver),
            "weights_only": weights_only,
        }
        if state is not None:
            callbacks = getattr(driver, "callbacks", None) or []
            meta.update(
                saved_data(
                    self.task,
                    self.datamodule,
                    callbacks,
                    state,
                    lambda: driver.context(state),
                    weights_only=weights_only,
                )
            )
        return meta

    def _logger_states(self, driver: Any) -> list[Any]:
        """The loggers' resume states, taken once per commit (a TensorBoard state closes
        its event file, so several saves in one commit must not take it again)."""
        commit = driver.last_commit
        if commit is None:  # a save outside a loop (Trainer.save_checkpoint)
            return [logger.state() for logger in self.loggers]
        if self._logger_cache is None or self._logger_cache[0] is not commit:
            self._logger_cache = (commit, [logger.state() for logger in self.loggers])
        return self._logger_cache[1]

    def save(self, state: Any, path: str, driver: Any) -> None:
        """Write ``state`` to ``path`` (the driver's checkpointer)."""
        if _sharded(state):
            # FSDP: every rank writes its shard (engine.checkpoint.sharded); rank 0 commits.
            weights_only = isinstance(state, dict) and state.get("weights_only") is True
            meta = None
            if self.strategy.is_primary:
                meta = self.metadata(driver, weights_only=weights_only, state=state)
                folder = _parent(path)
                if folder not in self._cleaned:  # what killed writers left
                    self.remove_partial([folder], say=getattr(driver, "say", None))
            self.wait()
            ck.sharded.save(state, path, metadata=meta)
            self.strategy.barrier()
            return
        state = self._with_rank_accumulators(state)  # every rank: a collective
        if self.strategy.is_primary:
            folder = _parent(path)
            if folder not in self._cleaned:
                self.remove_partial([folder], say=getattr(driver, "say", None))
            weights_only = isinstance(state, dict) and state.get("weights_only") is True
            meta = self.metadata(driver, weights_only=weights_only, state=state)
            sharded_folder = _sharded_folder(path)
            if sharded_folder is not None:  # an FSDP run's checkpoint, resumed without FSDP
                self.wait()

                def write(temp: str) -> None:
                    ck.save(state, temp, metadata=meta)

                ck.sharded.replace_with_file(sharded_folder, write)
            elif self.saver is not None:
                self.saver.save(state, path, metadata=meta)
            else:
                ck.save(state, path, metadata=meta)
        self.strategy.barrier()

    def _with_rank_accumulators(self, state: Any) -> Any:
        """Under DDP, ``state`` with every rank's epoch accumulators beside rank 0's own
        (``LoopState.train_epoch``: the epoch means and a Lightning-style module's kept
        metric states, each rank's own until the epoch's end merges them), so that each
        rank of a resumed run continues from its own (``_own_rank_accumulators``), not from
        rank 0's. Every rank saves (the barrier after the write needs them all), so the
        gather is one more collective at a point they all reach."""
        strategy = self.strategy
        if strategy.world_size <= 1 or not isinstance(state, TrainState):
            return state
        # as leaves (tensors and numbers): the accumulators' classes may be made at run time
        own = loop_state.ready(state).loop.train_epoch  # none yet: a fit that failed early
        structure = tree.structure(own)
        leaves = [x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in tree.leaves(own)]
        gathered = strategy.all_gather_object((repr(structure), leaves))  # CPU: any device
        if not strategy.is_primary:
            return state
        if any(shape != repr(structure) for shape, _ in gathered):  # ranks logged otherwise
            warnings.warn(
                "the ranks' epoch accumulators differ in their names (a "
                "value logged on some ranks only): the checkpoint keeps rank 0's, which a "
                "resumed run gives every rank (its epoch values then cover rank 0's part)",
                stacklevel=3,
            )
            return state
        accumulators = [tree.unflatten(structure, values) for _, values in gathered]
        ranks = {"world_size": strategy.world_size, "train_epoch": accumulators}
        return state.replace(extra={**state.extra, RANK_ACCUMULATORS: ranks})

    def wait(self) -> None:
        """Block until an asynchronous write is done (a run never ends with one in flight)."""
        if self.saver is not None:
            self.saver.wait()

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
            self.saver = None

    def remove(self, path: str) -> None:
        """Delete an evicted checkpoint. On local disks only a regular file inside its
        checkpoint folder (its own folder's real path in the checkpoint folder's: a template
        with folders, ``"{epoch}/{step}"``, writes to subfolders, and one may be a symlink
        out), or a symlink there to such a file (``save_last="link"``), is deleted; anything
        else is left alone with a warning (a checkpoint folder may hold what this run did
        not write). A sharded checkpoint goes with the hidden versions of its name that
        killed saves left (``sharded.remove_hidden``), also where only those are left: none
        of them would otherwise come back as the name's newest state."""
        remove_checkpoint(path, self._folder_of(path))

    def _folder_of(self, path: str) -> str:
        """The checkpoint folder ``path`` is in: the deepest of this fit's checkpoint
        folders (``check_writable`` records them) it is under, else its own folder."""
        under = [f for f in self._save_folders if path.startswith(f.rstrip("/") + "/")]
        if under:
            return max(under, key=len)
        return path.rsplit("/", 1)[0] if "/" in path else "."

    def remove_partial(self, folders: Sequence[str], say: Any = None) -> list[str]:
        """Settle what killed writers left in ``folders`` (primary process only, after this
        run's own write in flight is done): finish the sharded commits they cut short
        (``engine.checkpoint.sharded.recover``: the newest committed state of a name, left
        hidden, is moved to the name), then delete their temporary files and folders; return
        what was removed. ``say`` tells of both."""
        if not self.strategy.is_primary:
            return []
        self.wait()
        removed: list[str] = []
        completed: list[tuple[str, str]] = []
        for folder in folders:
            removed += ck.remove_partial(folder)
            if ck.storage.is_local_url(folder):
                recovery = ck.sharded.recover(ck.storage.filesystem(folder)[1])
                completed += recovery.completed
                removed += recovery.removed
                self._moved.update(recovery.completed)
            self._cleaned.add(folder)
        messages = []
        if completed:
            moves = ", ".join(f"{new} -> {path}" for new, path in completed)
            messages.append(
                f"Finished {len(completed)} sharded checkpoint commit(s) that a killed save "
                f"cut short (its newest committed state moved to its name): {moves}"
            )
        if removed:
            messages.append(
                f"Removed {len(removed)} partial checkpoint file(s) left by an interrupted "
                f"write: {', '.join(removed)}"
            )
        if say is not None:
            for message in messages:
                say(message)
        return removed

    def current(self, url: str) -> str:
        """Where the checkpoint ``url`` is now: the name cleanup moved it to if it was a
        hidden folder holding a name's newest state (a commit it finished), else ``url``.
        ``fit`` records this as the checkpoint it resumed from, which ``ModelCheckpoint``
        never evicts."""
        if not ck.storage.is_local_url(url):
            return url
        local = os.path.abspath(ck.storage.filesystem(url)[1])
        return self._moved.get(local, url)

    def check_writable(
        self, callbacks: Sequence[Any], state: TrainState, log_dir: Any, say: Any = None
    ) -> None:
        """Fail before a fit's first step, naming the folder, if no file can be created in
        a checkpoint callback's folder (the primary process probes; every process raises;
        a probe that cannot be deleted is only a warning). Remembers the folders: ``remove``
        deletes only inside them. Then settles what killed writers left there
        (``remove_partial``, told through ``say``, else as a warning), so a name whose
        newest state an interrupted commit left hidden is taken before the callbacks choose
        names (a fresh run then writes ``last-v1.ckpt`` beside it, as beside any existing
        ``last.ckpt``)."""
        error, cause = None, None
        self._save_folders = self.save_folders(callbacks, state, log_dir)
        if self.strategy.is_primary:
            for folder in self._save_folders:
                try:
                    ck.storage.check_writable(folder)
                except Exception as err:  # an OSError naming the folder, or a backend's own
                    reason = (err.strerror if isinstance(err, OSError) else None) or str(err)
                    if f" {folder}" not in reason:
                        reason = f"cannot write checkpoints to {folder}: {reason}"
                    error = (err.errno if isinstance(err, OSError) else None, reason)
                    cause = err
                    break
        if self.strategy.world_size > 1:
            error = self.strategy.broadcast_object(error, 0)
        if error is not None:
            message = (
                f"{error[1]}; fit checks its checkpoint folders before training (pass a "
                "writable ModelCheckpoint(dirpath=...) or default_root_dir)"
            )
            raise (OSError(error[0], message) if error[0] else OSError(message)) from cause
        folders = [f for f in self._save_folders if f not in self._cleaned]
        self.remove_partial(folders, say=say if say is not None else _warn)

    @staticmethod
    def save_folders(callbacks: Sequence[Any], state: TrainState, log_dir: Any) -> list[str]:
        """The folders this fit's checkpoint callbacks write to (as their ``on_fit_start``
        decides: their own ``dirpath``, else ``<log_dir>/checkpoints``; never a folder a
        checkpoint names)."""
        found = [cb.folder(log_dir) for cb in callbacks if isinstance(cb, ModelCheckpoint)]
        return list(dict.fromkeys(found))

    @staticmethod
    def link(target: str, link: str) -> None:
        """``link`` points at ``target``: a relative symlink on local disks, a copy elsewhere.
        A directory (or anything but a file or symlink) at ``link`` is left alone with a
        warning, and no link is made."""
        fs, link_path = ck.storage.filesystem(link)
        if ck.storage.is_local_url(link):
            if os.path.lexists(link_path) and not (
                os.path.islink(link_path) or os.path.isfile(link_path)
            ):
                kind = "a directory" if os.path.isdir(link_path) else "not a regular file"
                warnings.warn(f"not linking {link} to {target}: it is {kind}", stacklevel=2)
                return
            with contextlib.suppress(FileNotFoundError):
                os.remove(link_path)
            try:
                os.symlink(os.path.relpath(target, os.path.dirname(link_path)), link_path)
                return
            except OSError:
                pass
        elif fs.isdir(link_path):
            warnings.warn(f"not copying {target} to {link}: it is a directory", stacklevel=2)
            return
        fs.copy(ck.storage.filesystem(target)[1], link_path)

    # ------------------------------------------------------------------ finding

    def folders(self, callbacks: Sequence[Any], state: TrainState | None = None) -> list[str]:
        """Where checkpoints of this run may be: the checkpoint callbacks' folders and, for
        the default folder, every version folder of the first logger."""
        # The folders are configuration: a state's callback bookkeeping never adds one.
        found = [cb.dirpath for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        if self.loggers and getattr(self.loggers[0], "root_dir", None):
            root = self.loggers[0].root_dir
            fs, path = ck.storage.filesystem(root)
            if fs.exists(path):  # every run folder: version_N and named versions alike
                runs = [e["name"] for e in fs.ls(path, detail=True) if e.get("type") == "directory"]
                found += [_with_protocol(root, run) + "/checkpoints" for run in sorted(runs)]
        found.append(self.root_dir.rstrip("/") + "/checkpoints")
        return list(dict.fromkeys(found))

    def resolve(
        self,
        ckpt_path: str | None,
        callbacks: Sequence[Any],
        state: TrainState | None,
        *,
        fn: str,
        say: Any = None,
    ) -> str | None:
        """The checkpoint URL ``ckpt_path`` names (None: start fresh)."""
        self._resolved = None
        if ckpt_path is None:
            return None
        if ckpt_path == "last":
            self._resolved = self._latest(callbacks, state, say, clean=fn == "fit")
            if self._resolved is None:
                if say is not None:
                    say('ckpt_path="last" is set, but there is no checkpoint yet: starting fresh.')
                return None
            return self._resolved[0]
        if ckpt_path == "best":
            if fn == "fit":
                raise ValueError('ckpt_path="best" is for validate/test/predict, not fit')
            # every rank, before any rank may return; a Trainer that has not run has no best
            # (and asking its default logger for a folder would claim one for nothing)
            log_dir = self._log_dir() if state is not None else None
            for cb in callbacks:
                if isinstance(cb, ModelCheckpoint) and state is not None:
                    best = state.callbacks.get(cb.key, {}).get("best_model_path")
                    if best:
                        return cb.full_path(best, log_dir)
            raise ValueError(
                'ckpt_path="best" needs a ModelCheckpoint that has saved a checkpoint in this '
                "Trainer's fit; pass a path instead"
            )
        url, found = self._explicit(os.fspath(ckpt_path), say)
        if not found:
            raise FileNotFoundError(missing_checkpoint(url, fn))
        return url

    def _explicit(self, url: str, say: Any) -> tuple[str, bool]:
        """``(the entry to load for the path url, whether it exists)``, as rank 0 sees it,
        on every process (a collective under DDP/FSDP): a live run's folder may change
        between the ranks' looks, and ranks that resolved the name on their own could load
        the shards of two versions."""
        found = None
        if self.strategy.is_primary:
            chosen = self._newest(url, say)
            found = (chosen, ck.storage.exists(chosen))
        if self.strategy.world_size > 1:
            found = self.strategy.broadcast_object(found, 0)
        return found

    @staticmethod
    def _newest(url: str, say: Any) -> str:
        """``url``, or, for a local sharded checkpoint whose newest committed state a commit
        cut short left in a hidden folder beside it (``engine.checkpoint.sharded.newest``),
        that folder: the name's latest version, as ``"last"`` would find it."""
        if not ck.storage.is_local_url(url):
            return url
        local = ck.storage.filesystem(url)[1]
        found = ck.sharded.newest(local)
        if found is None or found == os.path.abspath(local):
            return url
        if say is not None:
            say(
                f"ckpt_path={url!r}: its newest committed state is {found}, where a save "
                "that was cut short left it; loading that"
            )
        return found

    def _latest(self, callbacks: Sequence[Any], state: TrainState | None, say: Any, *, clean: bool):
        """``(url, state, metadata)`` of the furthest checkpoint a run can resume from
        (``engine.checkpoint.load_latest``; weights-only files skipped). Rank 0 chooses; the
        other processes read the same file. ``clean``: first remove dead writers' temporary
        files (fit only; readers never delete)."""
        found = None
        if self.strategy.is_primary:
            folders = self.folders(callbacks, state)
            if clean:
                self.remove_partial(folders, say=say)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                # a sharded folder is checked, not read: restore loads it laid out like fresh
                found = ck.load_latest(folders, accept=resumable, tensors=False)
            for w in caught:
                if say is not None:
                    say(str(w.message))
        if self.strategy.world_size > 1:
            url = self.strategy.broadcast_object(found[0] if found else None, 0)
            if url is not None and found is None:
                if ck.sharded.is_sharded_checkpoint(ck.storage.filesystem(url)[1]):
                    found = (url, None, {})  # every rank loads its shard in restore
                else:
                    found = (url, *ck.load(url))
        return found

    # ------------------------------------------------------------------ restoring

    def restore(self, url: str, fresh: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """The state to resume from ``url``, checked against ``fresh`` (a new state of the
        same model and optimizer) and placed on its devices; the loggers are set to
        continue from the checkpoint."""
        if ck.sharded.is_sharded_checkpoint(url):
            self._resolved = None
            loaded, meta = ck.sharded.load(url, fresh)  # laid out like fresh, at any world size
        else:
            loaded, meta = self._load(url)
        if meta.get("weights_only") or not isinstance(loaded, TrainState):
            raise ck.CheckpointError(
                f"{url} holds weights only and cannot resume training; start from its weights "
                "with engine.checkpoint.load_weights(state, path, model)"
            )
        loaded = self._own_rank_accumulators(loop_state.ready(loaded), url)
        if not ck.sharded.is_sharded_checkpoint(url):
            loaded = ck.conform(loaded, fresh, url=url)
            if _sharded(fresh) and not _sharded(loaded):  # a plain file into FSDP ranks
                loaded = self.strategy.shard_state(loaded)
        states = meta.get("loggers") or []
        if len(states) == len(self.loggers):
            for logger, logger_state in zip(self.loggers, states):
                logger.restore(logger_state)
        elif self.loggers:
            warnings.warn(
                f"{url} was written with {len(states)} logger(s) and this run has "
                f"{len(self.loggers)}: the logs are not rewound to the checkpoint",
                stacklevel=3,
            )
        return loaded, meta

    def _own_rank_accumulators(self, loaded: TrainState, url: str) -> TrainState:
        """``loaded`` with this rank's epoch accumulators from a DDP checkpoint (see
        ``_with_rank_accumulators``); at another world size every rank keeps rank 0's, as a
        checkpoint without them gives, with a warning that the epoch cut by the checkpoint
        logs values of rank 0's part only."""
        ranks = loaded.extra.get(RANK_ACCUMULATORS)
        if ranks is None:
            return loaded
        extra = {k: v for k, v in loaded.extra.items() if k != RANK_ACCUMULATORS}
        loaded = loaded.replace(extra=extra)
        world_size, rank = self.strategy.world_size, self.strategy.rank
        if ranks.get("world_size") != world_size:
            warnings.warn(
                f"{url} was written by {ranks.get('world_size')} processes and this run has "
                f"{world_size}: every rank resumes the interrupted epoch's accumulators of "
                "rank 0 (the values logged for that epoch cover rank 0's part of it)",
                stacklevel=3,
            )
            return loaded
        own = ranks["train_epoch"][rank]
        return loaded.replace(loop=loaded.loop.replace(train_epoch=own))

    def load_for_eval(self, url: str, fresh: TrainState, *, with_metadata: bool = False) -> Any:
        """``fresh`` with the parameters and buffers of ``url`` (a full or weights-only
        checkpoint), checked against and placed like ``fresh``'s (``with_metadata``:
        ``(state, metadata)``)."""
        if ck.sharded.is_sharded_checkpoint(url):
            # only what evaluation needs: the optimizer state is neither read nor checked
            # (a fresh evaluation state has none), at any world size
            self._resolved = None
            parts, meta = ck.sharded.load_parts(url, ("params", "buffers"), fresh)
            state = fresh.replace(params=parts["params"], buffers=parts["buffers"])
            return (state, meta) if with_metadata else state
        loaded, meta = self._load(url)
        params = loaded["params"] if isinstance(loaded, dict) else loaded.params
        buffers = loaded["buffers"] if isinstance(loaded, dict) else loaded.buffers
        params = ck.conform(params, fresh.params, url=url, what="params")
        buffers = ck.conform(buffers, fresh.buffers, url=url, what="buffers")
        if _sharded(fresh.params) and not _sharded(params):  # a plain file into FSDP ranks
            params = self.strategy.shard(params)
        state = fresh.replace(params=params, buffers=buffers)
        return (state, meta) if with_metadata else state

    def _load(self, url: str) -> tuple[Any, dict[str, Any]]:
        """``(state, metadata)`` of ``url``, as ``resolve`` loaded it if it is that file's
        (used once), else read now."""
        resolved, self._resolved = self._resolved, None
        if resolved is not None and resolved[0] == url:
            return resolved[1], resolved[2]
        return ck.load(url)

    # ------------------------------------------------------------------ preemption

    @contextlib.contextmanager
    def preemption(self, driver: Any, callbacks: Sequence[Any]) -> Iterator[None]:
        """Catch the preemption signals for the duration of a fit (main thread only) and
        checkpoint then exit at the next commit point after one arrives."""
        self._signal = None
        requeue = SlurmRequeue.for_fit(self.strategy, self.signals)
        signals = self.signals + ((requeue.signal,) if requeue is not None else ())
        installed: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in dict.fromkeys(signals):
                installed[signum] = signal.signal(signum, self._on_signal)

        def at_commit(state: TrainState, drv: Any) -> None:
            flag = self._signal is not None
            if drv.world_size > 1:
                flag = self.strategy.reduce_flag(flag, "any")
            if not flag:
                return
            path = self._preemption_path(callbacks, state, drv)
            self.save(state, path, drv)
            self.wait()
            job = requeue.after_checkpoint(self._signal, drv, path) if requeue else None
            if job is not None:  # SLURM took the job back: every process exits 0
                raise Requeued(path, requeue.signal, job)
            drv.say(
                f"Preempted: checkpoint written to {path}; exiting with code "
                f"{PREEMPTED_EXIT_CODE}. Resume with ckpt_path='last'."
            )
            raise Preempted(path, self._signal or signal.SIGTERM)

        driver.commit_hooks.append(at_commit)
        try:
            yield
        finally:
            driver.commit_hooks.remove(at_commit)
            for signum, previous in installed.items():
                signal.signal(signum, previous)

    def _preemption_path(self, callbacks: Sequence[Any], state: TrainState, driver: Any) -> str:
        """``last.ckpt`` in this run's checkpoint folder: the checkpoint callback's, else the
        run folder's ``checkpoints``."""
        for cb in callbacks:
            if isinstance(cb, ModelCheckpoint):
                return cb.folder(driver.log_dir).rstrip("/") + "/last.ckpt"
        root = driver.log_dir or self.root_dir
        return root.rstrip("/") + "/checkpoints/last.ckpt"

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum

    def _log_dir(self) -> str:
        """The run folder the driver names files after (``trainer_run.shared_log_dir``):
        rank 0's first logger's, else the root, on every process (a collective under DDP:
        another rank's own logger may have picked another version folder)."""
        log_dir = self.loggers[0].log_dir if self.loggers else None
        own = log_dir if log_dir is not None else self.root_dir
        if self.strategy.world_size == 1:
            return own
        return self.strategy.broadcast_object(own if self.strategy.is_primary else None, 0)


def _sharded(state: Any) -> bool:
    """Whether ``state`` holds sharded tensors (DTensors: the FSDP strategy's states)."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:  # never imported: no state can hold a DTensor
        return False
    from purestep.engine.tree import leaves

    return any(isinstance(x, module.DTensor) for x in leaves(state))


def _sharded_folder(path: str) -> str | None:
    """The local path of ``path`` if a sharded checkpoint folder (not a symlink) is there,
    which a plain save must replace as ``engine.checkpoint.sharded.replace_with_file`` does
    (a file cannot be renamed over a folder)."""
    if not ck.storage.is_local_url(path):
        return None
    local = ck.storage.filesystem(path)[1]
    if os.path.islink(local) or not ck.sharded.is_sharded_checkpoint(local):
        return None
    return local


def _warn(message: str) -> None:
    """Tell ``message`` as a warning (where no ``say`` was given)."""
    warnings.warn(message, stacklevel=4)


def _parent(path: str) -> str:
    """The folder a checkpoint ``path`` (a URL or local path) is written in."""
    return path.rstrip("/").rsplit("/", 1)[0] if "/" in path else "."


def _with_protocol(root: str, path: str) -> str:
    if "://" in root and "://" not in path:
        return root.split("://", 1)[0] + "://" + path
    return path
