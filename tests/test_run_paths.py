"""Nothing a checkpoint holds makes a resumed run touch paths outside its run folder.

The checkpoint callback's bookkeeping is kept as names relative to its folder, which is
configuration: crafted entries (absolute paths, ``..``, another ``dirpath``, symlinks out of
the folder) are dropped or left alone, logger versions must be plain, and a moved run folder
resumes in its new place.
"""

from __future__ import annotations

import os
import shutil

import pytest
from torch.utils.data import DataLoader

from purestep.engine import Strategy, checkpoint, optim
from purestep.loops import Trainer
from purestep.loops.callbacks import ModelCheckpoint
from purestep.loops.loggers import CSVLogger, TensorBoardLogger
from purestep.loops.loggers.folders import RunFolder, check_version
from purestep.loops.resume import Checkpointing
from tests.helpers import mlp, sign_data
from tests.helpers import sign_loss as _loss


def _data(n=16, seed=0):
    return sign_data(n, seed)


KEY = "ModelCheckpoint"


def _fit(root, cb, *, max_epochs, said=None, **kwargs):
    trainer = Trainer(
        default_root_dir=str(root),
        logger=CSVLogger(str(root)),
        callbacks=[cb],
        max_epochs=max_epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer._printer = said.append if said is not None else lambda s: None
    trainer.fit(
        mlp(),
        _loss,
        optim.sgd(0.1),
        DataLoader(_data(), batch_size=8),
        DataLoader(_data(8, 1), batch_size=8),
        **kwargs,
    )
    return trainer


def _folder(root):
    return root / "lightning_logs" / "version_0" / "checkpoints"


def _craft(src, dst, *, callback=None, loggers=None):
    """Re-save the checkpoint ``src`` as ``dst`` with edited plain data."""
    state, meta = checkpoint.load(str(src))
    if callback is not None:
        cbs = dict(state.callbacks)
        cbs[KEY] = callback(dict(cbs[KEY]))
        state = state.replace(callbacks=cbs)
    if loggers is not None:
        meta = {**meta, "loggers": loggers}
    checkpoint.save(state, str(dst), metadata=meta)
    return str(dst)


def _sentinel(path, text="keep me"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _monitored():
    return ModelCheckpoint(monitor="val_loss", save_top_k=1, save_last=True)


def test_bookkeeping_pointing_outside_the_run_is_dropped_and_nothing_there_is_deleted(
    tmp_path,
):
    root = tmp_path / "run"
    _fit(root, _monitored(), max_epochs=1)
    outside = tmp_path / "outside"
    victims = [_sentinel(outside / f"victim{i}.ckpt") for i in range(3)]
    dotted = os.path.relpath(victims[2], _folder(root))  # "../../../../outside/victim2.ckpt"
    assert dotted.startswith("..")

    def edit(state):
        best_k = {str(victims[0]): 1e9, dotted: 1e9}
        return {
            **state,
            "best_k_models": best_k,
            "kth_best_model_path": str(victims[0]),
            "kth_value": 1e9,
            "best_model_path": dotted,
            "best_model_score": 1e9,
            "last_model_path": str(victims[1]),
            "last_checkpoint_saved": str(victims[1]),
        }

    crafted = _craft(_folder(root) / "last.ckpt", tmp_path / "crafted.ckpt", callback=edit)
    said: list[str] = []
    trainer = _fit(root, _monitored(), max_epochs=3, said=said, ckpt_path=crafted)
    assert all(v.read_text() == "keep me" for v in victims)
    assert any("ignoring 3 restored path(s)" in s for s in said), "\n".join(said)
    saved = trainer.train_state.callbacks[KEY]
    assert all("/" not in name for name in [*saved["best_k_models"], saved["best_model_path"]])
    names = {p.name for p in _folder(root).iterdir()}
    # the first run's best is kept: the crafted state no longer names it
    assert {"last.ckpt", "epoch=0-step=2.ckpt", saved["best_model_path"]} <= names
    assert len(names) <= 4 and all(n.endswith(".ckpt") for n in names)


def test_an_absolute_dirpath_in_the_state_redirects_nothing(tmp_path):
    root = tmp_path / "run"
    _fit(root, ModelCheckpoint(), max_epochs=1)
    elsewhere = tmp_path / "elsewhere"
    theirs = _sentinel(elsewhere / "epoch=0-step=2.ckpt")

    def edit(state):  # the old format: full paths and the folder
        return {
            **state,
            "dirpath": str(elsewhere),
            "best_model_path": str(theirs),
            "last_checkpoint_saved": str(theirs),
        }

    start = _folder(root) / "epoch=0-step=2.ckpt"
    crafted = _craft(start, tmp_path / "crafted.ckpt", callback=edit)
    _fit(root, ModelCheckpoint(), max_epochs=2, ckpt_path=crafted)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["epoch=0-step=2.ckpt"]
    assert theirs.read_text() == "keep me"
    # "epoch=0-step=2.ckpt" is taken to mean this folder's file of that name: rotated out
    assert sorted(p.name for p in _folder(root).iterdir()) == ["epoch=1-step=4.ckpt"]


def test_a_symlink_out_of_the_checkpoint_folder_is_not_deleted(tmp_path):
    root = tmp_path / "run"
    _fit(root, _monitored(), max_epochs=1)
    target = _sentinel(tmp_path / "outside" / "precious.bin")
    link = _folder(root) / "epoch=7-step=1.ckpt"
    link.symlink_to(target)

    def edit(state):
        name = link.name
        return {
            **state,
            "best_k_models": {name: 1e9},
            "kth_best_model_path": name,
            "kth_value": 1e9,
            "best_model_path": name,
            "best_model_score": 1e9,
        }

    crafted = _craft(_folder(root) / "last.ckpt", tmp_path / "crafted.ckpt", callback=edit)
    with pytest.warns(UserWarning, match="symbolic link to .*outside"):
        _fit(root, _monitored(), max_epochs=2, ckpt_path=crafted)
    assert link.is_symlink() and target.read_text() == "keep me"


def _checkpointing(root):
    return Checkpointing(strategy=Strategy(), loggers=[], config=None, root_dir=str(root))


def test_the_remover_deletes_regular_files_and_links_inside_the_folder_only(tmp_path):
    folder = tmp_path / "ckpts"
    regular = _sentinel(folder / "a.ckpt")
    inside = folder / "last.ckpt"
    inside.symlink_to("a.ckpt")
    remover = _checkpointing(tmp_path)
    remover.remove(str(inside))
    assert not inside.exists() and regular.exists()
    remover.remove(str(regular))
    assert not regular.exists()
    (folder / "d.ckpt").mkdir()
    with pytest.warns(UserWarning, match="not a regular file"):
        remover.remove(str(folder / "d.ckpt"))
    assert (folder / "d.ckpt").is_dir()


def _subfolders(**kwargs):
    return ModelCheckpoint(filename="{epoch}/{step}", save_top_k=1, **kwargs)


def test_an_evicted_file_in_a_subfolder_that_links_out_is_not_deleted(tmp_path):
    root = tmp_path / "run"
    _fit(root, _subfolders(save_last=True), max_epochs=1)
    folder = _folder(root)
    assert (folder / "epoch=0" / "step=2.ckpt").is_file()
    outside = tmp_path / "outside"
    shutil.move(str(folder / "epoch=0"), str(outside))  # the subfolder now links out
    (folder / "epoch=0").symlink_to(outside, target_is_directory=True)
    with pytest.warns(UserWarning, match=r"step=2\.ckpt: its folder is .*outside, outside"):
        _fit(root, _subfolders(save_last=True), max_epochs=2, ckpt_path=str(folder / "last.ckpt"))
    assert (outside / "step=2.ckpt").is_file()  # evicted, but not this folder's to delete
    assert (folder / "epoch=1" / "step=4.ckpt").is_file()
    remover = _checkpointing(tmp_path)
    remover._save_folders = [str(folder)]
    with pytest.warns(UserWarning, match="outside the checkpoint folder"):
        remover.remove(str(folder / "epoch=0" / "step=2.ckpt"))
    assert (outside / "step=2.ckpt").is_file()
    remover.remove(str(folder / "epoch=1" / "step=4.ckpt"))  # a real subfolder: deleted
    assert not (folder / "epoch=1" / "step=4.ckpt").exists()


def test_the_last_link_into_a_subfolder_is_the_librarys_own(tmp_path, recwarn):
    root = tmp_path / "run"
    _fit(root, _subfolders(save_last="link"), max_epochs=2)
    folder = _folder(root)
    last = folder / "last.ckpt"
    assert os.readlink(last) == os.path.join("epoch=1", "step=4.ckpt")
    assert not (folder / "epoch=0" / "step=2.ckpt").exists()  # evicted
    _fit(root, _subfolders(save_last="link"), max_epochs=3, ckpt_path="last")
    assert os.readlink(last) == os.path.join("epoch=2", "step=6.ckpt")
    assert checkpoint.load(str(last))[0].progress.epoch == 3
    assert not [w for w in recwarn if "not deleting" in str(w.message)]
    remover = _checkpointing(tmp_path)
    remover._save_folders = [str(folder)]
    remover.remove(str(last))  # a link to a file inside the folder: deleted, without a warning
    assert not [w for w in recwarn if "not deleting" in str(w.message)]
    assert not os.path.lexists(last) and (folder / "epoch=2" / "step=6.ckpt").is_file()


def test_a_directory_at_last_ckpt_is_not_replaced_by_the_link(tmp_path):
    folder = tmp_path / "ckpts"
    _fit(tmp_path / "run", ModelCheckpoint(dirpath=str(folder), save_last="link"), max_epochs=2)
    (folder / "last.ckpt").unlink()  # the resumed state still names it as its last
    _sentinel(folder / "last.ckpt" / "theirs.txt")
    start = str(folder / "epoch=1-step=4.ckpt")
    cb = ModelCheckpoint(dirpath=str(folder), save_last="link")
    with pytest.warns(UserWarning, match=r"not linking .*last\.ckpt to .*: it is a directory"):
        _fit(tmp_path / "run", cb, max_epochs=3, ckpt_path=start)
    assert (folder / "last.ckpt" / "theirs.txt").read_text() == "keep me"
    assert (folder / "epoch=2-step=6.ckpt").is_file()
    with pytest.warns(UserWarning, match="it is a directory"):
        Checkpointing.link(str(folder / "epoch=2-step=6.ckpt"), str(folder / "last.ckpt"))
    assert (folder / "last.ckpt").is_dir()


@pytest.mark.parametrize("version", ["../../x", "..", "a\\b", "x\x00", "/abs", 1.5, True])
def test_a_logger_version_must_be_plain(tmp_path, version):
    for logger in (CSVLogger(str(tmp_path)), TensorBoardLogger(str(tmp_path))):
        with pytest.raises(ValueError, match="not a plain version"):
            logger.restore({"version": version, "rows": 0, "step": None})
    assert not (tmp_path / "x").exists()
    with pytest.raises((TypeError, ValueError)):
        check_version(version)


def test_a_plain_logger_version_is_adopted(tmp_path):
    folder = RunFolder(str(tmp_path), "exp")
    folder.adopt("run-a")
    assert folder.log_dir == str(tmp_path / "exp" / "run-a")
    folder.adopt(3)
    assert folder.log_dir == str(tmp_path / "exp" / "version_3")


def test_a_resume_with_a_crafted_logger_version_fails_clearly(tmp_path):
    root = tmp_path / "run"
    _fit(root, ModelCheckpoint(), max_epochs=1)
    start = _folder(root) / "epoch=0-step=2.ckpt"
    crafted = _craft(start, tmp_path / "crafted.ckpt", loggers=[{"version": "../../x", "rows": 0}])
    with pytest.raises(ValueError, match="not a plain version"):
        _fit(root, ModelCheckpoint(), max_epochs=2, ckpt_path=crafted)
    assert not (tmp_path / "x").exists()


def test_a_moved_run_folder_resumes_in_its_new_place(tmp_path):
    old, new = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    _fit(old, ModelCheckpoint(save_last=True), max_epochs=2)
    assert sorted(p.name for p in _folder(old).iterdir()) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    shutil.move(str(old), str(new))
    trainer = _fit(new, ModelCheckpoint(save_last=True), max_epochs=4, ckpt_path="last")
    assert not old.exists()  # the old path is not recreated
    # the top-1 rotation deleted the moved run's file in the new folder
    assert sorted(p.name for p in _folder(new).iterdir()) == ["epoch=3-step=8.ckpt", "last.ckpt"]
    assert sorted(p.name for p in (new / "lightning_logs").iterdir()) == ["version_0"]
    assert trainer.logger.version == 0
    cb = trainer.checkpoint_callback
    best = trainer.train_state.callbacks[KEY]["best_model_path"]
    assert cb.full_path(best, trainer.log_dir) == str(_folder(new) / "epoch=3-step=8.ckpt")
    state, _ = checkpoint.load(str(_folder(new) / "last.ckpt"))
    assert state.progress.epoch == 4
    val = DataLoader(_data(8, 1), batch_size=8)
    trainer.validate(trainer.train_state, val, ckpt_path="best", verbose=False)  # new folder
    assert not old.exists()
