"""Run folders under attack and under load (issue #22, round 3).

* hyper-parameter writing is bounded: a stride-0 ``torch.zeros(1).expand(2**27)`` (a few
  bytes of storage, 512 MiB as values), memoryviews, arrays and bytes are summarised from
  their shapes and lengths, never materialised;
* reading ``version`` / ``log_dir`` creates nothing; a run claims its version folder when
  it starts (exclusively: two runs started at once never share one), decided by the
  strategy's main process (not ``RANK``), and the other ranks take rank 0's version;
* every writer in a run folder refuses a symbolic link planted there (the target outside
  is left untouched); rewrites on other filesystems go through a temporary file; a killed
  writer's temporary files are removed;
* a checkpoint evaluation with a fresh Trainer and the default logger logs nothing and
  creates no version folder, unless something writes into the run folder anyway; without
  ``ckpt_path`` it logs as Lightning's; one Trainer keeps one version folder across all
  its calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from purestep.engine import optim
from purestep.loops import Trainer
from purestep.loops.callbacks import LambdaCallback, PredictionWriter
from purestep.loops.loggers import CSVLogger, TensorBoardLogger
from purestep.loops.loggers import folders as run_folders
from purestep.loops.loggers.hparams_yaml import (
    MAX_DEPTH,
    MAX_TENSOR_VALUES,
    MAX_TEXT,
    MAX_VALUES,
    dump_yaml,
    to_plain,
)
from purestep.loops.loggers.run_files import LinkRefusedError
from tests.helpers import mlp, sign_data, sign_loss

HUGE = 2**27  # elements of the stride-0 tensor of the issue: 512 MiB of float32 as values


def _huge() -> torch.Tensor:
    x = torch.zeros(1).expand(HUGE)
    assert x.stride() == (0,) and x.untyped_storage().nbytes() == 4
    return x


# --------------------------------------------------------------------------- item 5: bounds


def test_a_stride0_tensor_in_hparams_is_summarised_by_csv_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    params = {"weights": _huge(), "small": torch.zeros(1).expand(3), "lr": 0.1}
    csv_logger = CSVLogger(tmp_path, name="csv")
    board = TensorBoardLogger(tmp_path, name="tb")
    started = time.perf_counter()
    csv_logger.log_hyperparams(params)
    board.log_hyperparams(params)
    board.finalize("success")
    assert time.perf_counter() - started < 5  # 2**27 Python floats would take minutes
    for logger in (csv_logger, board):
        path = os.path.join(logger.log_dir, "hparams.yaml")
        assert os.path.getsize(path) < 1024
        with open(path) as f:
            saved = yaml.safe_load(f)
        assert saved["small"] == [0.0, 0.0, 0.0] and saved["lr"] == 0.1
        assert saved["weights"].startswith(f"<Tensor shape=({HUGE},) dtype=torch.float32")
        assert f"more than {MAX_TENSOR_VALUES} elements" in saved["weights"]
    events = EventAccumulator(board.log_dir)
    events.Reload()
    # the hparams plugin got the summary string too (its session start lists the values)
    plugin = events.PluginTagToContent("hparams")
    assert any(b"shape=(134217728,)" in content for content in plugin.values())


def test_to_plain_bounds_counts_text_depth_and_arrays():
    import numpy as np

    long_list = to_plain({"xs": list(range(MAX_VALUES + 50))})["xs"]
    assert len(long_list) < MAX_VALUES + 1 and long_list[-1].startswith("... ")
    assert "more items not written" in long_list[-1]
    big = to_plain({str(i): i for i in range(MAX_VALUES + 5)})
    assert "more entries not written" in big["..."]
    text = to_plain({"a": "x" * (MAX_TEXT + 10)})["a"]
    assert (
        len(text) < MAX_TEXT + 200 and "11 more characters not written" in text
    )  # the key took one
    cycle: list = []
    cycle.append(cycle)
    out = to_plain(cycle)
    depth = 0
    while isinstance(out, list):
        out, depth = out[0], depth + 1
    assert depth == MAX_DEPTH and "nested deeper than" in out
    assert len(dump_yaml(to_plain(cycle))) < 10_000
    assert to_plain(np.zeros((2, 2))) == [[0.0, 0.0], [0.0, 0.0]]
    assert "ndarray shape=(2000, 3)" in to_plain(np.zeros((2000, 3)))
    assert "values not written" in to_plain(torch.empty(2, device="meta"))


def test_to_plain_never_expands_memoryviews_arrays_or_bytes():
    """Sizes come from shapes and lengths: a stride-0 numpy array behind a memoryview, a
    large ``array.array`` and long bytes are summarised without being read or printed;
    something with ``tolist`` whose size cannot be told is not read either."""
    import array

    import numpy as np

    class Opaque:
        def tolist(self):
            raise AssertionError("read")

    started = time.perf_counter()
    view = to_plain(memoryview(np.broadcast_to(np.zeros(1), (2**25,))))
    arr = to_plain(array.array("b", bytes(2**24)))
    blob = to_plain(b"\x00" * 2**24)
    opaque = to_plain(Opaque())
    assert time.perf_counter() - started < 1  # reading them took seconds and gigabytes
    assert view.startswith(f"<memoryview shape=({2**25},) dtype=d: values not written")
    assert arr.startswith(f"<array shape=({2**24},) dtype=b: values not written")
    assert blob == (
        f"<bytes of {2**24} bytes: values not written: more than {MAX_TENSOR_VALUES} elements>"
    )
    assert "its size is unknown" in opaque
    # small ones are written as before
    assert to_plain(memoryview(b"ab")) == [97, 98] and to_plain(b"ab") == "b'ab'"
    assert to_plain(array.array("i", [1, 2])) == [1, 2]


# --------------------------------------------------------------------------- item 10: races


@pytest.mark.parametrize("rank", [None, "1"])
def test_racing_threads_claim_distinct_version_folders(tmp_path, monkeypatch, rank):
    """Eight loggers write their first line at the same instant, 25 rounds: the listing
    all of them make first shows the same free number; only one may take it. ``RANK=1``
    (a torchrun-launched sweep of single-process runs) claims as well: claiming is decided
    by the run, not by an environment variable."""
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    for round_ in range(25):
        root = tmp_path / str(round_)
        (root / "lightning_logs" / "version_2").mkdir(parents=True)
        loggers = [CSVLogger(root) for _ in range(8)]
        for logger in loggers:
            assert logger.version == 3  # read first: all see the same free number
        barrier = threading.Barrier(len(loggers))
        versions: list[int] = []

        threads = [
            threading.Thread(target=_write_after, args=(lg, barrier, versions)) for lg in loggers
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(versions) == list(range(3, 11)), versions
        names = os.listdir(root / "lightning_logs")
        assert sorted(names, key=lambda n: int(n.split("_")[1])) == [
            f"version_{n}" for n in range(2, 11)
        ]


def _write_after(logger, barrier, versions):
    barrier.wait()
    logger.log_hyperparams({"thread": threading.get_ident()})
    versions.append(logger.version)


RACER = textwrap.dedent(
    """
    import os, sys, time
    from purestep.loops.loggers import CSVLogger
    root, start, runs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    while time.time() < start:
        pass
    for i in range(runs):
        logger = CSVLogger(root)  # a new run each time, as a new Trainer's logger
        logger.log_hyperparams({"pid": os.getpid(), "i": i})
        print(logger.version, flush=True)
    """
)


def test_two_processes_started_at_once_never_share_a_version_folder(tmp_path):
    runs = 40
    env = {k: v for k, v in os.environ.items() if k != "RANK"}  # each is a main process
    start = time.time() + 2.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path), str(start), str(runs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            outputs.append([int(v) for v in out.split()])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    first, second = outputs
    assert len(first) == len(second) == runs
    assert not set(first) & set(second)  # no folder shared
    assert sorted(first + second) == list(range(2 * runs))
    for process, versions in zip(procs, outputs):
        for i, version in enumerate(versions):
            path = tmp_path / "lightning_logs" / f"version_{version}" / "hparams.yaml"
            saved = yaml.safe_load(path.read_text())
            assert saved == {"pid": process.pid, "i": i}  # written by that run alone


def test_claims_keep_lightnings_version_semantics(tmp_path, monkeypatch):
    logs = tmp_path / "lightning_logs"
    # reading version / log_dir has no side effect: fresh reads name the same folder
    reads = [CSVLogger(tmp_path).log_dir for _ in range(3)]
    assert reads == [str(logs / "version_0")] * 3 and not logs.exists()
    picked = CSVLogger(tmp_path)
    assert picked.version == 0 and not picked.picked
    picked.log_hyperparams({"lr": 0.1})  # the first write claims it
    assert picked.picked and (logs / "version_0" / "hparams.yaml").is_file()
    # a version read before another run took it moves on at the claim
    early, other = CSVLogger(tmp_path), CSVLogger(tmp_path)
    assert early.version == other.version == 1
    other.claim()
    early.log_metrics({"x": 1.0}, step=0)
    early.save()
    assert (other.version, early.version) == (1, 2)
    assert not (logs / "version_1" / "metrics.csv").exists()
    assert (logs / "version_2" / "metrics.csv").is_file()
    explicit = CSVLogger(tmp_path, version=5)
    assert explicit.log_dir == str(logs / "version_5") and not (logs / "version_5").exists()
    assert CSVLogger(tmp_path, version=0).version == 0  # an existing version, when asked
    # a claim made before a resume adopts another version is given back (it was empty)
    resumed = CSVLogger(tmp_path)
    resumed.claim()
    assert resumed.version == 3 and (logs / "version_3").is_dir()
    resumed.restore({"version": 0, "rows": 0})
    assert resumed.version == 0 and not (logs / "version_3").exists()
    # state() records a claimed version (the one a resume will adopt)
    saved = CSVLogger(tmp_path)
    assert saved.state()["version"] == 3 and (logs / "version_3").is_dir()
    # a run of taken numbers ends in a clear error
    monkeypatch.setattr(run_folders, "MAX_CLAIMS", 3)
    monkeypatch.setattr(run_folders, "_claim", lambda root, version: None)
    with pytest.raises(RuntimeError, match="3 version numbers in a row were taken"):
        CSVLogger(tmp_path).claim()


def test_trainers_reading_log_dir_create_nothing_and_claim_when_they_run(tmp_path, monkeypatch):
    """``trainer.log_dir`` read before a run creates no folder (reads of fresh Trainers
    agree, as in Lightning); the run claims it, and a second Trainer that read the same
    folder moves on to the next one. Under ``RANK=1`` too (a single-process run launched
    by torchrun: its strategy, not the variable, makes it the main process)."""
    monkeypatch.setenv("RANK", "1")
    first, second = (_tiny_trainer(tmp_path, log_every_n_steps=1) for _ in range(2))
    expected = os.path.join(str(tmp_path), "lightning_logs", "version_0")
    assert [_tiny_trainer(tmp_path).log_dir for _ in range(3)] == [expected] * 3
    assert first.log_dir == second.log_dir == expected
    assert not (tmp_path / "lightning_logs").exists()
    train = DataLoader(sign_data(16), batch_size=8)
    first.fit(mlp(), sign_loss, optim.adam(1e-2), train)
    second.fit(mlp(), sign_loss, optim.adam(1e-2), train)
    assert first.log_dir == expected
    assert second.log_dir == os.path.join(str(tmp_path), "lightning_logs", "version_1")
    for trainer in (first, second):
        events = [n for n in os.listdir(trainer.log_dir) if n.startswith("events.out")]
        assert len(events) == 1  # each run its own event file in its own folder


class _Rank:
    """A stand-in for one process of a two-process strategy: rank 0's broadcast is what
    rank 1 receives (``shared_log_dir``'s collective, without processes)."""

    world_size = 2

    def __init__(self, rank, sent):
        self.rank, self.sent = rank, sent

    @property
    def is_primary(self):
        return self.rank == 0

    def broadcast_object(self, obj, src):
        if self.rank == 0:
            self.sent.append(obj)
        return self.sent[-1]


def test_other_ranks_take_the_version_rank_0_claimed(tmp_path):
    from purestep.loops.trainer_run import shared_log_dir

    sent: list = []
    ranks = [_tiny_trainer(tmp_path, logger=CSVLogger(tmp_path)) for _ in range(2)]
    for rank, trainer in enumerate(ranks):
        trainer.strategy = _Rank(rank, sent)
    dirs = [shared_log_dir(trainer, "fit")[0] for trainer in ranks]  # rank 0 first
    assert dirs[0] == dirs[1] == str(tmp_path / "lightning_logs" / "version_0")
    # rank 1 reads rank 0's version (its own listing now shows version_0 taken)
    assert ranks[1].logger.version == 0 and ranks[1].logger.picked
    assert os.listdir(tmp_path / "lightning_logs") == ["version_0"]


def test_remote_rewrites_go_through_a_temporary_file(monkeypatch):
    """On a non-local filesystem a rewrite of metrics.csv / hparams.yaml that dies midway
    leaves the old file whole (a temporary file is moved over it only once written)."""
    import uuid

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    root = f"memory://rewrite-{uuid.uuid4().hex}"
    logger = CSVLogger(root)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"a": 1.0}, step=0)
    logger.save()
    fs, folder = fsspec.core.url_to_fs(logger.log_dir)
    before = {n: fs.cat_file(f"{folder}/{n}") for n in ("metrics.csv", "hparams.yaml")}
    real_pipe = MemoryFileSystem.pipe_file

    def dies_midway(self, path, value, **kwargs):
        real_pipe(self, path, value[: len(value) // 2], **kwargs)  # half of it, then a crash
        raise OSError("connection lost")

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", dies_midway)
    logger.log_metrics({"b": 2.0}, step=1)  # a new column: metrics.csv is rewritten
    with pytest.raises(OSError, match="connection lost"):
        logger.save()
    with pytest.raises(OSError, match="connection lost"):
        logger.log_hyperparams({"lr": 0.2})
    monkeypatch.undo()
    assert {n: fs.cat_file(f"{folder}/{n}") for n in before} == before
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)) == [
        "hparams.yaml",
        "metrics.csv",
    ]  # no temporary file left either


# --------------------------------------------------------------------------- item 11: links


@pytest.fixture
def outside(tmp_path):
    """A file and a folder outside every run folder, with content that must survive."""
    folder = tmp_path / "outside"
    folder.mkdir()
    target = folder / "precious.txt"
    target.write_text("keep me")
    return target


def _plant(link, target) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=target.is_dir())


def _untouched(outside) -> None:
    assert outside.read_text() == "keep me"
    assert os.listdir(outside.parent) == ["precious.txt"]


def test_csv_refuses_links_at_hparams_and_metrics(tmp_path, outside):
    run = tmp_path / "runs" / "lightning_logs" / "version_0"
    _plant(run / "hparams.yaml", outside)
    logger = CSVLogger(tmp_path / "runs", version=0)
    with pytest.raises(LinkRefusedError, match=r"hparams\.yaml is a symbolic link \(to .*"):
        logger.log_hyperparams({"lr": 0.1})
    (run / "hparams.yaml").unlink()
    _plant(run / "metrics.csv", outside)
    logger.log_metrics({"x": 1.0}, step=0)
    with pytest.raises(LinkRefusedError, match=r"metrics\.csv is a symbolic link"):
        logger.save()
    with pytest.raises(LinkRefusedError, match=r"metrics\.csv is a symbolic link"):
        CSVLogger(tmp_path / "runs", version=0).restore({"version": 0, "rows": 1})
    _untouched(outside)


def test_csv_refuses_a_planted_version_folder_and_a_fifo(tmp_path, outside):
    _plant(tmp_path / "lightning_logs" / "v", outside.parent)
    with pytest.raises(LinkRefusedError, match="lightning_logs/v is a symbolic link"):
        CSVLogger(tmp_path, version="v").log_hyperparams({"lr": 0.1})
    run = tmp_path / "lightning_logs" / "version_3"
    run.mkdir()
    os.mkfifo(run / "metrics.csv")  # reading it would block forever
    with pytest.raises(LinkRefusedError, match="not a regular file"):
        CSVLogger(tmp_path, version=3).restore({"version": 3, "rows": 1})
    _untouched(outside)


def test_tensorboard_refuses_links_at_hparams_and_its_sub_dir(tmp_path, outside):
    run = tmp_path / "lightning_logs" / "version_0"
    _plant(run / "hparams.yaml", outside)
    with pytest.raises(LinkRefusedError, match=r"hparams\.yaml is a symbolic link"):
        TensorBoardLogger(tmp_path, version=0).log_hyperparams({"lr": 0.1})
    _plant(run / "sub", outside.parent)  # the event files would go outside
    board = TensorBoardLogger(tmp_path, version=0, sub_dir="sub")
    with pytest.raises(LinkRefusedError, match="version_0/sub is a symbolic link"):
        board.log_metrics({"x": 1.0}, step=0)
    _untouched(outside)


def test_tensorboard_add_scalars_refuses_a_planted_tag_folder(tmp_path, outside):
    run = tmp_path / "lightning_logs" / "version_0"
    _plant(run / "loss" / "train", outside.parent)  # tensorboardX's per-tag folder
    board = TensorBoardLogger(tmp_path, version=0)
    with pytest.raises(LinkRefusedError, match="loss/train is a symbolic link"):
        board.experiment.add_scalars("loss", {"train": 1.0}, 0)
    board.experiment.add_scalars("acc", {"train": 0.5, "val": 0.4}, 0)  # the others work
    board.finalize("success")
    assert all(
        any(n.startswith("events.out") for n in os.listdir(run / "acc" / tag))
        for tag in ("train", "val")
    )
    _untouched(outside)


def test_our_tensorboardx_writers_set_what_tensorboardx_sets(tmp_path):
    """``_EventsFile`` / ``_RecordFile`` rebuild tensorboardX's ``EventsWriter`` /
    ``RecordWriter`` constructors (to open their file safely): if a tensorboardX release
    changes what those constructors set, this fails and the copies must follow."""
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.record_writer import RecordWriter

    from purestep.loops.loggers.tensorboard import _EventsFile, _RecordFile

    (tmp_path / "a").mkdir()
    theirs = EventsWriter(str(tmp_path / "a" / "events"))
    ours = _EventsFile(str(tmp_path), str(tmp_path / "b"), "")
    assert set(vars(ours)) == set(vars(theirs))
    assert set(vars(ours._py_recordio_writer)) == set(vars(theirs._py_recordio_writer))
    plain = RecordWriter(str(tmp_path / "c"))
    with open(tmp_path / "d", "wb") as file:
        assert set(vars(_RecordFile(str(tmp_path / "d"), file))) == set(vars(plain))
    for writer in (theirs, ours):
        writer.close()
    plain.close()


def test_reports_in_the_run_folder_refuse_a_planted_version_folder(tmp_path, outside):
    """A profiler report (no dirpath) and PredictionWriter files go into the run folder
    walked from the logger's root_dir: a version folder replaced by a link out is refused."""
    from purestep.loops.profiling import SimpleProfiler

    run = tmp_path / "lightning_logs" / "version_0"
    _plant(run, outside.parent)
    prof = SimpleProfiler()
    prof.setup("test", None, str(run))
    prof.use_log_root(str(tmp_path / "lightning_logs"))
    with prof.profile("step"):
        pass
    with pytest.raises(LinkRefusedError, match="lightning_logs/version_0 is a symbolic link"):
        prof.describe()
    trainer = _tiny_trainer(
        tmp_path, logger=CSVLogger(tmp_path, version=0), callbacks=[PredictionWriter("epoch")]
    )
    with pytest.raises(LinkRefusedError, match="lightning_logs/version_0 is a symbolic link"):
        trainer.predict(mlp(), DataLoader(sign_data(8), batch_size=4))
    _untouched(outside)


def test_a_killed_writers_temporary_files_are_removed_at_the_next_write(tmp_path):
    from purestep.engine.checkpoint import storage

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    left = run / f".metrics.csv.tmp-{storage.writer_identity(dead.pid)}-{'0' * 12}"
    live = run / f".hparams.yaml.tmp-{storage.writer_identity()}-{'1' * 12}"  # a live writer
    unknown = run / ".notes.tmp-someone-else"  # another machine's, or unknown: left alone
    for path in (left, live, unknown):
        path.write_text("partial")
    CSVLogger(tmp_path, version=0).log_hyperparams({"lr": 0.1})
    assert not left.exists() and live.exists() and unknown.exists()
    assert (run / "hparams.yaml").is_file()


def _tiny_trainer(root, **flags):
    flags.setdefault("enable_checkpointing", False)
    return Trainer(
        default_root_dir=str(root),
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **flags,
    )


def test_prediction_writer_refuses_a_planted_predictions_folder_or_file(tmp_path, outside):
    loader = DataLoader(sign_data(8), batch_size=4)
    run = tmp_path / "lightning_logs" / "version_0"
    _plant(run / "predictions", outside.parent)
    (outside.parent / "predictions_rank0.pt").write_bytes(b"not ours")  # must not be removed
    trainer = _tiny_trainer(
        tmp_path, logger=CSVLogger(tmp_path, version=0), callbacks=[PredictionWriter("epoch")]
    )
    with pytest.raises(LinkRefusedError, match="version_0/predictions is a symbolic link"):
        trainer.predict(mlp(), loader)
    assert (outside.parent / "predictions_rank0.pt").read_bytes() == b"not ours"
    (outside.parent / "predictions_rank0.pt").unlink()
    # in a folder the user chose, a link named as one of this rank's earlier files is
    # removed as that file would be (the link, not its target); the new file is ours
    chosen = tmp_path / "chosen"
    _plant(chosen / "predictions_rank0_dataloader0_batch1.pt", outside)
    writer = _tiny_trainer(
        tmp_path, logger=False, callbacks=[PredictionWriter("batch", output_dir=chosen)]
    )
    writer.predict(mlp(), loader)
    written = chosen / "predictions_rank0_dataloader0_batch1.pt"
    assert not written.is_symlink() and "predictions" in torch.load(written, weights_only=True)
    _untouched(outside)


def test_cli_config_with_overwrite_refuses_a_planted_link(tmp_path, outside):
    pytest.importorskip("jsonargparse")
    from purestep.loops.command_line import cli
    from tests.test_cli import QUIET, Data, Regression

    root = tmp_path / "root"
    _plant(root / "config.yaml", outside)
    args = ["fit", "--trainer.logger", "false", "--trainer.default_root_dir", str(root)]
    args += ["--trainer.max_steps", "1", "--trainer.enable_checkpointing", "false", *QUIET]
    for kwargs in ({"overwrite": True}, {}):
        with pytest.raises(LinkRefusedError, match=r"config\.yaml is a symbolic link"):
            cli(Regression, Data, args=args, save_config_kwargs=kwargs)
    _untouched(outside)


# --------------------------------------------------------------------------- item 13: folders


def _fit_once(root):
    trainer = _tiny_trainer(root, enable_checkpointing=True)
    trainer.fit(
        mlp(),
        sign_loss,
        optim.adam(1e-2),
        DataLoader(sign_data(16), batch_size=8),
        DataLoader(sign_data(8, 1), batch_size=8),
    )
    folder = os.path.join(trainer.log_dir, "checkpoints")
    return trainer, os.path.join(folder, os.listdir(folder)[0])


def _validate(trainer, ckpt):
    val = DataLoader(sign_data(8, 1), batch_size=8)
    return trainer.validate(mlp(), val, fn=sign_loss, ckpt_path=ckpt, verbose=False)


def test_one_trainer_keeps_one_version_folder_across_its_calls(tmp_path):
    trainer, ckpt = _fit_once(tmp_path)
    run = trainer.log_dir
    for _ in range(3):
        _validate(trainer, ckpt)
    trainer.test(mlp(), DataLoader(sign_data(8, 1), batch_size=8), fn=sign_loss, verbose=False)
    trainer.predict(mlp(), DataLoader(sign_data(8, 1), batch_size=8), ckpt_path=ckpt)
    assert trainer.log_dir == run
    assert os.listdir(tmp_path / "lightning_logs") == ["version_0"]


def test_fresh_trainers_evaluating_a_live_runs_checkpoint_create_no_folders(tmp_path):
    live, ckpt = _fit_once(tmp_path)
    (expected,) = _validate(live, ckpt)
    for _ in range(3):  # a monitoring script: a new Trainer per evaluation
        fresh = _tiny_trainer(tmp_path)
        said: list[str] = []
        fresh._printer = said.append
        assert fresh.log_dir.endswith("version_1")  # read: nothing is created
        assert _validate(fresh, ckpt) == [expected]
        assert fresh.log_dir == str(tmp_path)  # no run folder: as logger=False
        assert fresh.logger is None and fresh.loggers == []  # for that run
        assert set(fresh.logged_metrics) == set(expected)
        assert any("is not logged" in line and "logger=True" in line for line in said), said
    assert os.listdir(tmp_path / "lightning_logs") == ["version_0"]
    # a fresh Trainer that evaluates, then fits, has its logger back and one folder
    both = _tiny_trainer(tmp_path)
    _validate(both, ckpt)
    both.fit(mlp(), sign_loss, optim.adam(1e-2), DataLoader(sign_data(16), batch_size=8))
    assert both.logger is not None and both.log_dir.endswith("version_1")
    assert sorted(os.listdir(tmp_path / "lightning_logs")) == ["version_0", "version_1"]
    # asked for (logger=True), an evaluation of a checkpoint logs into its own folder
    _validate(_tiny_trainer(tmp_path, logger=True), ckpt)
    assert sorted(os.listdir(tmp_path / "lightning_logs")) == [
        "version_0",
        "version_1",
        "version_2",
    ]
    assert any(
        name.startswith("events.out.tfevents.")
        for name in os.listdir(tmp_path / "lightning_logs" / "version_2")
    )


def test_the_logger_seen_during_a_skipped_run_is_none(tmp_path):
    _, ckpt = _fit_once(tmp_path)
    fresh = _tiny_trainer(tmp_path)
    seen = []
    fresh.callbacks.append(
        LambdaCallback(on_validation_start=lambda ctx: seen.append(fresh.logger))
    )
    _validate(fresh, ckpt)
    assert seen == [None]  # self.logger.experiment in a step would find no logger


def test_a_fresh_trainers_evaluation_without_ckpt_path_logs_as_lightnings(tmp_path):
    """No ``ckpt_path``: ``Trainer().test(model, data)`` logs into a new version folder,
    as Lightning's does (the default logger is left out only for checkpoint evaluations)."""
    fresh = _tiny_trainer(tmp_path)
    fresh.test(mlp(), DataLoader(sign_data(8, 1), batch_size=8), fn=sign_loss, verbose=False)
    assert fresh.log_dir == str(tmp_path / "lightning_logs" / "version_0")
    assert fresh.logger is not None
    assert any(n.startswith("events.out") for n in os.listdir(fresh.log_dir))


def test_skipped_runs_that_write_into_the_run_folder_get_their_own(tmp_path):
    """A checkpoint evaluation that would leave the default logger out but writes into the
    run folder (a PredictionWriter without output_dir, a profiler without dirpath) gets a
    version folder of its own: two fresh runs never overwrite each other's files, and
    nothing is written into default_root_dir itself."""
    _, ckpt = _fit_once(tmp_path)
    data = DataLoader(sign_data(8, 1), batch_size=4)
    folders = []
    for _ in range(2):
        for interval in ("epoch", "batch"):
            fresh = _tiny_trainer(tmp_path, callbacks=[PredictionWriter(interval)])
            fresh.predict(mlp(), data, ckpt_path=ckpt)
            folders.append(fresh.log_dir)
            assert os.listdir(os.path.join(fresh.log_dir, "predictions"))
    profiled = _tiny_trainer(tmp_path, profiler="simple")
    profiled.test(mlp(), data, fn=sign_loss, ckpt_path=ckpt, verbose=False)
    folders.append(profiled.log_dir)
    assert os.path.isfile(os.path.join(profiled.log_dir, "test-profile.txt"))
    assert len(set(folders)) == 5 and all("version_" in f for f in folders)
    assert sorted(os.listdir(tmp_path)) == ["lightning_logs"]  # nothing in the root itself
    for folder in folders[:4]:  # each run's files are whole and its own
        files = sorted(os.listdir(os.path.join(folder, "predictions")))
        assert files in (
            ["predictions_rank0.pt"],
            [f"predictions_rank0_dataloader0_batch{i}.pt" for i in range(2)],
        )


def test_cli_checkpoint_evaluations_write_their_config_into_their_own_folder(tmp_path):
    """The command line's config.yaml is a file in the run folder: a ``validate
    --ckpt_path`` on a fresh Trainer gets a version folder for it (never the root)."""
    pytest.importorskip("jsonargparse")
    import glob

    from purestep.loops.command_line import cli
    from tests.test_cli import QUIET, Data, Regression

    common = ["--trainer.default_root_dir", str(tmp_path), *QUIET]
    fitted = cli(Regression, Data, args=["fit", "--trainer.max_steps", "1", *common])
    (ckpt,) = glob.glob(os.path.join(fitted.trainer.log_dir, "**", "*.ckpt"), recursive=True)
    runs = [cli(Regression, Data, args=["validate", "--ckpt_path", ckpt, *common]) for _ in "ab"]
    folders = [run.trainer.log_dir for run in runs]
    assert folders == [str(tmp_path / "lightning_logs" / f"version_{i}") for i in (1, 2)]
    assert all(os.path.isfile(os.path.join(folder, "config.yaml")) for folder in folders)
    assert sorted(os.listdir(tmp_path)) == ["lightning_logs"]
