"""Checkpoint folders shared with other processes, read-only folders and full disks.

Temporary files carry their writer's identity: only ``fit`` removes them, and only once the
writer is gone; readers (validate/test/predict/discovery) never delete. Read-only and
disk-full cases use a real tmpfs where root can mount one here, else they are skipped or
simulated by monkeypatching (said in each test).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader

from purestep.engine import checkpoint as ck
from purestep.engine import optim, tree
from purestep.engine.checkpoint import storage
from purestep.loops import Trainer
from purestep.loops.callbacks import ModelCheckpoint
from tests.helpers import mlp
from tests.helpers import sign_data as _data
from tests.helpers import sign_loss as _loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_PROC = os.path.exists("/proc/self/stat") and os.name != "nt"
needs_proc = pytest.mark.skipif(not HAS_PROC, reason="writer liveness needs /proc")


def _predict(apply, batch):
    return apply(batch[0])


def _trainer(folder, **flags):
    flags.setdefault("max_epochs", 1)
    every = flags.pop("every_n_train_steps", None)
    checkpoint = ModelCheckpoint(dirpath=str(folder), save_top_k=-1, every_n_train_steps=every)
    return Trainer(
        default_root_dir=str(folder) + "-root",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint],
        **flags,
    )


def _fit(trainer, loss=_loss, **kwargs):
    return trainer.fit(
        mlp(),
        loss,
        optim.adam(1e-2),
        DataLoader(_data(), batch_size=8, shuffle=True),
        **kwargs,
    )


def _loader():
    return DataLoader(_data(16, 1), batch_size=8)


@contextlib.contextmanager
def _sleeper():
    """A live process (killed and reaped on exit)."""
    proc = subprocess.Popen(["sleep", "120"]) if shutil.which("sleep") else None
    if proc is None:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def _temp(folder, name, pid):
    path = folder / f".{name}.tmp-{storage.writer_identity(pid)}-0123456789ab"
    path.write_bytes(b"half a checkpoint")
    return path


def _hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------- real filesystems


def _can_mount() -> bool:
    return (
        sys.platform.startswith("linux")
        and getattr(os, "geteuid", lambda: -1)() == 0
        and shutil.which("mount") is not None
    )


@contextlib.contextmanager
def _tmpfs(path, size="1m"):
    """A tmpfs mounted at ``path`` (yields False, mounting nothing, where that fails)."""
    path.mkdir(parents=True, exist_ok=True)
    if not _can_mount():
        yield False
        return
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if subprocess.run(cmd, capture_output=True, timeout=30).returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _remount_read_only(path) -> None:
    cmd = ["mount", "-o", "remount,ro", str(path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _fill(path) -> None:
    """Write to ``path/filler`` until the filesystem under it is full."""
    with open(path / "filler", "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)


# ---------------------------------------------------------------- temporary files


@needs_proc
def test_only_a_gone_writers_temporary_file_is_removed(tmp_path):
    old = time.time() - 2 * storage.STALE_AFTER_S
    with _sleeper() as writer:
        live = _temp(tmp_path, "a.ckpt", writer.pid)
        dead = _temp(tmp_path, "b.ckpt", _dead_pid())
        remote = tmp_path / ".c.ckpt.tmp-otherhost-12-0-0123456789ab"  # another host's
        remote.write_bytes(b"x")
        unnamed = tmp_path / ".d.ckpt.tmp-abc"  # no writer identity in the name
        unnamed.write_bytes(b"x")
        own = tmp_path / f".e.ckpt.tmp-{storage.writer_identity()}-0123456789ab"
        own.write_bytes(b"x")  # this process is writing it
        assert storage.writer_alive(live.name) is True
        assert storage.writer_alive(dead.name) is False
        assert storage.writer_alive(remote.name) is None
        assert ck.remove_partial(str(tmp_path)) == [str(dead)]
        os.utime(remote, (old, old))
        os.utime(unnamed, (old, old))  # untouched for long enough: abandoned
        assert sorted(ck.remove_partial(str(tmp_path))) == [str(remote), str(unnamed)]
        assert live.exists() and own.exists()
    assert ck.remove_partial(str(tmp_path)) == [str(live)]  # its writer has ended
    assert own.exists()


def _aged(path) -> None:
    old = time.time() - 2 * storage.STALE_AFTER_S
    os.utime(path, (old, old))


@needs_proc
def test_a_writer_with_a_lookalike_host_is_not_judged_by_a_local_pid(tmp_path, monkeypatch):
    """Hosts whose long names share 40 characters, a container of the same name on another
    node (another boot id), and names in the earlier identity format: a dead local pid of
    the same number says nothing about them, so only the age rule removes their files."""
    here = "n" * 40 + ".rack-1.cluster.example.com"
    monkeypatch.setattr(storage.socket, "gethostname", lambda: here)
    monkeypatch.setattr(storage, "_IDENTITIES", {})
    pid = _dead_pid()
    start = "1a2b3c"
    tokens = {
        "prefix": storage._host_token(host="n" * 40 + ".rack-2.cluster.example.com"),
        "boot": storage._host_token(boot="0" * 8 + "-0000-4000-8000-" + "0" * 12),
        "ns": storage._host_token(ns="effffffb"),
    }
    assert storage._host_token() not in tokens.values()
    ns = f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    boot8 = storage._boot_id().replace("-", "")[:8]
    files = [tmp_path / f".{k}.ckpt.tmp-{t}-{pid}-{start}-0123456789ab" for k, t in tokens.items()]
    # the earlier formats: host name (cut to 40) and namespace; and no identity at all
    files.append(tmp_path / f".old.ckpt.tmp-{here[:40]}.{ns}-{pid}-{boot8}{start}-0123456789ab")
    files.append(tmp_path / ".older.ckpt.tmp-0123456789ab")
    for f in files:
        f.write_bytes(b"half a checkpoint")
        assert storage.writer_alive(f.name) is None, f.name
    ours = _temp(tmp_path, "ours.ckpt", pid)  # this machine's token: the pid tells
    assert storage.writer_alive(ours.name) is False
    assert ck.remove_partial(str(tmp_path)) == [str(ours)]
    assert all(f.exists() for f in files)
    for f in files:
        _aged(f)
    assert sorted(ck.remove_partial(str(tmp_path))) == sorted(map(str, files))


def test_without_a_boot_id_no_local_pid_judges_a_writer(tmp_path, monkeypatch):
    """A host token without a boot id is not this machine's alone (same host names)."""
    monkeypatch.setattr(storage, "_boot_id", lambda: "")
    monkeypatch.setattr(storage, "_IDENTITIES", {})
    token = storage._host_token()
    gone = tmp_path / f".a.ckpt.tmp-{token}-{_dead_pid()}-0-0123456789ab"
    gone.write_bytes(b"x")
    own = tmp_path / f".b.ckpt.tmp-{storage.writer_identity()}-0123456789ab"
    own.write_bytes(b"x")
    assert storage.writer_alive(gone.name) is None and storage.writer_alive(own.name) is True
    assert ck.remove_partial(str(tmp_path)) == []
    _aged(gone)
    assert ck.remove_partial(str(tmp_path)) == [str(gone)]


def test_the_writer_identity_is_short_and_a_long_checkpoint_name_saves(tmp_path, monkeypatch):
    monkeypatch.setattr(storage.socket, "gethostname", lambda: "h" * 63 + ".example.com")
    monkeypatch.setattr(storage, "_IDENTITIES", {})
    name = "n" * 196 + ".ckpt"  # 201 characters
    ck.save({"w": torch.arange(3.0)}, str(tmp_path / name))
    assert torch.equal(ck.load(str(tmp_path / name))[0]["w"], torch.arange(3.0))
    assert os.listdir(tmp_path) == [name]
    identity = storage.writer_identity()
    assert re.fullmatch(r"[0-9a-f]{12}-\d+-[0-9a-f]+", identity), identity
    assert len(identity) <= 12 + 1 + 20 + 1 + 16
    longest = "m" * 250 + ".ckpt"  # the most a file name may have: its temporary one is cut
    ck.save({"w": torch.ones(2)}, str(tmp_path / longest))
    assert sorted(os.listdir(tmp_path)) == sorted([name, longest])
    tmp = storage._temp_name("é" * 200)  # cut at a character, within 255 bytes
    assert len(tmp.encode()) <= 255 and storage.writer_alive(tmp) is True


@needs_proc
def test_readers_never_delete_and_fit_cleans_only_dead_writers(tmp_path):
    folder = tmp_path / "ckpts"
    _fit(_trainer(folder))
    with _sleeper() as writer:
        live = _temp(folder, "epoch=9-step=99.ckpt", writer.pid)
        dead = _temp(folder, "epoch=8-step=98.ckpt", _dead_pid())
        monitor = _trainer(folder)  # a monitoring process's Trainer: read only
        messages = []
        monitor._printer = messages.append
        assert monitor.validate(mlp(), _loader(), fn=_loss, ckpt_path="last", verbose=False)
        assert monitor.test(mlp(), _loader(), fn=_loss, ckpt_path="last", verbose=False)
        assert monitor.predict(mlp(), _loader(), fn=_predict, ckpt_path="last")
        assert ck.find_latest(str(folder)) and ck.candidates(str(folder))
        assert live.exists() and dead.exists()
        assert not any("Removed" in m for m in messages)

        _fit(_trainer(folder, max_epochs=2), ckpt_path="last")  # the writer cleans
        assert live.exists() and not dead.exists()
    _fit(_trainer(folder, max_epochs=3), ckpt_path="last")
    assert _hidden(folder) == []


_MONITOR = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from tests.test_checkpoint_concurrency import _trainer, _loader, _loss, mlp
folder, stop = {folder!r}, {stop!r}
count, deadline = 0, time.monotonic() + {limit}
while True:
    trainer = _trainer(folder)
    assert trainer.validate(mlp(), _loader(), fn=_loss, ckpt_path="last", verbose=False)
    count += 1
    if count == 1:
        print("ready", flush=True)
    if {once} or os.path.exists(stop) or time.monotonic() > deadline:
        break
print("validated", count, flush=True)
"""


def _monitor(folder, stop, *, once: bool, limit: float = 120.0) -> subprocess.Popen:
    script = _MONITOR.format(root=ROOT, folder=str(folder), stop=str(stop), limit=limit, once=once)
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def _wait_for(proc: subprocess.Popen, line: str, timeout: float = 180) -> None:
    """Read ``proc``'s output until ``line`` (bounded: fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        text = proc.stdout.readline() if ready else ""
        if text.strip() == line:
            return
        if not text and (not ready or proc.poll() is not None):
            break
    raise AssertionError(f"the monitoring process never printed {line!r}")


def _finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, out
    return out


def test_validate_in_another_process_during_a_write_does_not_break_the_fit(tmp_path, monkeypatch):
    """Deterministic: the second process validates while a save's temporary file is open."""
    folder = tmp_path / "ckpts"
    _fit(_trainer(folder))
    original = torch.save
    seen = []

    def save_then_validate_elsewhere(obj, f, *args, **kwargs):
        original(obj, f, *args, **kwargs)
        if not seen and hasattr(f, "flush"):
            f.flush()
            seen.append(_hidden(folder))  # the in-flight temporary file
            out = _finish(_monitor(folder, tmp_path / "stop", once=True))
            seen.append((_hidden(folder), out))

    monkeypatch.setattr(torch, "save", save_then_validate_elsewhere)
    _fit(_trainer(folder, max_epochs=2), ckpt_path="last")
    monkeypatch.undo()
    assert len(seen[0]) == 1 and ".tmp-" in seen[0][0]
    assert seen[1][0] == seen[0], "the monitoring process removed the live temporary file"
    assert "validated 1" in seen[1][1]
    assert _hidden(folder) == []


def test_validate_in_a_loop_beside_a_fit_with_frequent_checkpoints(tmp_path):
    """A smoke test of the real race (the deterministic case is the test above)."""
    folder = tmp_path / "ckpts"
    stop = tmp_path / "stop"
    _fit(_trainer(folder))
    proc = _monitor(folder, stop, once=False)
    try:
        _wait_for(proc, "ready")
        state = _fit(_trainer(folder, max_epochs=30, every_n_train_steps=1), ckpt_path="last")
    finally:
        stop.write_text("")
    out = _finish(proc)
    assert state.progress.epoch == 30 and "validated" in out
    assert _hidden(folder) == []


# ---------------------------------------------------------------- read-only folders


def test_validate_reads_a_read_only_folder_with_a_stale_temporary_file(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    with _tmpfs(folder) as mounted:
        _fit(_trainer(folder))
        stale = folder / ".epoch=0-step=4.ckpt.tmp-abc"
        stale.write_bytes(b"x")
        os.utime(stale, (0, 0))  # abandoned long ago: fit would remove it
        if mounted:
            _remount_read_only(folder)
        else:  # no mount here: the filesystem refuses every deletion instead

            def refuse(*args, **kwargs):
                raise OSError(errno.EROFS, "Read-only file system")

            for name in ("rm", "rm_file", "_rm"):
                monkeypatch.setattr(type(storage.filesystem(str(folder))[0]), name, refuse)
            monkeypatch.setattr(os, "remove", refuse)
            monkeypatch.setattr(os, "unlink", refuse)
        monitor = _trainer(folder)
        assert monitor.validate(mlp(), _loader(), fn=_loss, ckpt_path="last", verbose=False)
        assert stale.exists()
        assert ck.remove_partial(str(folder)) == []  # fit's cleanup: cannot delete, no error


def _counting_loss(calls):
    def loss(apply, batch):
        calls.append(1)
        return _loss(apply, batch)

    return loss


def test_fit_into_an_unwritable_folder_fails_before_the_first_step(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    folder = afile / "ckpts"  # a folder under a file can never be created, even by root
    calls = []
    with pytest.raises(OSError, match=re.escape(f"cannot write checkpoints to {folder}:")):
        _fit(_trainer(folder), loss=_counting_loss(calls))
    assert calls == []


def test_fit_into_a_read_only_mount_fails_before_the_first_step(tmp_path):
    folder = tmp_path / "ro"
    with _tmpfs(folder) as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here")
        _remount_read_only(folder)
        calls = []
        where = re.escape(f"cannot write checkpoints to {folder}/ckpts:")
        with pytest.raises(OSError, match=where) as err:
            _fit(_trainer(folder / "ckpts"), loss=_counting_loss(calls))
        assert err.value.errno == errno.EROFS and calls == []


def test_the_write_probe_leaves_nothing_behind(tmp_path):
    storage.check_writable(str(tmp_path / "a" / "b"))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "c").mkdir()
    storage.check_writable(str(tmp_path / "c"))
    assert list((tmp_path / "c").iterdir()) == []


def test_a_probe_that_cannot_be_deleted_is_only_a_warning(tmp_path, monkeypatch):
    """Object stores with retention deny deletes; save_top_k=-1 never deletes."""
    import fsspec.implementations.local as local

    def denied(self, path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "delete denied by the retention policy")

    monkeypatch.setattr(local.LocalFileSystem, "rm", denied)
    folder = tmp_path / "ckpts"
    with pytest.warns(UserWarning, match=re.escape(f"write probe {folder}/.write-probe")):
        storage.check_writable(str(folder))
    left = os.listdir(folder)
    assert len(left) == 1 and left[0].startswith(".write-probe.tmp-")
    os.remove(folder / left[0])
    with pytest.warns(UserWarning, match="could not be deleted"):
        trained = _fit(_trainer(folder))
    assert trained.progress.step == 4
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".")) == ["epoch=0-step=4.ckpt"]


def test_any_error_of_the_probe_names_the_folder(tmp_path, monkeypatch):
    """Some fsspec backends raise their own exceptions (not OSError)."""
    import fsspec.implementations.local as local

    class BackendError(Exception):
        pass

    def failing(self, path, *args, **kwargs):
        raise BackendError("AccessDenied: the bucket policy forbids PutObject")

    monkeypatch.setattr(local.LocalFileSystem, "open", failing)
    folder = tmp_path / "ckpts"
    where = re.escape(f"cannot write checkpoints to {folder}: AccessDenied")
    with pytest.raises(OSError, match=where) as err:
        storage.check_writable(str(folder))
    assert isinstance(err.value.__cause__, BackendError)
    calls = []
    with pytest.raises(OSError, match=where) as err:
        _fit(_trainer(folder), loss=_counting_loss(calls))
    assert "fit checks its checkpoint folders" in str(err.value) and calls == []
    assert isinstance(err.value.__cause__.__cause__, BackendError)
    with pytest.raises(OSError, match="cannot write checkpoints to nosuchproto://x: "):
        storage.check_writable("nosuchproto://x")  # no such backend


# ---------------------------------------------------------------- full disks


def _check_disk_full_error(err, path):
    assert err.errno == errno.ENOSPC and err.__cause__ is not None
    assert str(path) in str(err) and "no space left on device" in str(err)


def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "small"
    with _tmpfs(folder, size="1m") as mounted:
        if not mounted:
            pytest.skip("cannot mount a small tmpfs here (the monkeypatched case runs below)")
        path = folder / "a.ckpt"
        ck.save({"w": torch.arange(10.0)}, str(path))
        big = {"w": torch.randn(400_000)}  # 1.6 MB on a 1 MB disk
        with pytest.raises(OSError) as err:
            ck.save(big, str(path))
        _check_disk_full_error(err.value, path)
        assert isinstance(err.value.__cause__, RuntimeError)  # torch's zip writer's error
        saver = ck.AsyncCheckpointer()
        saver.save(big, str(path))
        with pytest.raises(OSError) as err:
            saver.wait()
        saver.close()
        _check_disk_full_error(err.value, path)
        assert torch.equal(ck.load(str(path))[0]["w"], torch.arange(10.0))
        assert os.listdir(folder) == ["a.ckpt"]


def test_a_full_disk_during_fit_then_resume_after_making_room(tmp_path):
    reference = _fit(_trainer(tmp_path / "reference", max_epochs=2))
    folder = tmp_path / "small"
    with _tmpfs(folder, size="1m") as mounted:
        if not mounted:
            pytest.skip("cannot mount a small tmpfs here (the monkeypatched case runs below)")
        _fit(_trainer(folder))
        first = folder / "epoch=0-step=4.ckpt"
        _fill(folder)
        with pytest.raises(OSError) as err:
            _fit(_trainer(folder, max_epochs=2), ckpt_path="last")
        _check_disk_full_error(err.value, folder / "epoch=1-step=8.ckpt")
        assert sorted(os.listdir(folder)) == ["epoch=0-step=4.ckpt", "filler"]
        ck.load(str(first))
        os.remove(folder / "filler")  # make room, relaunch the same command
        resumed = _fit(_trainer(folder, max_epochs=2), ckpt_path="last")
    tree.assert_trees_equal(resumed.params, reference.params)
    tree.assert_trees_equal(resumed.opt_state, reference.opt_state)


@pytest.mark.parametrize("how", ["torch enforce error", "statvfs"])
def test_a_full_disk_is_reported_where_no_tmpfs_can_be_mounted(tmp_path, monkeypatch, how):
    """Simulated: torch's writer fails the way it does on a full disk."""
    path = tmp_path / "a.ckpt"
    ck.save({"w": torch.arange(10.0)}, str(path))
    original = torch.save

    def failing(obj, f, *args, **kwargs):
        f.write(b"part of a checkpoint")
        if how == "statvfs":  # only the free space tells
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:  # as torch does it: the OSError is only the implicit context
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904

    class Full:
        f_bfree = f_bavail = 0
        f_frsize = 4096

    monkeypatch.setattr(torch, "save", failing)
    if how == "statvfs":
        monkeypatch.setattr(os, "statvfs", lambda p: Full())
    with pytest.raises(OSError) as err:
        ck.save({"w": torch.ones(3)}, str(path))
    _check_disk_full_error(err.value, path)
    monkeypatch.setattr(torch, "save", original)
    assert torch.equal(ck.load(str(path))[0]["w"], torch.arange(10.0))
    assert os.listdir(tmp_path) == ["a.ckpt"]


def test_other_write_errors_are_not_called_a_full_disk(tmp_path, monkeypatch):
    def failing(obj, f, *args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(RuntimeError, match="something else"):
        ck.save({"w": torch.ones(3)}, str(tmp_path / "a.ckpt"))
    assert os.listdir(tmp_path) == []
