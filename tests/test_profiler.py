"""Profilers: the actions the loops time, read back from the reports they write.

The simple profiler's table file, the advanced profiler's per-action ``pstats`` and the
PyTorch profiler's trace JSON are parsed back and checked against what the loop did (the
number of batches, optimizer steps, validations, callback events, logger calls, checkpoint
saves). A profiled run computes bitwise what an unprofiled one does, and without a profiler
the loops run their unprofiled code (nothing is wrapped).
"""

from __future__ import annotations

import glob
import json
import math
import os
import pstats

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import engine
from purestep.engine import optim
from purestep.engine.tree import assert_trees_equal
from purestep.loops import Driver, LoopConfig, Trainer, fit
from purestep.loops.callbacks import LambdaCallback, ModelCheckpoint
from purestep.loops.loggers import MemoryLogger
from purestep.loops.profiling import (
    AdvancedProfiler,
    PassThroughProfiler,
    Profiler,
    PyTorchProfiler,
    SimpleProfiler,
    parse_report,
    resolve,
)


def data(n: int = 24, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def loader(n: int = 24, batch_size: int = 4) -> DataLoader:
    return DataLoader(data(n), batch_size=batch_size)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def counting_loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def trainer(**flags) -> Trainer:
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("logger", MemoryLogger())
    t = Trainer(**flags)
    t._printer = lambda s: None
    return t


def read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


class FakeClock:
    def __init__(self, step: float = 1.0) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


# ---------------------------------------------------------------------- the profilers alone


def test_simple_profiler_table_reads_back_with_exact_counts_and_means():
    prof = SimpleProfiler(clock=FakeClock())  # every reading is 1 s after the previous
    prof.setup("fit")
    for _ in range(3):
        with prof.profile("outer"):
            prof.start("inner")
            prof.stop("inner")
    rows = parse_report(prof.summary())
    assert rows["inner"]["Num calls"] == 3 and rows["inner"]["Mean duration (s)"] == 1.0
    # outer spans its own start, inner's start and stop, and its stop: 3 s each
    assert rows["outer"]["Num calls"] == 3 and rows["outer"]["Total time (s)"] == 9.0
    assert rows["Total"]["Num calls"] == 6 and rows["Total"]["Percentage %"] == 100
    total = rows["Total"]["Total time (s)"]
    assert rows["outer"]["Percentage %"] == pytest.approx(100 * 9 / total, rel=1e-3)
    assert list(rows) == ["Total", "outer", "inner"]  # the busiest first
    short = SimpleProfiler(extended=False, clock=FakeClock())
    short.setup()
    with short.profile("a"):
        pass
    assert parse_report(short.summary())["a"] == {"Mean duration (s)": 1.0, "Total time (s)": 1.0}


def test_profilers_refuse_unbalanced_actions_and_bad_arguments():
    for prof in (SimpleProfiler(), AdvancedProfiler()):
        prof.setup("fit")
        prof.start("a")
        with pytest.raises(ValueError, match="already started"):
            prof.start("a")
        with pytest.raises(ValueError, match="never started"):
            prof.stop("b")
        prof.stop("a")
        prof.teardown()
    with pytest.raises(ValueError, match="path separator"):
        SimpleProfiler(filename="a/b")
    with pytest.raises(ValueError, match="line_count_restriction"):
        AdvancedProfiler(line_count_restriction=0)
    with pytest.raises(ValueError, match="torch.profiler.schedule"):
        PyTorchProfiler(schedule={"wait": 1, "often": 2})
    # sort keys are checked when made, not after the whole run
    with pytest.raises(ValueError, match="not a pstats sort key; one of calls"):
        AdvancedProfiler(sort_by="bogus")
    with pytest.raises(ValueError, match="not a column of the summary table"):
        PyTorchProfiler(sort_by_key="cpu_time_totl")
    with pytest.raises(ValueError, match="'simple', 'advanced', 'pytorch'"):
        resolve("fancy")
    with pytest.raises(ValueError, match="profiler must be"):
        Trainer(profiler=3)
    with pytest.raises(ValueError, match=r"pass an instance, SimpleProfiler\(\)"):
        Trainer(profiler=SimpleProfiler)


def test_reports_of_other_ranks_are_written_with_their_rank_and_not_printed(tmp_path):
    printed: list[str] = []
    prof = SimpleProfiler(clock=FakeClock())
    prof.setup("test", 1, str(tmp_path), primary=False, printer=printed.append)
    with prof.profile("test_step"):
        pass
    prof.describe()
    assert prof.report_path == str(tmp_path / "test-profile-1.txt")
    assert parse_report(read(prof.report_path))["test_step"]["Num calls"] == 1
    assert printed == []
    prof.setup("test", None, str(tmp_path), printer=printed.append)
    prof.describe()  # nothing measured in this run: no report
    assert printed == []
    with prof.profile("x"):
        pass
    prof.describe()
    assert printed and "x" in printed[0]
    assert prof.prepare_filename("[Callback]a/b c") == "test-profile-[Callback]a_b_c.txt"


def test_resolve_and_the_trainer_default():
    assert isinstance(resolve("Simple"), SimpleProfiler)
    assert isinstance(resolve("advanced"), AdvancedProfiler)
    assert isinstance(resolve("pytorch"), PyTorchProfiler)
    mine = SimpleProfiler()
    assert resolve(mine) is mine
    assert isinstance(Trainer(logger=False).profiler, PassThroughProfiler)


def test_without_a_profiler_the_loop_runs_its_unprofiled_code():
    d = Driver(fn="fit", profiler=PassThroughProfiler())
    assert d.profiler is None
    t = trainer(max_epochs=1, enable_checkpointing=False)
    t.fit(net(), counting_loss, optim.sgd(0.1), loader())
    assert t._driver.profiler is None
    assert type(t._loop._stepper).__name__ != "ProfiledTrainStep"
    t2 = trainer(max_epochs=1, enable_checkpointing=False, profiler="simple")
    t2.fit(net(), counting_loss, optim.sgd(0.1), loader())
    assert type(t2._loop._stepper).__name__ == "ProfiledTrainStep"


# ---------------------------------------------------------------------- simple, in the Trainer


def test_simple_profiler_report_file_counts_what_the_fit_did(tmp_path):
    logger = MemoryLogger()
    probe = LambdaCallback(name="probe", on_train_batch_end=lambda ctx: None)
    printed: list[str] = []
    t = Trainer(
        max_epochs=2,
        profiler="simple",
        default_root_dir=tmp_path,
        logger=logger,
        log_every_n_steps=2,
        limit_val_batches=3,
        num_sanity_val_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)],
    )
    t._printer = printed.append
    train_batches, epochs = 6, 2  # 24 samples in batches of 4

    def task_loss(apply, batch):
        return counting_loss(apply, batch)

    from purestep.loops import Task

    class Classifier(Task):
        def __init__(self):
            super().__init__()
            self.model = net()

        def training_step(self, apply, batch):
            return task_loss(apply, batch)

        def validation_step(self, apply, batch):
            return task_loss(apply, batch)

        def configure_optimizers(self):
            return optim.sgd(0.1)

    t.fit(Classifier(), train_dataloaders=loader(), val_dataloaders=loader(16))
    path = os.path.join(t.log_dir, "fit-profile.txt")
    assert t.profiler.report_path == path
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.strip() in printed  # printed at the end, and the same table in the file
    rows = parse_report(text)

    def calls(action):
        return rows[action]["Num calls"]

    batches = train_batches * epochs
    assert calls("training_step") == batches
    assert calls("optimizer_step") == t.global_step == batches
    assert calls("[FitLoop].train_dataloader_next") == batches
    assert calls("run_training_batch") == batches
    assert calls("run_training_epoch") == epochs
    assert calls("[Callback]probe.on_train_batch_end") == batches
    assert calls("run_sanity_check") == 1 and calls("run_validation") == epochs
    assert calls("validation_step") == 2 + 3 * epochs  # sanity batches, then 3 per validation
    assert calls("[EvaluationLoop].val_next") == calls("validation_step")
    ckpts = glob.glob(str(tmp_path / "ckpt" / "*.ckpt"))
    assert calls("save_checkpoint") == len(ckpts) == epochs
    assert calls("[Logger]MemoryLogger.log_metrics") == len(logger.metrics)
    # the sanity check's validation fires the validation events too, as in Lightning
    assert calls("[Callback]ModelCheckpoint.on_validation_end") == epochs + 1
    for action, row in rows.items():
        assert 0 <= row["Percentage %"] <= 100, action
        if action != "Total":
            assert row["Mean duration (s)"] == pytest.approx(
                row["Total time (s)"] / row["Num calls"], rel=1e-4, abs=1e-9
            )


def test_each_entry_point_writes_its_own_report(tmp_path):
    t = trainer(profiler=SimpleProfiler(filename="perf"), default_root_dir=tmp_path)
    t.test(net(), loader(12), fn=counting_loss, verbose=False)
    test_rows = parse_report(read(os.path.join(t.log_dir, "test-perf.txt")))
    assert test_rows["test_step"]["Num calls"] == 3
    assert test_rows["[EvaluationLoop].test_next"]["Num calls"] == 3
    assert test_rows["run_test"]["Num calls"] == 1
    t.predict(net(), loader(20))
    rows = parse_report(read(os.path.join(t.log_dir, "predict-perf.txt")))
    assert rows["predict_step"]["Num calls"] == 5
    assert rows["[PredictionLoop].predict_next"]["Num calls"] == 5
    assert "test_step" not in rows  # a new run starts a new report


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 9),
    epochs=st.integers(1, 3),
    limit=st.one_of(st.none(), st.integers(1, 9)),
    accumulate=st.integers(1, 3),
)
def test_profiled_counts_follow_the_loop(n, epochs, limit, accumulate):
    """Property: whatever the limits and accumulation, each batch is fetched, stepped and
    processed once, an optimizer step is timed per closed window, and an epoch per epoch."""
    config = LoopConfig.create(
        {
            "max_epochs": epochs,
            "limit_train_batches": limit,
            "accumulate_grad_batches": accumulate,
            "num_sanity_val_steps": 0,
        }
    )
    prof = SimpleProfiler()
    driver = Driver(fn="fit", config=config, profiler=prof, printer=lambda s: None)
    model = net()
    state = engine.init(model, optim.sgd(0.1), seed=0)
    step = engine.train_step(model, counting_loss, optim.sgd(0.1), accumulate=accumulate)
    final = fit(state, step, data(n), driver=driver)  # batches of one sample
    rows = prof.recorded
    per_epoch = n if limit is None else min(n, limit)
    assert rows["training_step"][0] == per_epoch * epochs == final.progress.total_batches
    assert rows["[FitLoop].train_dataloader_next"][0] == per_epoch * epochs
    assert rows["run_training_batch"][0] == per_epoch * epochs
    assert rows["optimizer_step"][0] == final.progress.step
    assert final.progress.step == epochs * math.ceil(per_epoch / accumulate)
    assert rows["run_training_epoch"][0] == epochs


@pytest.mark.bitwise
@pytest.mark.parametrize("kind", ["simple", "advanced"])
def test_a_profiled_fit_is_bitwise_the_unprofiled_fit(kind):
    def run(profiler):
        t = trainer(max_epochs=2, enable_checkpointing=False, profiler=profiler)
        return t.fit(net(), counting_loss, optim.adam(1e-2), loader(), loader(8))

    plain, profiled = run(None), run(kind)
    for name, p in plain.params.items():
        assert torch.equal(p, profiled.params[name]), name
    assert_trees_equal(plain, profiled)  # every leaf: optimizer, loop state, callbacks


def test_a_failed_run_still_reports_what_it_timed(tmp_path):
    calls = []

    def failing(apply, batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return counting_loss(apply, batch)

    t = trainer(max_epochs=1, profiler="simple", default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(net(), failing, optim.sgd(0.1), loader())
    rows = parse_report(read(t.profiler.report_path))
    assert rows["training_step"]["Num calls"] == 4  # the failing one included
    assert rows["optimizer_step"]["Num calls"] == 3


def test_a_profiler_of_ones_own_sees_properly_nested_actions():
    class Recording(Profiler):
        def __init__(self):
            super().__init__()
            self.stack, self.log, self.stages = [], [], []

        def setup(self, stage=None, *args, **kwargs):
            super().setup(stage, *args, **kwargs)
            self.stages.append(stage)

        def start(self, action):
            self.stack.append(action)
            self.log.append(action)

        def stop(self, action):
            assert self.stack.pop() == action  # every stop closes the innermost action

        def summary(self):
            return f"{len(self.log)} actions"

    prof = Recording()
    t = trainer(max_epochs=1, profiler=prof, enable_checkpointing=False)
    t.fit(net(), counting_loss, optim.sgd(0.1), loader(8), loader(8))
    assert prof.stack == [] and prof.stages == ["fit"]
    assert prof.log.count("training_step") == 2
    assert prof.log.index("run_sanity_check") < prof.log.index("run_training_epoch")


# ---------------------------------------------------------------------- advanced


def test_advanced_profiler_per_action_stats_read_back(tmp_path):
    prof = AdvancedProfiler(dirpath=tmp_path, filename="adv", dump_stats=True)
    t = trainer(max_epochs=1, profiler=prof, enable_checkpointing=False)

    class Samples(torch.utils.data.Dataset):
        def __init__(self):
            self.inner = data(24)

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner[i]

    t.fit(net(), counting_loss, optim.sgd(0.1), DataLoader(Samples(), batch_size=4))
    text = read(tmp_path / "fit-adv.txt")
    assert "Profile stats for: training_step" in text
    assert "Profile stats for: optimizer_step" in text

    def calls_of(action, function):
        """Calls of this file's ``function`` in ``action``'s profile."""
        stats = pstats.Stats(str(tmp_path / f"fit-adv-{action}.prof"))
        return sum(
            nc
            for (file, _, name), (_, nc, *_) in stats.stats.items()
            if name == function and file == __file__
        )

    assert calls_of("training_step", "counting_loss") == 6
    # exclusive profiles: the loss runs inside the step, not in the batch around it
    assert calls_of("run_training_batch", "counting_loss") == 0
    assert calls_of("[FitLoop].train_dataloader_next", "__getitem__") == 24  # the samples
    assert prof.stats("training_step").total_calls > 0


# ---------------------------------------------------------------------- pytorch


def test_pytorch_profiler_trace_reads_back(tmp_path):
    prof = PyTorchProfiler(schedule={"wait": 1, "warmup": 1, "active": 2})
    t = trainer(max_epochs=1, profiler=prof, default_root_dir=tmp_path, enable_checkpointing=False)
    t.fit(net(), counting_loss, optim.sgd(0.1), loader())  # 6 steps: 1 waits, 1 warms up
    files = prof.trace_files()
    assert len(files) == 1
    # the layout torch.profiler.tensorboard_trace_handler writes: <worker>.<ns>.pt.trace.json
    name = os.path.basename(files[0])
    assert os.path.dirname(files[0]) == t.log_dir and name.startswith("fit-profile.")
    assert name.endswith(".pt.trace.json")
    with open(files[0], encoding="utf-8") as f:
        trace = json.load(f)  # the Chrome trace format chrome://tracing reads
    events = trace["traceEvents"]
    ours = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    assert ours.count("training_step") == 2
    assert ours.count("optimizer_step") == 2
    assert sum(n.startswith("ProfilerStep#") for n in ours) == 2
    assert "[FitLoop].train_dataloader_next" in ours
    assert any(e.get("cat") == "cpu_op" for e in events)  # torch's operators inside
    assert "training_step" in prof.summary()


def test_pytorch_profiler_says_when_nothing_was_recorded(tmp_path):
    prof = PyTorchProfiler(dirpath=tmp_path, schedule={"wait": 5, "warmup": 1, "active": 1})
    t = trainer(max_epochs=1, profiler=prof, enable_checkpointing=False)
    t.fit(net(), counting_loss, optim.sgd(0.1), loader(8))
    assert "nothing recorded" in prof.summary()
    assert prof.trace_files() == []


def test_several_optimizers_time_each_batch_and_advance_the_pytorch_schedule(tmp_path):
    """A two-optimizer fit runs its batches through one several-optimizer step: each batch
    is still a ``training_step`` (and so a step of ``torch.profiler``'s schedule)."""
    from purestep.loops import Task

    class TwoOptimizers(Task):
        def __init__(self):
            super().__init__(nn.ModuleDict({"a": nn.Linear(4, 8), "b": nn.Linear(8, 2)}))

        def training_step(self, apply, batch, optimizer_idx):
            x, y = batch
            return F.cross_entropy(apply["b"](torch.relu(apply["a"](x))), y)

        def configure_optimizers(self):
            return [
                {"optimizer": optim.sgd(0.1), "params": "a"},
                {"optimizer": optim.sgd(0.1), "params": "b"},
            ]

    simple = SimpleProfiler()
    t = trainer(max_epochs=1, enable_checkpointing=False, profiler=simple)
    t.fit(TwoOptimizers(), train_dataloaders=loader())
    assert simple.recorded["training_step"][0] == 6 == t.global_step
    prof = PyTorchProfiler(dirpath=tmp_path, schedule={"wait": 1, "warmup": 1, "active": 2})
    t = trainer(max_epochs=1, enable_checkpointing=False, profiler=prof)
    t.fit(TwoOptimizers(), train_dataloaders=loader())
    assert prof.steps == 6 and len(prof.trace_files()) == 1


def test_a_failing_report_still_closes_the_loggers_and_the_profiler():
    class Broken(SimpleProfiler):
        torn_down = False

        def summary(self):
            raise OSError("disk full")

        def teardown(self, stage=None):
            self.torn_down = True

    logger, prof = MemoryLogger(), Broken()
    t = trainer(max_epochs=1, enable_checkpointing=False, profiler=prof, logger=logger)
    with pytest.raises(OSError, match="disk full"):
        t.fit(net(), counting_loss, optim.sgd(0.1), loader(8))
    assert prof.torn_down and logger.status == "success"


@pytest.mark.bitwise
def test_a_profiled_run_resumed_mid_epoch_is_bitwise_the_uninterrupted_one(tmp_path):
    """The README's claim: timings never enter the state, so a profiled run that crashed
    mid-epoch and resumed (profiled) from its last checkpoint ends bitwise where an
    unprofiled uninterrupted run does."""
    seen = []

    def crashing(apply, batch):
        seen.append(torch.is_grad_enabled())  # training, not the sanity check's validation
        if sum(seen) == 4:  # the fourth batch of the first epoch (6 batches)
            raise RuntimeError("crash")
        return counting_loss(apply, batch)

    def run(name, profiler, loss_fn, ckpt_path=None):
        ckpt = ModelCheckpoint(dirpath=tmp_path / name, save_last=True, every_n_train_steps=1)
        t = trainer(max_epochs=2, profiler=profiler, callbacks=[ckpt], default_root_dir=tmp_path)
        state = t.fit(net(), loss_fn, optim.adam(1e-2), loader(), loader(8), ckpt_path=ckpt_path)
        return state, t

    full, _ = run("full", None, counting_loss)
    with pytest.raises(RuntimeError, match="crash"):
        run("crashed", "simple", crashing)
    last = str(tmp_path / "crashed" / "last.ckpt")
    resumed, t = run("crashed", "simple", counting_loss, ckpt_path=last)
    assert resumed.progress.step == full.progress.step == 12
    rows = parse_report(read(t.profiler.report_path))
    assert rows["training_step"]["Num calls"] == 12 - 3  # from the third step's checkpoint
    assert_trees_equal(full.params, resumed.params)
    assert_trees_equal(full.opt_state, resumed.opt_state)


def test_every_accepted_sort_key_sorts_the_pytorch_summary():
    from purestep.loops.profiling.pytorch import SORT_KEYS

    prof = PyTorchProfiler(schedule={"wait": 0, "warmup": 1, "active": 2}, export_to_chrome=False)
    prof.setup("fit")
    for _ in range(3):
        with prof.profile("training_step"):
            torch.randn(8, 8) @ torch.randn(8, 8)
    prof.teardown()
    for key in sorted(SORT_KEYS):
        prof.sort_by_key = key
        assert "aten::mm" in prof.summary(), key
    for key in ("cumulative", "tottime", "calls"):
        adv = AdvancedProfiler(sort_by=key)
        adv.setup("fit")
        with adv.profile("a"):
            sum(range(10))
        assert "Profile stats for: a" in adv.summary()


def test_a_callback_named_like_an_observer_keeps_its_own_label():
    """Labels are per kind: a callback keyed ``BatchCounts`` is not the ``BatchCounts``
    observer the Trainer runs on the same event."""
    twin = LambdaCallback(name="BatchCounts", on_validation_start=lambda ctx: None)
    prof = SimpleProfiler()
    t = trainer(max_epochs=1, enable_checkpointing=False, profiler=prof, callbacks=[twin])
    t.fit(net(), counting_loss, optim.sgd(0.1), loader(8), loader(8))
    rows = prof.recorded
    assert rows["[Observer]BatchCounts.on_validation_start"][0] == 2  # sanity check, epoch
    assert rows["[Callback]BatchCounts.on_validation_start"][0] == 2


def test_reports_refuse_a_link_planted_at_their_names(tmp_path):
    """A planted symbolic link at a report's name is refused, its target untouched: the
    text report and AdvancedProfiler's ``.prof`` dumps alike."""
    from purestep.loops.loggers import LinkRefusedError

    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    folder = tmp_path / "reports"
    folder.mkdir()
    os.symlink(outside, folder / "test-perf.txt")
    t = trainer(profiler=SimpleProfiler(dirpath=folder, filename="perf"))
    with pytest.raises(LinkRefusedError):
        t.test(net(), loader(12), fn=counting_loss, verbose=False)
    assert outside.read_text() == "keep"
    prof = AdvancedProfiler(dirpath=folder, filename="adv", dump_stats=True)
    os.symlink(outside, folder / "test-adv-run_test.prof")
    with pytest.raises(LinkRefusedError):
        trainer(profiler=prof).test(net(), loader(12), fn=counting_loss, verbose=False)
    assert outside.read_text() == "keep"
