"""DDP in this process: the torchrun environment, argument errors, and a world of one rank.

A one-rank gloo group is enough to check everything that does not need a peer: validation
with clear errors, purity, adoption of an existing group, ``from_flags(strategy="ddp")``,
and that a one-rank DDP run is bitwise a single-device run. Run time: about 1 s.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from purestep import engine, hardware
from purestep.engine import optim, tree
from purestep.hardware.process_env import ProcessEnv
from tests.helpers import batches, loss_fn, mlp

pytestmark = pytest.mark.timeout(60)

TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def no_env(monkeypatch):
    # torchrun's variables, and every cluster launcher's (ddp() would detect a real SLURM,
    # LSF or MPI job the tests run inside)
    launchers = ("SLURM_", "OMPI_", "PMI_", "JSM_", "LSB_")
    for name in [*TORCHRUN_VARS, *(n for n in os.environ if n.startswith(launchers))]:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def one_rank(no_env):
    """A one-rank default group (made by hand, like a user's own init_process_group)."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=7)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- environment


def test_process_env_reads_and_writes_the_torchrun_variables():
    env = ProcessEnv(1, 4, 1, 2, "10.0.0.1", 29500)
    assert ProcessEnv.from_environ(env.to_environ()) == env
    minimal = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    assert ProcessEnv.from_environ(minimal) == ProcessEnv(3, 4, 3, 4, "h", 1234)


@pytest.mark.parametrize(
    ("environ", "error", "match"),
    [
        ({}, RuntimeError, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set.*torchrun"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, RuntimeError, "MASTER_PORT is"),
        (
            {"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            ValueError,
            "RANK='x' is not an integer",
        ),
        (
            {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            ValueError,
            r"RANK=2 is outside \[0, WORLD_SIZE=2\)",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
            ValueError,
            "not a TCP port",
        ),
    ],
)
def test_process_env_errors(environ, error, match):
    with pytest.raises(error, match=match):
        ProcessEnv.from_environ(environ)


def test_ddp_outside_a_launched_process_says_how_to_launch(no_env):
    with pytest.raises(RuntimeError, match=r"torchrun --nproc_per_node=N.*hardware\.launch"):
        hardware.ddp()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"timeout": True}, "timeout must be a positive number"),
        ({"buffers": "sometimes"}, "buffers must be one of"),
    ],
)
def test_ddp_argument_errors(no_env, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hardware.ddp(**kwargs)


def test_ddp_creates_and_closes_the_group_from_the_environment(no_env, monkeypatch):
    env = ProcessEnv(0, 1, 0, 1, "127.0.0.1", hardware.free_port())
    for name, value in env.to_environ().items():
        monkeypatch.setenv(name, value)
    with hardware.ddp(timeout=5, device="cpu") as strategy:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert (strategy.rank, strategy.world_size, strategy.is_primary) == (0, 1, True)
        assert strategy.timeout == 5.0
        strategy.barrier()
    assert not dist.is_initialized()


def test_nccl_on_cpu_is_refused(no_env, monkeypatch):
    env = ProcessEnv(0, 1, 0, 1, "127.0.0.1", hardware.free_port())
    for name, value in env.to_environ().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="'nccl' reduces CUDA tensors only"):
        hardware.ddp(backend="nccl", device="cpu")
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- one rank


def test_an_existing_group_is_adopted_with_its_timeout(one_rank):
    strategy = hardware.ddp()
    assert strategy.timeout == 7.0 and strategy.backend == "gloo"
    assert hardware.ddp(timeout=3).timeout == 3.0
    assert hardware.ddp().timeout == 3.0  # the explicit timeout was applied to the group
    with pytest.raises(ValueError, match="already exists with backend 'gloo', not 'nccl'"):
        hardware.ddp(backend="nccl")
    strategy.close()
    assert dist.is_initialized()  # not this value's group: left alone


@pytest.mark.parametrize(
    ("tree_", "op", "error", "match"),
    [
        ({"a": torch.ones(2)}, "avg", ValueError, "unknown reduction 'avg'"),
        ({"a": torch.ones(2, dtype=torch.int64)}, "mean", TypeError, "mean of torch.int64"),
        ({"a": torch.ones(2, dtype=torch.bool)}, "sum", TypeError, "cannot sum bool"),
        ({"a": {"b": 1.5}}, "sum", TypeError, "the leaf at a/b is a float"),
    ],
)
def test_all_reduce_errors(one_rank, tree_, op, error, match):
    with pytest.raises(error, match=match):
        hardware.ddp().all_reduce(tree_, op)


def test_other_collective_errors(one_rank):
    strategy = hardware.ddp()
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 1\)"):
        strategy.broadcast({"a": torch.ones(1)}, src=1)
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 1\)"):
        strategy.broadcast_object("x", src=-1)
    assert strategy.broadcast_object({"k": 1}) == {"k": 1}
    with pytest.raises(ValueError, match="op must be 'any' or 'all'"):
        strategy.reduce_flag(True, "most")
    with pytest.raises(ValueError, match="unknown reduction"):
        strategy.sync_buffers({"a": torch.ones(1)}, "median")


def test_one_rank_collectives_are_pure_copies(one_rank):
    strategy = hardware.ddp()
    x = {"w": torch.randn(3, 2), "n": torch.arange(3), "m": torch.tensor([True, False])}
    before = tree.map(torch.clone, x)
    for op in ("sum", "max", "min"):
        out = strategy.all_reduce(x if op != "sum" else {"w": x["w"], "n": x["n"]}, op)
        out = {**x, **out}
        tree.assert_trees_equal(out, x)
        assert out["w"].untyped_storage().data_ptr() != x["w"].untyped_storage().data_ptr()
    tree.assert_trees_equal(strategy.all_reduce({"w": x["w"]}, "mean"), {"w": x["w"]})
    tree.assert_trees_equal(strategy.broadcast(x, 0), x)
    tree.assert_trees_equal(x, before)
    assert strategy.all_reduce({}, "sum") == {}
    assert strategy.reduce_flag(True) and not strategy.reduce_flag(False, "all")
    assert strategy.in_sync(x)
    assert strategy.all_gather_object("me") == ["me"]


@pytest.mark.bitwise
def test_one_rank_training_is_bitwise_single_device(one_rank):
    strategy = hardware.ddp(device="cpu")
    runs = []
    for s in (strategy, hardware.single_device("cpu")):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        opt = optim.adam(1e-2)
        state = engine.init(net, opt, seed=0, strategy=s)
        step = engine.train_step(net, loss_fn, opt, strategy=s, accumulate=2)
        for batch in batches(4, size=8):
            state, _ = step(state, batch)
        runs.append(state)
    assert isinstance(
        engine.train_step(mlp(), loss_fn, opt, strategy=strategy), hardware.DDPTrainStep
    )
    tree.assert_trees_equal(runs[0], runs[1])


def test_prepare_state_owns_its_storage_and_converts(one_rank):
    strategy = hardware.ddp(precision="64-true")
    params = {"a": torch.ones(2), "b": torch.zeros(3)}
    new_params, new_buffers = strategy.prepare_state(params, {"n": torch.tensor(3)})
    assert new_params["a"].dtype == torch.float64 and new_buffers["n"].dtype == torch.int64
    ptrs = {t.untyped_storage().data_ptr() for t in (*new_params.values(), params["a"])}
    assert len(ptrs) == 3


def test_different_seeds_are_refused(one_rank, monkeypatch):
    strategy = hardware.ddp()
    monkeypatch.setattr(strategy, "all_gather_object", lambda obj: [obj, obj + 1])
    with pytest.raises(ValueError, match=r"different seeds to engine.init \(\[0, 1\]\)"):
        engine.init(mlp(), optim.sgd(0.1), seed=0, strategy=strategy)


def test_a_different_model_on_another_rank_is_named(one_rank, monkeypatch):
    strategy = hardware.ddp()
    real = strategy.all_gather_object
    monkeypatch.setattr(
        strategy, "all_gather_object", lambda obj: [*real(obj), [(p, (1,), d) for p, _, d in obj]]
    )
    with pytest.raises(
        ValueError,
        match=r"rank 1's model does not match rank 0's: \['params'\]\['0.bias'\] is \[16\] "
        r"torch.float32 on rank 0 but \[1\] torch.float32 on rank 1",
    ):
        strategy.prepare_state(dict(mlp().named_parameters()), {})


def test_from_flags_builds_ddp(one_rank, monkeypatch):
    strategy = hardware.from_flags("cpu", 1, "ddp", "64-true")
    assert isinstance(strategy, hardware.DDP)
    assert strategy.precision.name == "64-true" and strategy.device == torch.device("cpu")
    env = ProcessEnv(0, 1, 0, 1, "127.0.0.1", 1234)
    for name, value in env.to_environ().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"devices=2 asks for 2 process\(es\) .* 1 were started"):
        hardware.from_flags("cpu", 2, "ddp")
