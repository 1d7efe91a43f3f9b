"""Checkpoint files that would hang, explode or crash discovery: refused or skipped, clearly.

FIFOs are never opened (a watcher thread unblocks any reader that opens one and records it,
so a regression fails instead of hanging); zip archives torch.save never writes are refused
from their directory, before torch.load; files that read but do not decode are skipped by
"last" discovery; "last" is chosen by the progress each file records, not by its mtime.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import threading
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep import engine
from purestep.engine import checkpoint as ck
from purestep.engine import optim
from purestep.engine.state import Progress
from purestep.loops import Trainer
from purestep.loops.loggers import CSVLogger
from purestep.loops.resume import Checkpointing
from tests.helpers import mlp


def _state(step: int = 0, **extra):
    state = engine.init(mlp(), optim.sgd(0.1), seed=1)
    progress = Progress(epoch=step // 4, step=step, batch_in_epoch=step % 4, total_batches=step)
    return state.replace(progress=progress, extra=extra)


@contextlib.contextmanager
def _never_opened(fifo):
    """Fail (instead of hanging) if anything opens ``fifo`` for reading meanwhile."""
    opened, stop = threading.Event(), threading.Event()

    def watch():
        while not stop.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader
            except OSError:
                stop.wait(0.02)
                continue
            opened.set()
            os.close(fd)  # the blocked reader goes on and reads an empty file
            stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join(10)
    assert not opened.is_set(), f"{fifo} was opened for reading"


# ------------------------------------------------------------------ not regular files


def test_a_fifo_is_refused_by_load_and_skipped_by_discovery_unopened(tmp_path):
    ck.save(_state(3), str(tmp_path / "a.ckpt"))
    fifo = tmp_path / "z.ckpt"
    os.mkfifo(fifo)
    with _never_opened(fifo):
        with pytest.raises(ck.CheckpointError, match=r"z.ckpt is a FIFO \(named pipe\), not a"):
            ck.load(str(fifo))
        with pytest.raises(ck.CheckpointError, match="z.ckpt is a FIFO"):
            ck.load(str(fifo), target=_state())
        with pytest.raises(ck.CheckpointError, match="z.ckpt is a FIFO"):
            ck.read_state_dict(str(fifo))
        with pytest.warns(UserWarning, match="skipping checkpoint .*z.ckpt: .*FIFO"):
            assert ck.find_latest(str(tmp_path)).endswith("a.ckpt")


def test_a_directory_or_device_is_refused_naming_it(tmp_path):
    folder = tmp_path / "d.ckpt"
    folder.mkdir()
    with pytest.raises(ck.CheckpointError, match="d.ckpt is a directory, not a checkpoint file"):
        ck.load(str(folder))
    ck.save(_state(3), "memory://files-tests/dir/x/a.ckpt")
    with pytest.raises(ck.CheckpointError, match="dir/x is a directory"):
        ck.load("memory://files-tests/dir/x")
    ck.save(_state(3), str(tmp_path / "a.ckpt"))
    with pytest.warns(UserWarning, match="skipping checkpoint .*d.ckpt: .*directory"):
        assert ck.find_latest(str(tmp_path)).endswith("a.ckpt")
    if os.path.exists("/dev/zero"):
        with pytest.raises(ck.CheckpointError, match="/dev/zero is a character device"):
            ck.load("/dev/zero")


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _fit(root, **kwargs):
    trainer = Trainer(
        default_root_dir=root,
        max_epochs=kwargs.pop("max_epochs", 1),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(root),
    )
    trainer._printer = kwargs.pop("say", lambda message: None)
    return trainer.fit(
        mlp(), _loss, optim.sgd(0.1), DataLoader(_data(), batch_size=8), None, **kwargs
    )


def _loss(apply, batch):
    return F.cross_entropy(apply(batch[0]), batch[1])


def test_fit_refuses_a_fifo_ckpt_path_and_last_skips_one(tmp_path):
    root = str(tmp_path)
    _fit(root)
    folder = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    fifo = folder / "zz.ckpt"
    os.mkfifo(fifo)
    with _never_opened(fifo):
        with pytest.raises(ck.CheckpointError, match="zz.ckpt is a FIFO"):
            _fit(root, ckpt_path=str(fifo))
        messages = []
        state = _fit(root, max_epochs=2, ckpt_path="last", say=messages.append)
    assert state.progress.epoch == 2
    assert any("skipping checkpoint" in m and "zz.ckpt" in m and "FIFO" in m for m in messages)


# ------------------------------------------------------------------ zips torch.save never writes


def _rewrite(src, dst, *, compression=zipfile.ZIP_STORED, replace=None):
    """A copy of the zip ``src`` at ``dst``, entries recompressed and optionally replaced."""
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w", compression) as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if replace and info.filename.endswith(tuple(replace)):
                data = replace[next(k for k in replace if info.filename.endswith(k))]
            new.writestr(info.filename, data, compress_type=compression)


def _patch_declared_size(path, entry, size):
    """Make the central directory of ``path`` declare ``size`` bytes for ``entry``."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        offset = archive.start_dir
    while raw[offset : offset + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, offset + 28)
        name = bytes(raw[offset + 46 : offset + 46 + name_len]).decode()
        if name.endswith(entry):
            struct.pack_into("<II", raw, offset + 20, size, size)  # compressed, uncompressed
        offset += 46 + name_len + extra_len + comment_len
    path.write_bytes(bytes(raw))


def no_torch_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(torch, "load", refuse)


def test_compressed_or_oversized_entries_are_refused_before_torch_load(tmp_path, monkeypatch):
    good = tmp_path / "good.ckpt"
    ck.save(_state(3, big=torch.zeros(4096)), str(good))
    deflated = tmp_path / "deflated.ckpt"
    _rewrite(good, deflated, compression=zipfile.ZIP_DEFLATED)
    assert deflated.stat().st_size < good.stat().st_size  # it would inflate past the file
    oversized = tmp_path / "oversized.ckpt"
    oversized.write_bytes(good.read_bytes())
    _patch_declared_size(oversized, "data/1", 2**31)
    with zipfile.ZipFile(oversized) as archive:  # a stored entry that claims 2 GiB
        assert archive.getinfo("archive/data/1").file_size == 2**31
    no_torch_load(monkeypatch)
    with pytest.raises(ck.CheckpointError, match=r"deflated.ckpt: its entry .* is compressed"):
        ck.load(str(deflated))
    with pytest.raises(ck.CheckpointError, match=r"oversized.ckpt: .*data/1' declares 2147483648"):
        ck.load(str(oversized))
    with pytest.raises(ck.CheckpointError, match="compressed"):
        ck.read_state_dict(str(deflated))
    with pytest.warns(UserWarning) as caught:
        assert ck.ranked(str(tmp_path)) == [str(good)]  # ranking reads no torch.load either
    assert {str(w.message).split(":")[0] for w in caught} == {
        f"skipping checkpoint {deflated}",
        f"skipping checkpoint {oversized}",
    }


def test_entries_that_add_up_to_more_than_the_file_are_refused(tmp_path):
    good = tmp_path / "good.ckpt"
    ck.save(_state(3), str(good))
    # the same bytes listed many times over: each entry fits the file, all together do not
    twice = tmp_path / "twice.ckpt"
    with zipfile.ZipFile(good) as old:
        infos = old.infolist()
    raw = good.read_bytes()
    with zipfile.ZipFile(good) as old:
        start = old.start_dir
    stop = raw.find(b"PK\x06\x06")  # torch writes zip64 end records
    directory = raw[start : stop if stop > 0 else raw.index(b"PK\x05\x06")]
    count = len(infos) * 40
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(directory) * 40, start, 0)
    twice.write_bytes(raw[:start] + directory * 40 + end)
    with pytest.raises(ck.CheckpointError, match=r"twice.ckpt: its entries declare \d+ bytes"):
        ck.load(str(twice))


def test_discovery_reads_only_the_records_to_rank(tmp_path, monkeypatch):
    for step in (2, 5, 3):
        ck.save(_state(step), str(tmp_path / f"s{step}.ckpt"))
    calls = []
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda f, **kw: calls.append(f) or original(f, **kw))
    assert ck.ranked(str(tmp_path)) == [str(tmp_path / f"s{s}.ckpt") for s in (5, 3, 2)]
    assert calls == []
    assert ck.read_record(str(tmp_path / "s5.ckpt"))["progress"]["step"] == 5
    url, state, _ = ck.load_latest(str(tmp_path))
    assert url.endswith("s5.ckpt") and state.progress.step == 5 and len(calls) == 1
    # ranking reads no data.pkl: a damaged one is found when the file is loaded
    s5 = tmp_path / "s5.ckpt"
    raw = bytearray(s5.read_bytes())
    raw[raw.index(ck.FORMAT.encode())] ^= 0x20
    s5.write_bytes(bytes(raw))
    assert ck.read_record(str(s5))["progress"]["step"] == 5
    with pytest.warns(UserWarning, match="skipping checkpoint .*s5.ckpt: .*checksum"):
        assert ck.find_latest(str(tmp_path)).endswith("s3.ckpt")


# ------------------------------------------------------------------ reads but does not decode


def _nodes(node):
    """Every dict node of an encoded tree."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _unknown_struct(payload):
    payload["state"]["type"] = "purestep.engine.state:NoSuchState"


def _bad_dtype(payload):
    node = next(n for n in _nodes(payload["state"]) if n.get("__kind__") == "dtype")
    node["name"] = "float1024"


def _plain_dict(payload):
    payload["state"] = ck.encode({"params": {}, "step": 5})


_PLACEHOLDER = "purestep-deep-placeholder"


def _deep(payload):
    payload["state"]["data"]["extra"]["items"][0][1] = _PLACEHOLDER


def _splice_deep(path, depth=10_000):
    """Replace the placeholder string in ``path``'s data.pkl by a ``depth``-deep nesting of
    encoded lists (written opcode by opcode: pickling it would exhaust the stack)."""

    def text(s):
        return b"X" + struct.pack("<I", len(s)) + s.encode()

    level = b"}(" + text("__kind__") + text("list") + text("items") + b"]"
    deep = level * depth + b"N" + b"au" * depth
    with zipfile.ZipFile(path) as archive:
        pickle_bytes = archive.read("archive/data.pkl")
    assert pickle_bytes.count(text(_PLACEHOLDER)) == 1
    spliced = pickle_bytes.replace(text(_PLACEHOLDER), deep)
    copy = path.with_suffix(".tmp")
    _rewrite(path, copy, replace={"data.pkl": spliced})
    os.replace(copy, path)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_unknown_struct, "NoSuchState but no such @struct class is loaded"),
        (_bad_dtype, r"unknown dtype 'float1024' at .extra\['dt'\]"),
        (_deep, r"extra\['dt'\]\[0\]\[0\].*nested deeper than 100 levels"),
        (_plain_dict, "it holds a dict, not a TrainState, and cannot resume training"),
    ],
    ids=["unknown-struct", "bad-dtype", "10000-deep", "plain-dict"],
)
def test_last_skips_a_file_that_reads_but_does_not_decode(tmp_path, damage, reason):
    folder = tmp_path / "checkpoints"
    ck.save(_state(3), str(folder / "good.ckpt"))
    payload = ck.files.serialize(_state(5, dt=torch.float16, nested=[1]))
    damage(payload)
    bad = folder / "bad.ckpt"
    ck.files.write_payload(payload, str(bad))
    if damage is _deep:
        _splice_deep(bad)
    assert ck.ranked(str(folder))[0] == str(bad)  # it is tried first
    messages = []
    checkpointing = Checkpointing(
        strategy=engine.Strategy(), loggers=[], config=None, root_dir=str(tmp_path)
    )
    url = checkpointing.resolve("last", [], None, fn="fit", say=messages.append)
    assert url == str(folder / "good.ckpt")
    skipped = [m for m in messages if m.startswith(f"skipping checkpoint {bad}")]
    assert len(skipped) == 1 and re.search(reason, skipped[0]), messages
    restored, _ = checkpointing.restore(url, _state())
    assert restored.progress.step == 3
    if damage is not _plain_dict:  # a plain dict is a valid checkpoint, if not a resumable one
        with pytest.raises(ck.CheckpointError, match="bad.ckpt: "):
            ck.load(str(bad))


def test_too_deep_nesting_is_a_clear_error_both_ways():
    deep = None
    for _ in range(ck.codec.MAX_DEPTH):
        deep = [deep]
    assert ck.decode(ck.encode(deep)) == deep
    with pytest.raises(ck.CheckpointError, match="cannot save .*nested deeper than 100 levels"):
        ck.encode([deep])
    node = None
    for _ in range(10_000):
        node = {"__kind__": "list", "items": [node]}
    with pytest.raises(ck.CheckpointError, match=r"malformed checkpoint at \[0\]\[0\].*deeper"):
        ck.decode(node)


# ------------------------------------------------------------------ corrupt, not "pickle payload"


def test_bit_flips_and_zeros_are_corrupt_not_a_pickle_payload(tmp_path):
    good = tmp_path / "good.ckpt"
    ck.save(_state(3), str(good))
    raw = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as archive:
        info = archive.getinfo("archive/data.pkl")
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    first_opcode = info.header_offset + 30 + name_len + extra_len + 2  # after PROTO 2
    flipped = tmp_path / "flipped.ckpt"
    raw[first_opcode] ^= 0x01  # EMPTY_DICT '}' becomes '|', no opcode
    flipped.write_bytes(bytes(raw))
    renamed = tmp_path / "renamed.ckpt"  # reads, but as another format: the checksum tells
    raw[first_opcode] ^= 0x01
    at = raw.index(ck.FORMAT.encode(), info.header_offset)
    raw[at] ^= 0x20  # "Purestep-checkpoint"
    renamed.write_bytes(bytes(raw))
    zeros = tmp_path / "zeros.ckpt"
    zeros.write_bytes(bytes(len(raw)))
    garbled = tmp_path / "garbled.ckpt"  # a sound zip whose pickle stream is garbage
    _rewrite(good, garbled, replace={"data.pkl": b"\x80\x02\xff."})
    with pytest.raises(ck.CheckpointError, match="data.pkl' does not match its checksum"):
        ck.load(str(renamed))
    for path in (flipped, renamed, zeros, garbled):
        for reader in (ck.load, ck.read_state_dict):
            with pytest.raises(ck.CheckpointError) as info:
                reader(str(path))
            message = str(info.value)
            assert f"{path} is corrupt or truncated, or not a checkpoint" in message
            assert "pickle payload" not in message
    evil = tmp_path / "evil.ckpt"
    torch.save({"format": ck.FORMAT, "state": print}, evil)  # a global: really refused
    with pytest.raises(ck.CheckpointError, match="evil.ckpt: it holds Python objects .*pickle"):
        ck.load(str(evil))


# ------------------------------------------------------------------ chosen by progress


def test_last_is_chosen_by_recorded_progress_when_mtimes_are_equal(tmp_path):
    ck.save(_state(12), str(tmp_path / "epoch=1-step=12.ckpt"))
    ck.save(_state(9), str(tmp_path / "epoch=1-step=9.ckpt"))  # reverse name order: first
    old = ck.files.serialize(_state(20))
    del old["record"]  # a file written before records: ranks after, by mtime
    ck.files.write_payload(old, str(tmp_path / "old.ckpt"))
    for path in tmp_path.iterdir():
        os.utime(path, (1_700_000_000, 1_700_000_000))
    assert ck.read_record(str(tmp_path / "old.ckpt")) is None
    assert [os.path.basename(u) for u in ck.ranked(str(tmp_path))] == [
        "epoch=1-step=12.ckpt",
        "epoch=1-step=9.ckpt",
        "old.ckpt",
    ]
    assert ck.find_latest(str(tmp_path)).endswith("epoch=1-step=12.ckpt")
    state, _ = ck.load(str(tmp_path / "old.ckpt"))  # older files still load
    assert state.progress.step == 20


def test_across_folders_the_most_recently_written_run_comes_first(tmp_path):
    """An older run that got further (version_0) does not win over a fresh run in a new
    version folder (version_1): folders are taken newest first, progress ranks within."""
    old_run, new_run = tmp_path / "version_0", tmp_path / "version_1"
    old_run.mkdir()
    new_run.mkdir()
    ck.save(_state(1000), str(old_run / "epoch=250-step=1000.ckpt"))
    ck.save(_state(50), str(new_run / "epoch=12-step=50.ckpt"))
    ck.save(_state(48), str(new_run / "epoch=12-step=48.ckpt"))
    os.utime(old_run / "epoch=250-step=1000.ckpt", (1_700_000_000, 1_700_000_000))
    for path in new_run.iterdir():  # equal, later mtimes: progress decides inside the folder
        os.utime(path, (1_700_000_100, 1_700_000_100))
    folders = [str(old_run), str(new_run)]
    assert [os.path.basename(u) for u in ck.ranked(folders)] == [
        "epoch=12-step=50.ckpt",
        "epoch=12-step=48.ckpt",
        "epoch=250-step=1000.ckpt",
    ]
    assert ck.find_latest(folders).endswith("epoch=12-step=50.ckpt")


def test_a_record_that_lies_about_its_progress_does_not_win(tmp_path):
    """Ranking trusts the small record, so the chosen file's state must agree with it: a
    file whose record claims step 10**18 is skipped with a warning once loaded."""
    ck.save(_state(12), str(tmp_path / "epoch=3-step=12.ckpt"))
    payload = ck.files.serialize(_state(8))
    fake = ck.files.serialize(_state(10**18))["record"]
    ck.files.write_payload({**payload, "record": fake}, str(tmp_path / "liar.ckpt"))
    assert os.path.basename(ck.ranked(str(tmp_path))[0]) == "liar.ckpt"
    with pytest.warns(UserWarning, match="liar.ckpt.*record states a progress"):
        assert ck.find_latest(str(tmp_path)).endswith("epoch=3-step=12.ckpt")
