"""The examples run, learn, and print their result last (the README's main job included)."""

from __future__ import annotations

import os
import runpy

import pytest

from purestep.engine import checkpoint, tree

pytest.importorskip("sklearn")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)  # the examples import each other's data helpers

    def load(name):
        return runpy.run_path(os.path.join(EXAMPLES, name))["main"]

    return load


def test_digits_reaches_97_percent_and_prints_test_acc_last(example, capsys, tmp_path):
    acc = example("digits.py")(["--no-progress-bar", "--root", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"test_acc={acc:.4f}"
    assert acc >= 0.97
    assert (tmp_path / "csv" / "version_0" / "metrics.csv").exists()
    board = tmp_path / "tensorboard" / "version_0"
    assert any(board.glob("events.out.tfevents.*"))
    assert (board / "checkpoints" / "last.ckpt").exists()


def test_digits_resumes_from_its_last_checkpoint(example, capsys, tmp_path):
    main = example("digits.py")
    first = main(["--no-progress-bar", "--root", str(tmp_path), "--epochs", "3"])
    again = main(["--no-progress-bar", "--root", str(tmp_path), "--epochs", "3", "--resume"])
    assert again == first  # the finished run is restored, not retrained
    assert "Restored the training state" in capsys.readouterr().err


def test_dp_sgd_learns_and_is_a_pure_function_of_the_seed(example, capsys):
    main = example("dp_sgd.py")
    acc = main(["--epochs", "2"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"test_acc={acc:.4f}"
    assert acc > 0.5  # 10 classes: chance is 0.1; two noisy epochs reach about 0.8
    assert main(["--epochs", "2"]) == acc


def test_the_custom_gan_loop_trains_logs_and_checkpoints(example, capsys, tmp_path):
    score = example("custom_loop.py")(
        ["--epochs", "2", "--samples", "512", "--root", str(tmp_path)]
    )
    out = capsys.readouterr()
    assert out.out.strip().splitlines()[-1] == f"mode_coverage={score:.3f}"
    assert "epoch 1:" in out.err  # the callback's message, carried out by the driver
    (g_state, d_state), _ = checkpoint.load(str(tmp_path / "gan" / "last.ckpt"))
    assert d_state.progress.epoch == 2 and g_state.progress.step == d_state.progress.step
    assert all(map(lambda x: bool(x.isfinite().all()), tree.leaves(g_state.params)))
    assert (tmp_path / "gan" / "version_0" / "metrics.csv").read_text().count("\n") == 3


def test_the_gan_in_the_trainer_steps_the_critic_twice_per_generator_step(
    example, capsys, tmp_path
):
    score = example("gan.py")(["--epochs", "1", "--samples", "256", "--root", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"mode_coverage={score:.3f}"
    assert lines[-2] == "critic_steps=8 generator_steps=4"  # 4 batches
    assert (tmp_path / "gan" / "version_0" / "metrics.csv").exists()
    assert any(tmp_path.glob("**/checkpoints/*.ckpt"))


def test_char_lm_learns_eagerly_and_compiled(monkeypatch, capsys, tmp_path):
    # imported as a module (dynamo looks a traced function's module up by name; run_path's
    # "<run_path>" is none), with a one-block, width-16, context-8 stand-in on the aot_eager
    # backend: this checks the example's wiring (the Trainer's compiled fit and eval step);
    # inductor's code generation is tested in tests/test_compile.py and the README's block
    import importlib

    from torch._dynamo.utils import counters

    monkeypatch.syspath_prepend(EXAMPLES)
    char_lm = importlib.import_module("char_lm")
    args = ["--steps", "12", "--bytes", "10000", "--width", "16", "--layers", "1"]
    args += ["--context", "8", "--batch-size", "16", "--backend", "aot_eager"]
    graphs = counters["stats"]["unique_graphs"]
    results = char_lm.main([*args, "--root", str(tmp_path)])
    # the compiled side really compiled: its train step and its eval step, one graph each
    # (the validation windows fit one batch)
    assert counters["stats"]["unique_graphs"] - graphs == 2
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("eager_val_loss=") and "compiled_tokens_per_s=" in last
    for side in ("eager", "compiled"):
        assert results[side]["val_loss"] < 5.45  # uniform over 256 bytes: 5.55
        assert results[side]["tokens_per_s"] > 0
    # the same seed, batches and dropout draws: the two runs differ by rounding only
    assert abs(results["eager"]["val_loss"] - results["compiled"]["val_loss"]) < 1e-3
