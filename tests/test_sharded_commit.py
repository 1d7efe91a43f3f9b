"""The sharded checkpoint's lifecycle (``engine.checkpoint.sharded``): a committed state of
a name exists at every instant of a save, discovery and cleanup take the newest committed
state of each name (never deleting it), evaluation loads only params and buffers, and a
full disk in DCP's writes is the same out-of-space error as for a plain file.

Kill points are simulated in one process: ``sharded.commit._reached`` raises at each of
``COMMIT_STEPS`` (nothing after it runs, as after a SIGKILL), the temporary names carry a
writer identity of another host (one that cannot be checked: dated an hour back, so cleanup
treats their writer as gone; left recent, a writer that may live) or of an ended process
of this machine (gone at once). The Trainer of a plain process writes sharded checkpoints
here by taking its state for a sharded one (``resume._sharded``). The review's findings
(names taken by a hidden newest state, relative folders, forged markers, one clock, kills
during cleanup and during plain/sharded replacements, superseded versions, marker-first
deletion, eviction, discovery races, matching parts by name, agreed commit errors) each
have a test below. Two 2-rank tests: one (two bounded launches) SIGKILLs rank 0 between the
renames of ``last.ckpt``, resumes, and then evaluates and saves onto a full disk; one
resolves an explicit ``ckpt_path`` on rank 0 for both ranks.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from purestep import engine, hardware
from purestep.engine import checkpoint, optim
from purestep.engine.checkpoint import CheckpointError, sharded, storage
from purestep.engine.checkpoint.sharded import commit
from purestep.loops import resume
from tests import fsdp_job
from tests.helpers import mlp

pytestmark = pytest.mark.timeout(300)

STEPS = sharded.COMMIT_STEPS
#: The steps after which the new version is the newest committed state of its name.
NEW_FROM = STEPS.index("committed")


class _Killed(BaseException):
    """Stands for a SIGKILL: no ``except Exception`` of the save catches it."""


def _foreign_temp_name(name: str) -> str:
    """A temporary name whose writer identity is another host's: ``writer_alive`` cannot
    tell, so the folder counts as abandoned once dated back (``_date_back``)."""
    real = storage._temp_name(name)
    return real.replace(storage._host_token(), "0" * 12)


def _date_back(folder: str) -> None:
    """Date every hidden folder in ``folder`` past ``STALE_AFTER_S``."""
    old = time.time() - storage.STALE_AFTER_S - 60
    for name in os.listdir(folder):
        if name.startswith("."):
            os.utime(os.path.join(folder, name), (old, old))


@functools.cache
def _dead_pid() -> int:
    """The pid of a process of this machine that has ended."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def _dead_temp_name(name: str) -> str:
    """A temporary name whose writer identity is an ended process of this machine:
    ``writer_alive`` tells it is gone, no dating back needed."""
    real = storage._temp_name(name)
    dead = real.replace(storage.writer_identity(), storage.writer_identity(_dead_pid()))
    if storage.writer_alive(dead) is not False:
        pytest.skip("this machine cannot tell that a process of it is gone")
    return dead


_WRITERS = {"foreign": _foreign_temp_name, "dead": _dead_temp_name, "self": None}


def _kill_at(monkeypatch, step: str, name: str, save: int = 0, *, writer: str = "foreign") -> None:
    """The ``save``-th save of ``name`` (counted by its ``written`` step; 0: a cleanup,
    which writes nothing) raises ``_Killed`` once it has done ``step``. ``writer``: whose
    identity the temporary names made meanwhile carry: another host's (``foreign``: cannot
    be checked), an ended process's of this machine (``dead``), or this process's own
    (``self``: alive)."""
    seen = {"saves": 0}

    def reached(done: str, path: str) -> None:
        if os.path.basename(path) != name:
            return
        if done == "written":
            seen["saves"] += 1
        if seen["saves"] == save and done == step:
            raise _Killed(step)

    monkeypatch.setattr(commit, "_reached", reached)
    if _WRITERS[writer] is not None:
        monkeypatch.setattr(commit, "_temp_name", _WRITERS[writer])


def _kill_during(monkeypatch, run, step: str, name: str, save: int = 0, **kw) -> None:
    """``run()`` killed as ``_kill_at`` says (the patches undone after it)."""
    with monkeypatch.context() as kill:
        _kill_at(kill, step, name, save, **kw)
        with pytest.raises(_Killed):
            run()


def _states(n: int):
    """Engine states after 1..n steps (plain tensors)."""
    out, state = [], None
    for i in range(n):
        state, _ = fsdp_job.train(None, optim.sgd(0.1), steps=1, state=state, start=i)
        out.append(state)
    return out


def _step_of(path: str) -> int:
    return sharded.read_record(path)["progress"]["step"]


def _committed(folder: str) -> dict[str, int]:
    """Entry -> recorded step of every committed sharded folder in ``folder``."""
    return {
        n: _step_of(os.path.join(folder, n))
        for n in os.listdir(folder)
        if sharded.is_committed(os.path.join(folder, n))
    }


# ---------------------------------------------------------------------- item 1: the protocol


@pytest.mark.parametrize("writer", ["foreign", "dead"])
@pytest.mark.parametrize("step", STEPS)
def test_a_save_killed_at_any_step_keeps_its_newest_committed_state(
    tmp_path, monkeypatch, step, writer
):
    """Killed at each step, by a writer cleanup cannot check (dated back) or by an ended
    process of this machine (gone at once)."""
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    sharded.save(one, path)
    _kill_at(monkeypatch, step, "last.ckpt", save=1, writer=writer)
    with pytest.raises(_Killed):
        sharded.save(two, path)
    monkeypatch.undo()
    if writer == "foreign":
        _date_back(folder)
    want = 2 if STEPS.index(step) >= NEW_FROM else 1
    # a committed state exists after the kill, and the newest is what discovery takes
    assert want in _committed(folder).values()
    assert max(_committed(folder).values()) == want
    assert _step_of(sharded.newest(path)) == want
    url, state, _ = checkpoint.load_latest(folder)
    assert state.progress.step == want and url == sharded.newest(path)
    # cleanup finishes the commit and removes the rest: the newest state is at its name
    recovery = sharded.recover(folder)
    assert os.listdir(folder) == ["last.ckpt"], recovery
    assert _step_of(path) == want
    loaded, _ = sharded.load(path)
    torch.testing.assert_close(loaded.params, (one, two)[want - 1].params, rtol=0, atol=0)
    assert bool(recovery.completed) == (step in ("committed", "retired"))


def _trainer(
    folder: str,
    max_steps: int,
    note: list[int] | None = None,
    strategy: str = "auto",
    **checkpoint_args,
):
    """A Trainer of ``max_steps`` steps checkpointing to ``<folder>/ckpt`` at every step
    (only ``last.ckpt`` unless ``checkpoint_args`` say otherwise); ``note`` gets the step
    its first batch starts from."""
    from purestep.loops import Trainer
    from purestep.loops.callbacks import LambdaCallback, ModelCheckpoint

    def first(ctx):
        if note is not None and not note:
            note.append(ctx.state.progress.step)

    args = {"save_top_k": 0, "save_last": True, "every_n_train_steps": 1, **checkpoint_args}
    return Trainer(
        max_steps=max_steps,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=folder,
        callbacks=[
            ModelCheckpoint(dirpath=f"{folder}/ckpt", **args),
            LambdaCallback(on_train_batch_start=first),
        ],
    )


def _fit(trainer, ckpt_path=None):
    loader = DataLoader(fsdp_job._points(64, 0), batch_size=8, shuffle=True)
    return trainer.fit(
        mlp(0), fsdp_job._plain_loss, optim.adam(1e-2), loader, seed=3, ckpt_path=ckpt_path
    )


@pytest.mark.parametrize("step", STEPS)
def test_the_trainer_resumes_from_the_newest_state_after_a_kill_at_any_step(
    tmp_path, monkeypatch, step
):
    """``ModelCheckpoint(save_top_k=0, save_last=True)`` (only ``last.ckpt``), killed in
    step 3's save: the relaunch with ``ckpt_path="last"`` resumes at step 3 (or 2, killed
    before the commit), never at 0, and ends with ``last.ckpt`` alone."""
    folder = str(tmp_path)
    ckpt = f"{folder}/ckpt"
    monkeypatch.setattr(resume, "_sharded", lambda state: True)  # write as FSDP ranks do
    _kill_during(monkeypatch, lambda: _fit(_trainer(folder, 4)), step, "last.ckpt", save=3)
    _date_back(ckpt)
    want = 3 if STEPS.index(step) >= NEW_FROM else 2
    first: list[int] = []
    messages: list[str] = []
    trainer = _trainer(folder, 4, first)
    trainer._printer = messages.append
    state = _fit(trainer, ckpt_path="last")
    assert first == [want] and state.progress.step == 4
    assert os.listdir(ckpt) == ["last.ckpt"] and _step_of(f"{ckpt}/last.ckpt") == 4
    finished = any("Finished 1 sharded checkpoint commit" in m for m in messages)
    assert finished == (step in ("committed", "retired")), messages
    assert not any("no checkpoint yet" in m for m in messages)


def test_a_fresh_fit_writes_beside_a_commit_cut_short(tmp_path, monkeypatch):
    """A fresh fit (no ``ckpt_path``) in the folder of a save killed between its renames:
    the cut-short commit is finished before any name is chosen, so the fresh run writes
    ``last-v1.ckpt`` beside ``last.ckpt`` (as beside any existing one) and the killed run's
    newest state survives."""
    folder = str(tmp_path)
    ckpt = f"{folder}/ckpt"
    monkeypatch.setattr(resume, "_sharded", lambda state: True)
    _kill_during(monkeypatch, lambda: _fit(_trainer(folder, 3)), "retired", "last.ckpt", save=2)
    _date_back(ckpt)
    assert "last.ckpt" not in os.listdir(ckpt)
    trainer = _trainer(folder, 1)
    told: list[str] = []
    trainer._printer = told.append
    with warnings.catch_warnings(record=True) as caught:  # told as a warning without a say
        warnings.simplefilter("always")
        _fit(trainer)
    told += [str(w.message) for w in caught]
    assert any("Finished 1 sharded checkpoint commit" in m for m in told), told
    assert sorted(os.listdir(ckpt)) == ["last-v1.ckpt", "last.ckpt"]
    assert _step_of(f"{ckpt}/last.ckpt") == 2 and _step_of(f"{ckpt}/last-v1.ckpt") == 1


def test_a_writer_that_may_live_keeps_its_hidden_commit_which_readers_use(tmp_path, monkeypatch):
    """A cut-short commit whose writer cannot be checked and is recent may still be
    running: cleanup leaves it, and ``"last"``, an explicit path and discovery all read the
    newest state from the hidden folder. A later save orders after it, and evicting that
    name removes the older hidden version too (nothing evicted comes back)."""
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two, three = _states(3)
    sharded.save(one, path)
    _kill_at(monkeypatch, "retired", "last.ckpt", save=1)
    with pytest.raises(_Killed):
        sharded.save(two, path)
    monkeypatch.undo()
    hidden = sharded.newest(path)
    assert os.path.basename(hidden).startswith(".last.ckpt.tmp-") and _step_of(hidden) == 2
    assert sharded.recover(folder) == sharded.Recovery([], [])  # young, may be alive
    assert checkpoint.candidates(folder) == [hidden]
    ckpt = resume.Checkpointing(
        strategy=type("P", (), {"is_primary": True, "world_size": 1})(),
        loggers=[],
        config=None,
        root_dir=folder,
    )
    said: list[str] = []
    assert ckpt.resolve(path, [], None, fn="validate", say=said.append) == hidden
    assert "newest committed state is" in said[0]
    sharded.save(three, path)  # ordered after the hidden version, whatever the clocks say
    assert sharded.newest(path) == path and _step_of(path) == 3
    assert checkpoint.load_latest(folder)[1].progress.step == 3
    sharded.remove(path)
    assert not [n for n in os.listdir(folder) if sharded.is_committed(os.path.join(folder, n))]


def test_a_marker_naming_another_checkpoint_is_not_believed(tmp_path):
    """A hidden folder's record must name the checkpoint its own name was made from: a
    crafted marker cannot make cleanup replace another checkpoint."""
    folder = str(tmp_path)
    one, two = _states(2)
    sharded.save(one, os.path.join(folder, "best.ckpt"))
    sharded.save(two, os.path.join(folder, "x.ckpt"))
    forged = os.path.join(folder, _foreign_temp_name("x.ckpt"))
    os.replace(os.path.join(folder, "x.ckpt"), forged)
    marker = os.path.join(forged, sharded.COMMIT_FILE)
    with open(marker) as f:
        record = json.load(f)
    with open(marker, "w") as f:
        json.dump({**record, "name": "best.ckpt", "sequence": 99}, f)
    _date_back(folder)
    assert sharded.newest(os.path.join(folder, "best.ckpt")) == os.path.join(folder, "best.ckpt")
    sharded.recover(folder)
    assert os.listdir(folder) == ["best.ckpt"] and _step_of(f"{folder}/best.ckpt") == 1


# ---------------------------------------------------------------------- item 2: evaluation


def test_evaluation_from_a_fresh_trainer_loads_params_and_buffers_of_a_sharded_folder(
    tmp_path, monkeypatch
):
    """validate / test / predict(ckpt_path=<sharded folder>) from a fresh Trainer (whose
    state has no optimizer state) give what the fitted state gives."""
    from purestep.loops import Trainer

    folder = str(tmp_path)
    monkeypatch.setattr(resume, "_sharded", lambda state: True)
    fitted = _fit(_trainer(folder, 3))
    monkeypatch.undo()
    path = f"{folder}/ckpt/last.ckpt"
    assert sharded.is_committed(path)
    val = DataLoader(fsdp_job._points(16, 1), batch_size=8)
    args = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    want = Trainer(**args).validate(mlp(0), val, state=fitted, fn=fsdp_job._plain_loss)
    loss, net = fsdp_job._plain_loss, mlp(7)  # another initialisation: the file's weights win
    got_val = Trainer(**args).validate(net, val, fn=loss, ckpt_path=path, verbose=False)
    got_test = Trainer(**args).test(net, val, fn=loss, ckpt_path=path, verbose=False)
    assert got_val == want and got_test[0]["test_loss"] == want[0]["val_loss"]
    x = fsdp_job._points(16, 1).tensors[0]
    preds = Trainer(**args).predict(
        net, DataLoader(x, batch_size=8), fn=lambda apply, b: apply(b), ckpt_path=path
    )
    expected = torch.func.functional_call(mlp(0), dict(fitted.params), (x,))
    torch.testing.assert_close(torch.cat(preds), expected, rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="different model"):
        other = torch.nn.Linear(8, 3)
        Trainer(**args).validate(other, val, fn=loss, ckpt_path=path, verbose=False)


def test_load_parts_reads_only_the_parts_asked_for(tmp_path, monkeypatch):
    state = _states(1)[0]
    path = str(tmp_path / "s.ckpt")
    sharded.save(state, path)
    fresh = engine.init(mlp(0), optim.identity(), seed=1)
    read = []
    loader = sharded.read._read_tensors
    monkeypatch.setattr(
        sharded.read, "_read_tensors", lambda dest, p: (read.append(set(dest)), loader(dest, p))
    )
    parts, meta = sharded.load_parts(path, ("params", "buffers"), fresh)
    assert set(parts) == {"params", "buffers"} and meta["world_size"] == 1
    assert all(k.split(".")[0] in ("params", "buffers") for k in read[0])
    torch.testing.assert_close(parts["params"], dict(state.params), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="holds no scaler"):
        sharded.load_parts(path, ("params", "scaler"))


# ---------------------------------------------------------------------- item 6: DCP's errors


def _fail_dcp_writes(monkeypatch, error: OSError) -> None:
    """DCP's file writer fails every write with ``error`` (inside DCP's own machinery)."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    def write_item(*args, **kwargs):
        raise error

    monkeypatch.setattr(dcp_files, "_write_item", write_item)


def test_a_full_disk_in_dcp_is_the_plain_out_of_space_error(tmp_path, monkeypatch):
    one, two = _states(2)
    path = tmp_path / "run.ckpt"
    sharded.save(one, path)
    _fail_dcp_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="no space left on device: writing the checkpoint") as err:
        sharded.save(two, path)
    assert err.value.errno == errno.ENOSPC and str(path) in str(err.value)
    assert "temporary folder was removed" in str(err.value)
    assert os.listdir(tmp_path) == ["run.ckpt"]  # no temporary folder left on the full disk
    monkeypatch.undo()
    assert sharded.load(path)[0].progress.step == 1


def test_another_dcp_write_error_is_a_checkpoint_error_naming_the_rank(tmp_path, monkeypatch):
    _fail_dcp_writes(monkeypatch, PermissionError(errno.EACCES, "Permission denied"))
    with pytest.raises(CheckpointError, match=r"run.ckpt failed: rank 0: PermissionError"):
        sharded.save(_states(1)[0], tmp_path / "run.ckpt")
    assert os.listdir(tmp_path) == []


def test_a_dcp_read_error_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "s.ckpt"
    sharded.save(_states(1)[0], path)
    shard = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    size = os.path.getsize(path / shard)
    (path / shard).write_bytes(b"\0" * size)  # its extents intact, its bytes not
    with pytest.raises(CheckpointError, match="reading the sharded checkpoint"):
        sharded.load(path)


# ---------------------------------------------------------------------- names and cleanup


def test_a_fresh_fit_beside_a_commit_whose_writer_may_live_takes_another_name(
    tmp_path, monkeypatch
):
    """A save killed between the renames, its writer not provably gone (another host's
    identity, recent): cleanup must leave it, and the name it holds the newest state of is
    taken, so a fresh fit writes ``last-v1.ckpt`` and never orders a ``last.ckpt`` of its
    own after the killed run's state (which the next cleanup would then delete)."""
    folder = str(tmp_path)
    ckpt = f"{folder}/ckpt"
    monkeypatch.setattr(resume, "_sharded", lambda state: True)
    _kill_during(monkeypatch, lambda: _fit(_trainer(folder, 4)), "retired", "last.ckpt", save=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(_trainer(folder, 1))  # fresh: no ckpt_path, no date back
    assert _step_of(sharded.newest(f"{ckpt}/last.ckpt")) == 3
    assert _step_of(f"{ckpt}/last-v1.ckpt") == 1
    _date_back(ckpt)
    sharded.recover(ckpt)  # the killed run's writer is gone now: its commit is finished
    assert sorted(os.listdir(ckpt)) == ["last-v1.ckpt", "last.ckpt"]
    assert _step_of(f"{ckpt}/last.ckpt") == 3


@pytest.mark.parametrize("clean", ["recover", "remove_partial"])
def test_cleanup_of_a_relative_folder_keeps_the_newest_state(tmp_path, monkeypatch, clean):
    """A relative folder names the same entries as its absolute path: the newest state,
    left hidden because it cannot be placed now, is kept; only the older version goes."""
    monkeypatch.chdir(tmp_path)
    os.mkdir("ckpt")
    one, two = _states(2)
    sharded.save(one, "ckpt/last.ckpt")
    _kill_during(
        monkeypatch, lambda: sharded.save(two, "ckpt/last.ckpt"), "retired", "last.ckpt", save=1
    )
    _date_back("ckpt")

    def cannot_place(new: str, path: str):
        raise PermissionError(errno.EACCES, "simulated: cannot place it now")

    with monkeypatch.context() as failing:
        failing.setattr(commit, "_place", cannot_place)
        removed = getattr(sharded, clean)("ckpt")
    removed = removed.removed if clean == "recover" else removed
    assert list(_committed(str(tmp_path / "ckpt")).values()) == [2]
    assert len(removed) == 1 and os.path.isabs(removed[0])
    assert sharded.recover("ckpt").completed  # placed once it can be
    assert os.listdir("ckpt") == ["last.ckpt"] and _step_of("ckpt/last.ckpt") == 2


def _forge(folder: str, state, claims: str, made_from: str, **record) -> str:
    """A committed hidden folder named as a version of ``made_from`` (another host's
    writer, dated back) whose marker claims the checkpoint ``claims``, with ``record``'s
    fields in its record."""
    scratch = os.path.join(folder, "scratch")
    sharded.save(state, scratch)
    forged = os.path.join(folder, _foreign_temp_name(made_from))
    os.replace(scratch, forged)
    marker = os.path.join(forged, sharded.COMMIT_FILE)
    with open(marker) as f:
        written = json.load(f)
    with open(marker, "w") as f:
        json.dump({**written, "name": claims, **record}, f)
    _date_back(folder)
    return forged


@pytest.mark.parametrize("made_from, real", [("l", "last.ckpt"), ("last.ckpt", "last.ckpt-v1")])
def test_a_marker_claiming_a_name_its_folder_was_not_made_from_is_not_believed(
    tmp_path, made_from, real
):
    """A hidden folder named after ``l`` (or ``last.ckpt``) whose marker claims
    ``last.ckpt`` (``last.ckpt-v1``) with a huge sequence: the name must be exactly the one
    the folder's name was made from, so the real checkpoint is neither replaced nor
    deleted."""
    folder = str(tmp_path)
    one, two = _states(2)
    sharded.save(one, os.path.join(folder, real))
    _forge(folder, two, real, made_from, sequence=99)
    assert sharded.newest(os.path.join(folder, real)) == os.path.join(folder, real)
    sharded.recover(folder)
    assert os.listdir(folder) == [real] and _step_of(os.path.join(folder, real)) == 1


@pytest.mark.parametrize("newer", ["plain file", "folder"])
def test_a_plain_file_and_a_folder_are_ordered_by_the_file_servers_clock(tmp_path, newer):
    """A plain ``last.ckpt`` against a hidden committed version of it: the one written
    later wins, by the modification times of the file and of the folder's ``COMMITTED``,
    whatever time the record claims (a writer's clock far ahead, or far behind)."""
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    day = 86_400 * 10**9
    if newer == "plain file":  # the record claims a time far ahead of the file's
        hidden = _forge(folder, two, "last.ckpt", "last.ckpt", time_ns=time.time_ns() + day)
        old = time.time() - 60
        os.utime(os.path.join(hidden, sharded.COMMIT_FILE), (old, old))
        checkpoint.save(one, path)
        want, kept = 1, path
    else:  # the record claims a time far behind the file's
        checkpoint.save(one, path)
        old = time.time() - 60
        os.utime(path, (old, old))
        hidden = _forge(folder, two, "last.ckpt", "last.ckpt", time_ns=0)
        want, kept = 2, hidden
    assert sharded.newest(path) == kept
    assert checkpoint.load_latest(folder)[1].progress.step == want
    storage.remove_partial(folder)
    sharded.recover(folder)
    assert os.listdir(folder) == ["last.ckpt"]
    assert checkpoint.load_latest(folder)[1].progress.step == want


@pytest.mark.parametrize("step", ["retired", "placed", "unmarked"])
def test_a_cleanup_killed_while_it_places_leaves_the_newest_state_for_the_next(
    tmp_path, monkeypatch, step
):
    """``recover`` finishing a cut-short commit runs the same steps, and may be killed at
    each: discovery still takes the newest state, and the next cleanup finishes."""
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    sharded.save(one, path)
    # old at the name, new hidden
    _kill_during(monkeypatch, lambda: sharded.save(two, path), "committed", "last.ckpt", save=1)
    _date_back(folder)
    # the cleanup's own steps
    _kill_during(monkeypatch, lambda: sharded.recover(folder), step, "last.ckpt")
    _date_back(folder)
    assert _step_of(sharded.newest(path)) == 2
    assert checkpoint.load_latest(folder)[1].progress.step == 2
    sharded.recover(folder)
    assert os.listdir(folder) == ["last.ckpt"] and _step_of(path) == 2


@pytest.mark.parametrize("step", STEPS[:-1])  # a retired file is deleted at once
def test_a_sharded_save_over_a_plain_file_killed_at_any_step_keeps_the_newest(
    tmp_path, monkeypatch, step
):
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    checkpoint.save(one, path)  # a plain file: a DDP run's, resumed under FSDP
    _kill_during(monkeypatch, lambda: sharded.save(two, path), step, "last.ckpt", save=1)
    _date_back(folder)
    want = 2 if STEPS.index(step) >= NEW_FROM else 1
    assert checkpoint.load_latest(folder, tensors=False)[1].progress.step == want
    storage.remove_partial(folder)
    sharded.recover(folder)
    assert os.listdir(folder) == ["last.ckpt"]
    assert checkpoint.load_latest(folder)[1].progress.step == want


@pytest.mark.parametrize("step", sharded.REPLACE_STEPS)
def test_a_plain_save_over_a_sharded_folder_killed_at_any_step_keeps_the_newest(
    tmp_path, monkeypatch, step
):
    """A plain file replacing a sharded ``last.ckpt`` (an FSDP run resumed without FSDP):
    a committed state of the name exists at every step, and discovery takes the newest."""
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    sharded.save(one, path)
    _kill_during(
        monkeypatch,
        lambda: sharded.replace_with_file(path, lambda temp: checkpoint.save(two, temp)),
        step,
        "last.ckpt",
        save=1,
    )
    _date_back(folder)
    want = 2 if sharded.REPLACE_STEPS.index(step) >= 2 else 1
    assert checkpoint.load_latest(folder)[1].progress.step == want
    storage.remove_partial(folder)
    sharded.recover(folder)
    assert os.listdir(folder) == ["last.ckpt"]
    assert checkpoint.load_latest(folder)[1].progress.step == want
    assert sharded.is_sharded_checkpoint(path) == (want == 1)


def test_a_run_resumed_without_fsdp_replaces_its_sharded_last_checkpoint(tmp_path, monkeypatch):
    """``last.ckpt`` written by FSDP ranks (a folder), resumed by a single-device run: its
    first save replaces the folder with a plain file (no ``IsADirectoryError``)."""
    folder = str(tmp_path)
    ckpt = f"{folder}/ckpt"
    with monkeypatch.context() as fsdp:
        fsdp.setattr(resume, "_sharded", lambda state: True)
        _fit(_trainer(folder, 2))
    assert sharded.is_committed(f"{ckpt}/last.ckpt")
    first: list[int] = []
    state = _fit(_trainer(folder, 3, first), ckpt_path="last")
    assert first == [2] and state.progress.step == 3
    assert os.listdir(ckpt) == ["last.ckpt"] and os.path.isfile(f"{ckpt}/last.ckpt")
    assert checkpoint.load(f"{ckpt}/last.ckpt")[0].progress.step == 3


def test_a_place_discards_the_older_hidden_versions_of_writers_not_provably_alive(
    tmp_path, monkeypatch
):
    """After a save killed between the renames (another host's writer, recent: cleanup may
    not touch it), the next successful save of the name removes both hidden versions: two
    full checkpoints are not kept for a whole run. A provably live writer's stays."""
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two, three = _states(3)
    sharded.save(one, path)
    _kill_during(monkeypatch, lambda: sharded.save(two, path), "retired", "last.ckpt", save=1)
    assert len(_committed(folder)) == 2
    sharded.save(three, path)
    assert os.listdir(folder) == ["last.ckpt"] and _step_of(path) == 3
    # this process's own identity: alive
    _kill_during(
        monkeypatch, lambda: sharded.save(one, path), "placed", "last.ckpt", save=1, writer="self"
    )
    sharded.save(two, path)
    assert sorted(_committed(folder).values()) == [2, 3]  # the live writer's retired one


def test_cleanup_deletes_marker_first_so_a_kill_leaves_no_partial_committed_folder(
    tmp_path, monkeypatch
):
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    sharded.save(one, path)
    # the retired folder is left
    _kill_during(monkeypatch, lambda: sharded.save(two, path), "placed", "last.ckpt", save=1)
    _date_back(folder)
    rmtree = shutil.rmtree

    def killed_midway(entry, *args, **kwargs):
        shard = next(f for f in os.listdir(entry) if f.endswith(".distcp"))
        os.remove(os.path.join(entry, shard))
        raise _Killed("rmtree")

    with monkeypatch.context() as kill:
        kill.setattr(shutil, "rmtree", killed_midway)
        with pytest.raises(_Killed):
            sharded.recover(folder)
    assert rmtree is shutil.rmtree
    for entry in _committed(folder):  # every committed folder left is whole
        sharded.peek(os.path.join(folder, entry))
    assert list(_committed(folder).values()) == [2]


def test_evicting_a_name_whose_newest_state_is_hidden_removes_its_versions(tmp_path, monkeypatch):
    """``Checkpointing.remove`` (``ModelCheckpoint``'s eviction) of a name with no entry at
    its path, its newest state hidden (a writer that may live cut its save short), or of a
    plain file with such a hidden version: nothing of the name comes back."""
    folder = str(tmp_path)
    one, two = _states(2)
    ckpt = resume.Checkpointing(
        strategy=type("P", (), {"is_primary": True, "world_size": 1})(),
        loggers=[],
        config=None,
        root_dir=folder,
    )
    for name in ("x.ckpt", "y.ckpt"):
        path = os.path.join(folder, name)
        sharded.save(one, path)
        _kill_during(
            monkeypatch, lambda path=path: sharded.save(two, path), "retired", name, save=1
        )
    checkpoint.save(two, os.path.join(folder, "y.ckpt"))  # y: a plain file at the name
    for name in ("x.ckpt", "y.ckpt"):
        assert sharded.newest(os.path.join(folder, name)) is not None
        ckpt.remove(os.path.join(folder, name))
        assert sharded.newest(os.path.join(folder, name)) is None
    assert os.listdir(folder) == []


def test_a_fit_resumed_from_a_hidden_newest_state_records_where_cleanup_moved_it(
    tmp_path, monkeypatch
):
    """``fit(ckpt_path=<last.ckpt>)`` whose newest state is hidden resumes from there; the
    cleanup before step 1 moves it to ``last.ckpt``, and the run records that path as the
    checkpoint it resumed from (which ``ModelCheckpoint`` never evicts)."""
    folder = str(tmp_path)
    ckpt = f"{folder}/ckpt"
    monkeypatch.setattr(resume, "_sharded", lambda state: True)
    _kill_during(monkeypatch, lambda: _fit(_trainer(folder, 4)), "retired", "last.ckpt", save=3)
    _date_back(ckpt)
    first: list[int] = []
    trainer = _trainer(folder, 4, first)
    _fit(trainer, ckpt_path=f"{ckpt}/last.ckpt")
    assert first == [3]
    assert trainer._driver.extra["resumed_from"] == os.path.join(ckpt, "last.ckpt")


# ---------------------------------------------------------------------- discovery


def test_discovery_keeps_a_name_whose_writer_places_it_during_the_listing(tmp_path, monkeypatch):
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    sharded.save(one, path)
    _kill_during(monkeypatch, lambda: sharded.save(two, path), "committed", "last.ckpt", save=1)
    newest_in = sharded.newest_in

    def placed_right_after(where):
        found = newest_in(where)
        for name, hidden in found.items():  # the writer finishes its commit now
            commit._place(hidden, os.path.join(where, name))
        return found

    monkeypatch.setattr(sharded, "newest_in", placed_right_after)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is skipped either
        assert checkpoint.candidates(folder) == [path]
        assert checkpoint.load_latest(folder)[1].progress.step == 2


def test_discovery_falls_back_to_the_name_when_its_hidden_newest_state_fails(tmp_path, monkeypatch):
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    sharded.save(one, path)
    _kill_during(monkeypatch, lambda: sharded.save(two, path), "committed", "last.ckpt", save=1)
    hidden = sharded.newest(path)
    shard = next(f for f in os.listdir(hidden) if f.endswith(".distcp"))
    os.remove(os.path.join(hidden, shard))  # its data is gone: peek refuses it
    with pytest.warns(UserWarning, match="skipping checkpoint .*last.ckpt.tmp-"):
        url, state, _ = checkpoint.load_latest(folder)
    assert url == path and state.progress.step == 1


# ---------------------------------------------------------------------- reading parts


def test_parts_are_matched_to_the_target_by_name_not_by_position(tmp_path):
    path = str(tmp_path / "t.ckpt")
    a, b = torch.arange(3.0), torch.arange(2.0) + 10
    sharded.save({"params": {"a": a, "b": b}}, path)
    # another order, other shapes by position: each tensor is laid out like its namesake
    parts, _ = sharded.load_parts(path, ["params"], {"params": {"b": b * 0, "a": a * 0}})
    torch.testing.assert_close(parts["params"], {"a": a, "b": b}, rtol=0, atol=0)
    loaded, _ = sharded.load(path, {"params": {"b": b * 0, "a": a * 0}})
    torch.testing.assert_close(loaded["params"], {"a": a, "b": b}, rtol=0, atol=0)
    sharded.save({"params": {"a": a, "b": a + 1}}, path)  # two tensors shaped alike
    other = {"params": {"x": a * 0, "y": a * 0}}
    for read in (
        lambda: sharded.load_parts(path, ["params"], other),
        lambda: sharded.load(path, other),
    ):
        with pytest.raises(CheckpointError, match=r"different model") as err:
            read()
        assert ".params['x']: missing in the checkpoint" in str(err.value)
        assert ".params['a']: in the checkpoint but not in the target" in str(err.value)


def test_load_parts_reads_a_part_under_a_key_that_is_not_an_identifier(tmp_path):
    path = str(tmp_path / "s.ckpt")
    sharded.save(
        {"my-w": torch.ones(2), "x-y": torch.zeros(1), "params": {"a": torch.zeros(3)}}, path
    )
    parts, _ = sharded.load_parts(path, ["my-w", "x-y"])
    torch.testing.assert_close(parts, {"my-w": torch.ones(2), "x-y": torch.zeros(1)})


# ---------------------------------------------------------------------- errors of the commit


def test_any_error_of_the_commit_is_raised_as_a_checkpoint_error_and_cleaned_up(
    tmp_path, monkeypatch
):
    path = tmp_path / "run.ckpt"
    one, two = _states(2)
    sharded.save(one, path)

    def broken(temp: str, path: str) -> None:
        raise RuntimeError("simulated: not a write error")

    monkeypatch.setattr(commit, "_commit", broken)
    with pytest.raises(CheckpointError, match="failed: RuntimeError: simulated") as err:
        sharded.save(two, path)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert os.listdir(tmp_path) == ["run.ckpt"]  # the temporary folder is gone
    assert sharded.load(path)[0].progress.step == 1


def test_a_non_write_error_on_a_nearly_full_disk_is_not_out_of_space(tmp_path, monkeypatch):
    full = os.statvfs(tmp_path)
    fields = {"f_bavail": 0, "f_bfree": 0, "f_frsize": full.f_frsize}
    monkeypatch.setattr(os, "statvfs", lambda p: type("Full", (), fields)())

    def broken(temp: str, path: str) -> None:
        raise TypeError("simulated: a value the manifest cannot hold")

    monkeypatch.setattr(commit, "_commit", broken)
    with pytest.raises(CheckpointError, match="TypeError: simulated"):
        sharded.save(_states(1)[0], tmp_path / "run.ckpt")


def test_a_folder_that_cannot_be_created_is_the_cause_of_the_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="cannot create") as err:
        sharded.save(_states(1)[0], tmp_path / "file" / "run.ckpt")
    assert isinstance(err.value.__cause__, OSError)


def test_a_version_that_cannot_be_put_back_is_named_where_it_is_kept(tmp_path, monkeypatch):
    path = str(tmp_path / "run.ckpt")
    one, two = _states(2)
    sharded.save(one, path)
    replace = os.replace

    def no_entry_at_the_name(src, dst):
        if os.fspath(dst) == path:
            raise PermissionError(errno.EACCES, "simulated: the name is locked")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", no_entry_at_the_name)
    with pytest.raises(CheckpointError, match="kept, hidden, at") as err:
        sharded.save(two, path)
    monkeypatch.undo()
    assert "intact" not in str(err.value)
    kept = sharded.newest(path)
    assert kept in str(err.value) and _step_of(kept) == 1
    assert checkpoint.load_latest(str(tmp_path))[1].progress.step == 1


# ---------------------------------------------------------------------- 2 FSDP ranks


def fsdp_fit(rank: int, folder: str, kill: bool) -> dict:
    """``Trainer(strategy="fsdp")``, 4 steps, only ``last.ckpt`` (``save_top_k=0``). ``kill``:
    rank 0 SIGKILLs itself in step 3's save between retiring step 2's folder and moving step
    3's into place. Else: resume with ``ckpt_path="last"``, then evaluate the folder from
    fresh Trainers, then save onto a disk that is full for rank 1."""
    from purestep.loops import Trainer

    if kill and rank == 0:
        seen = {"n": 0}

        def reached(step: str, path: str) -> None:
            seen["n"] += step == "written"
            if seen["n"] == 3 and step == "retired":
                os.kill(os.getpid(), signal.SIGKILL)

        commit._reached = reached
    first: list[int] = []
    trainer = _trainer(folder, 4, first, strategy="fsdp")
    state = _fit(trainer, ckpt_path=None if kill else "last")
    val = DataLoader(fsdp_job._points(16, 1), batch_size=4)
    inputs = DataLoader(fsdp_job._points(16, 1).tensors[0], batch_size=4)
    loss = fsdp_job._plain_loss

    def predict(apply, batch):
        return apply(batch)

    want = trainer.validate(state=state, dataloaders=val, fn=loss, verbose=False)
    want_preds = trainer.predict(state=state, dataloaders=inputs, fn=predict)
    path = f"{folder}/ckpt/last.ckpt"
    args = {"strategy": "fsdp", "logger": False, "enable_progress_bar": False}
    got_val = Trainer(**args).validate(mlp(7), val, fn=loss, ckpt_path=path, verbose=False)
    got_test = Trainer(**args).test(mlp(7), val, fn=loss, ckpt_path=path, verbose=False)
    preds = Trainer(**args).predict(mlp(7), inputs, fn=predict, ckpt_path=path)
    full = None
    if rank == 1:
        import torch.distributed.checkpoint.filesystem as dcp_files

        def write_item(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        dcp_files._write_item = write_item
    try:
        sharded.save(state, f"{folder}/full.ckpt")
    except OSError as err:
        full = (err.errno, str(err))
    return {
        "first": first[0],
        "step": state.progress.step,
        "want": want[0]["val_loss"],
        "val": got_val[0]["val_loss"],
        "test": got_test[0]["test_loss"],
        "preds": torch.equal(torch.cat(preds), torch.cat(want_preds)),
        "full": full,
        "names": sorted(os.listdir(folder)),
    }


def test_two_fsdp_ranks_resume_after_rank_0_dies_between_the_renames_and_evaluate():
    """Item 1 with real processes (rank 0 SIGKILLed with no ``last.ckpt`` in place), item 2
    on 2 FSDP ranks (fresh Trainers evaluate the folder as the fitted state does) and item 6
    on 2 ranks (rank 1's disk full: both raise ENOSPC, no temporary folder is left)."""
    folder = tempfile.mkdtemp(prefix="purestep-commit-")
    try:
        with pytest.raises(hardware.LaunchError, match="rank 0"):
            hardware.launch(fsdp_fit, 2, folder, True, max_seconds=120, **fsdp_job.LAUNCH)
        ckpt = f"{folder}/ckpt"
        assert "last.ckpt" not in os.listdir(ckpt)  # killed between the renames
        assert sorted(_committed(ckpt).values()) == [2, 3]  # both hidden, both committed
        got = hardware.launch(fsdp_fit, 2, folder, False, max_seconds=150, **fsdp_job.LAUNCH)
        for r in got:
            assert r["first"] == 3 and r["step"] == 4  # from the newest state, not from 0
            assert r["val"] == r["want"] and r["test"] == r["want"]
            assert r["full"][0] == errno.ENOSPC and "full.ckpt" in r["full"][1]
            assert not [n for n in r["names"] if n.startswith(".full.ckpt")]
            assert r["preds"]  # predictions from the folder equal the fitted state's
        assert os.listdir(ckpt) == ["last.ckpt"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _TwoRanks:
    """The strategy side ``Checkpointing.resolve`` uses, on the launched ranks' group."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        self.is_primary = rank == 0

    def broadcast_object(self, obj, src: int):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def resolve_explicit(rank: int, folder: str) -> str:
    """Both ranks resolve ``ckpt_path=<last.ckpt>`` while its writer finishes the commit
    right after rank 0 has looked (rank 1 would look only then, on its own)."""
    path = os.path.join(folder, "last.ckpt")
    flag = os.path.join(folder, "placed")
    if rank == 1:
        newest = sharded.newest

        def after_rank_0(where):
            deadline = time.monotonic() + 30
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.02)
            return newest(where)

        sharded.newest = after_rank_0
    ckpt = resume.Checkpointing(strategy=_TwoRanks(rank), loggers=[], config=None, root_dir=folder)
    got = ckpt.resolve(path, [], None, fn="validate")
    if rank == 0:
        commit._place(got, path)  # the live writer moves its new version in
        with open(flag, "w"):
            pass
    return got


def test_an_explicit_ckpt_path_is_resolved_by_rank_0_for_every_rank(tmp_path, monkeypatch):
    folder = str(tmp_path)
    path = os.path.join(folder, "last.ckpt")
    one, two = _states(2)
    sharded.save(one, path)
    # a live writer, between steps
    _kill_during(monkeypatch, lambda: sharded.save(two, path), "committed", "last.ckpt", save=1)
    hidden = sharded.newest(path)
    got = hardware.launch(resolve_explicit, 2, folder, max_seconds=90, **fsdp_job.LAUNCH)
    assert got == [hidden, hidden]
