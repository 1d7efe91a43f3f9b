"""loops.aggregate: Lightning's self.log semantics over the values steps return."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purestep.engine import metrics as M
from purestep.loops.aggregate import (
    accumulate,
    epoch_values,
    log,
    plain_step_values,
    resolve,
    specs_of,
    step_values,
)


def test_names_and_stage_defaults():
    train = resolve({"loss": torch.tensor(1.0), "train_acc": 0.5}, "train")
    assert set(train) == {"train_loss", "train_acc"}  # an existing prefix is kept
    spec = train["train_loss"][0]
    assert (spec.on_step, spec.on_epoch, spec.prog_bar, spec.logger) == (True, False, True, True)
    assert train["train_acc"][0].prog_bar is False
    for stage, prefix in (("validate", "val_"), ("sanity_check", "val_"), ("test", "test_")):
        ((name, (spec, _)),) = resolve({"acc": 1.0}, stage).items()
        assert name == prefix + "acc"
        assert (spec.on_step, spec.on_epoch) == (False, True)


def test_log_options_override_the_defaults():
    resolved = resolve(
        {"a": log(1.0, on_step=True, on_epoch=True, prog_bar=True, logger=False)}, "validate"
    )
    spec, raw = resolved["val_a"]
    assert spec.forked and spec.prog_bar and not spec.logger and raw == 1.0


def test_forked_step_and_epoch_names():
    resolved = resolve({"x": log(torch.tensor(3.0), on_step=True, on_epoch=True)}, "train")
    to_log, bar, to_callbacks = step_values(resolved)
    assert set(to_log) == {"train_x_step"} and bar == {}
    assert set(to_callbacks) == {"train_x", "train_x_step"}
    acc = accumulate({}, resolved, batch_size=2)
    to_log, _, to_callbacks = epoch_values(acc, specs_of(resolved), "/dataloader_idx_1")
    assert set(to_log) == {"train_x_epoch/dataloader_idx_1"}
    assert set(to_callbacks) == {"train_x/dataloader_idx_1", "train_x_epoch/dataloader_idx_1"}


def test_logger_false_keeps_values_for_callbacks_only():
    resolved = resolve({"x": log(2.0, logger=False)}, "train")
    to_log, _, to_callbacks = step_values(resolved)
    assert to_log == {} and float(to_callbacks["train_x"]) == 2.0


def test_step_only_values_are_not_accumulated():
    resolved = resolve({"loss": torch.tensor(2.0)}, "train")
    assert accumulate({}, resolved, 4) == {}


def test_batch_size_weighted_mean_and_other_reductions():
    specs = {}
    acc = {}
    for value, size in ((1.0, 4), (2.0, 4), (10.0, 1)):
        resolved = resolve(
            {
                "mean": value,
                "sum": log(value, reduce="sum"),
                "max": log(value, reduce=torch.max),
                "min": log(value, reduce="MIN"),
            },
            "test",
        )
        acc = accumulate(acc, resolved, size)
        specs.update(specs_of(resolved))
    to_log, _, _ = epoch_values(acc, specs)
    assert float(to_log["test_mean"]) == pytest.approx((4 + 8 + 10) / 9)  # not (1+2+10)/3
    assert float(to_log["test_sum"]) == 13.0
    assert float(to_log["test_max"]) == 10.0 and float(to_log["test_min"]) == 1.0


def test_metric_objects_merge_exactly():
    a = M.Accuracy.of(torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]), torch.tensor([1, 1, 0]))
    b = M.Accuracy.of(torch.tensor([[0.0, 1.0]]), torch.tensor([0]))
    acc = accumulate({}, resolve({"acc": a}, "validate"), 3)
    acc = accumulate(acc, resolve({"acc": b}, "validate"), 1)
    to_log, _, _ = epoch_values(acc, specs_of(resolve({"acc": a}, "validate")))
    assert float(to_log["val_acc"]) == 0.5  # 2 of 4, not the mean of 2/3 and 0


def test_bad_values_and_options():
    with pytest.raises(ValueError, match="would log nothing"):
        log(1.0, on_step=False, on_epoch=False)
    with pytest.raises(ValueError, match="reduce"):
        log(1.0, reduce="median")
    with pytest.raises(ValueError, match="reduce"):
        log(1.0, reduce=torch.median)
    with pytest.raises(TypeError, match="on_step"):
        log(1.0, on_step="yes")
    with pytest.raises(ValueError, match="one element"):
        step_values(resolve({"v": torch.ones(2, 2)}, "train"))
    with pytest.raises(TypeError, match="cannot log a value of type str"):
        step_values(resolve({"v": "text"}, "train"))
    acc = accumulate({}, resolve({"v": log(1.0, reduce="sum")}, "test"), 1)
    with pytest.raises(TypeError, match="one reduction"):
        accumulate(acc, resolve({"v": log(1.0, reduce="max")}, "test"), 1)


@settings(max_examples=50)
@given(
    batches=st.lists(st.tuples(st.integers(-50, 50), st.integers(1, 8)), min_size=1, max_size=12),
    cut=st.integers(0, 12),
)
def test_epoch_mean_is_independent_of_grouping(batches, cut):
    """Accumulating in two parts and merging equals accumulating in one (a resumed epoch
    reports what an uninterrupted one does), and both equal the weighted mean."""

    def run(part, acc):
        for value, size in part:
            acc = accumulate(acc, resolve({"v": float(value)}, "validate"), size)
        return acc

    whole = run(batches, {})
    first = run(batches[:cut], {})
    merged = run(batches[cut:], first)
    specs = specs_of(resolve({"v": 0.0}, "validate"))
    a = epoch_values(whole, specs)[0]["val_v"]
    b = epoch_values(merged, specs)[0]["val_v"]
    expected = sum(v * n for v, n in batches) / sum(n for _, n in batches)
    assert torch.equal(a, b)
    assert float(a) == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_vector_values_are_logged_per_member_and_as_their_mean():
    resolved = resolve({"loss": torch.tensor([1.0, 2.0, 6.0])}, "train")
    to_log, bar, _ = step_values(resolved)
    assert {k: float(v) for k, v in to_log.items()} == {
        "train_loss": 3.0,
        "train_loss/0": 1.0,
        "train_loss/1": 2.0,
        "train_loss/2": 6.0,
    }
    assert set(bar) == {"train_loss"}  # the bar shows the mean only


_VALUE_KINDS = {
    "scalar": lambda: torch.tensor(1.5),
    "number": lambda: 2.0,
    "grad": lambda: torch.tensor(1.0, requires_grad=True),
    "vector": lambda: torch.tensor([1.0, 2.0]),
    "epoch": lambda: log(torch.tensor(3.0), on_epoch=True),
    "bar": lambda: log(torch.tensor(4.0), prog_bar=True),
    "metric": lambda: M.Mean.of(torch.tensor(5.0)),
}


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.dictionaries(
        st.sampled_from(["loss", "acc", "train_x", "y"]), st.sampled_from(sorted(_VALUE_KINDS))
    ),
    stage=st.sampled_from(["train", "validate"]),
    known_first=st.booleans(),
)
def test_the_plain_fast_path_agrees_with_the_general_one(kinds, stage, known_first):
    """When ``plain_step_values`` answers, its answer is the general path's, and the general
    path would change neither the epoch accumulators nor the known specs; it answers for
    every all-plain-scalar training output whose specs are known."""
    values = {name: _VALUE_KINDS[kind]() for name, kind in kinds.items()}
    resolved = resolve(values, stage)
    known = specs_of(resolved) if known_first else {}
    fast = plain_step_values(values, stage, known)
    everything_plain = all(kind == "scalar" for kind in kinds.values())
    if stage == "train" and everything_plain and known_first:
        assert fast is not None
    if fast is None:
        return
    slow = step_values(resolved)
    for got, want in zip(fast, slow):
        assert got.keys() == want.keys()
        assert all(got[k] is want[k] for k in got)
    assert accumulate({}, resolved, 4) == {}
    assert specs_of(resolved) == dict(known)
