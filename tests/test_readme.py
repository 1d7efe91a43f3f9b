"""The README's code runs: the tour, the checkpoint snippet, the callback and the
property-test example (executed in order, in a temporary folder, as a reader would)."""

from __future__ import annotations

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _python_blocks() -> list[str]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _block(startswith: str) -> str:
    matches = [b for b in _python_blocks() if b.lstrip().startswith(startswith)]
    assert len(matches) == 1, f"expected one README block starting with {startswith!r}"
    return matches[0]


def test_the_tour_and_the_checkpoint_snippet_run(capsys):
    namespace: dict = {}
    exec(_block("import torch, torch.nn as nn"), namespace)
    exec(_block("from torch.utils.data import DataLoader"), namespace)
    assert namespace["state"].progress.epoch == 3
    exec(_block("from purestep import checkpoint"), namespace)
    assert namespace["latest"].endswith(".ckpt")
    assert namespace["meta"]["note"] == "x" and namespace["state"].progress.step == 1
    assert os.path.exists("runs/b.ckpt")
    assert "test_loss" in capsys.readouterr().out + str(namespace["trainer"].callback_metrics)


def test_the_callback_example_stops_after_its_patience():
    import torch

    from purestep import engine
    from purestep.engine import optim
    from purestep.loops.callbacks import init_states
    from purestep.loops.events import Context, dispatch

    namespace: dict = {}
    exec(_block("from purestep.loops.callbacks import Callback"), namespace)
    cb = namespace["StopOnPlateau"](patience=2)
    state = init_states([cb], engine.init(torch.nn.Linear(2, 1), optim.sgd(0.1)))
    stops = []
    for loss in [3.0, 2.0, 2.5, 2.5]:
        ctx = Context(stage="validate", fn="fit", state=state, metrics={"val_loss": loss})
        state, requests = dispatch("on_validation_end", [cb], state, ctx)
        stops.append(requests.stop)
    assert stops == [False, False, False, True]


def test_the_property_test_example_passes():
    namespace: dict = {}
    exec(_block("from hypothesis import given"), namespace)
    namespace["test_my_loop_steps_like_fit"]()
