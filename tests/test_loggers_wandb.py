"""WandbLogger in offline mode, read back from the run's ``.wandb`` file.

W&B runs its own service process, so each run happens in a subprocess (time-bounded, with
``WANDB_MODE=offline``, ``WANDB_SILENT`` and every W&B folder inside pytest's ``tmp_path``:
nothing reaches the network). wandb 0.31 writes no ``config.yaml`` / ``wandb-summary.json``
for an offline run and has no Python reader of its transaction log, so the test reads the
``run-<id>.wandb`` file itself: LevelDB's log format (W&B's stable on-disk format, which
``wandb sync`` reads) holding ``wandb_internal_pb2.Record`` protobufs.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("wandb")

from wandb.proto import wandb_internal_pb2

from purestep.loops.loggers import WandbLogger

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 32768  # LevelDB log block size
HEADER = 7  # ":W&B" + magic (2 bytes) + version (1 byte); also a record header's size
FULL, LAST = 1, 4


def records(path: str) -> list:
    """The protobuf records of a ``.wandb`` file, in order."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:HEADER]
    out, chunks, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunks += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            out.append(record)
            chunks = b""
    return out


def read_run(path: str) -> dict:
    """The run id, project, display name, config and history rows of a ``.wandb`` file."""
    run, config, rows = None, {}, []
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({i.key: json.loads(i.value_json) for i in run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    config.pop("_wandb", None)
    return {
        "id": run.run_id,
        "project": run.project,
        "name": run.display_name,
        "config": config,
        "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
    }


def wandb_env(tmp_path) -> dict:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("WANDB_"):
            del env[key]
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(tmp_path),
        WANDB_CACHE_DIR=str(tmp_path / "cache"),
        WANDB_CONFIG_DIR=str(tmp_path / "config"),
        WANDB_DATA_DIR=str(tmp_path / "data"),
        WANDB_DISABLE_GIT="true",
        WANDB_DISABLE_CODE="true",
        WANDB_CONSOLE="off",
        WANDB_X_DISABLE_STATS="true",
        WANDB__DISABLE_STATS="true",
        GIT_PYTHON_REFRESH="quiet",
        PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
    )
    return env


def run_python(code: str, tmp_path, timeout: int = 180) -> str:
    try:
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=str(tmp_path),
            env=wandb_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as error:  # the child is killed by subprocess.run
        pytest.fail(f"the W&B subprocess took over {timeout}s: {error.stderr!r}")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def run_files(tmp_path, run_id: str) -> list[str]:
    return sorted(glob.glob(str(tmp_path / "logs" / "wandb" / f"offline-run-*-{run_id}")))


def test_offline_run_records_project_name_config_and_steps(tmp_path):
    out = run_python(
        """
        import torch
        from purestep.loops.loggers import WandbLogger
        logger = WandbLogger(name="first", project="proj", save_dir="logs", offline=True,
                             prefix="p")
        logger.log_hyperparams({"lr": 0.1, "opt": {"name": "adam"}, "sizes": (1, 2)})
        logger.log_metrics({"loss": torch.tensor(0.5), "epoch": 0}, step=0)
        logger.log_metrics({"loss": 0.25}, step=3)
        logger.log_metrics({"val": 1.0}, step=3)  # a second row at the same step
        print(logger.state()["id"])
        logger.finalize("success")
        logger.finalize("success")  # finishing twice is harmless
        """,
        tmp_path,
    )
    run_id = out.strip().splitlines()[-1]
    (folder,) = run_files(tmp_path, run_id)
    run = read_run(os.path.join(folder, f"run-{run_id}.wandb"))
    assert run["id"] == run_id and run["project"] == "proj" and run["name"] == "first"
    assert run["config"] == {"lr": 0.1, "opt": {"name": "adam"}, "sizes": [1, 2]}
    assert run["rows"] == [
        {"p-loss": 0.5, "p-epoch": 0, "trainer/global_step": 0},
        {"p-loss": 0.25, "trainer/global_step": 3},
        {"p-val": 1.0, "trainer/global_step": 3},
    ]


def test_resume_continues_the_same_run_id(tmp_path):
    # two processes, as a killed run and its resume
    out = run_python(
        """
        import json
        from purestep.loops.loggers import WandbLogger
        first = WandbLogger(project="proj", save_dir="logs", offline=True)
        for step in range(3):
            first.log_metrics({"a": float(step)}, step)
        print(json.dumps(first.state()))
        first.finalize("interrupted")
        """,
        tmp_path,
    )
    state = json.loads(out.strip().splitlines()[-1])
    assert (state["step"], state["wandb_step"]) == (2, 3)
    out = run_python(
        f"""
        from purestep.loops.loggers import WandbLogger
        again = WandbLogger(project="proj", save_dir="logs", offline=True)
        again.restore({state!r})
        for step in range(3, 5):
            again.log_metrics({{"a": float(step)}}, step)
        print(again.version)
        again.finalize("success")
        """,
        tmp_path,
    )
    assert out.strip().splitlines()[-1] == state["id"]
    files = sorted(glob.glob(str(tmp_path / "logs" / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert files and all(f.endswith(f"-{state['id']}.wandb") for f in files)
    runs = [read_run(f) for f in files]
    assert {run["id"] for run in runs} == {state["id"]}
    steps = sorted(r["trainer/global_step"] for run in runs for r in run["rows"])
    assert steps == [0, 1, 2, 3, 4]


def test_trainer_logs_to_wandb_offline(tmp_path):
    out = run_python(
        """
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        from purestep.engine import optim
        from purestep.loops import Trainer
        from purestep.loops.loggers import WandbLogger
        from tests.helpers import mlp
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
        def loss(apply, batch):
            x, y = batch
            return torch.nn.functional.cross_entropy(apply(x), y)
        logger = WandbLogger(project="proj", save_dir="logs", offline=True)
        trainer = Trainer(default_root_dir="root", logger=logger, max_epochs=2,
                          log_every_n_steps=1, enable_progress_bar=False,
                          enable_model_summary=False)
        trainer.fit(mlp(), loss, optim.adam(1e-2), data, data)
        print(logger.version)
        """,
        tmp_path,
    )
    run_id = out.strip().splitlines()[-1]
    (folder,) = run_files(tmp_path, run_id)
    rows = read_run(os.path.join(folder, f"run-{run_id}.wandb"))["rows"]
    train = [r["trainer/global_step"] for r in rows if "train_loss" in r]
    assert train == list(range(8))
    assert len([r for r in rows if "val_loss" in r]) == 2


def test_missing_extra_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    logger = WandbLogger(save_dir=tmp_path, offline=True)  # creating it does not need wandb
    with pytest.raises(ImportError, match=r'pip install "purestep\[wandb\]"'):
        logger.log_metrics({"a": 1.0}, 0)


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="resume"):
        WandbLogger(save_dir=tmp_path, resume="must")
    with pytest.raises(TypeError, match="prefix"):
        WandbLogger(save_dir=tmp_path, prefix=1)
    logger = WandbLogger(save_dir=tmp_path)
    with pytest.raises(ValueError, match="'id'"):
        logger.restore({"id": 3})
    with pytest.raises(ValueError, match="finalize status"):
        logger.finalize("done")
    logger.finalize("success")  # no run was started: nothing to finish
