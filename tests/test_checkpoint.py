import os
import pickle
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn

import engine
from engine import checkpoint as ck
from engine import metrics, optim, tree
from tests.helpers import batches, loss_fn, mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trained_state(steps=3):
    net = mlp(dropout=0.5, batchnorm=True)
    opt = optim.chain(
        optim.clip_by_global_norm(1.0), optim.inject_hyperparams(optim.adamw)(lr=1e-2)
    )
    state = engine.init(net, opt, seed=5)
    step = engine.train_step(net, loss_fn, opt, accumulate=2)
    for batch in batches(steps):
        state, _ = step(state, batch)
    extra = {
        "metrics": {"acc": metrics.Accuracy.of(torch.tensor([1, 0]), torch.tensor([1, 1]))},
        "misc": (1, "a", None, 2.5, True, [3, 4]),
        "int_keys": {3: "x"},
    }
    return state.replace(extra=extra, callbacks={"cb": {"best": float("inf"), "path": ""}})


@pytest.mark.parametrize("url", ["{tmp}/a.ckpt", "memory://ckpt-tests/a.ckpt"])
def test_the_whole_state_round_trips_bitwise(tmp_path, url):
    state = _trained_state()
    assert state.grad_accum is not None  # an open accumulation window is saved too
    url = url.format(tmp=tmp_path)
    ck.save(state, url, metadata={"config": {"max_epochs": 3}, "note": "x"})
    loaded, meta = ck.load(url)
    tree.assert_trees_equal(loaded, state)
    assert meta["config"] == {"max_epochs": 3}
    assert meta["versions"]["torch"] == str(torch.__version__)
    assert ck.load_metadata(url)["note"] == "x"


def test_restore_into_a_target_places_tensors_and_checks_structure(tmp_path):
    state = _trained_state()
    path = str(tmp_path / "a.ckpt")
    ck.save(state, path)
    fresh = engine.init(mlp(dropout=0.5, batchnorm=True), optim.sgd(0.1))
    with pytest.raises(ck.CheckpointError) as info:
        ck.load(path, target=fresh.replace(extra=state.extra, callbacks=state.callbacks))
    message = str(info.value)
    assert "does not match the target state" in message
    assert ".opt_state" in message and "strict=False" in message
    same, _ = ck.load(path, target=state)
    tree.assert_trees_equal(same, state)


def test_mismatched_shapes_and_dtypes_are_all_listed():
    net = mlp()
    a = engine.init(net, optim.sgd(0.1))
    b = engine.init(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), optim.sgd(0.1))
    b = b.replace(params={**b.params, "0.bias": b.params["0.bias"].double()})
    ck.save(a, "memory://ckpt-tests/shape.ckpt")
    with pytest.raises(ck.CheckpointError) as info:
        ck.load("memory://ckpt-tests/shape.ckpt", target=b)
    message = str(info.value)
    assert "['2.weight']: shape (3, 16) in the checkpoint, (4, 16) in the target" in message
    assert "['2.bias']: shape (3,)" in message
    assert "['0.bias']: dtype torch.float32 in the checkpoint, torch.float64" in message


def test_partial_restore_keeps_the_target_where_the_file_does_not_fit():
    a = engine.init(mlp(), optim.sgd(0.1))
    b = engine.init(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), optim.sgd(0.1))
    ck.save(a, "memory://ckpt-tests/partial.ckpt")
    with pytest.warns(UserWarning, match="partial restore"):
        mixed, _ = ck.load("memory://ckpt-tests/partial.ckpt", target=b, strict=False)
    assert torch.equal(mixed.params["0.weight"], a.params["0.weight"])
    assert torch.equal(mixed.params["2.weight"], b.params["2.weight"])


class _Payload:
    marker = "/nonexistent/purestep-payload-ran"

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    payload = _Payload()
    payload.marker = marker
    evil = tmp_path / "evil.ckpt"
    torch.save({"format": ck.FORMAT, "version": 1, "state": payload, "metadata": {}}, evil)
    with pytest.raises(
        ck.CheckpointError, match="refusing to load .*evil.ckpt.*nothing from it was run"
    ):
        ck.load(str(evil))
    raw = tmp_path / "raw.ckpt"
    raw.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(ck.CheckpointError):
        ck.load(str(raw))
    assert not marker.exists()


def test_truncated_and_foreign_files_get_errors_naming_them(tmp_path):
    good = tmp_path / "good.ckpt"
    ck.save(_trained_state(1), str(good))
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ck.CheckpointError, match=r"truncated.ckpt is corrupt or truncated"):
        ck.load(str(truncated))
    foreign = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "epoch": 3}, foreign)
    with pytest.raises(ck.CheckpointError, match="not a purestep checkpoint.*load_weights"):
        ck.load(str(foreign))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ck.load(str(tmp_path / "missing.ckpt"))


def test_auto_resume_falls_back_to_the_newest_valid_checkpoint(tmp_path):
    ck.save(_trained_state(1), str(tmp_path / "old.ckpt"))
    time.sleep(0.01)
    ck.save(_trained_state(2), str(tmp_path / "new.ckpt"))
    time.sleep(0.01)
    broken = tmp_path / "newest.ckpt"
    broken.write_bytes(b"not a zip")
    (tmp_path / ".newest.ckpt.tmp-abc").write_bytes(b"partial")
    assert ck.candidates(str(tmp_path))[0].endswith("newest.ckpt")
    assert all(".tmp-" not in c for c in ck.candidates(str(tmp_path)))
    with pytest.warns(UserWarning, match="skipping checkpoint .*newest.ckpt"):
        assert ck.find_latest(str(tmp_path)).endswith("new.ckpt")
    assert ck.remove_partial(str(tmp_path))[0].endswith(".newest.ckpt.tmp-abc")


def test_object_store_mode_commits_with_a_marker():
    url = "memory://ckpt-tests/store/a.ckpt"
    ck.save(_trained_state(1), url, commit="marker")
    assert ck.is_committed(url, commit="marker")
    loaded, _ = ck.load(url, commit="marker")
    # a writer killed before its marker: the file is there but not a checkpoint
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.rm("/ckpt-tests/store/a.ckpt" + ck.MARKER_SUFFIX)
    assert not ck.is_committed(url, commit="marker")
    with pytest.raises(FileNotFoundError, match="no commit marker"):
        ck.load(url, commit="marker")
    assert ck.candidates("memory://ckpt-tests/store", commit="marker") == []
    assert loaded.progress.total_batches == 1


_KILL_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from engine import checkpoint as ck
big = {{"w": torch.randn(8_000_000)}}
print("ready", flush=True)
while True:
    ck.save(big, {path!r})
"""


def test_sigkill_during_a_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "last.ckpt")
    previous = {"w": torch.arange(10.0)}
    ck.save(previous, path)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT.format(root=ROOT, path=path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    loaded, _ = ck.load(path)  # either the old state or a completely written new one
    assert loaded["w"].shape in (torch.Size([10]), torch.Size([8_000_000]))
    assert ck.candidates(str(tmp_path)) == [path]
    ck.remove_partial(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_async_saves_write_the_same_bytes_and_wait_for_completion(tmp_path):
    state = _trained_state()
    ck.save(state, str(tmp_path / "sync.ckpt"), metadata={"k": 1})
    saver = ck.AsyncCheckpointer()
    saver.save(state, str(tmp_path / "async.ckpt"), metadata={"k": 1})
    saver.wait()
    assert not saver.in_flight
    sync_bytes = (tmp_path / "sync.ckpt").read_bytes()
    async_bytes = (tmp_path / "async.ckpt").read_bytes()
    # the versions block is identical within one process, so the files are byte-identical
    assert sync_bytes == async_bytes
    saver.close()
    with pytest.raises(RuntimeError, match="closed"):
        saver.save(state, str(tmp_path / "x.ckpt"))


def test_async_save_errors_surface_on_wait():
    saver = ck.AsyncCheckpointer()
    saver.save({"bad": object()}, "memory://ckpt-tests/bad.ckpt")
    with pytest.raises(ck.CheckpointError, match="not a tensor"):
        saver.wait()
    saver.close()


_EXIT_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from engine import checkpoint as ck
saver = ck.AsyncCheckpointer()
saver.save({{"w": torch.randn(4_000_000)}}, {path!r})
"""


def test_a_process_never_exits_with_a_save_in_flight(tmp_path):
    path = str(tmp_path / "exit.ckpt")
    subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT.format(root=ROOT, path=path)], check=True, timeout=120
    )
    loaded, _ = ck.load(path)
    assert loaded["w"].shape == (4_000_000,)


def test_values_that_cannot_be_saved_are_named():
    with pytest.raises(ck.CheckpointError, match=r"\['fn'\]: a function"):
        ck.save({"fn": lambda: 1}, "memory://ckpt-tests/fn.ckpt")
    with pytest.raises(ck.CheckpointError, match="meta tensor"):
        ck.save({"m": torch.empty(2, device="meta")}, "memory://ckpt-tests/meta.ckpt")


def test_unknown_classes_and_newer_formats_are_clear_errors(tmp_path):
    payload = ck.files.serialize({"x": 1})
    payload["state"] = {"__kind__": "struct", "type": "nowhere:Thing", "data": {}, "static": {}}
    torch.save(payload, tmp_path / "unknown.ckpt")
    with pytest.raises(ck.CheckpointError, match="nowhere:Thing"):
        ck.load(str(tmp_path / "unknown.ckpt"))
    payload = ck.files.serialize({"x": 1})
    payload["version"] = ck.FORMAT_VERSION + 1
    torch.save(payload, tmp_path / "newer.ckpt")
    with pytest.raises(ck.CheckpointError, match="newer than this version"):
        ck.load(str(tmp_path / "newer.ckpt"))


# ------------------------------------------------------------------ state_dict interop


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.emb.weight
        self.norm = nn.BatchNorm1d(4)


def test_exported_state_dicts_load_into_the_module():
    net = _Tied()
    state = engine.init(net, optim.sgd(0.1))
    state = state.replace(params={k: v + 1 for k, v in state.params.items()})
    sd = ck.export_state_dict(state, net)
    assert list(sd) == list(net.state_dict())
    fresh = _Tied()
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.emb.weight, state.params["emb.weight"])
    assert fresh.out.weight is fresh.emb.weight


def test_weights_from_plain_and_lightning_style_checkpoints(tmp_path):
    source = mlp(seed=3)
    target = mlp(seed=4)
    state = engine.init(target, optim.sgd(0.1))
    plain = tmp_path / "plain.pt"
    torch.save(source.state_dict(), plain)
    loaded = ck.load_weights(state, str(plain), target)
    tree.assert_trees_equal(loaded.params, dict(source.named_parameters()))
    lightning_like = tmp_path / "model.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in source.state_dict().items()},
            "epoch": 3,
            "global_step": 10,
        },
        lightning_like,
    )
    loaded = ck.load_weights(state, str(lightning_like), target)
    tree.assert_trees_equal(loaded.params, dict(source.named_parameters()))
    tree.assert_trees_equal(loaded.opt_state, state.opt_state)


def test_mismatched_weights_are_listed_unless_not_strict():
    state = engine.init(mlp(), optim.sgd(0.1))
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    with pytest.raises(ck.CheckpointError, match=r"2.weight: shape \(5, 16\) vs \(3, 16\)"):
        ck.load_weights(state, other.state_dict(), mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        partial = ck.load_weights(state, other.state_dict(), mlp(), strict=False)
    assert torch.equal(partial.params["0.weight"], other[0].weight)
    assert torch.equal(partial.params["2.weight"], state.params["2.weight"])


def test_files_with_arbitrary_objects_are_refused_with_advice(tmp_path):
    path = tmp_path / "objects.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "hparams": _Payload()}, path)
    with pytest.raises(ck.CheckpointError, match="weights_only=False"):
        ck.load_weights(engine.init(mlp(), optim.sgd(0.1)), str(path), mlp())
