"""The README's and the documentation site's code runs as written, and does what they say.

Every ```python block of README.md and of the site's pages (``docs/``, in the nav's order,
the Lightning guide aside: ``tests/test_guide.py`` runs that one) is executed by a test here
(in reading order where the blocks build on each other, in a temporary folder, as a reader
would), inside a real ``Trainer`` where it is meant for one. Each test declares the blocks it
runs with ``@runs(<first line>, ...)`` and must run exactly those; the last test fails when a
block is declared by no test.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
import textwrap

import pytest
import torch

from tests.docs_book import PAGE, ROOT
from tests.markdown_blocks import first_line

runs, _run, _matching, _python_blocks = PAGE.runs, PAGE.run, PAGE.matching, PAGE.blocks
_first_line = first_line
_DECLARED, _RAN = PAGE.declared, PAGE.ran


TOUR = "import torch, torch.nn as nn, torch.nn.functional as F"
TOUR_TRAINER = "from torch.utils.data import DataLoader, TensorDataset"
STEPS = "step = engine.train_step(net, loss_fn, opt,"
PRECISION = "from purestep import hardware"
CHECKPOINT = "from purestep import checkpoint"
PROPERTY_TEST = "from hypothesis import given"
CALLBACK = "from purestep.loops.callbacks import Callback"
FROM_TORCH = "import functools"
GAN = "from purestep import Task, Trainer, optim"
COMPILE = "from purestep.engine.compile import CompileOptions"


def _readme_order(prefixes: list[str]) -> list[str]:
    firsts = [_first_line(b) for b in _python_blocks()]
    return sorted(prefixes, key=lambda p: next(i for i, f in enumerate(firsts) if f.startswith(p)))


@pytest.mark.bitwise
@runs(TOUR, TOUR_TRAINER, STEPS, PRECISION, CHECKPOINT)
def test_the_tour_steps_precision_and_checkpoint_blocks_run_in_order(capsys):
    from purestep import engine

    order = [TOUR, TOUR_TRAINER, STEPS, PRECISION, CHECKPOINT]
    assert _readme_order(order) == order  # each builds on the ones before
    ns: dict = {}
    _run(TOUR, ns)
    net = ns["net"]
    template = {k: v.clone() for k, v in net.state_dict().items()}

    _run(TOUR_TRAINER, ns)
    state, trainer = ns["state"], ns["trainer"]
    assert state.progress.epoch == 3 and state.progress.step == 24
    assert "test_loss" in capsys.readouterr().out + str(trainer.callback_metrics)
    # the default checkpoint name is Lightning's, as the ModelCheckpoint paragraph says
    names = [os.path.basename(p) for p in glob.glob("runs/tour/**/*.ckpt", recursive=True)]
    assert names == ["epoch=2-step=24.ckpt"], names
    assert trainer.best_model_path.endswith("/checkpoints/epoch=2-step=24.ckpt")
    # the tour's trained module: the state's weights, and the template is untouched
    trained = ns["trained"]
    assert isinstance(trained, torch.nn.Module) and trained is not net
    for name, value in net.state_dict().items():
        assert torch.equal(value, template[name]), name
    x = ns["x"]
    with torch.no_grad():
        assert torch.equal(trained.eval()(x), engine.predict_step(net)(state, x))

    _run(STEPS, ns)
    out = ns["out"]
    assert ns["new_state"].progress.step == state.progress.step + 1 and out.stepped

    _run(PRECISION, ns)
    bf16_state, bf16_step = ns["state"], ns["step"]
    after, bf16_out = bf16_step(bf16_state, (x, ns["y"]))
    assert after.params["0.weight"].dtype == torch.float32  # mixed: float32 weights
    assert torch.isfinite(bf16_out.loss)

    _run(CHECKPOINT, ns)
    assert ns["latest"].endswith(".ckpt")
    assert ns["meta"]["note"] == "x"
    assert ns["state"].progress.step == ns["new_state"].progress.step
    assert os.path.exists("runs/b.ckpt")
    net.load_state_dict(ns["sd"])  # "net.load_state_dict(sd) works"


def _plateau_trainer(callbacks, max_epochs=10):
    from torch.utils.data import DataLoader, TensorDataset

    from purestep import Trainer

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    trainer = Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    return trainer, DataLoader(data, batch_size=16), DataLoader(data, batch_size=32)


@runs(CALLBACK)
def test_the_callback_example_stops_training_after_its_patience_in_a_trainer():
    import torch.nn.functional as F

    from purestep import optim

    ns: dict = {}
    _run(CALLBACK, ns)
    seen = []

    class Spy(ns["StopOnPlateau"]):  # records what the example's handler sees
        name = "StopOnPlateau"

        def on_validation_end(self, state, ctx):
            seen.append((ctx.stage, dict(ctx.metrics), ctx.epoch))
            return super().on_validation_end(state, ctx)

    def loss_fn(apply, batch):
        x, y = batch
        return F.cross_entropy(apply(x), y)

    cb = Spy(patience=2)
    trainer, train, val = _plateau_trainer([cb])
    assert trainer.config.num_sanity_val_steps == 2  # the default sanity check runs
    # lr=0: the validation loss never improves after the first epoch
    state = trainer.fit(torch.nn.Linear(8, 3), loss_fn, optim.sgd(0.0), train, val)
    stages = [stage for stage, _, _ in seen]
    assert stages == ["sanity_check", "validate", "validate", "validate"], stages
    assert "val_loss" not in seen[0][1]  # why the example skips the sanity check
    # epoch 0 sets the best, epochs 1 and 2 wait: the stop comes after patience=2 epochs
    assert state.progress.epoch == 3 and trainer.current_epoch == 3
    assert trainer.should_stop
    assert state.callbacks["StopOnPlateau"] == {"best": seen[1][1]["val_loss"], "wait": 2}

    # without the example, the same run trains all 10 epochs
    trainer, train, val = _plateau_trainer([])
    state = trainer.fit(torch.nn.Linear(8, 3), loss_fn, optim.sgd(0.0), train, val)
    assert state.progress.epoch == 10


def test_the_callback_example_handler_by_hand():
    """The handler alone, through ``dispatch``, as a custom loop would call it."""
    from purestep import engine
    from purestep.engine import optim
    from purestep.loops.callbacks import init_states
    from purestep.loops.events import Context, Stage, dispatch

    ns: dict = {}
    exec(_matching(CALLBACK)[0], ns)  # the block's run is checked by the Trainer test
    cb = ns["StopOnPlateau"](patience=2)
    state = init_states([cb], engine.init(torch.nn.Linear(2, 1), optim.sgd(0.1)))
    ctx = Context(stage=Stage.SANITY_CHECK, fn="fit", state=state, metrics={})
    state, requests = dispatch("on_validation_end", [cb], state, ctx)
    assert not requests.stop and state.callbacks[cb.key]["wait"] == 0
    stops = []
    for loss in [3.0, 2.0, 2.5, 2.5]:
        ctx = Context(stage=Stage.VALIDATE, fn="fit", state=state, metrics={"val_loss": loss})
        state, requests = dispatch("on_validation_end", [cb], state, ctx)
        stops.append(requests.stop)
    assert stops == [False, False, False, True]


@runs(PROPERTY_TEST)
def test_the_property_test_example_passes():
    ns: dict = {}
    _run(PROPERTY_TEST, ns)
    ns["test_my_loop_steps_like_fit"]()


@pytest.mark.bitwise
@runs(FROM_TORCH)
def test_the_from_torch_example_steps_as_torch_s_nadam():
    import torch.nn.functional as F

    from purestep.engine.optim import PartitionState

    torch.manual_seed(0)
    ns: dict = {}
    _run(FROM_TORCH, ns)
    torch.manual_seed(0)
    w, b = torch.randn(3, 2), torch.zeros(3)  # the block's params, drawn again
    hand = torch.optim.NAdam(
        [{"params": [b], "weight_decay": 0.0}, {"params": [w]}],
        lr=ns["optim"].schedules.cosine(2e-3, 1000)(0),
        weight_decay=0.01,
    )
    w.grad, b.grad = torch.ones(3, 2), torch.ones(3)
    hand.step()
    assert torch.equal(ns["params"]["w"], w) and torch.equal(ns["params"]["b"], b)
    state = ns["opt_state"]
    assert isinstance(state, PartitionState) and list(state.inner_states) == ["no_decay", "pg2"]
    from purestep import Trainer

    trainer = Trainer(
        max_steps=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(4, 3), torch.randint(0, 2, (4,))), batch_size=4)
    trained = trainer.fit(
        torch.nn.Linear(3, 2),
        lambda apply, b: F.cross_entropy(apply(b[0]), b[1]),
        ns["nadam_1e3"],
        data,
    )
    assert trained.opt_state.name == "NAdam" and float(trained.opt_state.hyperparams["lr"]) == 1e-3


def test_predict_without_a_predict_step_is_what_the_readme_says():
    """``predict`` with no ``predict_step``: the module on the inputs; a dict batch is a
    clear error (the Trainer bullet about predict)."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    from purestep import Task, engine, optim

    def loss_fn(apply, batch):
        x, y = batch
        return F.cross_entropy(apply(x), y)

    net = torch.nn.Linear(8, 3)
    trainer, train, _ = _plateau_trainer([], max_epochs=1)
    state = trainer.fit(net, loss_fn, optim.sgd(0.1), train)
    x = train.dataset.tensors[0]
    loader = DataLoader(TensorDataset(x, torch.zeros(64)), batch_size=16)
    out = trainer.predict(state, loader)  # (inputs, targets) batches: module(batch[0])
    assert isinstance(out, list) and len(out) == 4
    assert all(o.device.type == "cpu" and not o.requires_grad for o in out)
    assert torch.equal(torch.cat(out), engine.predict_step(net)(state, x))
    two = trainer.predict(state, [loader, DataLoader(x, batch_size=32)])  # plain tensors too
    assert [len(o) for o in two] == [4, 2] and torch.equal(torch.cat(two[1]), torch.cat(out))

    class Dicts(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.randn(8), "y": 0}

    with pytest.raises(TypeError, match=r"no predict_step is defined.*module\(batch\) on a dict"):
        trainer.predict(state, DataLoader(Dicts(), batch_size=2))

    from purestep import loops

    with pytest.raises(TypeError, match=r"no predict_step is defined.*module\(batch\) on a dict"):
        loops.predict(state, engine.predict_step(net), DataLoader(Dicts(), batch_size=2))

    class NoPredict(Task):
        def training_step(self, apply, batch):
            return apply(batch["x"]).square().mean()

        def configure_optimizers(self):
            return optim.sgd(0.1)

    with pytest.raises(TypeError, match="Define predict_step"):
        trainer.predict(NoPredict(torch.nn.Linear(8, 3)), DataLoader(Dicts(), batch_size=2))

    class WithPredict(NoPredict):  # an error in the user's own predict_step is left as it is
        def predict_step(self, apply, batch):
            raise TypeError("mine")

    with pytest.raises(TypeError, match="^mine") as caught:
        trainer.predict(WithPredict(torch.nn.Linear(8, 3)), DataLoader(Dicts(), batch_size=2))
    assert "no predict_step" not in str(caught.value)


PROFILING = "from purestep.loops.profiling import parse_report"


@runs(GAN)
def test_the_gan_in_the_trainer_block(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    _run(GAN, ns)
    state, trainer = ns["state"], ns["trainer"]
    assert state.opt_state.steps == {"disc": 32, "gen": 16} and trainer.global_step == 16
    assert capsys.readouterr().out.strip().endswith("{'disc': 32, 'gen': 16} 16")
    from purestep.engine import optim

    assert optim.injected_values(state.opt_state.states["gen"], "lr") == [1e-4]  # epoch 1
    assert optim.injected_values(state.opt_state.states["disc"], "lr") == [2e-4]
    assert glob.glob("runs/gan/**/*.ckpt", recursive=True)


@runs(PROFILING)
def test_the_profiling_example_reports_the_actions_and_logs_the_monitors(capsys):
    pytest.importorskip("psutil")
    ns: dict = {}
    _run(PROFILING, ns)
    trainer, report = ns["trainer"], ns["report"]
    path = trainer.profiler.report_path
    assert path == os.path.join(trainer.log_dir, "fit-profile.txt") and "runs/profiled" in path
    assert report["optimizer_step"]["Num calls"] == trainer.global_step == 16
    assert report["[FitLoop].train_dataloader_next"]["Num calls"] == 16
    assert report["run_training_epoch"]["Num calls"] == 2
    assert "Profiler Report (fit)" in capsys.readouterr().err  # "prints the table at the end"
    logged = trainer.logged_metrics
    assert logged["train/device/samples_per_sec"] > 0 and logged["train/samples"] > 0
    assert "DeviceStatsMonitor.on_train_batch_end/process_rss_bytes" in logged


FSDP_EXAMPLE = "# fsdp_example.py: run it as a script"


@pytest.mark.timeout(240)
@runs(FSDP_EXAMPLE)
def test_the_fsdp_example_trains_on_two_ranks_and_continues_on_one(tmp_path, monkeypatch, capsys):
    """The block as the script it says it is, in this process (no interpreter to start): its
    module imported from a file (the spawned ranks import ``train`` from it), then its
    ``__main__`` part run in that module's namespace."""
    import importlib

    blocks = _matching(FSDP_EXAMPLE)
    assert len(blocks) == 1
    _RAN.append(FSDP_EXAMPLE)
    (tmp_path / "fsdp_example.py").write_text(blocks[0])
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _, main = blocks[0].split('if __name__ == "__main__":\n')
    try:
        module = importlib.import_module("fsdp_example")
        capsys.readouterr()
        exec(textwrap.dedent(main), vars(module))
    finally:
        sys.modules.pop("fsdp_example", None)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[-3:] == ["[3, 3]", "[5]", "5 1"], lines  # what the comments say
    assert {"COMMITTED", "purestep.json", ".metadata"} <= set(os.listdir(tmp_path / "fsdp.ckpt"))


TUNER = "from purestep import Trainer, Tuner, optim"
AVERAGING = "from purestep.loops.callbacks import EMA, PredictionWriter"


@pytest.mark.bitwise
@runs(TUNER, AVERAGING)
def test_the_tuner_averaging_and_writer_examples_do_what_the_readme_says(monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    assert _readme_order([AVERAGING, TUNER]) == [TUNER, AVERAGING]  # the second uses the first
    ns: dict = {}
    _run(TUNER, ns)
    task, dm, finder, state = ns["task"], ns["dm"], ns["finder"], ns["state"]
    assert ns["size"] == dm.batch_size == 8  # "2, 4, 8 ran: 8"
    assert task.lr == finder.suggestion() and os.path.getsize("lr_find.png") > 0
    assert len(finder.results["lr"]) == len(finder.results["loss"]) <= 40
    # "from the very state the searches started from": the same fit on a trainer that ran
    # no search ends bitwise the same
    tr = ns["Trainer"](max_epochs=2, enable_progress_bar=False, logger=False)
    by_hand = tr.fit(task, datamodule=dm)
    for k in state.params:
        assert torch.equal(state.params[k], by_hand.params[k]), k
    capsys.readouterr()

    _run(AVERAGING, ns)
    state, ema = ns["state"], ns["ema"]
    assert state.callbacks["StochasticWeightAveraging"]["n_averaged"] == 2  # "epochs 3 and 4"
    assert set(ema) == set(state.params)
    assert any(not torch.equal(ema[k], state.params[k]) for k in ema)
    logits = ns["logits"]
    assert logits.shape == (512, 2) and "torch.Size([512, 2])" in capsys.readouterr().out
    from purestep.engine import to_module

    model = to_module(state, ns["net"]).eval()
    with torch.no_grad():
        want = model(ns["points"].tensors[0])  # "row k: sample k of `points`"
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


@runs(COMPILE)
def test_the_compile_block_compiles_one_graph_and_keeps_the_state(capsys):
    ns: dict = {}
    _run(COMPILE, ns)
    step, state = ns["step"], ns["state"]
    assert step.compilations == 1 and state.progress.step == 10
    assert ns["evaluate"].compilations == 1
    assert "compiled in" in capsys.readouterr().out


SEEDING = "import purestep, torch, torch.nn as nn, torch.nn.functional as F"


@pytest.mark.bitwise
@runs(SEEDING)
def test_the_seeding_block_repeats_its_run_in_one_process():
    first: dict = {}
    _run(SEEDING, first)
    torch.rand(3)  # whatever runs in between
    again: dict = {}
    exec(_matching(SEEDING)[0], again)
    from purestep.engine import tree

    assert tree.trees_equal(first["state"], again["state"])
    assert torch.equal(first["data"].tensors[0], again["data"].tensors[0])


LIGHTNING_STYLE = "import torch, torch.nn.functional as F"
TASK_FORM = "class TaskClassifier(purestep.Task):"


@runs(LIGHTNING_STYLE, TASK_FORM)
def test_the_lightning_style_block_trains_and_leaves_the_weights_in_the_module(capsys):
    ns: dict = {}
    _run(LIGHTNING_STYLE, ns)
    _run(TASK_FORM, ns)
    assert "val_acc" in ns["task_trainer"].callback_metrics
    assert ns["task_state"].progress.epoch == 4
    model, trainer = ns["model"], ns["trainer"]
    assert {"train_loss_step", "train_loss_epoch", "val_acc"} <= set(trainer.callback_metrics)
    assert trainer.callback_metrics["val_acc"] > 0.5  # 3 classes: chance is about 0.4
    state = trainer.train_state
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, state.params[name]), name
    from purestep.engine.optim import injected_values

    # StepLR(step_size=2, gamma=0.1) over 4 epochs: the last epoch ran at 1e-2 * 0.1
    assert injected_values(state.opt_state, "lr") == [1e-2 * 0.1]


def test_every_python_block_of_the_book_is_run_by_a_test():
    """Every block of the README and the site's pages is declared by a test here or in
    another test file that declares blocks with ``@PAGE.runs`` (each is imported here, so
    that its declarations count when this file runs alone)."""
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py"))):
        with open(path, encoding="utf-8") as f:
            declares = "@PAGE.runs(" in f.read()
        if declares and os.path.basename(path) != "test_readme.py":
            importlib.import_module(os.path.basename(path)[: -len(".py")])
    blocks = _python_blocks()
    assert blocks, "no ```python blocks found in the README and the site's pages"
    unrun = [
        _first_line(b) for b in blocks if not any(_first_line(b).startswith(p) for p in _DECLARED)
    ]
    assert not unrun, f"python blocks that no test runs (add them to a @runs test): {unrun}"
    for prefix in _DECLARED:
        assert len(_matching(prefix)) == 1, f"{prefix!r} matches {len(_matching(prefix))} blocks"
