"""Loggers: run folders, CSV, hparams YAML, TensorBoard read-back, resume truncation, fan-out.

Files are written to pytest's ``tmp_path`` or to fsspec's ``memory://`` filesystem (under a
fresh random root per test, removed afterwards). TensorBoard files are read back with
TensorBoard's own ``EventAccumulator``; the YAML with ``load_yaml`` and PyYAML's ``safe_load``.
"""

from __future__ import annotations

import argparse
import csv
import enum
import io
import math
import os
import pathlib
import uuid

import fsspec
import numpy as np
import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.loops import Trainer
from purestep.loops.callbacks import ModelCheckpoint
from purestep.loops.loggers import (
    STATUSES,
    CSVLogger,
    Logger,
    LoggerCollection,
    MemoryLogger,
    TensorBoardLogger,
    create_loggers,
    dump_yaml,
    load_yaml,
    next_version,
    run_dir,
)
from purestep.loops.loggers.hparams_yaml import to_plain
from tests.helpers import mlp

MEMORY = fsspec.filesystem("memory")


def memory_root() -> str:
    return f"memory://test-loggers-{uuid.uuid4().hex}"


@pytest.fixture
def mem_root():
    root = memory_root()
    yield root
    path = root[len("memory://") :]
    if MEMORY.exists(path):
        MEMORY.rm(path, recursive=True)


@pytest.fixture(params=["local", "memory"])
def any_root(request, tmp_path, mem_root):
    return str(tmp_path) if request.param == "local" else mem_root


def make_dirs(root: str, *names: str) -> None:
    fs, path = fsspec.core.url_to_fs(root)
    for name in names:
        fs.makedirs(f"{path}/{name}", exist_ok=True)


def read_text(url: str) -> str:
    fs, path = fsspec.core.url_to_fs(url)
    return fs.cat_file(path).decode()


def read_csv(url: str) -> tuple[list[str], list[dict[str, str]]]:
    reader = csv.DictReader(io.StringIO(read_text(url)))
    rows = list(reader)
    return list(reader.fieldnames or []), rows


# --------------------------------------------------------------------------- run folders


def test_next_version_counts_only_version_folders(any_root):
    fs, path = fsspec.core.url_to_fs(any_root)
    assert next_version(fs, f"{path}/missing") == 0
    make_dirs(any_root, "exp/other", "exp/version_x", "exp/version_", "exp/version_2a")
    assert next_version(fs, f"{path}/exp") == 0
    make_dirs(any_root, "exp/version_0", "exp/version_3")
    fs.pipe_file(f"{path}/exp/version_10", b"a file, not a folder")
    assert next_version(fs, f"{path}/exp") == 4


@given(existing=st.sets(st.integers(0, 40), max_size=6))
def test_next_version_is_one_past_the_largest(existing):
    root = memory_root()
    try:
        make_dirs(root, "x", *(f"x/version_{n}" for n in existing))
        fs, path = fsspec.core.url_to_fs(root)
        assert next_version(fs, f"{path}/x") == (max(existing) + 1 if existing else 0)
    finally:
        MEMORY.rm(root[len("memory://") :], recursive=True)


def test_run_dir_layout():
    assert run_dir("memory://r", "exp", 3) == "memory://r/exp/version_3"
    assert run_dir("memory://r", None, 3) == "memory://r/version_3"
    assert run_dir("memory://r", "", "final") == "memory://r/final"
    assert run_dir("memory://", "exp", 0) == "memory://exp/version_0"
    assert run_dir("/tmp/r", "exp", "v") == os.path.join("/tmp/r", "exp", "v")
    with pytest.raises(ValueError, match="needs a version"):
        run_dir("/tmp/r", "exp", None)


@pytest.mark.parametrize("cls", [CSVLogger, TensorBoardLogger])
def test_loggers_take_the_next_free_version(cls, any_root):
    make_dirs(any_root, "exp/version_0", "exp/version_3")
    first = cls(any_root, name="exp")
    assert first.version == 4
    assert first.log_dir == run_dir(any_root, "exp", 4)
    assert first.root_dir == run_dir(any_root, None, "exp")
    assert first.save_dir == any_root
    first.log_metrics({"x": 1.0}, step=0)
    first.finalize("success")
    assert cls(any_root, name="exp").version == 5  # version_4 now exists
    assert cls(any_root, name=None).log_dir == run_dir(any_root, None, 0)
    explicit = cls(any_root, name="exp", version=1)
    assert explicit.log_dir == run_dir(any_root, "exp", 1)
    assert cls(any_root, name="exp", version="final").log_dir.endswith("exp/final")


@pytest.mark.parametrize(
    ("version", "error", "match"),
    [
        (-1, ValueError, "must be >= 0"),
        (1.5, TypeError, "must be an int, a str or None"),
        (True, TypeError, "must be an int, a str or None"),
        ("", ValueError, "folder name"),
        ("a/b", ValueError, "folder name"),
    ],
)
def test_bad_versions(version, error, match, tmp_path):
    with pytest.raises(error, match=match):
        CSVLogger(tmp_path, version=version)


def test_bad_folder_arguments(tmp_path):
    with pytest.raises(TypeError, match="save_dir must be a path"):
        CSVLogger(3)
    with pytest.raises(TypeError, match="name must be a str"):
        CSVLogger(tmp_path, name=5)
    with pytest.raises(TypeError, match="prefix must be a str"):
        CSVLogger(tmp_path, prefix=None)
    with pytest.raises(TypeError, match="sub_dir must be a str"):
        TensorBoardLogger(tmp_path, sub_dir=1)


# --------------------------------------------------------------------------- CSV


def test_csv_columns_rows_and_new_keys(any_root):
    logger = CSVLogger(any_root, flush_logs_every_n_steps=1)
    logger.log_metrics({"b": 1.5, "a": torch.tensor(2.0)}, step=0)
    columns, rows = read_csv(logger.metrics_file)
    assert columns == ["a", "b", "step"]
    assert rows == [{"a": "2.0", "b": "1.5", "step": "0"}]
    logger.log_metrics({"a": 3.25, "epoch": 0}, step=1)  # a new key: the file is rewritten
    logger.log_metrics({"b": torch.tensor([0.5])}, step=2)
    columns, rows = read_csv(logger.metrics_file)
    assert columns == ["a", "b", "epoch", "step"]
    assert rows == [
        {"a": "2.0", "b": "1.5", "epoch": "", "step": "0"},
        {"a": "3.25", "b": "", "epoch": "0", "step": "1"},
        {"a": "", "b": "0.5", "epoch": "", "step": "2"},
    ]


def test_csv_flushes_every_n_steps_and_on_save(mem_root):
    logger = CSVLogger(mem_root, flush_logs_every_n_steps=3)
    fs, path = fsspec.core.url_to_fs(logger.metrics_file)
    logger.log_metrics({"x": 0.0}, step=0)
    logger.log_metrics({"x": 1.0}, step=1)
    assert not fs.exists(path)
    logger.log_metrics({"x": 2.0}, step=2)  # (2 + 1) % 3 == 0
    assert [r["step"] for r in read_csv(logger.metrics_file)[1]] == ["0", "1", "2"]
    logger.log_metrics({"x": 3.0}, step=3)
    assert len(read_csv(logger.metrics_file)[1]) == 3
    logger.save()
    assert [r["x"] for r in read_csv(logger.metrics_file)[1]] == ["0.0", "1.0", "2.0", "3.0"]
    logger.log_metrics({"x": 4.0}, step=4)
    logger.finalize("interrupted")
    assert len(read_csv(logger.metrics_file)[1]) == 5


def test_csv_prefix(mem_root):
    logger = CSVLogger(mem_root, prefix="train")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    assert read_csv(logger.metrics_file)[0] == ["step", "train-loss"]


def test_csv_fresh_run_replaces_leftover_file(mem_root):
    old = CSVLogger(mem_root, version=0)
    old.log_metrics({"old": 1.0}, step=0)
    old.save()
    new = CSVLogger(mem_root, version=0)
    new.log_metrics({"new": 2.0}, step=0)
    with pytest.warns(UserWarning, match="already exists"):
        new.save()
    assert read_csv(new.metrics_file) == (["new", "step"], [{"new": "2.0", "step": "0"}])


@pytest.mark.parametrize(
    ("metrics", "step", "error", "match"),
    [
        ([("a", 1.0)], 0, TypeError, "mapping of name -> value"),
        ({1: 1.0}, 0, TypeError, "names must be str"),
        ({"a": "high"}, 0, TypeError, "'a' must be a number"),
        ({"a": torch.ones(2)}, 0, ValueError, r"'a' must hold a single value.*\(2,\)"),
        ({"a": 1.0}, -1, ValueError, "step must be >= 0"),
        ({"a": 1.0}, True, TypeError, "step must be an int"),
        ({"a": 1.0}, 1.0, TypeError, "step must be an int"),
        ({"step": 1.0}, 0, ValueError, "'step' is the CSV's own column"),
    ],
)
def test_csv_bad_metrics(metrics, step, error, match, tmp_path):
    with pytest.raises(error, match=match):
        CSVLogger(tmp_path).log_metrics(metrics, step)


def test_csv_bad_flush_interval(tmp_path):
    with pytest.raises(ValueError, match="flush_logs_every_n_steps must be an int >= 1"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


def test_csv_hparams_yaml(any_root):
    logger = CSVLogger(any_root)
    logger.log_hyperparams(argparse.Namespace(lr=1e-3, layers=(64, 32)))
    logger.log_hyperparams({"optimizer": {"name": "adam", "betas": [0.9, 0.999]}, "lr": 0.1})
    written = load_yaml(read_text(f"{logger.log_dir}/hparams.yaml"))
    expected = {"lr": 0.1, "layers": [64, 32], "optimizer": {"name": "adam", "betas": [0.9, 0.999]}}
    assert written == expected
    with pytest.raises(TypeError, match="must be a mapping, an argparse.Namespace"):
        logger.log_hyperparams([("lr", 1)])


# Rows: each a set of metric names; steps never decrease (ties allowed, as when validation
# rows share the last training row's step).
rows_strategy = st.lists(
    st.tuples(st.sets(st.sampled_from("abcd"), min_size=1), st.integers(0, 1)),
    min_size=1,
    max_size=10,
)


def _rows(spec):
    rows, step = [], 0
    for i, (names, advance) in enumerate(spec):
        step += advance
        rows.append(({n: i + ord(n) / 4 for n in sorted(names)}, step))
    return rows


@given(spec=rows_strategy, data=st.data(), flush_every=st.integers(1, 4))
def test_csv_resume_matches_uninterrupted_run(spec, data, flush_every):
    rows = _rows(spec)
    checkpoint = data.draw(st.integers(0, len(rows)), label="rows before the checkpoint")
    kill = data.draw(st.integers(checkpoint, len(rows)), label="rows before the kill")
    root = memory_root()
    try:
        whole = CSVLogger(f"{root}/whole", flush_logs_every_n_steps=flush_every)
        for values, step in rows:
            whole.log_metrics(values, step)
        whole.finalize("success")

        killed = CSVLogger(f"{root}/resumed", flush_logs_every_n_steps=flush_every)
        state = killed.state() if checkpoint == 0 else None
        for i, (values, step) in enumerate(rows[:kill]):
            killed.log_metrics(values, step)
            if i + 1 == checkpoint:
                state = killed.state()
        if data.draw(st.booleans(), label="saved before the kill"):
            killed.save()

        resumed = CSVLogger(f"{root}/resumed", flush_logs_every_n_steps=flush_every)
        resumed.restore(state)
        assert resumed.version == killed.version
        for values, step in rows[checkpoint:]:
            resumed.log_metrics(values, step)
        resumed.finalize("success")
        assert read_text(resumed.metrics_file) == read_text(whole.metrics_file)
    finally:
        MEMORY.rm(root[len("memory://") :], recursive=True)


def test_csv_truncate_after_step(mem_root):
    logger = CSVLogger(mem_root)
    for step in range(6):
        logger.log_metrics({"x": float(step), **({"late": 1.0} if step >= 4 else {})}, step)
    logger.truncate_after(2)  # flushes, then keeps rows with step <= 2; "late" disappears
    assert read_csv(logger.metrics_file) == (
        ["step", "x"],
        [{"step": str(s), "x": f"{s}.0"} for s in range(3)],
    )
    logger.log_metrics({"x": 9.0}, step=3)
    logger.save()
    assert [r["x"] for r in read_csv(logger.metrics_file)[1]] == ["0.0", "1.0", "2.0", "9.0"]


def test_csv_restore_errors(mem_root):
    first = CSVLogger(mem_root)
    first.log_metrics({"x": 1.0}, 0)
    state = first.state()
    with pytest.raises(ValueError, match="was given version=5 but the state"):
        CSVLogger(mem_root, version=5).restore(state)
    started = CSVLogger(mem_root)
    started.log_metrics({"x": 1.0}, 0)
    with pytest.raises(RuntimeError, match="before anything is logged"):
        started.restore(state)
    with pytest.raises(ValueError, match="'rows' must be an int >= 0"):
        CSVLogger(mem_root).restore({"version": 0, "rows": -1})
    with pytest.raises(TypeError, match="must be a mapping"):
        CSVLogger(mem_root).restore([0, 1])
    short = CSVLogger(mem_root)
    with pytest.warns(UserWarning, match="has 1 rows but the checkpoint counted 3"):
        short.restore({"version": 0, "rows": 3})


# --------------------------------------------------------------------------- YAML

yaml_key = st.one_of(st.text(max_size=8), st.integers(-5, 5))
yaml_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.sampled_from(["true", "No", "null", "~", "1.5", "1e3", "- x", "a: b", "#c", " x", ""]),
)
yaml_value = st.recursive(
    yaml_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(yaml_key, inner, max_size=4)
    ),
    max_leaves=12,
)


@given(value=yaml_value)
def test_yaml_round_trip(value):
    assert load_yaml(dump_yaml(value)) == value


@given(value=yaml_value)
def test_yaml_is_read_the_same_by_pyyaml(value):
    assert yaml.safe_load(dump_yaml(value)) == value


# Strings that YAML 1.1/1.2 readers could take for booleans, nulls, numbers, dates,
# indicators or line breaks: each must come back as the same string.
TRICKY = ["true", "No", "yes", "on", "OFF", "y", "n", "null", "~", "nan", ".inf", "1.5", "1e3"]
TRICKY += ["0x1f", "010", "1_000", "12:30", "2001-12-14", "- x", "a: b", "#c", " x", "x ", ""]
TRICKY += ["@x", "`x", "!x", "&x", "*x", "%x", "|", ">", "[a]", "{a}", "a #b", "é", "a\u2028b"]


TRICKY_DATA = {"as values": TRICKY, "as keys": {s: i for i, s in enumerate(TRICKY)}}


def test_yaml_tricky_strings_stay_strings():
    assert load_yaml(dump_yaml(TRICKY_DATA)) == TRICKY_DATA


def test_pyyaml_reads_tricky_strings_the_same():
    assert yaml.safe_load(dump_yaml(TRICKY_DATA)) == TRICKY_DATA


def test_yaml_special_floats_and_format():
    text = dump_yaml({"a": math.nan, "b": -math.inf, "c": 1e-5, "d": [1, [2]], "e": {}})
    assert text == "a: .nan\nb: -.inf\nc: 1.0e-05\nd:\n- 1\n- - 2\ne: {}\n"
    back = load_yaml(text)
    assert math.isnan(back["a"]) and back["b"] == -math.inf and back["c"] == 1e-5


def test_yaml_to_plain_and_errors():
    assert to_plain({"t": torch.tensor(1.5), "v": torch.tensor([1, 2]), "s": {3, 1}, "f": len}) == {
        "t": 1.5,
        "v": [1, 2],
        "s": [1, 3],
        "f": "len",
    }
    with pytest.raises(TypeError, match="cannot write Tensor"):
        dump_yaml({"t": torch.ones(1)})
    with pytest.raises(ValueError, match="malformed YAML: mapping values"):
        load_yaml("a: 1\n    b: 2\n")
    with pytest.raises(ValueError, match="malformed YAML: (?s:.*)unknown escape character 'q'"):
        load_yaml('a: "\\q"\n')
    with pytest.raises(ValueError, match=r"malformed YAML: (?s:.*)line 2, column 1"):
        load_yaml("- 1\nb: 2\n")


class _Choice(str, enum.Enum):
    FAST = "fast"


def test_yaml_plain_values_and_key_order(tmp_path):
    params = {
        "z_first": np.float64(0.5),
        "count": np.int64(3),
        "flag": np.bool_(True),
        "dtype": torch.float32,
        "path": pathlib.Path("/data/x"),
        "tensor": torch.tensor(2.5),
        "choice": _Choice.FAST,
        "betas": (0.9, 0.999),
        "a_last": {"y": 1, "b": 2},
    }
    expected = {
        "z_first": 0.5,
        "count": 3,
        "flag": True,
        "dtype": "torch.float32",
        "path": "/data/x",
        "tensor": 2.5,
        "choice": "fast",
        "betas": [0.9, 0.999],
        "a_last": {"y": 1, "b": 2},
    }
    plain = to_plain(params)
    assert plain == expected
    assert [type(v) for v in plain.values()] == [type(v) for v in expected.values()]
    text = dump_yaml(plain)
    top_keys = [line.split(":")[0] for line in text.splitlines() if line[0] not in " -"]
    assert top_keys == list(expected)  # the given order, not sorted
    assert list(load_yaml(text)["a_last"]) == ["y", "b"]
    assert yaml.safe_load(text) == load_yaml(text) == expected
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams(params)
    written = (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text()
    assert yaml.safe_load(written) == expected


def test_yaml_never_constructs_objects(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="could not determine a constructor"):
        load_yaml(f"!!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match="could not determine a constructor"):
        load_yaml(f"a: !!python/object/new:pathlib.PosixPath ['{marker}']\n")
    assert not marker.exists()


# --------------------------------------------------------------------------- TensorBoard


def read_events(folder) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def hparams_data(events: EventAccumulator, tag: str):
    content = events.PluginTagToContent("hparams")[f"_hparams_/{tag}"]
    return plugin_data_pb2.HParamsPluginData.FromString(content)


def test_tensorboard_read_back(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    logger.log_hyperparams({"lr": 0.25, "opt": {"name": "adam"}, "layers": [2, 3]})
    for step in range(4):
        logger.log_metrics({"loss": torch.tensor(step / 4), "acc": 1 - step / 8}, step)
    logger.log_text("notes", "hello *world*", step=2)
    logger.finalize("success")
    events = read_events(logger.log_dir)
    assert scalars(events, "loss") == [(s, s / 4) for s in range(4)]
    assert scalars(events, "acc") == [(s, 1 - s / 8) for s in range(4)]
    assert scalars(events, "hp_metric") == [(0, -1.0)]
    start = hparams_data(events, "session_start_info").session_start_info.hparams
    assert start["lr"].number_value == 0.25
    assert start["opt/name"].string_value == "adam"
    assert start["layers"].string_value == "[2, 3]"
    experiment = hparams_data(events, "experiment").experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["hp_metric"]
    (text,) = events.Tensors("notes/text_summary")
    assert (text.step, text.tensor_proto.string_val[0].decode()) == (2, "hello *world*")
    assert load_yaml((tmp_path / "tb" / "version_0" / "hparams.yaml").read_text())["lr"] == 0.25


def test_tensorboard_hparams_metrics_prefix_and_sub_dir(tmp_path):
    logger = TensorBoardLogger(tmp_path, default_hp_metric=False, prefix="p", sub_dir="train")
    assert logger.log_dir == os.path.join(str(tmp_path), "lightning_logs", "version_0", "train")
    logger.log_hyperparams({"lr": 1.0})
    logger.log_hyperparams({"lr": 2.0}, metrics={"best": 0.5})
    logger.log_metrics({"x": 1.0}, 3)
    logger.finalize("success")
    events = read_events(logger.log_dir)
    assert sorted(events.Tags()["scalars"]) == ["p-best", "p-x"]
    assert scalars(events, "p-best") == [(0, 0.5)]


def _log_range(logger, steps, offset):
    for step in steps:
        logger.log_metrics({"v": step + offset}, step)


def test_tensorboard_resume_supersedes_later_steps(tmp_path):
    killed = TensorBoardLogger(tmp_path)
    _log_range(killed, range(5), 0)
    state = killed.state()  # the checkpoint: steps 0..4 logged
    assert state == {"version": 0, "step": 4}
    _log_range(killed, range(5, 10), 0)
    killed.state()  # a later checkpoint, so the killed run's steps 5..9 are surely on disk
    assert scalars(read_events(killed.log_dir), "v") == [(s, float(s)) for s in range(10)]

    resumed = TensorBoardLogger(tmp_path)
    resumed.restore(state)
    _log_range(resumed, range(5, 10), 100)
    resumed.finalize("success")
    assert resumed.log_dir == killed.log_dir
    expected = [(s, float(s)) for s in range(5)] + [(s, s + 100.0) for s in range(5, 10)]
    assert scalars(read_events(resumed.log_dir), "v") == expected


def test_tensorboard_truncate_after_in_process(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    _log_range(logger, range(10), 0)
    logger.truncate_after(4)
    _log_range(logger, range(5, 10), 100)
    logger.log_text("t", "after", 7)
    logger.finalize("success")
    expected = [(s, float(s)) for s in range(5)] + [(s, s + 100.0) for s in range(5, 10)]
    events = read_events(logger.log_dir)
    assert scalars(events, "v") == expected
    assert logger.state() == {"version": 0, "step": 9}


def test_tensorboard_on_memory_filesystem(mem_root, tmp_path):
    logger = TensorBoardLogger(mem_root, name="tb")
    logger.log_hyperparams({"lr": 0.5})
    _log_range(logger, range(3), 0)
    state = logger.state()  # writes and uploads everything logged so far
    fs, remote = fsspec.core.url_to_fs(logger.log_dir)
    assert any("tfevents" in p for p in fs.find(remote))

    resumed = TensorBoardLogger(mem_root, name="tb")  # "after a kill": only what was saved
    resumed.restore({**state, "step": 1})
    _log_range(resumed, range(2, 4), 10)
    resumed.finalize("failed")
    assert resumed._local_dir is None  # the local staging folder is gone

    local = tmp_path / "download"
    fs.get(remote, str(local), recursive=True)
    assert load_yaml((local / "hparams.yaml").read_text()) == {"lr": 0.5}
    events = read_events(local)
    assert scalars(events, "v") == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def test_tensorboard_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="sets the SummaryWriter's 'purge_step' itself"):
        TensorBoardLogger(tmp_path, purge_step=3)
    logger = TensorBoardLogger(tmp_path)
    with pytest.raises(TypeError, match="str tag and a str text"):
        logger.log_text("t", 3, 0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        logger.truncate_after(-1)


# --------------------------------------------------------------------------- memory, statuses


def test_memory_logger_records_and_resumes():
    logger = MemoryLogger()
    logger.log_hyperparams({"lr": 1}, metrics={"best": torch.tensor(0.5)})
    for step in range(4):
        logger.log_metrics({"loss": torch.tensor(step / 2)}, step)
    logger.log_text("t", "hi", 1)
    state = logger.state()
    logger.log_metrics({"loss": 9.0}, 4)
    logger.log_text("t", "lost", 4)
    logger.save()
    logger.finalize("interrupted")
    assert (logger.saves, logger.status) == (1, "interrupted")
    assert logger.hyperparams == {"lr": 1} and logger.hyperparam_metrics == {"best": 0.5}
    logger.restore(state)
    assert logger.history("loss") == [(s, s / 2) for s in range(4)]
    assert logger.texts == [(1, "t", "hi")] and logger.status is None
    logger.truncate_after(1)
    assert logger.history("loss") == [(0, 0.0), (1, 0.5)]
    with pytest.raises(ValueError, match="'rows' must be an int >= 0"):
        logger.restore({"rows": "3"})


def _every_logger(root):
    return [MemoryLogger(), CSVLogger(root), TensorBoardLogger(root, name="tb")]


@pytest.mark.parametrize("status", STATUSES)
def test_finalize_accepts_every_status(status, mem_root):
    loggers = _every_logger(mem_root)
    for logger in loggers:
        logger.log_metrics({"x": 1.0}, 0)
        logger.finalize(status)
    assert loggers[0].status == status
    assert read_csv(loggers[1].metrics_file)[1] == [{"step": "0", "x": "1.0"}]
    fs, path = fsspec.core.url_to_fs(loggers[2].log_dir)
    assert any("tfevents" in p for p in fs.find(path))


def test_finalize_rejects_unknown_status(mem_root):
    for logger in [*_every_logger(mem_root), LoggerCollection()]:
        with pytest.raises(ValueError, match="must be one of"):
            logger.finalize("done")


# --------------------------------------------------------------------------- several at once


class Broken(MemoryLogger):
    def log_metrics(self, metrics, step):
        raise OSError("disk full")


def test_collection_fans_out_to_every_logger(mem_root):
    a, b, csv_logger = MemoryLogger(), MemoryLogger(name="b"), CSVLogger(mem_root)
    loggers = LoggerCollection([a, b, csv_logger])
    assert len(loggers) == 3 and loggers[1] is b and list(loggers) == [a, b, csv_logger]
    assert (loggers.name, loggers.version, loggers.log_dir) == ("memory", 0, None)
    loggers.log_hyperparams({"lr": 2})
    loggers.log_metrics({"x": torch.tensor(0.5)}, 3)
    loggers.log_text("t", "hello", 3)
    state = loggers.state()
    loggers.log_metrics({"x": 1.5}, 4)
    loggers.finalize("success")
    for memory in (a, b):
        assert memory.history("x") == [(3, 0.5), (4, 1.5)]
        assert (memory.hyperparams, memory.texts, memory.status) == (
            {"lr": 2},
            [(3, "t", "hello")],
            "success",
        )
    assert [r["x"] for r in read_csv(csv_logger.metrics_file)[1]] == ["0.5", "1.5"]
    a.restore(state[0])
    assert a.history("x") == [(3, 0.5)]
    with pytest.raises(ValueError, match="holds 2 logger states but there are 3"):
        loggers.restore(state[:2])
    with pytest.raises(TypeError, match="must be a list of states"):
        loggers.restore({"rows": 1})


def test_collection_reaches_all_then_raises_first_error():
    before, after = MemoryLogger(), MemoryLogger()
    loggers = LoggerCollection([before, Broken(), after])
    with pytest.raises(OSError, match="disk full"):
        loggers.log_metrics({"x": 1.0}, 0)
    assert before.history("x") == after.history("x") == [(0, 1.0)]
    with pytest.raises(TypeError, match="must be a loops.loggers.Logger"):
        LoggerCollection([before, "csv"])


def test_create_loggers_mirrors_the_trainer_flag(tmp_path):
    (default,) = create_loggers(True, tmp_path)
    assert isinstance(default, TensorBoardLogger)
    assert default.log_dir == os.path.join(str(tmp_path), "lightning_logs", "version_0")
    assert create_loggers(False, tmp_path) == [] and create_loggers(None, tmp_path) == []
    a, b = MemoryLogger(), MemoryLogger()
    assert create_loggers(a, tmp_path) == [a]
    assert create_loggers([a, b], tmp_path) == [a, b]
    assert create_loggers((a,), tmp_path) == [a]
    assert create_loggers(LoggerCollection([a, b]), tmp_path) == [a, b]
    for bad in ("tensorboard", 1, {"a": a}):
        with pytest.raises(TypeError, match="logger must be True, False, None, a Logger"):
            create_loggers(bad, tmp_path)
    with pytest.raises(TypeError, match="each item of the logger flag must be"):
        create_loggers([a, "csv"], tmp_path)


def test_logger_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        Logger()


# --------------------------------------------------------------------------- through the Trainer


def _tiny_data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _tiny_loss(apply, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(apply(x), y)


def _trainer_fit(root, loggers, max_epochs=2, callbacks=None, ckpt_path=None, **flags):
    trainer = Trainer(
        default_root_dir=root,
        logger=loggers,
        max_epochs=max_epochs,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        **flags,
    )
    trainer.fit(
        mlp(),
        _tiny_loss,
        optim.adam(1e-2),
        DataLoader(_tiny_data(), batch_size=8),
        DataLoader(_tiny_data(16, 1), batch_size=8),
        ckpt_path=ckpt_path,
    )
    return trainer


def _event_files(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.startswith("events.out.tfevents."))


def _csv_points(csv_logger) -> dict[str, list[tuple[int, float]]]:
    """Every (step, value) of each metric of ``metrics.csv``, as TensorBoard stores it (f32)."""
    columns, rows = read_csv(csv_logger.metrics_file)
    return {
        c: [(int(r["step"]), float(np.float32(r[c]))) for r in rows if r[c] != ""]
        for c in columns
        if c != "step"
    }


def _tb_points(folder) -> dict[str, list[tuple[int, float]]]:
    events = read_events(folder)
    return {tag: scalars(events, tag) for tag in events.Tags()["scalars"]}


def test_trainer_loggers_share_one_version_and_the_checkpoints_follow(tmp_path):
    root = str(tmp_path)
    logs = tmp_path / "lightning_logs"
    first = _trainer_fit(root, [CSVLogger(root), TensorBoardLogger(root)])
    csv_logger, tb_logger = first.loggers
    assert csv_logger.log_dir == tb_logger.log_dir == first.log_dir == str(logs / "version_0")
    assert sorted(os.listdir(logs)) == ["version_0"]
    assert sorted(os.listdir(logs / "version_0")) == [
        "checkpoints",
        *_event_files(logs / "version_0"),
        "metrics.csv",
    ]
    assert os.listdir(logs / "version_0" / "checkpoints") == ["epoch=1-step=8.ckpt"]

    second = _trainer_fit(root, [TensorBoardLogger(root), CSVLogger(root)])
    assert {lg.version for lg in second.loggers} == {1}
    assert sorted(os.listdir(logs)) == ["version_0", "version_1"]
    assert os.listdir(logs / "version_1" / "checkpoints") == ["epoch=1-step=8.ckpt"]

    # an explicit version is the logger's own; the others still pick a new one together
    third = _trainer_fit(
        root, [CSVLogger(root, version=7), TensorBoardLogger(root), CSVLogger(root, name="b")]
    )
    assert [lg.version for lg in third.loggers] == [7, 2, 2]
    assert third.log_dir == str(logs / "version_7")
    assert os.listdir(logs / "version_7" / "checkpoints") == ["epoch=1-step=8.ckpt"]
    named = [CSVLogger(root, version="run_a"), TensorBoardLogger(root, version="run_b")]
    assert [lg.log_dir for lg in create_loggers(named, root)] == [
        str(logs / "run_a"),
        str(logs / "run_b"),
    ]


def test_shared_version_is_free_under_every_root(any_root):
    make_dirs(any_root, "a/version_0", "a/version_3", "b/version_5")
    loggers = LoggerCollection(
        [CSVLogger(any_root, name="a"), MemoryLogger(), TensorBoardLogger(any_root, name="b")]
    )
    assert loggers[2].version == 6  # asking any of them picks it for all
    assert loggers[0].version == 6 and loggers.version == 6
    # reading creates nothing (as in Lightning); a logger whose version was already read
    # keeps it
    fs, path = fsspec.core.url_to_fs(any_root)
    assert not fs.exists(f"{path}/a/version_6") and not fs.exists(f"{path}/b/version_6")
    picked = CSVLogger(any_root, name="a")
    assert picked.version == 4
    again = create_loggers([picked, CSVLogger(any_root, name="b")], any_root)
    assert [lg.version for lg in again] == [4, 6]
    # the first write claims the group's version under both roots at once
    loggers[0].log_hyperparams({"lr": 0.1})
    assert fs.isdir(f"{path}/a/version_6") and fs.isdir(f"{path}/b/version_6")


def test_trainer_resume_stays_in_its_version_and_tensorboard_keeps_one_file_per_run(tmp_path):
    root = str(tmp_path)
    run = tmp_path / "lightning_logs" / "version_0"
    every = ModelCheckpoint(save_top_k=-1)
    killed = _trainer_fit(
        root,
        [CSVLogger(root), TensorBoardLogger(root)],
        max_epochs=30,
        callbacks=[every],
        log_every_n_steps=1,
    )
    assert killed.log_dir == str(run)
    # one event file for the whole run, holding every point the CSV holds
    assert len(_event_files(run)) == 1
    points = _csv_points(killed.loggers[0])
    assert len(points["train_loss"]) == 120 and len(points["val_loss"]) == 30
    assert _tb_points(run) == points

    # resume from an earlier checkpoint: the steps the "killed" run logged after it are
    # superseded, in both loggers, in the same folder; the resume adds one event file
    resumed = _trainer_fit(
        root,
        [CSVLogger(root), TensorBoardLogger(root)],
        max_epochs=32,
        callbacks=[ModelCheckpoint(save_top_k=-1)],
        log_every_n_steps=1,
        ckpt_path=str(run / "checkpoints" / "epoch=9-step=40.ckpt"),
    )
    assert [lg.log_dir for lg in resumed.loggers] == [str(run), str(run)]
    assert sorted(os.listdir(tmp_path / "lightning_logs")) == ["version_0"]
    assert len(_event_files(run)) == 2
    points = _csv_points(resumed.loggers[0])
    assert len(points["train_loss"]) == 128 and len(points["val_loss"]) == 32
    steps = [s for s, _ in points["train_loss"]]
    assert steps == sorted(set(steps))  # no step twice
    assert _tb_points(run) == points


def test_a_logger_failing_to_close_does_not_keep_the_others_open(tmp_path):
    """Driver.finalize closes every logger even when one before it raises, then raises
    that first error: a CSV logger listed after a failing one still flushes its rows."""
    from purestep.loops.driver import Driver
    from purestep.loops.loggers import MemoryLogger

    class Failing(MemoryLogger):
        def finalize(self, status: str) -> None:
            raise RuntimeError("store unreachable")

    after = CSVLogger(tmp_path)
    after.log_metrics({"a": 1.0}, 0)  # buffered until finalize flushes it
    with pytest.raises(RuntimeError, match="store unreachable"):
        Driver(fn="fit", loggers=[Failing(), after]).finalize("failed")
    assert os.path.isfile(after.metrics_file)
