"""Checkpointing through the Trainer: where files go, ckpt_path, weights, async, links."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.utils.data import DataLoader

from purestep import engine
from purestep.engine import checkpoint, optim, tree
from purestep.loops import Trainer
from purestep.loops.callbacks import ModelCheckpoint
from purestep.loops.loggers import CSVLogger
from purestep.loops.resume import Checkpointing
from tests.helpers import mlp
from tests.helpers import sign_data as _data
from tests.helpers import sign_loss as _loss


def _trainer(root, **flags):
    flags.setdefault("max_epochs", 3)
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("logger", CSVLogger(root))
    return Trainer(default_root_dir=root, **flags)


def _fit(trainer, **kwargs):
    return trainer.fit(
        mlp(),
        _loss,
        optim.adam(1e-2),
        DataLoader(_data(), batch_size=8, shuffle=True),
        DataLoader(_data(16, 1), batch_size=8),
        **kwargs,
    )


def test_the_default_checkpoint_goes_to_the_loggers_run_folder(tmp_path):
    trainer = _trainer(str(tmp_path))
    state = _fit(trainer)
    folder = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["epoch=2-step=12.ckpt"]
    assert trainer.best_model_path == str(folder / "epoch=2-step=12.ckpt")
    loaded, meta = checkpoint.load(trainer.best_model_path)
    tree.assert_trees_equal(loaded.params, state.params)
    assert meta["fn"] == "fit" and meta["flags"]["max_epochs"] == 3 and meta["elapsed"] > 0


def test_checkpointing_can_be_switched_off_but_not_half_way(tmp_path):
    trainer = _trainer(str(tmp_path), enable_checkpointing=False)
    _fit(trainer)
    assert not list(tmp_path.rglob("*.ckpt"))
    with pytest.raises(ValueError, match="enable_checkpointing=False"):
        _trainer(str(tmp_path), enable_checkpointing=False, callbacks=[ModelCheckpoint()])


def test_test_with_the_best_checkpoint_uses_its_weights(tmp_path):
    best = ModelCheckpoint(monitor="val_loss", save_top_k=1)
    trainer = _trainer(str(tmp_path), callbacks=[best], max_epochs=4)
    state = _fit(trainer)
    path = trainer.best_model_path
    weights, _ = checkpoint.load(path)
    by_best = trainer.test(
        state, DataLoader(_data(16, 1), batch_size=8), ckpt_path="best", verbose=False
    )
    by_state = trainer.test(weights, DataLoader(_data(16, 1), batch_size=8), verbose=False)
    assert by_best == by_state
    assert (
        trainer.test(state, DataLoader(_data(16, 1), batch_size=8), ckpt_path=path, verbose=False)
        == by_best
    )


def test_ckpt_path_best_is_refused_for_fit_and_last_starts_fresh_without_checkpoints(tmp_path):
    messages = []
    trainer = _trainer(str(tmp_path))
    trainer._printer = messages.append
    with pytest.raises(ValueError, match="not fit"):
        _fit(trainer, ckpt_path="best")
    state = _fit(_trainer(str(tmp_path / "fresh")), ckpt_path=None)
    trainer = _trainer(str(tmp_path / "fresh2"))
    trainer._printer = messages.append
    again = _fit(trainer, ckpt_path="last")
    assert any("no checkpoint yet: starting fresh" in m for m in messages)
    tree.assert_trees_equal(again.params, state.params)


@pytest.mark.parametrize(
    ("ckpt_path", "hint"),
    [
        ("lastt", " (did you mean 'last'?)"),
        ("LAST", " (did you mean 'last'?)"),
        ("hpc", " ('hpc' is Lightning's SLURM checkpoint keyword, not available yet)"),
        ("nowhere/x.ckpt", ""),
        ("last.ckpt", ""),  # a file name, not a misspelt keyword
    ],
)
def test_fit_with_a_missing_ckpt_path_names_the_keywords(tmp_path, ckpt_path, hint):
    expected = f"ckpt_path={ckpt_path!r}: no checkpoint at {ckpt_path}{hint}; "
    expected += "fit takes a checkpoint path or 'last'"
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(expected)}$"):
        _fit(_trainer(str(tmp_path)), ckpt_path=ckpt_path)
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before anything trained


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
@pytest.mark.parametrize(
    ("ckpt_path", "hint"),
    [("lastt", " (did you mean 'last'?)"), ("bset", " (did you mean 'best'?)"), ("x.ckpt", "")],
)
def test_evaluating_a_missing_ckpt_path_names_the_keywords(tmp_path, fn, ckpt_path, hint):
    trainer = _trainer(str(tmp_path))
    expected = f"no checkpoint at {ckpt_path}{hint}; {fn} takes a checkpoint path, "
    expected += "'last' or 'best'"
    with pytest.raises(FileNotFoundError, match=re.escape(expected)):
        getattr(trainer, fn)(
            mlp(), DataLoader(_data(8), batch_size=8), fn=_loss, ckpt_path=ckpt_path
        )


@pytest.mark.bitwise
def test_resuming_from_a_path_continues_and_a_wrong_model_is_refused(tmp_path):
    trainer = _trainer(str(tmp_path), max_epochs=1)
    _fit(trainer)
    path = trainer.best_model_path
    longer = _trainer(str(tmp_path), max_epochs=2)
    state = _fit(longer, ckpt_path=path)
    assert state.progress.epoch == 2 and state.progress.step == 8
    other = _trainer(str(tmp_path), max_epochs=2)
    mismatch = r"(?s)params: .*shape \(16,\) in the checkpoint, \(5,\) in the target"
    with pytest.raises(checkpoint.CheckpointError, match=mismatch):
        other.fit(
            torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)),
            _loss,
            optim.adam(1e-2),
            DataLoader(_data(), batch_size=8),
            ckpt_path=path,
        )


def test_save_checkpoint_and_weights_only_files(tmp_path):
    trainer = _trainer(str(tmp_path), enable_checkpointing=False)
    state = _fit(trainer)
    trainer.save_checkpoint(str(tmp_path / "full.ckpt"))
    trainer.save_checkpoint(str(tmp_path / "weights.ckpt"), weights_only=True)
    full, _ = checkpoint.load(str(tmp_path / "full.ckpt"))
    tree.assert_trees_equal(full, state)
    weights, meta = checkpoint.load(str(tmp_path / "weights.ckpt"))
    assert meta["weights_only"] and set(weights) == {"weights_only", "params", "buffers"}
    with pytest.raises(checkpoint.CheckpointError, match="weights only and cannot resume"):
        _fit(_trainer(str(tmp_path)), ckpt_path=str(tmp_path / "weights.ckpt"))
    net = mlp()
    fresh = engine.init(net, optim.sgd(0.1))
    loaded = checkpoint.load_weights(fresh, checkpoint.export_state_dict(state, net), net)
    tree.assert_trees_equal(loaded.params, state.params)


@pytest.mark.bitwise
def test_async_checkpointing_writes_the_same_states(tmp_path):
    sync_cb = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    async_cb = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    _fit(_trainer(str(tmp_path / "sync"), callbacks=[sync_cb]))
    _fit(_trainer(str(tmp_path / "async"), callbacks=[async_cb], async_checkpoint=True))
    names = sorted(p.name for p in (tmp_path / "sync").rglob("*.ckpt"))
    assert names == sorted(p.name for p in (tmp_path / "async").rglob("*.ckpt"))
    assert len(names) == 6
    for name in names:
        a, _ = checkpoint.load(str(next((tmp_path / "sync").rglob(name))))
        b, _ = checkpoint.load(str(next((tmp_path / "async").rglob(name))))
        a_cb, b_cb = a.callbacks.pop("ModelCheckpoint"), b.callbacks.pop("ModelCheckpoint")
        tree.assert_trees_equal(a, b)  # the callback's paths name each run's own folder
        assert os.path.basename(a_cb["last_checkpoint_saved"]) == name
        assert os.path.basename(b_cb["last_checkpoint_saved"]) == name


def test_save_last_link_points_at_the_latest_checkpoint(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1, save_last="link")
    _fit(_trainer(str(tmp_path), callbacks=[cb]))
    last = next(tmp_path.rglob("last.ckpt"))
    assert last.is_symlink()
    assert os.readlink(last) == "epoch=2-step=12.ckpt"
    loaded, _ = checkpoint.load(str(last))
    assert loaded.progress.step == 12


# ------------------------------------------------------------------ restoring, reading, cleaning


class _Rank1(engine.Strategy):
    rank = 1
    world_size = 2


def _checkpointing(root, strategy=None):
    return Checkpointing(
        strategy=strategy or engine.Strategy(), loggers=[], config=None, root_dir=str(root)
    )


def _mid_window_checkpoint(path):
    """A state saved inside an accumulation window, and the model and optimizer it trains."""
    net, opt = mlp(), optim.adam(1e-2)
    state = engine.init(net, opt, seed=2)
    step = engine.train_step(net, _loss, opt, accumulate=3)
    x, y = _data(8).tensors
    for i in range(4):
        state, _ = step(state, (x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]))
    assert state.progress.micro_step == 1
    checkpoint.save(state.replace(extra={"loop": {"epoch": 0}}), path)
    return net, opt, state


def test_restores_keep_the_fresh_states_devices_and_the_files_position(tmp_path):
    path = str(tmp_path / "window.ckpt")
    net, opt, state = _mid_window_checkpoint(path)
    fresh = tree.to_device(engine.init(net, opt), "meta")  # as a strategy would place it
    restored, meta = _checkpointing(tmp_path).restore(path, fresh)
    for part in (restored.params, restored.opt_state, restored.grad_accum):
        devices = {t.device.type for t in tree.leaves(part) if isinstance(t, torch.Tensor)}
        assert devices == {"meta"}
    tree.assert_trees_equal(restored.progress, state.progress)
    assert restored.rng == state.rng and restored.extra == {"loop": {"epoch": 0}}
    assert "versions" in meta
    evaluated = _checkpointing(tmp_path).load_for_eval(path, fresh)
    assert {t.device.type for t in evaluated.params.values()} == {"meta"}
    assert evaluated.opt_state is fresh.opt_state


def test_resuming_from_last_reads_the_checkpoint_once(tmp_path, monkeypatch):
    _fit(_trainer(str(tmp_path), max_epochs=1))
    loads = []
    original = torch.load

    def counting(*args, **kwargs):
        loads.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    trainer = _trainer(str(tmp_path), max_epochs=2)
    state = _fit(trainer, ckpt_path="last")
    assert state.progress.epoch == 2 and len(loads) == 1
    loads.clear()
    trainer.test(state, DataLoader(_data(16, 1), batch_size=8), ckpt_path="last", verbose=False)
    assert len(loads) == 1


def test_partial_files_are_removed_before_resuming_and_before_writing(tmp_path):
    _fit(_trainer(str(tmp_path / "run"), max_epochs=1))
    folder = tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints"
    leftover = folder / ".epoch=0-step=4.ckpt.tmp-dead"
    leftover.write_bytes(b"half a checkpoint")
    os.utime(leftover, (0, 0))  # its name names no writer: removed once it is stale
    messages = []
    trainer = _trainer(str(tmp_path / "run"), max_epochs=2)
    trainer._printer = messages.append
    _fit(trainer, ckpt_path="last")
    assert not leftover.exists()
    assert any("Removed 1 partial checkpoint file" in m for m in messages)

    own = tmp_path / "own"
    own.mkdir()
    (own / ".a.ckpt.tmp-dead").write_bytes(b"x")
    os.utime(own / ".a.ckpt.tmp-dead", (0, 0))
    _fit(_trainer(str(tmp_path / "run2"), callbacks=[ModelCheckpoint(dirpath=str(own))]))
    assert not (own / ".a.ckpt.tmp-dead").exists() and list(own.glob("*.ckpt"))


def test_only_the_primary_process_removes_partial_files(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    leftover = folder / ".a.ckpt.tmp-dead"
    leftover.write_bytes(b"x")
    os.utime(leftover, (0, 0))
    assert _checkpointing(tmp_path, _Rank1()).resolve("last", [], None, fn="fit") is None
    assert leftover.exists()
    assert _checkpointing(tmp_path).resolve("last", [], None, fn="fit") is None
    assert not leftover.exists()


def test_last_skips_weights_only_files_and_finds_named_versions(tmp_path):
    weights = ModelCheckpoint(
        name="weights", save_weights_only=True, every_n_train_steps=1, save_top_k=-1
    )
    full = ModelCheckpoint(name="full", every_n_epochs=1)
    root = str(tmp_path)
    first = _trainer(
        root, max_epochs=1, logger=CSVLogger(root, version="run_a"), callbacks=[full, weights]
    )
    _fit(first)
    messages = []
    again = _trainer(
        root, max_epochs=2, logger=CSVLogger(root, version="run_a"), callbacks=[full, weights]
    )
    again._printer = messages.append
    state = _fit(again, ckpt_path="last")  # newest files are weights-only: skipped
    assert any(
        "Restored the training state from" in m and "epoch=0-step=4.ckpt" in m for m in messages
    )
    assert state.progress.epoch == 2


def test_preemption_writes_into_this_runs_folder(tmp_path):
    import signal

    from purestep.loops.callbacks import LambdaCallback
    from purestep.loops.resume import Preempted

    root = str(tmp_path)
    for old in ("version_0", "version_2", "version_10"):
        (tmp_path / "lightning_logs" / old).mkdir(parents=True)

    def preempt(ctx):
        if ctx.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer = _trainer(
        root,
        enable_checkpointing=False,
        callbacks=[LambdaCallback(on_train_batch_end=preempt)],
    )
    trainer._printer = lambda s: None
    with pytest.raises(Preempted) as info:
        _fit(trainer)
    assert info.value.code == 75
    assert info.value.path.endswith("lightning_logs/version_11/checkpoints/last.ckpt")
    assert checkpoint.load(info.value.path)[0].progress.step == 2


def test_a_missing_monitor_fails_at_the_first_validation_listing_the_metrics(tmp_path):
    cb = ModelCheckpoint(monitor="val_accuracy")
    trainer = _trainer(str(tmp_path), callbacks=[cb], max_epochs=3)
    with pytest.raises(RuntimeError, match=r"val_accuracy.*'val_loss'") as err:
        _fit(trainer)
    assert trainer.current_epoch == 0  # at the end of the first epoch, not after the run
    assert "'train_loss'" in str(err.value) and not list(tmp_path.rglob("*.ckpt"))
    # without validation data it cannot appear later either, but Lightning only warns: once
    messages = []
    quiet = _trainer(str(tmp_path / "b"), callbacks=[ModelCheckpoint(monitor="val_accuracy")])
    quiet._printer = messages.append
    quiet.fit(mlp(), _loss, optim.adam(1e-2), DataLoader(_data(), batch_size=8))
    assert sum("val_accuracy" in m for m in messages) == 1
    assert not list((tmp_path / "b").rglob("*.ckpt"))


def test_the_callbacks_bookkeeping_attributes_after_fit_and_after_a_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative root: the attributes are absolute paths
    cb = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)
    assert cb.best_model_path == "" and cb.best_model_score is None
    trainer = _trainer("runs", callbacks=[cb], max_epochs=3)
    state = _fit(trainer)
    folder = tmp_path / "runs" / "lightning_logs" / "version_0" / "checkpoints"
    kept = state.callbacks[cb.key]
    assert set(cb.best_k_models) == {str(folder / n) for n in kept["best_k_models"]}
    assert all(os.path.isfile(p) for p in cb.best_k_models)
    assert cb.best_model_path == trainer.best_model_path == str(folder / kept["best_model_path"])
    assert cb.best_model_score == torch.tensor(kept["best_model_score"])
    assert cb.best_model_score == min(cb.best_k_models.values())
    assert cb.kth_best_model_path == str(folder / kept["kth_best_model_path"])
    assert cb.kth_value == max(cb.best_k_models.values())
    assert cb.last_model_path == str(folder / "last.ckpt") and os.path.isfile(cb.last_model_path)
    assert cb.current_score is not None
    # a resumed run (a new trainer, a new callback) shows the restored and updated bookkeeping
    again = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)
    longer = _trainer("runs", callbacks=[again], max_epochs=4)
    resumed = _fit(longer, ckpt_path=cb.last_model_path)
    bookkeeping = resumed.callbacks[again.key]
    assert again.best_model_path == str(folder / bookkeeping["best_model_path"])
    assert set(again.best_k_models) == {str(folder / n) for n in bookkeeping["best_k_models"]}
    assert again.best_model_score == torch.tensor(bookkeeping["best_model_score"])
    assert again.last_model_path == cb.last_model_path
