import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from purestep import engine
from purestep.engine import checkpoint as ck
from purestep.engine import metrics, optim, tree
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
@pytest.mark.bitwise
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
    os.utime(tmp_path / ".newest.ckpt.tmp-abc", (0, 0))  # no writer named: stale by age
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
from purestep.engine import checkpoint as ck
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


@pytest.mark.parametrize("copy", ["auto", "never"])
def test_async_saves_snapshot_the_metadata_when_save_returns(tmp_path, monkeypatch, copy):
    """The metadata is the caller's live objects: changing them after ``save`` returned
    (lists, dicts, a tensor in place) must not reach the file, whatever ``copy`` says."""
    from purestep.engine.checkpoint import background

    released = threading.Semaphore(0)
    serialize = background.serialize

    def held(*args, **kwargs):  # the write starts only once the caller has moved on
        released.acquire(timeout=10)
        return serialize(*args, **kwargs)

    monkeypatch.setattr(background, "serialize", held)
    state = {"w": torch.arange(3.0)}
    meta = {"live": [1], "t": torch.zeros(2), "nested": {"d": {}}, "pair": (1, [2])}
    saver = ck.AsyncCheckpointer(copy=copy)
    saver.save(state, str(tmp_path / "a.ckpt"), metadata=meta)
    meta["live"].append(2)
    meta["t"].add_(5)
    meta["nested"]["d"]["x"] = 1
    meta["pair"][1].append(3)
    meta["new"] = 1
    released.release()
    saver.wait()
    _, got = ck.load(str(tmp_path / "a.ckpt"))
    got.pop("versions")
    assert torch.equal(got.pop("t"), torch.zeros(2))
    assert got == {"live": [1], "nested": {"d": {}}, "pair": (1, [2])}
    # metadata the codec cannot write is refused by save itself, before anything is queued
    with pytest.raises(ck.CheckpointError, match=r"metadata\['fn'\]"):
        saver.save(state, str(tmp_path / "b.ckpt"), metadata={"fn": print})
    assert not saver.in_flight and not (tmp_path / "b.ckpt").exists()
    saver.close()


_EXIT_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from purestep.engine import checkpoint as ck
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
    with pytest.raises(ck.CheckpointError, match="weights_only=False and save its"):
        ck.load_weights(engine.init(mlp(), optim.sgd(0.1)), str(path), mlp())


# ------------------------------------------------------------------ restoring into a fresh target


def _mid_window(micro_batches=1, accumulate=2):
    """A state after ``micro_batches`` micro-batches, with callback and loop state filled."""
    net = mlp(dropout=0.5)
    opt = optim.adam(1e-2)
    state = engine.init(net, opt, seed=5)
    step = engine.train_step(net, loss_fn, opt, accumulate=accumulate)
    for batch in batches(micro_batches):
        state, _ = step(state, batch)
    state = state.replace(
        callbacks={"cb": {"best": 1.5}}, extra={"loop": {"sums": torch.arange(3.0)}}
    )
    return net, opt, step, state


def _other_head():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))


def test_a_fresh_target_takes_the_runs_position_and_open_window_from_the_file():
    net, opt, step, state = _mid_window()
    assert state.progress.micro_step == 1 and state.grad_accum is not None
    ck.save(state, "memory://ckpt-tests/window.ckpt")
    fresh = engine.init(net, opt, seed=9)  # no window, no callbacks, another key
    loaded, _ = ck.load("memory://ckpt-tests/window.ckpt", target=fresh)
    tree.assert_trees_equal(loaded, state)
    # the window's gradients are used: the step that closes it gives the same bits
    batch = batches(2, seed=1)[1]
    tree.assert_trees_equal(step(loaded, batch)[0], step(state, batch)[0])


@given(
    micro_batches=st.integers(0, 5),
    accumulate=st.integers(1, 3),
    same_model=st.booleans(),
)
@settings(max_examples=25)
def test_a_restore_never_counts_an_open_window_without_its_gradients(
    micro_batches, accumulate, same_model
):
    net, opt, _, state = _mid_window(micro_batches, accumulate)
    url = f"memory://ckpt-tests/prop-{micro_batches}-{accumulate}.ckpt"
    ck.save(state, url)
    fresh = engine.init(net if same_model else _other_head(), opt, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, _ = ck.load(url, target=fresh, strict=False)
    assert (loaded.progress.micro_step > 0) == (loaded.grad_accum is not None)
    dropped = any("Dropped the open accumulation window" in str(w.message) for w in caught)
    if same_model:
        tree.assert_trees_equal(loaded, state)
        assert not caught
    else:
        assert dropped == (state.progress.micro_step > 0)
        assert loaded.progress.micro_step == 0
        tree.assert_trees_equal(loaded.progress, state.progress.replace(micro_step=0))
        assert torch.equal(loaded.params["3.weight"], fresh.params["3.weight"])
        assert torch.equal(loaded.params["0.weight"], state.params["0.weight"])


def test_accumulated_gradients_are_checked_against_the_parameters():
    _, opt, _, state = _mid_window()
    ck.save(state, "memory://ckpt-tests/accum.ckpt")
    with pytest.raises(ck.CheckpointError) as info:
        ck.load("memory://ckpt-tests/accum.ckpt", target=engine.init(_other_head(), opt))
    message = str(info.value)
    assert "params: 2 differences" in message and "grad_accum: 2 differences" in message
    assert "grad_accum['0.weight']" not in message  # only the head differs
    assert (
        ".grad_accum['3.weight']: shape (3, 16) in the checkpoint, (4, 16) in the target" in message
    )
    stray = state.replace(grad_accum={**state.grad_accum, "9.weight": torch.zeros(3)})
    ck.save(stray, "memory://ckpt-tests/accum-stray.ckpt")
    with pytest.raises(ck.CheckpointError, match="the target has no parameter '9.weight'"):
        ck.load("memory://ckpt-tests/accum-stray.ckpt", target=state)
    bad = state.replace(grad_accum={**state.grad_accum, "0.bias": torch.zeros(3)})
    ck.save(bad, "memory://ckpt-tests/accum-shape.ckpt")
    with pytest.raises(ck.CheckpointError, match=r"grad_accum\['0.bias'\]: shape \(3,\)"):
        ck.load("memory://ckpt-tests/accum-shape.ckpt", target=state)


def test_an_open_window_without_gradients_is_refused_or_dropped():
    net, opt, _, state = _mid_window()
    ck.save(state.replace(grad_accum=None), "memory://ckpt-tests/no-accum.ckpt")
    fresh = engine.init(net, opt)
    with pytest.raises(ck.CheckpointError, match="1 micro-batches accumulated, but the"):
        ck.load("memory://ckpt-tests/no-accum.ckpt", target=fresh)
    with pytest.warns(UserWarning, match="Dropped the open accumulation window"):
        loaded, _ = ck.load("memory://ckpt-tests/no-accum.ckpt", target=fresh, strict=False)
    assert loaded.progress.micro_step == 0 and loaded.grad_accum is None
    tree.assert_trees_equal(loaded.params, state.params)


def test_a_restored_run_lands_on_the_targets_devices():
    net, opt, _, state = _mid_window()
    ck.save(state, "memory://ckpt-tests/placed.ckpt")
    fresh = tree.to_device(engine.init(net, opt), "meta")  # a device other than the file's
    loaded, _ = ck.load("memory://ckpt-tests/placed.ckpt", target=fresh)
    for part in (loaded.params, loaded.opt_state, loaded.grad_accum):
        assert {t.device.type for t in tree.leaves(part) if isinstance(t, torch.Tensor)} == {"meta"}
    tree.assert_trees_equal(loaded.progress, state.progress)
    assert loaded.rng == state.rng


def test_other_targets_are_matched_as_a_whole():
    ck.save({"w": torch.ones(2), "extra": 1}, "memory://ckpt-tests/dict.ckpt")
    with pytest.raises(ck.CheckpointError, match=r"\['extra'\]: in the checkpoint but not"):
        ck.load("memory://ckpt-tests/dict.ckpt", target={"w": torch.zeros(2)})


# ------------------------------------------------------------------ malformed files


@pytest.mark.parametrize(
    ("entry", "node", "where"),
    [
        ("state", {"__kind__": "dict"}, "at the root: KeyError"),
        ("state", {"__kind__": "dict", "items": [["a", {"__kind__": "list"}]]}, r"\['a'\]"),
        ("state", {"__kind__": "dict", "items": [[["unhashable"], 1]]}, "TypeError"),
        ("state", {"__kind__": "device", "name": "nowhere"}, "RuntimeError"),
        ("metadata", {"__kind__": "list", "items": 3}, "at metadata: TypeError"),
    ],
)
def test_malformed_payloads_are_checkpoint_errors_naming_the_file(tmp_path, entry, node, where):
    payload = ck.files.serialize({"x": 1})
    payload[entry] = node
    torch.save(payload, tmp_path / "malformed.ckpt")
    with pytest.raises(ck.CheckpointError, match=f"malformed.ckpt: malformed checkpoint .*{where}"):
        ck.load(str(tmp_path / "malformed.ckpt"))
    del payload[entry]
    torch.save(payload, tmp_path / "short.ckpt")
    with pytest.raises(ck.CheckpointError, match=f"short.ckpt: .*no '{entry}' entry"):
        ck.load(str(tmp_path / "short.ckpt"))


@pytest.mark.parametrize(
    "error",
    [
        zipfile.BadZipFile("bad central directory"),
        OSError("read failed"),
        KeyError("data/0"),
        EOFError(),
        RuntimeError("PytorchStreamReader failed"),
        ValueError("bad header"),
    ],
    ids=lambda e: type(e).__name__,
)
@pytest.mark.parametrize("reader", [ck.read, ck.read_state_dict], ids=["checkpoint", "state_dict"])
def test_checkpoints_and_weight_files_report_corruption_the_same_way(
    tmp_path, monkeypatch, error, reader
):
    path = tmp_path / "damaged.pt"
    ck.save({"w": torch.ones(2)}, str(path))  # a sound zip: torch.load is reached

    def failing_load(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "load", failing_load)
    with pytest.raises(ck.CheckpointError, match=r"damaged.pt is corrupt or truncated"):
        reader(str(path))


# ------------------------------------------------------------------ reading once


def _counting_torch_load(monkeypatch):
    calls = []
    original = torch.load

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    return calls


def test_the_latest_checkpoint_is_read_once_and_restored_from_its_payload(tmp_path, monkeypatch):
    state = _trained_state(1)
    ck.save(state, str(tmp_path / "good.ckpt"))
    time.sleep(0.01)
    (tmp_path / "broken.ckpt").write_bytes(b"not a zip")
    calls = _counting_torch_load(monkeypatch)
    with pytest.warns(UserWarning, match="skipping checkpoint .*broken.ckpt"):
        url, payload = ck.read_latest([str(tmp_path / "missing"), str(tmp_path)])
    assert url.endswith("good.ckpt") and len(calls) == 1  # the broken one is refused unread
    loaded, meta = ck.load_payload(payload, url=url, target=state)
    assert len(calls) == 1
    tree.assert_trees_equal(loaded, state)
    assert meta["versions"] == ck.versions()
    assert ck.read_latest(str(tmp_path / "missing")) is None


# ------------------------------------------------------------------ weights round trip


class _TiedWithCache(nn.Module):
    """Tied weights, a persistent buffer (BatchNorm) and a non-persistent one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.emb.weight
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("cache", torch.arange(4.0), persistent=False)


def test_export_then_load_weights_round_trips_with_non_persistent_buffers():
    net = _TiedWithCache()
    state = engine.init(net, optim.sgd(0.1))
    state = state.replace(
        params={k: v + 1 for k, v in state.params.items()},
        buffers={k: v + 2 for k, v in state.buffers.items()},
    )
    sd = ck.export_state_dict(state, net)
    assert "cache" not in sd and sd["out.weight"] is sd["emb.weight"]
    fresh = engine.init(_TiedWithCache(), optim.sgd(0.1), seed=3)
    loaded = ck.load_weights(fresh, sd, net)
    tree.assert_trees_equal(loaded.params, state.params)
    assert torch.equal(loaded.buffers["norm.running_mean"], state.buffers["norm.running_mean"])
    assert torch.equal(loaded.buffers["cache"], fresh.buffers["cache"])  # the state's own
    assert loaded.params["emb.weight"] is not sd["emb.weight"]  # copied, not aliased
    without_tie = {k: v for k, v in sd.items() if k != "emb.weight"}
    tree.assert_trees_equal(ck.load_weights(fresh, without_tie, net).params, state.params)
    missing = {k: v for k, v in sd.items() if k != "norm.running_var"}
    with pytest.raises(ck.CheckpointError, match="norm.running_var: missing in the source"):
        ck.load_weights(fresh, missing, net)


class _CountingNet(nn.Sequential):
    calls = 0

    def named_parameters(self, *args, **kwargs):
        type(self).calls += 1
        return super().named_parameters(*args, **kwargs)


def test_load_weights_walks_the_model_a_fixed_number_of_times():
    counts = []
    for layers in (2, 40):
        net = _CountingNet(*[nn.Linear(3, 3) for _ in range(layers)])
        state = engine.init(net, optim.sgd(0.1))
        _CountingNet.calls = 0
        ck.load_weights(state, net.state_dict(), net)
        counts.append(_CountingNet.calls)
    assert counts[0] == counts[1] <= 2


def test_struct_names_written_before_the_purestep_namespace_still_load(tmp_path):
    """Files from before the rename name classes ``engine.state:TrainState``; they load as
    the ``purestep.`` classes, and a name outside our packages is still refused."""
    from purestep.engine.checkpoint import codec

    state = engine.init(mlp(), optim.adam(1e-3), seed=0)
    encoded = codec.encode(state)

    def legacy(node):
        if isinstance(node, dict):
            out = {k: legacy(v) for k, v in node.items()}
            if out.get("__kind__") == "struct":
                assert out["type"].startswith("purestep.")
                out["type"] = out["type"].removeprefix("purestep.")
            return out
        if isinstance(node, list):
            return [legacy(v) for v in node]
        return node

    old = legacy(encoded)
    assert old["type"] == "engine.state:TrainState"
    tree.assert_trees_equal(codec.decode(old), state)
    old["type"] = "os:system"
    with pytest.raises(ck.CheckpointError, match="no such @struct class"):
        codec.decode(old)


def test_a_field_added_since_the_file_was_written_takes_its_default(tmp_path):
    """``InjectHyperparamsState.name`` came later: an older file without it loads (the
    default alone, or the target's value when restored into one); a missing field with no
    default is still an error naming the fields."""
    net = nn.Linear(3, 2)
    opt = optim.inject_hyperparams(optim.adamw)(lr=1e-3)
    state = engine.init(net, opt, seed=0)
    ck.save(state, str(tmp_path / "new.ckpt"))
    raw = torch.load(str(tmp_path / "new.ckpt"), weights_only=True)

    def strip(node, field):
        if isinstance(node, dict):
            out = {k: strip(v, field) for k, v in node.items()}
            if out.get("__kind__") == "struct" and field in out.get("static", {}):
                del out["static"][field]
            if out.get("__kind__") == "struct" and field in out.get("data", {}):
                del out["data"][field]
            return out
        return [strip(v, field) for v in node] if isinstance(node, list) else node

    torch.save({**raw, "state": strip(raw["state"], "name")}, str(tmp_path / "old.ckpt"))
    plain, _ = ck.load(str(tmp_path / "old.ckpt"))
    assert plain.opt_state.name == ""
    tree.assert_trees_equal(plain.opt_state.inner_state, state.opt_state.inner_state)
    restored, _ = ck.load(str(tmp_path / "old.ckpt"), target=engine.init(net, opt, seed=1))
    assert restored.opt_state.name == "AdamW"
    tree.assert_trees_equal(restored.params, state.params)

    torch.save({**raw, "state": strip(raw["state"], "count")}, str(tmp_path / "bad.ckpt"))
    with pytest.raises(ck.CheckpointError, match="fields"):
        ck.load(str(tmp_path / "bad.ckpt"))


_USER_STRUCT = """
import torch
import engine  # the user's own engine.py, beside the script
from purestep import checkpoint, init, optim
state = init(torch.nn.Linear(2, 1), optim.sgd(0.1), seed=0)
state = state.replace(extra={"counter": engine.Counter(3)})
checkpoint.save(state, "user.ckpt")
loaded, _ = checkpoint.load("user.ckpt")
assert type(loaded.extra["counter"]) is engine.Counter and loaded.extra["counter"].n == 3
print("ok")
"""


def test_a_users_struct_in_a_module_named_engine_still_loads(tmp_path):
    """Old names are read with the ``purestep.`` prefix only when the name as written is no
    registered class: a user's own ``engine.py`` struct keeps its name."""
    (tmp_path / "engine.py").write_text(
        "from purestep.engine.tree import struct\n\n@struct\nclass Counter:\n    n: int\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", _USER_STRUCT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
