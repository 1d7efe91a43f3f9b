"""FSDP on 2 CPU ranks (gloo), checked against one process with the same global batch.

One bounded launch (``fsdp_job.two_rank_run``, shared with the checkpoint and Trainer
tests) runs every configuration, one of them twice for the bitwise test, and checks that
no step changes the state it is given. Tolerance of the parity tests:
every tensor within ``1e-5 * max|ref| + 1e-6`` of one process (the reduce-scatter sums two
half-batch means where one process takes one mean, so the last bits differ); bfloat16
compute within ``5e-2``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from purestep.engine import tree
from purestep.hardware.fsdp import wrap_units
from tests import fsdp_job
from tests.helpers import batches, loss_fn, mlp

pytestmark = pytest.mark.timeout(600)  # the first test waits for the shared launches


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return [r["parity"] for r in fsdp_job.two_rank_run()[0]]


def _close(got, want, tol=1e-5):
    for (path, a), (_, b) in zip(tree.flatten_with_paths(got), tree.flatten_with_paths(want)):
        if isinstance(b, torch.Tensor):
            bound = tol * float(b.abs().max()) + 1e-6 if b.numel() else 0.0
            err = float((a - b).abs().max()) if b.numel() else 0.0
            assert err <= bound, f"{path}: off by {err} > {bound}"
        else:
            assert a == b, path


@pytest.mark.parametrize("policy", ["none", "linear", "grad_op"])
@pytest.mark.parametrize("name", ["adam", "clip_sgd"])
def test_matches_one_process_with_the_global_batch(two_ranks, policy, name):
    ref, last = fsdp_job.train(None, fsdp_job.optimizers()[name])
    for rank in range(2):
        got = two_ranks[rank][(policy, name)]
        _close(got["params"], dict(ref.params))
        _close(got["opt_state"], ref.opt_state)
        # the reported gradient norm is the norm over all shards
        _close(got["grad_norm"], last.grad_norm)


def test_accumulation_matches(two_ranks):
    ref, _ = fsdp_job.train(None, fsdp_job.optimizers()["adam"], accumulate=2)
    _close(two_ranks[0]["accumulate"]["params"], dict(ref.params))
    assert two_ranks[0]["accumulate"]["step"] == ref.progress.step == fsdp_job.STEPS // 2


def test_grad_op_shards_gradients_and_optimizer_state_only(two_ranks):
    whole_params, sharded_opt = two_ranks[0]["grad_op_layout"]
    assert whole_params and sharded_opt
    ref, _ = fsdp_job.train(None, fsdp_job.optimizers()["adam"], accumulate=2)
    _close(two_ranks[1]["grad_op_accumulate"]["params"], dict(ref.params))


def test_state_is_sharded(two_ranks):
    total = sum(p.numel() for p in mlp(0).parameters())
    locals_ = [r["local_numel"] for r in two_ranks]
    assert sum(locals_) == total and max(locals_) <= total // 2 + 16
    assert all(r["opt_sharded"] for r in two_ranks)


def test_reshard_after_forward_gathers_again_for_backward(two_ranks):
    assert two_ranks[0]["regathered"] > 0
    assert two_ranks[0]["reshard_same"] and two_ranks[1]["reshard_same"]


def test_bf16_compute_keeps_float32_master_weights(two_ranks):
    ref, _ = fsdp_job.train(None, fsdp_job.optimizers()["adam"])
    got = two_ranks[0]["bf16"]["params"]
    assert all(p.dtype == torch.float32 for p in got.values())
    _close(got, dict(ref.params), tol=5e-2)
    fp32 = two_ranks[0][("linear", "adam")]["params"]
    assert any(not torch.equal(got[n], fp32[n]) for n in got)  # it did compute in bf16


def test_eval_and_predict_match_one_process(two_ranks):
    from purestep import engine

    x, y = batches(1, seed=5, size=fsdp_job.G)[0]
    final = two_ranks[0]["accumulate"]["params"]  # the state the job evaluated
    state = engine.init(mlp(0), fsdp_job.optimizers()["adam"], seed=0)
    state = state.replace(params=final)
    for rank in range(2):
        sl = slice(rank * 4, rank * 4 + 4)
        want = engine.eval_step(mlp(0), loss_fn)(state, (x[sl], y[sl]))
        _close(two_ranks[rank]["eval"], want)
        _close(two_ranks[rank]["predict"], engine.predict_step(mlp(0))(state, x[sl]))


def test_errors_are_clear(two_ranks):
    errors = two_ranks[0]["errors"]
    assert errors["unsharded"].startswith("ValueError") and "not sharded" in errors["unsharded"]
    assert errors["policy"].startswith("TypeError") and "auto_wrap_policy" in errors["policy"]
    assert errors["fp16"].startswith("ValueError") and "bf16" in errors["fp16"]
    assert errors["func"].startswith("ValueError") and "autograd" in errors["func"]
    assert errors["mp_type"].startswith("TypeError") and "MixedPrecisionPolicy" in errors["mp_type"]
    assert errors["sharding"].startswith("ValueError") and "grad_op" in errors["sharding"]


@pytest.mark.bitwise
def test_runs_are_bitwise_identical(two_ranks):
    """The same run twice (a fresh strategy value, state and step) gives the same bits; that
    separate processes do too is the kill-and-resume test's (``test_fsdp_trainer``)."""
    for rank in range(2):
        first, again = two_ranks[rank][("linear", "clip_sgd")], two_ranks[rank]["repeat"]
        for key in ("params", "opt_state"):
            for a, b in zip(tree.leaves(first[key]), tree.leaves(again[key])):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_wrap_units_assigns_each_parameter_to_its_innermost_unit():
    net = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 3), nn.ReLU()), nn.Linear(3, 1))
    units = wrap_units(net, {nn.Linear})
    assert units == {
        "": [],
        "0": ["0.weight", "0.bias"],
        "1.0": ["1.0.weight", "1.0.bias"],
        "2": ["2.weight", "2.bias"],
    }
    assert wrap_units(net, None) == {"": [n for n, _ in net.named_parameters()]}
    assert set(wrap_units(net, lambda m: isinstance(m, nn.Sequential) and m is not net)) == {
        "",
        "1",
    }


def test_tied_parameters_across_units_go_to_the_root():
    net = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    net[1].weight = net[0].weight
    assert wrap_units(net, {nn.Linear}) == {"": ["0.weight"]}


def test_steps_leave_their_input_state_unchanged(two_ranks):
    """Every FSDP step of the parity runs (full and grad_op sharding, wrap policies, clipping,
    accumulation, bf16, resharding) left the state it was given as it was."""
    for r in two_ranks:
        assert r["impure"] == []
