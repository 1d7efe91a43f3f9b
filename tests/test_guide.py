"""The "Coming from Lightning" guide's code runs as written, and does what the page says.

Every ```python block of docs/coming_from_lightning.md is executed by a test here (in a
temporary folder, as a reader would). Each test declares the blocks it runs with
``@runs(<first line>, ...)`` and must run exactly those; the last test fails when a block
is declared by no test. Blocks written for Lightning itself skip when ``lightning`` is not
installed.
"""

from __future__ import annotations

import difflib
import glob
import os
import warnings

import pytest
import torch

from tests.markdown_blocks import MarkdownBlocks, first_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "coming_from_lightning.md")

LIT_CALLBACK = "# a Lightning callback"
PURE_CALLBACK = "# the same callback, pure"
LIT_PORT = "# port_lightning.py"
PURE_PORT = "# port_purestep.py"
RESUME = "# resume:"
TASK = "# the port's classifier as a Task"


PAGE = MarkdownBlocks(GUIDE, "coming_from_lightning.md")
runs, _run, _block, _python_blocks, _exec = PAGE.runs, PAGE.run, PAGE.block, PAGE.blocks, PAGE.exec
_first_line = first_line
_DECLARED = PAGE.declared


def _up_to(prefix: str, marker: str, namespace: dict, *, include: bool = False) -> None:
    """Execute a block up to the first line that starts with ``marker`` (that line too with
    ``include``): the definitions another test builds on, without the block's own run.
    Not counted as running the block."""
    lines = _block(prefix).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(marker))
    _exec("\n".join(lines[: at + 1 if include else at]), f"{prefix} (part)", namespace)


def _changed_lines(a: str, b: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def test_the_two_ports_differ_only_in_their_first_comment_and_the_import_lines():
    changed = _changed_lines(_block(LIT_PORT), _block(PURE_PORT))
    assert changed == [
        "-# port_lightning.py: the Lightning script",
        "+# port_purestep.py: the same script under purestep",
        "-from lightning.pytorch import LightningDataModule, LightningModule, Trainer, "
        "seed_everything",
        "-from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint",
        "+from purestep import DataModule as LightningDataModule, LightningModule, Trainer, "
        "seed_everything",
        "+from purestep.loops.callbacks import EarlyStopping, ModelCheckpoint",
    ], changed


@pytest.mark.bitwise
@runs(PURE_PORT, RESUME)
def test_the_purestep_port_trains_and_its_preempted_run_resumes_bit_exactly(capsys):
    from purestep.engine import tree

    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no attribute the steps change, etc.
        warnings.filterwarnings("ignore", message=".*log_every_n_steps.*")
        _run(PURE_PORT, ns)
    trainer, model, state = ns["trainer"], ns["model"], ns["trainer"].train_state
    assert model.hparams == {"hidden": 32, "lr": 0.1}
    # the module holds the trained weights after fit, as in Lightning
    for name, value in model.named_parameters():
        assert torch.equal(value, state.params[name]), name
    # after validate() the fit's values stay beside the validation's (Lightning keeps only these)
    assert {"train_loss", "val_loss", "val_acc"} == set(trainer.callback_metrics)
    # the files the page names
    folder = "runs/port/lightning_logs/version_0"
    names = sorted(os.path.basename(p) for p in glob.glob(f"{folder}/checkpoints/*.ckpt"))
    assert names == ["epoch=3-step=64.ckpt", "last.ckpt"], names
    assert os.path.exists(f"{folder}/hparams.yaml") and glob.glob(f"{folder}/events.out.*")
    assert state.progress.epoch == 4 and state.progress.step == 64
    out = capsys.readouterr().out
    assert "'val_loss'" in out and "'val_acc'" in out  # validate(model, ckpt_path="best")
    best = ns["best"]
    assert type(best).__name__ == "LitClassifier" and best.hparams == model.hparams
    assert trainer.checkpoint_callback.best_model_path.endswith("epoch=3-step=64.ckpt")

    _run(RESUME, ns)
    assert ns["sent"] == [20]  # one SIGTERM, at step 20 of 64 (epoch 1)
    out = capsys.readouterr().out
    assert "preempted, exit code 75" in out
    resumed, uninterrupted = ns["resumed"], ns["uninterrupted"]
    assert resumed.progress.step == uninterrupted.progress.step == 64
    assert tree.trees_equal(resumed, uninterrupted)
    # the relaunch resumed the preempted run's folder, it did not start a new version
    assert sorted(os.listdir("runs/job/lightning_logs")) == ["version_0"]


@runs(PURE_CALLBACK)
def test_the_pure_callback_stops_a_purestep_run_and_keeps_its_count_in_the_state():
    ns: dict = {}
    _up_to(PURE_PORT, "seed_everything(0)", ns)
    _run(PURE_CALLBACK, ns)
    ns["seed_everything"](0)
    trainer = ns["Trainer"](
        max_epochs=10,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[ns["StopWhenAccurate"](0.5)],
    )
    state = trainer.fit(ns["LitClassifier"](), datamodule=ns["Points"]())
    assert state.progress.epoch < 10 and trainer.should_stop
    assert state.callbacks["StopWhenAccurate"] == {"hits": 2}
    assert float(trainer.callback_metrics["accurate_epochs"]) == 2.0


@runs(TASK)
def test_the_task_block_trains_an_ensemble_of_four_on_the_ports_datamodule(capsys):
    ns: dict = {}
    _up_to(PURE_PORT, "seed_everything(0)", ns)
    _run(TASK, ns)
    state, trainer = ns["state"], ns["trainer"]
    assert all(p.shape[0] == 4 for p in state.params.values())
    members = [float(trainer.callback_metrics[f"val_acc/{i}"]) for i in range(4)]
    assert len(set(members)) > 1  # the members start from their own initial weights
    assert float(trainer.callback_metrics["val_acc"]) == pytest.approx(sum(members) / 4)
    assert state.progress.epoch == 2
    assert "tensor(" in capsys.readouterr().out


@runs(LIT_PORT, LIT_CALLBACK)
def test_the_lightning_blocks_run_under_lightning():
    pytest.importorskip("lightning.pytorch")
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging cadence
        _run(LIT_PORT, ns)
        folder = "runs/port/lightning_logs/version_0/checkpoints"
        names = sorted(os.path.basename(p) for p in glob.glob(f"{folder}/*.ckpt"))
        assert names == ["epoch=3-step=64.ckpt", "last.ckpt"], names
        # Lightning's validate() leaves only its own values in callback_metrics
        assert {"val_loss", "val_acc"} == set(ns["trainer"].callback_metrics)

        _run(LIT_CALLBACK, ns)
        callback = ns["StopWhenAccurate"](0.5)
        ns["seed_everything"](0)
        trainer = ns["Trainer"](
            max_epochs=10,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            callbacks=[callback],
        )
        trainer.fit(ns["LitClassifier"](), datamodule=ns["Points"]())
        assert trainer.current_epoch < 10 and callback.hits == 2


@pytest.mark.bitwise
def test_without_shuffling_or_dropout_the_two_ports_end_bitwise_equal():
    """The page's claim: the numbers differ only through the data order and dropout."""
    pytest.importorskip("lightning.pytorch")
    models = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for prefix in (LIT_PORT, PURE_PORT):
            source = _block(prefix)
            assert "shuffle=True" in source and "nn.Dropout(0.1)" in source
            source = source.replace("shuffle=True", "shuffle=False")
            source = source.replace("nn.Dropout(0.1)", "nn.Dropout(0.0)")
            root = "lightning" if prefix == LIT_PORT else "purestep"
            source = source.replace('"runs/port"', f'"runs/{root}"')
            lines = source.splitlines()
            end = next(i for i, line in enumerate(lines) if line.startswith("trainer.fit("))
            ns: dict = {}
            _exec("\n".join(lines[: end + 1]), f"{prefix} (no shuffle, no dropout)", ns)
            models[prefix] = ns["model"]
    theirs = dict(models[LIT_PORT].named_parameters())
    ours = dict(models[PURE_PORT].named_parameters())
    assert sorted(theirs) == sorted(ours)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_the_readme_links_the_guide():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "docs/coming_from_lightning.md" in f.read()


def test_every_guide_python_block_is_run_by_a_test():
    blocks = _python_blocks()
    assert blocks, "no ```python blocks found in docs/coming_from_lightning.md"
    unrun = [
        _first_line(b) for b in blocks if not any(_first_line(b).startswith(p) for p in _DECLARED)
    ]
    assert not unrun, f"guide python blocks that no test runs (add them to a @runs test): {unrun}"
    for prefix in _DECLARED:
        _block(prefix)  # exactly one block per declared prefix
