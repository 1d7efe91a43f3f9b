"""ModelSummary: layer rows and totals checked against sums computed here, on meta too."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from purestep import engine
from purestep.engine import optim, tree
from purestep.loops.callbacks import ModelSummary, init_states, layer_summaries, summarize, totals
from purestep.loops.events import Context, dispatch


def _model() -> nn.Module:
    model = nn.Sequential(
        OrderedDict(
            enc=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)),
            norm=nn.BatchNorm1d(8),
            head=nn.Linear(8, 2),
        )
    )
    model.head.requires_grad_(False)
    model.norm.eval()
    return model


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_rows_at_depth_one(device):
    with torch.device(device):
        model = _model()
    params = engine.init(model, optim.sgd(0.1)).params
    rows = layer_summaries(model, params, max_depth=1)
    assert [(r.name, r.type, r.mode) for r in rows] == [
        ("enc", "Sequential", "train"),
        ("norm", "BatchNorm1d", "eval"),
        ("head", "Linear", "train"),
    ]
    assert [r.params for r in rows] == [_numel(model.enc), _numel(model.norm), _numel(model.head)]
    assert [r.size_mb for r in rows] == [r.params * 4 / 1e6 for r in rows]


def test_deeper_rows():
    model = _model()
    names = [r.name for r in layer_summaries(model, max_depth=2)]
    assert names == ["enc", "enc.0", "enc.1", "enc.2", "norm", "head"]
    assert [r.name for r in layer_summaries(model, max_depth=-1)] == names
    assert layer_summaries(model, max_depth=0) == []
    enc2 = next(r for r in layer_summaries(model, max_depth=2) if r.name == "enc.2")
    assert enc2.params == 8 * 8 + 8


def test_totals_on_meta_with_bf16_state():
    with torch.device("meta"):
        model = _model()
    params = tree.cast(engine.init(model, optim.sgd(0.1)).params, torch.bfloat16)
    t = totals(model, params)
    all_params = list(model.parameters())
    assert t.total == sum(p.numel() for p in all_params)
    assert t.trainable == sum(p.numel() for p in all_params if p.requires_grad)
    assert t.non_trainable == _numel(model.head)
    assert t.size_mb == t.total * 2 / 1e6  # two bytes per bfloat16 parameter
    assert (t.train_modules, t.eval_modules) == (len(list(model.modules())) - 1, 1)


def test_mixed_dtypes_are_sized_per_tensor():
    model = nn.Linear(3, 2)
    params = {"weight": torch.zeros(2, 3, dtype=torch.float64), "bias": torch.zeros(2)}
    assert totals(model, params).size_mb == (6 * 8 + 2 * 4) / 1e6


def test_shared_weights_are_counted_once():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    assert totals(model).total == 16
    assert [r.params for r in layer_summaries(model)] == [16, 16]


def test_summary_text_holds_the_numbers():
    model = _model()
    text = summarize(model, max_depth=1)
    lines = text.splitlines()
    t = totals(model)
    header = ["|", "Name", "|", "Type", "|", "Params", "|", "Size", "(MB)", "|", "Mode"]
    assert lines[0].split() == header
    enc = next(line for line in lines if " enc " in line)
    assert f"{_numel(model.enc):,}" in enc and "Sequential" in enc
    for value, label in [
        (t.trainable, "Trainable params"),
        (t.non_trainable, "Non-trainable params"),
        (t.total, "Total params"),
    ]:
        line = next(line for line in lines if line.endswith(label))
        assert line.split()[0] == f"{value:,}"
    size_line = next(line for line in lines if "Total estimated model params size" in line)
    assert float(size_line.split()[0]) == round(t.total * 4 / 1e6, 3)


def test_callback_requests_the_summary_at_fit_start():
    model = _model()
    cb = ModelSummary(max_depth=2)
    state = init_states([cb], engine.init(model, optim.sgd(0.1)))
    ctx = Context(stage=None, fn="fit", state=state, extra={"model": model})
    _, req = dispatch("on_fit_start", [cb], state, ctx)
    assert req.messages == (summarize(model, state.params, 2),)
    # not on other ranks, not with max_depth=0
    assert not dispatch("on_fit_start", [cb], state, ctx.replace(rank=1))[1]
    off = ModelSummary(max_depth=0)
    assert not dispatch("on_fit_start", [off], init_states([off], state), ctx)[1]


def test_callback_needs_the_model():
    cb = ModelSummary()
    state = init_states([cb], engine.init(nn.Linear(2, 2), optim.sgd(0.1)))
    with pytest.raises(ValueError, match=r"ctx.extra\['model'\]"):
        dispatch("on_fit_start", [cb], state, Context(stage=None, fn="fit", state=state))


def test_bad_depth():
    with pytest.raises(ValueError, match="max_depth"):
        ModelSummary(max_depth=-2)
    with pytest.raises(ValueError, match="max_depth"):
        summarize(nn.Linear(2, 2), max_depth=1.5)
