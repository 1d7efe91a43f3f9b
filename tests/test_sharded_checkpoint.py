"""Sharded checkpoints (``engine.checkpoint.sharded``): written by 2 FSDP ranks, read at 1, 2
and 4 ranks and into a plain single-process state, and a plain checkpoint read by 2 ranks;
nothing in a checkpoint runs code; the global data order continues at another world size.

Launches: ``fsdp_job``'s shared ones at 2 ranks (save, reload, continue) and at 1 rank (load
and continue), and one at 4 ranks, each bounded. Tolerance where the world size changes the
reduction arithmetic: ``1e-5 * max|ref| + 1e-6`` per tensor; loads themselves are bitwise.
Resume discovery and the Trainer's deletion of sharded folders, and crafted DCP indexes,
in one process.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from purestep import engine, hardware
from purestep.engine import checkpoint, tree
from purestep.engine.checkpoint import CheckpointError, sharded
from purestep.loops.data.order import rank_order
from tests import fsdp_job
from tests.helpers import mlp

pytestmark = pytest.mark.timeout(600)  # the first test waits for the shared launches


@pytest.fixture(scope="module")
def folder() -> str:
    return fsdp_job.two_rank_run()[1]


@pytest.fixture(scope="module")
def two(folder) -> list[dict]:
    return [r["ckpt"] for r in fsdp_job.two_rank_run()[0]]


def _equal(a, b):
    la, lb = tree.leaves(a), tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def _close(got, want, tol=1e-5):
    for (path, a), (_, b) in zip(tree.flatten_with_paths(got), tree.flatten_with_paths(want)):
        if isinstance(b, torch.Tensor):
            bound = tol * float(b.abs().max()) + 1e-6 if b.numel() else 0.0
            assert float((a - b).abs().max()) <= bound, path
        else:
            assert a == b, path


def test_every_rank_writes_its_shard_and_rank_zero_commits(two, folder):
    files = two[0]["files"]
    assert {
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata",
        sharded.MANIFEST,
        sharded.COMMIT_FILE,
    } <= set(files)
    assert not [f for f in os.listdir(folder) if ".partial-" in f or ".old-" in f]
    assert two[0]["meta"] == "two ranks"


@pytest.mark.bitwise
def test_same_world_size_loads_and_continues_bitwise(two):
    assert two[0]["same"] and two[1]["same"]
    assert two[0]["progress"].step == 2
    _equal(two[0]["resumed"], two[0]["after"])


@pytest.mark.bitwise
def test_loads_into_a_plain_single_process_state(two, folder):
    path = f"{folder}/two.ckpt"
    fresh = engine.init(mlp(0), engine.optim.adam(1e-2), seed=1)
    loaded, meta = sharded.load(path, fresh)
    saved = two[0]["saved"]
    _equal(dict(loaded.params), saved["params"])
    _equal(loaded.opt_state, saved["opt_state"])
    assert loaded.progress.step == 2 and meta["world_size"] == 2
    untargeted, _ = sharded.load(path)  # no target: plain full CPU tensors
    _equal(dict(untargeted.params), saved["params"])
    # and continues like the 2-rank run (same global batches)
    cont, _ = fsdp_job.train(None, engine.optim.adam(1e-2), steps=2, state=loaded, start=2)
    _close(dict(cont.params), two[0]["after"]["params"])


@pytest.mark.parametrize("world", [1, 4])
def test_loads_at_another_world_size(two, folder, world):
    if world == 1:
        got = [fsdp_job.one_rank_run()["load"]]  # shared with the Trainer's 1-rank resume
    else:
        got = hardware.launch(fsdp_job.load_n, world, folder, max_seconds=150, timeout=40)
    total = sum(p.numel() for p in mlp(0).parameters())
    assert sum(r["local"] for r in got) == total  # sharded over the new world
    for r in got:
        _equal(r["loaded"]["params"], two[0]["saved"]["params"])
        _equal(r["loaded"]["opt_state"], two[0]["saved"]["opt_state"])
        _close(r["resumed"]["params"], two[0]["after"]["params"])


@pytest.mark.bitwise
def test_plain_checkpoint_loads_into_fsdp_ranks(two, folder):
    plain, _ = checkpoint.load(f"{folder}/plain.ckpt")
    for r in two:
        _equal(r["from_plain"]["params"], dict(plain.params))
        _equal(r["from_plain"]["opt_state"], plain.opt_state)


@pytest.mark.bitwise
def test_single_process_round_trip_and_overwrite(tmp_path):
    state, _ = fsdp_job.train(None, engine.optim.adam(1e-2), steps=1)
    path = tmp_path / "one.ckpt"
    sharded.save(state, path, metadata={"k": [1, 2.5, None]})
    later, _ = fsdp_job.train(None, engine.optim.adam(1e-2), steps=1, state=state, start=1)
    sharded.save(later, path)  # replaces the older checkpoint
    loaded, _ = sharded.load(path, later)
    _equal(loaded, later)
    assert sorted(os.listdir(tmp_path)) == ["one.ckpt"]


@pytest.mark.bitwise
def test_weights_only_folder_loads_against_a_full_target(tmp_path):
    state, _ = fsdp_job.train(None, engine.optim.adam(1e-2), steps=1)
    path = tmp_path / "w.ckpt"
    sharded.save({"weights_only": True, "params": state.params, "buffers": state.buffers}, path)
    fresh = engine.init(mlp(0), engine.optim.adam(1e-2), seed=1)
    loaded, _ = sharded.load(path, fresh)  # the file's sections only: no optimizer state
    assert loaded["weights_only"] is True and set(loaded) == {"weights_only", "params", "buffers"}
    _equal(loaded["params"], dict(state.params))


def _saved(tmp_path) -> str:
    state = engine.init(mlp(0), engine.optim.sgd(0.1), seed=0)
    path = str(tmp_path / "s.ckpt")
    sharded.save(state, path)
    return path


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creates a file when unpickled by pickle.load


def test_crafted_metadata_does_not_run_code(tmp_path):
    path = _saved(tmp_path)
    marker = str(tmp_path / "pwned")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Evil(marker), f)
    with pytest.raises(CheckpointError, match="refused to read .metadata"):
        sharded.load(path)
    with pytest.raises(CheckpointError, match="refused"):
        sharded.load(path, engine.init(mlp(0), engine.optim.sgd(0.1), seed=0))
    assert not os.path.exists(marker)
    # plain pickle would have run it: the test's payload is live
    with open(os.path.join(path, ".metadata"), "rb") as f:
        pickle.load(f).close()
    assert os.path.exists(marker)


def test_metadata_pointing_outside_the_folder_is_refused(tmp_path):
    from purestep.engine.checkpoint.dcp_metadata import MetadataUnpickler

    path = _saved(tmp_path)
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        meta = MetadataUnpickler(f).load()
    first = next(iter(meta.storage_data))
    meta.storage_data[first].relative_path = "../../etc/passwd"
    with open(file, "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(CheckpointError, match="not a data file"):
        sharded.load(path)


def test_uncommitted_and_mismatched_checkpoints_are_refused(tmp_path):
    path = _saved(tmp_path)
    other = engine.init(torch.nn.Linear(3, 2), engine.optim.sgd(0.1), seed=0)
    with pytest.raises(CheckpointError, match="different model|in the checkpoint but"):
        sharded.load(path, other)
    manifest = os.path.join(path, sharded.MANIFEST)
    with open(manifest) as f:
        data = json.load(f)
    with open(manifest, "w") as f:
        json.dump({k: v for k, v in data.items() if k != "state"}, f)
    with pytest.raises(CheckpointError, match="malformed purestep.json"):
        sharded.load(path)
    os.remove(os.path.join(path, sharded.COMMIT_FILE))
    with pytest.raises(CheckpointError, match="not committed"):
        sharded.load(path)
    with pytest.raises(CheckpointError, match="not a sharded checkpoint folder"):
        sharded.load(tmp_path / "missing")


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    seed=st.integers(0, 2**31),
    per=st.sampled_from([1, 2, 4]),
    worlds=st.sampled_from([(1, 2), (2, 4), (1, 4), (4, 2)]),
    batch=st.integers(0, 20),
)
def test_global_batches_do_not_depend_on_the_world_size(n, seed, per, worlds, batch):
    """With the global batch G = world size * per-rank batch held fixed, global batch b
    holds the same samples at any world size (full batches; padding or trimming to a
    multiple of the world size only touches the epoch's last samples): a run resumed at
    another world size continues the same global sample sequence (positions
    [b G, (b + 1) G) of the seed's permutation)."""
    g = per * 4
    assume((batch + 1) * g <= (n // 4) * 4)  # a full global batch at every world size

    def global_batch(world: int) -> list[int]:
        b = g // world
        out: list[int] = []
        for rank in range(world):
            order = rank_order(
                n, seed=seed, epoch=1, shuffle=True, rank=rank, world_size=world, drop_last=True
            )
            out += order[batch * b : (batch + 1) * b].tolist()
        return sorted(out)

    first, second = (global_batch(w) for w in worlds)
    assert first == second


# ---------------------------------------------------------------------- discovery, deletion


def _trained(steps: int):
    return fsdp_job.train(None, engine.optim.sgd(0.1), steps=steps)[0]


def test_resume_discovery_takes_committed_sharded_folders_only(tmp_path):
    runs = tmp_path / "ckpts"
    checkpoint.save(_trained(1), runs / "file.ckpt")
    two = _trained(2)
    sharded.save(two, runs / "two.ckpt")
    sharded.save(_trained(3), runs / "three.ckpt")
    os.remove(runs / "three.ckpt" / sharded.COMMIT_FILE)  # furthest, but its writer died
    assert sorted(os.path.basename(u) for u in checkpoint.candidates(str(runs))) == [
        "file.ckpt",
        "two.ckpt",
    ]
    with pytest.warns(UserWarning, match="three.ckpt.*not committed"):
        url, state, _ = checkpoint.load_latest(str(runs))
    assert os.path.basename(url) == "two.ckpt" and state.progress.step == 2
    _equal(state.params, two.params)
    with pytest.warns(UserWarning, match="not committed"):
        url, peeked, _ = checkpoint.load_latest(str(runs), tensors=False)
    assert os.path.basename(url) == "two.ckpt"
    assert all(p.device.type == "meta" for p in peeked.params.values())
    # a record that lies about the folder's progress loses the ranking
    manifest = runs / "two.ckpt" / sharded.MANIFEST
    data = json.loads(manifest.read_text())
    data["record"]["progress"]["step"] = 7
    manifest.write_text(json.dumps(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        url, state, _ = checkpoint.load_latest(str(runs))
    assert any(re.search("two.ckpt.*record states a progress", str(w.message)) for w in caught)
    assert os.path.basename(url) == "file.ckpt" and state.progress.step == 1


class _Primary:
    is_primary, world_size = True, 1


def _checkpointing(dirpath: str):
    from purestep.loops.resume import Checkpointing

    ckpt = Checkpointing(strategy=_Primary(), loggers=[], config=None, root_dir=dirpath)
    ckpt._save_folders = [dirpath]
    return ckpt


def test_the_trainer_deletes_only_committed_purestep_folders_in_its_dirpath(tmp_path):
    dirpath = tmp_path / "ckpt"
    ours, uncommitted = dirpath / "ours.ckpt", dirpath / "cut.ckpt"
    outside = tmp_path / "elsewhere" / "x.ckpt"
    for path in (ours, uncommitted, outside):
        sharded.save(_trained(1), path)
    os.remove(uncommitted / sharded.COMMIT_FILE)
    foreign = dirpath / "foreign.ckpt"  # another program's DCP folder: no purestep manifest
    os.makedirs(foreign)
    for name in (".metadata", sharded.COMMIT_FILE):
        (foreign / name).write_bytes(b"")
    os.symlink(tmp_path / "elsewhere", dirpath / "sub")  # a subfolder linking out
    os.symlink(ours, dirpath / "link.ckpt")
    ckpt = _checkpointing(str(dirpath))
    for path, why in (
        (uncommitted, "not committed"),
        (foreign, "no purestep.json"),
        (dirpath / "sub" / "x.ckpt", "outside the checkpoint folder"),
        (dirpath / "link.ckpt", "links to no regular file"),
    ):
        with pytest.warns(UserWarning, match=why):
            ckpt.remove(str(path))
        assert os.path.isdir(path), path
    ckpt.remove(str(ours))
    assert not os.path.lexists(ours) and os.path.isdir(outside)


def _rewrite(path: str, change) -> None:
    """Read ``path``'s DCP index, let ``change`` alter it, pickle it back (a crafted file)."""
    from purestep.engine.checkpoint.dcp_metadata import read_metadata

    meta = read_metadata(path)
    change(meta)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _first(meta):
    return next(iter(meta.state_dict_metadata.values()))


def _huge(meta):
    entry = _first(meta)
    entry.size = torch.Size([2**40])
    entry.chunks[0].offsets, entry.chunks[0].sizes = torch.Size([0]), torch.Size([2**40])


@pytest.mark.parametrize(
    "change, why",
    [
        # BUILD sets any attribute: a dtype that is a path, an extra __setstate__
        (lambda m: setattr(_first(m).properties, "dtype", pathlib.PosixPath("x")), "tensor's"),
        (lambda m: m.__dict__.update(__setstate__=torch.Size), "__setstate__"),
        (lambda m: setattr(_first(m), "size", torch.Size([-1, 3])), "tensor's"),
        (lambda m: setattr(_first(m).chunks[0], "offsets", torch.Size([5, 0])), "outside"),
        (_huge, "data files hold"),  # terabytes asked for, a few bytes stored
        (lambda m: setattr(m, "planner_data", {"a": [pathlib.PosixPath("/")]}), "planner"),
        (lambda m: m.storage_data.update({"params.0": next(iter(m.storage_data.values()))}), "key"),
        (
            lambda m: setattr(
                next(iter(m.storage_data.values())), "relative_path", pathlib.PosixPath("/etc")
            ),
            "names the file",
        ),
    ],
)
def test_crafted_metadata_within_the_allowed_classes_is_refused(tmp_path, change, why):
    path = _saved(tmp_path)
    _rewrite(path, change)
    with pytest.raises(CheckpointError, match=why):
        sharded.load(path)
    with pytest.raises(CheckpointError, match=why):
        sharded.peek(path)


def test_metadata_globals_outside_dcp_are_refused(tmp_path):
    path = _saved(tmp_path)
    marker = tmp_path / "ran"
    for payload in (
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.",
        b"cbuiltins\neval\n(S'1'\ntR.",
        b"ctorch\nload\n(S'x'\ntR.",
        b"ctorch\nSize\n(S'ab'\ntR.",  # an allowed class, odd arguments: not Metadata
    ):
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(payload)
        with pytest.raises(CheckpointError, match="refused|not DCP Metadata"):
            sharded.load(path)
    assert not marker.exists()


@pytest.mark.bitwise
def test_a_failed_commit_keeps_the_checkpoint_before(tmp_path, monkeypatch):
    path = tmp_path / "run.ckpt"
    one = _trained(1)
    sharded.save(one, path)
    write = sharded.folder._write_file

    def full_disk(file, data):
        if file.endswith(sharded.COMMIT_FILE):
            raise OSError(28, "No space left on device")
        write(file, data)

    monkeypatch.setattr(sharded.folder, "_write_file", full_disk)
    with pytest.raises(OSError, match="no space left on device: writing the checkpoint") as err:
        sharded.save(_trained(2), path)  # the plain path's out-of-space error
    assert err.value.errno == 28 and "run.ckpt" in str(err.value)
    assert os.listdir(tmp_path) == ["run.ckpt"]  # no temporary folder left either
    loaded, _ = sharded.load(path)
    assert loaded.progress.step == 1
    _equal(loaded.params, one.params)


def test_partial_folders_of_dead_writers_are_removed(tmp_path):
    import subprocess
    import sys

    from purestep.engine.checkpoint import storage

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(dead.stdout)
    gone = tmp_path / f".x.ckpt.tmp-{storage.writer_identity(pid)}-0123456789ab"
    mine = tmp_path / storage._temp_name("y.ckpt")  # a live writer's (this process)
    if storage.writer_alive(gone.name) is not False:
        pytest.skip("this machine cannot tell that a process of it is gone")
    for folder in (gone, mine):
        os.makedirs(folder)
    (tmp_path / "z.ckpt").mkdir()
    assert sharded.remove_partial(tmp_path) == [str(gone)]
    assert sorted(os.listdir(tmp_path)) == sorted([mine.name, "z.ckpt"])
