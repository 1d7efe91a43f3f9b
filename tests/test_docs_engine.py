"""The engine pages' own blocks (docs/custom_loops.md) run as written and do what they say.

The hand-written loop resumes a killed run bitwise, and the same run composed by
``loops.fit`` ends with the same parameters and optimizer state, compared with
``torch.equal`` (the same arithmetic runs on both sides).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.docs_book import PAGE

CUSTOM_LOOP = "# a loop of your own: train steps, an evaluation, a checkpoint, a resume"
COMPOSED = "# the same run, composed by loops.fit"


@pytest.mark.bitwise
@PAGE.runs(CUSTOM_LOOP, COMPOSED)
def test_the_custom_loop_resumes_bitwise_and_matches_loops_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    PAGE.run(CUSTOM_LOOP, ns)
    whole, resumed = ns["whole"], ns["resumed"]
    assert whole.progress.epoch == 3 and whole.progress.step == 12  # 3 epochs of 4 batches
    for name, value in whole.params.items():
        assert torch.equal(value, resumed.params[name]), name
    assert os.path.exists("runs/custom/last.ckpt") and os.path.exists("runs/custom/whole.ckpt")
    lines = capsys.readouterr().out.splitlines()
    evals = [line for line in lines if line.startswith("epoch ")]
    # the whole run's three evaluations, the killed run's first, the resumed run's last two
    assert [e.split(":")[0] for e in evals] == ["epoch 0", "epoch 1", "epoch 2"] * 2
    assert evals[1:3] == evals[4:6]  # the resumed run evaluates as the uninterrupted one

    PAGE.run(COMPOSED, ns)
    fitted, results = ns["fitted"], ns["results"]
    assert vars(fitted.progress) == vars(whole.progress)
    for name, value in whole.params.items():
        assert torch.equal(value, fitted.params[name]), name
    from purestep.engine import tree

    for got, want in zip(tree.leaves(fitted.opt_state), tree.leaves(whole.opt_state)):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))
    # the hand loop's last printed val_loss is the one loops.validate reports
    assert evals[2] == f"epoch 2: val_loss={results[0]['val_loss']:.4f}"
