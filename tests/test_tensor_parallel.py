"""Tensor parallelism (``hardware.tensor_parallel``) on gloo ranks, against one process.

Three bounded launches: 4 ranks on a 2 x 2 mesh (parity, a repeated run, accumulation,
eval/predict, purity, a sharded checkpoint and its resume), 4 ranks on a 4 x 1 mesh (that
checkpoint loaded at another mesh shape) and 2 ranks on 1 x 2 (tensor parallelism only,
and the errors); the checkpoint is also loaded in this process, plain.

Tolerance of the parity tests: every tensor within ``1e-5 * max|ref| + 1e-6`` of one
process on the global batch. The arithmetic differs in its last bits: a row-wise layer sums
two partial matrix products across the "tp" ranks where one process takes one product, a
column-wise layer's weight gradient is computed by halves, and the "dp" mean averages two
half-batch means.
"""

from __future__ import annotations

import pytest
import torch

from purestep import engine, hardware
from purestep.engine import checkpoint, optim, tree
from purestep.hardware import tp_layout
from tests import tp_job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.xdist_group("processes"),
]


@pytest.fixture(scope="module")
def meshes(tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp("tp"))
    two = hardware.launch(tp_job.two_by_two, 4, folder, max_seconds=180)
    four = hardware.launch(tp_job.four_by_one, 4, folder, max_seconds=180)
    return {"2x2": two, "4x1": four, "folder": folder}


@pytest.fixture(scope="module")
def pure_tp() -> list[dict]:
    return hardware.launch(tp_job.one_by_two, 2, max_seconds=120)


def _close(got, want, tol=1e-5):
    pairs = zip(tree.flatten_with_paths(got), tree.flatten_with_paths(want), strict=True)
    for (path, a), (_, b) in pairs:
        if isinstance(b, torch.Tensor):
            bound = tol * float(b.abs().max()) + 1e-6 if b.numel() else 0.0
            err = float((a - b).abs().max()) if b.numel() else 0.0
            assert err <= bound, f"{path}: off by {err} > {bound}"
        else:
            assert a == b, path


def _equal(got, want):
    pairs = zip(tree.flatten_with_paths(got), tree.flatten_with_paths(want), strict=True)
    for (path, a), (_, b) in pairs:
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, path


def _check_parity(results, runs):
    for kind, name in runs:
        ref, last = tp_job.train(kind, None, tp_job.optimizers()[name])
        for rank, res in enumerate(results):
            got = res[(kind, name)]
            _close(got["params"], dict(ref.params))
            _close(got["opt_state"], ref.opt_state)
            # the reported norm is the full gradients' (replicated tensors counted once)
            _close(got["grad_norm"], last.grad_norm)
            assert got["step"] == ref.progress.step, rank


def test_2x2_matches_one_process_with_the_global_batch(meshes):
    runs = [("mlp", "adam"), ("mlp", "clip_sgd"), ("seq", "adam")]
    _check_parity(meshes["2x2"], runs)


def test_2x2_with_replicas_sharded_matches_one_process(meshes):
    _check_parity([res["fsdp"] for res in meshes["2x2"]], [("mlp", "clip_sgd"), ("seq", "adam")])


def test_2x2_accumulation_matches(meshes):
    ref, _ = tp_job.train("mlp", None, optim.adam(1e-2), steps=4, accumulate=2)
    for res in meshes["2x2"]:
        for got in (res["accumulate"], res["fsdp"]["accumulate"]):
            _close(got["params"], dict(ref.params))
            assert got["step"] == ref.progress.step == 2


def test_state_is_laid_out_by_the_plan(meshes, pure_tp):
    from torch.distributed.tensor import Replicate, Shard

    res = meshes["2x2"][0]
    assert res["placements"]["0.weight"] == (Shard(0),)  # column-wise
    assert res["placements"]["2.weight"] == (Shard(1),)  # row-wise
    assert res["placements"]["2.bias"] == (Replicate(),)
    assert res["opt_laid_out"]
    total = sum(p.numel() for p in tp_job.mlp(0).parameters())
    replicated = 8 + 3  # the row-wise biases
    assert res["local_numel"] == (total - replicated) // 2 + replicated
    assert pure_tp[0]["local_numel"] == res["local_numel"]
    # data_parallel="fsdp": sharded over "dp" too, along a dimension the plan leaves whole
    sharded = res["fsdp"]["placements"]
    assert sharded["0.weight"] == (Shard(1), Shard(0))
    assert sharded["2.weight"] == (Shard(0), Shard(1))
    assert sharded["2.bias"] == (Shard(0), Replicate())
    assert sharded["0.bias"] == (Replicate(), Shard(0))  # 1-D and sharded by the plan
    # every element is held by one rank, but the row-wise biases by both ranks of a
    # replica (the plan replicates them) and the column-wise ones by both replicas
    held = [r["fsdp"]["local_numel"] for r in meshes["2x2"]]
    assert sum(held) == total + replicated + (16 + 16)
    assert max(held) < res["local_numel"] * 0.6


def test_eval_and_predict_match_one_process(meshes):
    x, y = tp_job.data("mlp", 1, seed=5)[0]
    for rank, res in enumerate(meshes["2x2"]):
        for got in (res, res["fsdp"]):
            final = got["accumulate"]["params"]  # the state the job evaluated
            state = engine.init(tp_job.mlp(0), optim.adam(1e-2), seed=0).replace(params=final)
            d = rank // 2  # the replica's slice: both ranks of a tensor-parallel group read it
            sl = slice(d * 4, d * 4 + 4)
            want = engine.eval_step(tp_job.mlp(0), tp_job.loss_fn)(state, (x[sl], y[sl]))
            _close(got["eval"], want)
            _close(got["predict"], engine.predict_step(tp_job.mlp(0))(state, x[sl]))


def test_steps_leave_their_input_state_unchanged(meshes):
    assert all(res["pure"] for res in meshes["2x2"])


@pytest.mark.bitwise
def test_runs_are_bitwise_identical(meshes):
    """The same run twice (a fresh strategy value, state and step) gives the same bits."""
    for res in meshes["2x2"]:
        first, again = res[("mlp", "clip_sgd")], res["repeat"]
        _equal(first["params"], again["params"])
        _equal(first["opt_state"], again["opt_state"])


@pytest.mark.bitwise
def test_resume_from_a_sharded_checkpoint_is_bitwise(meshes):
    for res in meshes["2x2"]:
        for ckpt in (res["ckpt"], res["fsdp"]["ckpt"]):
            assert ckpt["loaded_same"] and ckpt["resumed_same"]
            assert ckpt["meta"] == [2, 2]


@pytest.mark.parametrize("name", ["tp", "fsdp"])
def test_checkpoint_loads_at_another_mesh_shape_and_in_one_process(meshes, name):
    two = meshes["2x2"][0]
    ckpt = two["ckpt"] if name == "tp" else two["fsdp"]["ckpt"]
    saved, after = ckpt["saved"], ckpt["after"]
    for res in meshes["4x1"]:  # 4 replicas of one rank each: the same full values
        got = res[name]
        _equal(got["loaded"]["params"], saved["params"])
        _equal(got["loaded"]["opt_state"], saved["opt_state"])
        _close(got["resumed"]["params"], after["params"])
    opt = optim.adam(1e-2)
    target = engine.init(tp_job.mlp(1), opt, seed=1)
    plain, _ = checkpoint.sharded.load(f"{meshes['folder']}/{name}.ckpt", target)
    _equal(dict(plain.params), saved["params"])
    _equal(plain.opt_state, saved["opt_state"])
    resumed, _ = tp_job.train("mlp", None, opt, steps=2, state=plain, start=2)
    _close(dict(resumed.params), after["params"])


def test_1x2_matches_one_process(pure_tp):
    _check_parity(pure_tp, [("mlp", "adam"), ("seq", "clip_sgd")])
    # both ranks form one model: the same data, the same replica index
    assert pure_tp[0]["mesh"] == (1, 2, 0, 0, {"rank": 0, "world_size": 1})
    assert pure_tp[1]["mesh"] == (1, 2, 0, 1, {"rank": 0, "world_size": 1})


def test_shard_state_lays_a_plain_state_out(pure_tp):
    # a state trained one step in one process, laid out by the plan: parameters and Adam
    # moments laid out as the ranks' own state, and gathered back bitwise
    assert all(res["shard_state"] for res in pure_tp)


def test_errors_are_clear(pure_tp):
    errors = pure_tp[0]["errors"]
    assert errors["missing"].startswith("ValueError") and "['9']" in errors["missing"]
    assert errors["shape"].startswith("ValueError") and "world size is 2" in errors["shape"]
    assert errors["style"].startswith("TypeError") and "not a ParallelStyle" in errors["style"]
    assert errors["unlaid"].startswith("ValueError") and "laid out" in errors["unlaid"]
    assert errors["func"].startswith("ValueError") and "autograd" in errors["func"]
    assert errors["fp16"].startswith("ValueError") and "bf16" in errors["fp16"]
    assert errors["mode"].startswith("ValueError") and "data_parallel" in errors["mode"]


def _trainer_shards_by_replica() -> bool:
    """Whether the Trainer's data sharding asks the strategy's ``data_options()`` (under
    tensor parallelism the ranks of one model read the same batches)."""
    from purestep.loops import trainer_data

    class Probe:
        rank, world_size = 1, 2

        def data_options(self):
            return {"rank": 0, "world_size": 1}

    return trainer_data._shard(Probe(), 0)["world_size"] == 1


def test_the_trainer_splits_data_by_the_strategys_data_options():
    assert _trainer_shards_by_replica()


@pytest.mark.bitwise
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_trainer_resumes_bitwise(tmp_path):
    runs = hardware.launch(tp_job.trainer_runs, 2, str(tmp_path), max_seconds=120)
    for res in runs:
        assert res["whole"]["step"] == res["resumed"]["step"] == 4
        _equal(res["resumed"]["params"], res["whole"]["params"])
    _equal(runs[0]["whole"]["params"], runs[1]["whole"]["params"])


# ---------------------------------------------------------------------- no processes


def test_mesh_shape_checks():
    assert tp_layout.check_mesh_shape(None, 4) == (1, 4)
    assert tp_layout.check_mesh_shape([2, 2], 4) == (2, 2)
    for bad in [(2, 2, 1), (0, 4), (2.0, 2), (True, 4), 4]:
        with pytest.raises(ValueError, match="two positive ints"):
            tp_layout.check_mesh_shape(bad, 4)
    with pytest.raises(ValueError, match="product"):
        tp_layout.check_mesh_shape((3, 1), 4)


def test_plan_checks():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = tp_job.mlp(0)
    style = ColwiseParallel()
    assert tp_layout.check_plan(style, model) is style
    plan = {"[04]": ColwiseParallel()}  # fnmatch patterns, as parallelize_module reads them
    assert tp_layout.check_plan(plan, model) is plan
    with pytest.raises(ValueError, match=r"does not have"):
        tp_layout.check_plan({"0.inner": ColwiseParallel()}, model)
    with pytest.raises(TypeError, match="ParallelStyle"):
        tp_layout.check_plan({}, model)
    with pytest.raises(TypeError, match="ParallelStyle"):
        tp_layout.check_plan([ColwiseParallel()], model)
    with pytest.raises(TypeError, match="submodule names"):
        tp_layout.check_plan({0: ColwiseParallel()}, model)
