"""MLFlowLogger against real MLflow stores (a local ``file:`` store and a ``sqlite:///`` one).

Everything is read back with MLflow's own ``MlflowClient``: parameters, tags, metric
histories with their steps, artifacts, and the resumed run's history, which must equal an
uninterrupted run's point for point. Skipped when the ``mlflow`` extra is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
pytest.importorskip("alembic")

from mlflow.tracking import MlflowClient

from purestep.engine import optim
from purestep.loops import Trainer
from purestep.loops.callbacks import ModelCheckpoint
from purestep.loops.loggers import CSVLogger, MLFlowLogger
from tests.helpers import mlp
from tests.helpers import sign_data as _data
from tests.helpers import sign_loss as _loss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _mlflow_env(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("GIT_PYTHON_REFRESH", "quiet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


@pytest.fixture(params=["file", "sqlite"])
def uri(request, tmp_path):
    if request.param == "file":
        return f"file:{tmp_path / 'mlruns'}"
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def all_histories(client, run_id):
    keys = client.get_run(run_id).data.metrics
    return {k: sorted(history(client, run_id, k)) for k in keys}


def test_params_metrics_tags_read_back(uri):
    logger = MLFlowLogger(
        experiment_name="exp", run_name="first", tracking_uri=uri, tags={"team": "a", "n": 3}
    )
    logger.log_hyperparams({"lr": 0.1, "opt": {"name": "adam", "betas": (0.9, 0.99)}, "x": None})
    logger.log_metrics({"loss": torch.tensor(0.5), "epoch": 0}, step=0)
    logger.log_metrics({"loss": 0.25, "acc": 1.0}, step=3)
    logger.save()
    logger.finalize("success")

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("exp")
    assert logger.name == experiment.experiment_id
    run = client.get_run(logger.version)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "first"
    assert run.data.params == {
        "lr": "0.1",
        "opt/name": "adam",
        "opt/betas": "[0.9, 0.99]",
        "x": "None",
    }
    assert run.data.tags["team"] == "a" and run.data.tags["n"] == "3"
    assert history(client, logger.run_id, "loss") == [(0, 0.5), (3, 0.25)]
    assert history(client, logger.run_id, "acc") == [(3, 1.0)]
    assert history(client, logger.run_id, "epoch") == [(0, 0.0)]


def test_prefix_hparam_metrics_status_and_save_dir(tmp_path):
    logger = MLFlowLogger(save_dir=tmp_path / "runs", prefix="p")
    assert logger.save_dir == str(tmp_path / "runs")
    logger.log_hyperparams({"a": 1}, metrics={"hp": 2.0})
    logger.log_metrics({"m": 1.0}, step=1)
    logger.finalize("interrupted")
    client = MlflowClient(tracking_uri=logger.tracking_uri)
    assert client.get_experiment_by_name("lightning_logs") is not None
    assert history(client, logger.run_id, "p-hp") == [(0, 2.0)]
    assert history(client, logger.run_id, "p-m") == [(1, 1.0)]
    assert client.get_run(logger.run_id).info.status == "KILLED"
    assert MLFlowLogger(tracking_uri="sqlite:///x.db").save_dir is None


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="log_model"):
        MLFlowLogger(save_dir=tmp_path, log_model="best")
    with pytest.raises(TypeError, match="tags"):
        MLFlowLogger(save_dir=tmp_path, tags=["a"])
    logger = MLFlowLogger(save_dir=tmp_path)
    with pytest.raises(ValueError, match="finalize status"):
        logger.finalize("done")
    with pytest.raises(ValueError, match="run_id"):
        logger.restore({"run_id": 3})


def test_resume_in_process_skips_points_logged_again_and_keeps_the_rest(uri):
    first = MLFlowLogger(tracking_uri=uri)
    for step in range(4):
        first.log_metrics({"a": float(step)}, step)
    state = first.state()
    for step in range(4, 7):  # logged after the checkpoint, then "killed"
        first.log_metrics({"a": float(step), "b": 1.0}, step)

    resumed = MLFlowLogger(tracking_uri=uri)
    resumed.restore(state)
    for step in range(4, 9):  # the same values again, then new ones
        resumed.log_metrics({"a": float(step), "b": 1.0}, step)
    resumed.finalize("success")
    client = MlflowClient(tracking_uri=uri)
    assert resumed.run_id == first.run_id
    assert client.get_run(first.run_id).info.status == "FINISHED"
    assert sorted(history(client, first.run_id, "a")) == [(s, float(s)) for s in range(9)]
    assert sorted(history(client, first.run_id, "b")) == [(s, 1.0) for s in range(4, 9)]

    # a point the resumed run does not repeat stays, with a warning at the end
    again = MLFlowLogger(tracking_uri=uri)
    again.restore(resumed.state())
    again.truncate_after(6)
    again.log_metrics({"a": 7.0, "b": 1.0}, 7)  # repeats step 7 but not step 8
    again.log_metrics({"a": 9.0}, 9)
    with pytest.warns(UserWarning, match="not logged again"):
        again.finalize("success")
    assert sorted(history(client, first.run_id, "a")) == [(s, float(s)) for s in range(10)]


def test_a_stride0_tensor_param_is_summarised_not_expanded(tmp_path):
    huge = torch.zeros(1).expand(2**27)  # 4 bytes of storage, 2**27 values
    logger = MLFlowLogger(save_dir=tmp_path)
    logger.log_hyperparams({"w": huge, "b": torch.zeros(1).expand(2)})
    params = MlflowClient(tracking_uri=logger.tracking_uri).get_run(logger.run_id).data.params
    assert params["w"].startswith("<Tensor shape=(134217728,) dtype=torch.float32")
    assert params["b"] == "[0.0, 0.0]"


def test_a_run_id_from_another_experiment_is_refused(uri):
    """A checkpoint's logger state (or a run_id given with an experiment_name) naming a run
    of another experiment of the same store: refused before anything is logged into it."""
    other = MLFlowLogger(experiment_name="other", tracking_uri=uri)
    other.log_metrics({"a": 1.0}, 0)
    other.finalize("success")
    mine = MLFlowLogger(experiment_name="mine", tracking_uri=uri)
    mine.log_metrics({"a": 5.0}, 0)
    mine.finalize("success")
    client = MlflowClient(tracking_uri=uri)
    state = {"run_id": other.run_id, "timestamp": 0}
    refused = [
        (MLFlowLogger(experiment_name="mine", tracking_uri=uri), r"'mine' \(id "),
        (MLFlowLogger(tracking_uri=uri), r"'lightning_logs' \(not in this store\)"),
    ]
    for logger, configured in refused:
        logger.restore(state)
        with pytest.raises(ValueError, match=f"belongs to experiment 'other'.*{configured}"):
            logger.log_metrics({"a": 2.0}, 1)
    given = MLFlowLogger(experiment_name="mine", tracking_uri=uri, run_id=other.run_id)
    with pytest.raises(ValueError, match="refusing to log into another experiment's run"):
        given.log_hyperparams({"lr": 1})
    assert client.get_run(other.run_id).info.status == "FINISHED"  # not even marked running
    assert history(client, other.run_id, "a") == [(0, 1.0)]
    assert client.get_run(other.run_id).data.params == {}
    # the same experiment is accepted, and run_id= alone continues the run where it is
    again = MLFlowLogger(experiment_name="other", tracking_uri=uri)
    again.restore(state)
    again.log_metrics({"a": 2.0}, 1)
    MLFlowLogger(tracking_uri=uri, run_id=other.run_id).log_metrics({"a": 3.0}, 2)
    assert sorted(history(client, other.run_id, "a")) == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_a_refused_run_is_left_alone_by_finalize_and_the_other_loggers_still_close(tmp_path):
    """After the refusal, ``finalize`` does not ask again (nor raise): the run loop's
    finalize reaches the loggers after MLflow, and the other experiment's run keeps its
    status."""
    from purestep.loops.driver import Driver

    uri = f"file:{tmp_path / 'mlruns'}"
    other = MLFlowLogger(experiment_name="other", tracking_uri=uri)
    other.log_metrics({"a": 1.0}, 0)
    other.finalize("success")
    refused = MLFlowLogger(experiment_name="mine", tracking_uri=uri)
    refused.restore({"run_id": other.run_id, "timestamp": 0})
    with pytest.raises(ValueError, match="refusing to log into another experiment's run"):
        refused.log_metrics({"a": 2.0}, 1)
    with pytest.raises(ValueError, match="refusing"):  # refused again on every use
        refused.log_hyperparams({"lr": 1})
    csv_logger = CSVLogger(tmp_path)
    csv_logger.log_metrics({"a": 3.0}, 0)  # buffered until finalize flushes it
    Driver(fn="fit", loggers=[refused, csv_logger]).finalize("failed")
    assert os.path.isfile(csv_logger.metrics_file)
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(other.run_id).info.status == "FINISHED"
    assert history(client, other.run_id, "a") == [(0, 1.0)]


def test_restore_after_logging_is_an_error(tmp_path):
    logger = MLFlowLogger(save_dir=tmp_path)
    logger.log_metrics({"a": 1.0}, 0)
    with pytest.raises(RuntimeError, match="before anything is logged"):
        logger.restore({"run_id": logger.run_id, "timestamp": 0})
    with pytest.raises(ValueError, match="pending"):
        MLFlowLogger(save_dir=tmp_path).restore(
            {"run_id": logger.run_id, "timestamp": 0, "pending": {"a": [[1]]}}
        )


def test_restore_after_log_dir_drops_the_empty_run(uri, tmp_path):
    first = MLFlowLogger(tracking_uri=uri)
    first.log_metrics({"a": 1.0}, 0)
    state = first.state()
    first.finalize("success")
    again = MLFlowLogger(tracking_uri=uri)
    again.use_root_dir(tmp_path / "root")
    base = again.save_dir or str(tmp_path / "root")  # a file: store's folder, else the root
    assert again.root_dir == os.path.join(base, first.experiment_id)  # creates no run
    empty = os.path.basename(again.log_dir)  # creates a run, nothing written to it
    again.restore(state)
    assert again.run_id == first.run_id
    assert again.log_dir == os.path.join(base, first.experiment_id, first.run_id)
    assert MlflowClient(tracking_uri=uri).get_run(empty).info.lifecycle_stage == "deleted"


def _log(logger, steps, value=float, keys=("loss",)):
    for step in steps:
        logger.log_metrics({key: value(step) for key in keys}, step)


def test_a_second_resume_doubles_nothing(uri):
    """Run 1 logs 1..10 (checkpoint at 5) and dies; run 2 resumes, repeats 6..7, checkpoints
    at 7 and dies; run 3 resumes from 7: 8..10 of run 1 are still pending, not doubled."""
    one = MLFlowLogger(tracking_uri=uri)
    _log(one, range(1, 6), keys=("loss", "val"))
    at5 = one.state()
    _log(one, range(6, 11), keys=("loss", "val"))
    two = MLFlowLogger(tracking_uri=uri)
    two.restore(at5)
    _log(two, range(6, 8), keys=("loss", "val"))
    two.log_metrics({"new": 1.0}, 7)  # a point only the resumed run logs, before its checkpoint
    at7 = two.state()
    assert set(at7["pending"]) == {"loss", "val"}
    _log(two, range(8, 9), keys=("loss", "val"))  # killed again after step 8
    two.log_metrics({"new": 2.0}, 8)
    three = MLFlowLogger(tracking_uri=uri)
    three.restore(at7)
    _log(three, range(8, 10), keys=("loss", "val"))
    at9 = three.state()  # a third kill: the pending points of two earlier runs
    four = MLFlowLogger(tracking_uri=uri)
    four.restore(at9)
    _log(four, range(10, 12), keys=("loss", "val"))
    four.log_metrics({"new": 3.0}, 11)
    with pytest.warns(UserWarning) as caught:
        four.finalize("success")
    (message,) = [str(w.message) for w in caught if "MLflow run" in str(w.message)]
    assert "0 metric point(s) doubled" in message
    assert "1 point(s) kept from the interrupted run" in message  # run 2's "new" at 8
    client = MlflowClient(tracking_uri=uri)
    for key in ("loss", "val"):
        assert sorted(history(client, one.run_id, key)) == [(s, float(s)) for s in range(1, 12)]
    # run 2's point at step 8 was logged after its checkpoint and never repeated: it stays
    assert sorted(history(client, one.run_id, "new")) == [(7, 1.0), (8, 2.0), (11, 3.0)]


def test_non_deterministic_metric_is_logged_again_and_counted(uri):
    one = MLFlowLogger(tracking_uri=uri)
    _log(one, range(1, 6), keys=("loss", "val"))
    at5 = one.state()
    _log(one, range(6, 11), keys=("loss", "val"))
    two = MLFlowLogger(tracking_uri=uri)
    two.restore(at5)
    for step in range(6, 9):  # killed at 10; the resumed run stops at 8
        two.log_metrics({"loss": step + 0.001, "val": float(step)}, step)
    with pytest.warns(UserWarning) as caught:
        two.finalize("success")
    (message,) = [str(w.message) for w in caught if "MLflow run" in str(w.message)]
    assert "3 metric point(s) doubled" in message  # loss at 6, 7, 8
    assert "4 point(s) kept from the interrupted run" in message  # loss and val at 9, 10
    client = MlflowClient(tracking_uri=uri)
    loss = sorted(history(client, one.run_id, "loss"))
    assert loss == sorted(
        [(s, float(s)) for s in range(1, 11)] + [(s, s + 0.001) for s in range(6, 9)]
    )
    assert sorted(history(client, one.run_id, "val")) == [(s, float(s)) for s in range(1, 11)]


# --------------------------------------------------------------------------- through the Trainer


def _fit(root, loggers, ckpt_path=None, callbacks=None, **flags):
    trainer = Trainer(
        default_root_dir=root,
        logger=loggers,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **flags,
    )
    trainer.fit(
        mlp(),
        _loss,
        optim.adam(1e-2),
        DataLoader(_data(), batch_size=8),
        DataLoader(_data(16, 1), batch_size=8),
        ckpt_path=ckpt_path,
    )
    return trainer


@pytest.mark.parametrize("log_model", [True, "all"])
def test_trainer_logs_checkpoints_as_artifacts(tmp_path, log_model):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = str(tmp_path / "root")
    logger = MLFlowLogger(tracking_uri=uri, log_model=log_model)
    _fit(root, logger, max_epochs=3, callbacks=[ModelCheckpoint(save_top_k=-1)])
    folder = os.path.join(root, logger.experiment_id, logger.run_id, "checkpoints")
    assert logger.log_dir == os.path.dirname(folder)  # the run's own folder, as Lightning
    names = sorted(os.listdir(folder))
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    client = MlflowClient(tracking_uri=uri)
    listed = [a.path for a in client.list_artifacts(logger.run_id, "checkpoints")]
    assert listed == [f"checkpoints/{n}" for n in names]
    local = client.download_artifacts(logger.run_id, f"checkpoints/{names[-1]}", str(tmp_path))
    with open(local, "rb") as a, open(os.path.join(folder, names[-1]), "rb") as b:
        assert a.read() == b.read()
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert {"train_loss", "val_loss", "epoch"} <= set(run.data.metrics)


def test_trainer_without_log_model_uploads_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(tracking_uri=uri)
    _fit(str(tmp_path / "root"), logger, max_epochs=1)
    assert MlflowClient(tracking_uri=uri).list_artifacts(logger.run_id) == []


@pytest.mark.parametrize(
    "checkpoint",
    [
        "epoch=1-step=6.ckpt",  # the first fit's last: nothing to skip
        "epoch=0-step=3.ckpt",  # as if killed after step 6: steps 3-6 are logged again
    ],
)
def test_trainer_resume_continues_the_run_with_the_uninterrupted_history(uri, tmp_path, checkpoint):
    every = dict(save_top_k=-1, every_n_train_steps=3)
    # the uninterrupted run
    whole = MLFlowLogger(tracking_uri=uri, experiment_name="whole")
    _fit(str(tmp_path / "a"), whole, max_steps=11, callbacks=[ModelCheckpoint(**every)])
    # the same in two fits: to max_steps=6, then from its checkpoint to 11
    part = MLFlowLogger(tracking_uri=uri, experiment_name="parts", run_name="r")
    root = str(tmp_path / "b")
    _fit(root, [part, CSVLogger(root)], max_steps=6, callbacks=[ModelCheckpoint(**every)])
    ckpt = os.path.join(part.log_dir, "checkpoints", checkpoint)
    again = MLFlowLogger(tracking_uri=uri, experiment_name="parts", run_name="r")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(
            root,
            [again, CSVLogger(root)],
            max_steps=11,
            callbacks=[ModelCheckpoint(**every)],
            ckpt_path=ckpt,
        )
    assert not [w for w in caught if "not logged again" in str(w.message)]  # none left over
    assert again.run_id == part.run_id
    client = MlflowClient(tracking_uri=uri)
    parts = client.get_experiment_by_name("parts").experiment_id
    assert len(client.search_runs([parts])) == 1  # no second run
    expected = all_histories(client, whole.run_id)
    assert all_histories(client, part.run_id) == expected
    assert {"train_loss", "val_loss", "epoch"} <= set(expected)
    assert len(expected["train_loss"]) == 11
    steps = [s for s, _ in expected["train_loss"]]
    assert steps == sorted(set(steps))
    assert client.get_run(part.run_id).info.status == "FINISHED"


def test_trainer_second_resume_has_the_uninterrupted_history(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def every(folder):
        return [
            ModelCheckpoint(dirpath=str(tmp_path / folder), save_top_k=-1, every_n_train_steps=1)
        ]

    whole = MLFlowLogger(tracking_uri=uri, experiment_name="whole")
    _fit(str(tmp_path / "w"), whole, max_steps=10)
    root = str(tmp_path / "r")
    first = MLFlowLogger(tracking_uri=uri, experiment_name="parts")
    _fit(root, first, max_steps=10, callbacks=every("a"))  # "killed" after step 10
    second = MLFlowLogger(tracking_uri=uri, experiment_name="parts")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # it stops at 7: 8..10 left over
        _fit(
            root,
            second,
            max_steps=7,
            callbacks=every("b"),
            ckpt_path=str(tmp_path / "a" / "epoch=1-step=5.ckpt"),
        )
    third = MLFlowLogger(tracking_uri=uri, experiment_name="parts")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(
            root,
            third,
            max_steps=10,
            callbacks=every("c"),
            ckpt_path=str(tmp_path / "b" / "epoch=1-step=7.ckpt"),
        )
    assert not [w for w in caught if "MLflow run" in str(w.message)]
    assert first.run_id == second.run_id == third.run_id
    client = MlflowClient(tracking_uri=uri)
    expected = all_histories(client, whole.run_id)
    assert all_histories(client, first.run_id) == expected
    assert len(expected["train_loss"]) == 10


def test_trainer_runs_get_their_own_folders_and_last_resumes_the_newest(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = str(tmp_path / "root")
    one = MLFlowLogger(tracking_uri=uri)
    _fit(root, one, max_steps=3)
    two = MLFlowLogger(tracking_uri=uri)
    _fit(root, two, max_steps=2)  # a fresh run does not resume the first one
    assert one.run_id != two.run_id
    folders = [os.path.join(root, lg.experiment_id, lg.run_id, "checkpoints") for lg in (one, two)]
    assert os.listdir(folders[0]) == ["epoch=0-step=3.ckpt"]
    assert os.listdir(folders[1]) == ["epoch=0-step=2.ckpt"]
    assert not os.path.exists(os.path.join(root, "checkpoints"))
    three = MLFlowLogger(tracking_uri=uri)
    trainer = _fit(root, three, max_steps=4, ckpt_path="last")
    assert three.run_id == two.run_id  # the newest run folder's checkpoint, and its run
    assert trainer.log_dir == os.path.dirname(folders[1])
    assert any(n.endswith("step=4.ckpt") for n in os.listdir(folders[1]))
    client = MlflowClient(tracking_uri=uri)
    assert [s for s, _ in history(client, two.run_id, "train_loss")] == [0, 1, 2, 3]
    experiment = client.get_experiment_by_name("lightning_logs").experiment_id
    assert len(client.search_runs([experiment])) == 2  # no third run


def test_missing_extra_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    logger = MLFlowLogger(save_dir=tmp_path)  # creating it does not need mlflow
    with pytest.raises(ImportError, match=r'pip install "purestep\[mlflow\]"'):
        logger.log_metrics({"a": 1.0}, 0)


def test_importing_purestep_imports_neither_mlflow_nor_wandb():
    code = (
        "import sys, purestep, purestep.loops, purestep.loops.loggers\n"
        "from purestep.loops.loggers import MLFlowLogger, WandbLogger\n"
        "bad = [m for m in ('mlflow', 'wandb') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
