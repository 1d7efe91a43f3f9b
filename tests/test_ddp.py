"""DDP on 2 CPU ranks (gloo), checked against one process and against itself.

One launch (``two_ranks``, module scope) runs every multi-rank check and returns what each
rank saw; the tests below compare those results with what a single process computes. A
second launch repeats the training for the bitwise-reproducibility test. Every launch is
bounded (``max_seconds``) and leaves no process behind. Run time: about 10-15 s on 2 shared
cores (two launches of ~4-6 s each).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from purestep import engine, hardware
from purestep.engine import metrics, optim, tree
from tests.helpers import batches, loss_fn, mlp

pytestmark = pytest.mark.timeout(120)

W = 2  # ranks
B = 4  # samples per rank per micro-batch
STEPS = 6  # micro-batches per training run
LAUNCH = {"max_seconds": 90, "timeout": 30}


# --------------------------------------------------------------------------- shared pieces


def _optimizers() -> dict[str, optim.GradientTransformation]:
    return {"sgd": optim.sgd(0.1, momentum=0.9), "adam": optim.adam(1e-2)}


def _train(strategy, opt, accumulate: int = 1, model=None, data=None):
    """Train from seed 0 on ``STEPS`` global batches of ``W * B`` samples; each rank of a
    strategy takes its ``B``-sample slice, a single process (``strategy=None``) takes all."""
    net = model if model is not None else mlp(seed=0)
    state = engine.init(net, opt, seed=0, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy, accumulate=accumulate)
    for x, y in data if data is not None else batches(STEPS, seed=0, size=W * B):
        if strategy is not None:
            r = strategy.rank
            x, y = x[r * B : (r + 1) * B], y[r * B : (r + 1) * B]
        state, _ = step(state, (x, y))
    return state


def _mixed_tree(rank: int) -> dict:
    """Rank-dependent tensors of three dtypes (three buckets), in a nested tree."""
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "a": torch.randn(3, 2, generator=g),
        "b": {"c": torch.randn(4, generator=g), "d": torch.randn((), generator=g)},
        "e": torch.randn(5, generator=g, dtype=torch.float64),
        "f": [torch.randint(-50, 50, (3,), generator=g), torch.randn(2, generator=g)],
    }


def _local_metrics(rank: int) -> dict:
    g = torch.Generator().manual_seed(10 + rank)
    v = torch.randn(5 + rank, generator=g)
    logits, y = torch.randn(6, 3, generator=g), torch.randint(0, 3, (6,), generator=g)
    return {
        "mean": metrics.Mean.of(v),
        "sum": metrics.Sum.of(v),
        "max": metrics.Max.of(v),
        "min": metrics.Min.of(v),
        "acc": metrics.Accuracy.of(logits, y),
    }


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _counting(strategy):
    """Count ``strategy.all_reduce`` and ``torch.distributed.all_reduce`` calls."""
    counts = {"strategy": 0, "dist": 0, "after_each_call": []}
    inner_strategy, inner_dist = strategy.all_reduce, dist.all_reduce

    def strategy_all_reduce(tree_, op="mean"):
        counts["strategy"] += 1
        return inner_strategy(tree_, op)

    def dist_all_reduce(*args, **kwargs):
        counts["dist"] += 1
        return inner_dist(*args, **kwargs)

    strategy.all_reduce = strategy_all_reduce
    dist.all_reduce = dist_all_reduce
    return counts, lambda: (
        delattr(strategy, "all_reduce"),
        setattr(dist, "all_reduce", inner_dist),
    )


# --------------------------------------------------------------------------- the rank side


def _checks(rank: int) -> dict:
    """Everything the multi-rank tests look at, as seen by ``rank``."""
    strategy = hardware.ddp(timeout=30)
    out: dict = {"rank": rank, "world_size": strategy.world_size, "repr": repr(strategy)}
    out["data_options"] = strategy.data_options()

    # Parity with one process, for two optimizers, with and without accumulation.
    out["params"] = {name: _train(strategy, opt).params for name, opt in _optimizers().items()}

    counts, undo = _counting(strategy)
    net = mlp(seed=0)
    opt = optim.adam(1e-2)
    state = engine.init(net, opt, seed=0, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy, accumulate=2)
    for x, y in batches(STEPS, seed=0, size=W * B):
        state, _ = step(state, (x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B]))
        counts["after_each_call"].append((counts["strategy"], counts["dist"]))
    undo()
    out["accum_params"] = state.params
    out["accum_counts"] = counts

    # Coalescing and purity of all_reduce, for every op.
    counts, undo = _counting(strategy)
    mixed = _mixed_tree(rank)
    before = tree.map(torch.clone, mixed)
    out["reduced"] = {}
    out["dist_calls"] = {}
    for op in ("sum", "max", "min"):
        start = counts["dist"]
        out["reduced"][op] = strategy.all_reduce(mixed, op)
        out["dist_calls"][op] = counts["dist"] - start
    floats = {"a": mixed["a"], "b": mixed["b"], "e": mixed["e"]}
    start = counts["dist"]
    out["reduced"]["mean"] = strategy.all_reduce(floats, "mean")
    out["dist_calls"]["mean"] = counts["dist"] - start
    undo()
    out["input_after"], out["input_before"] = mixed, before
    out["broadcast"] = strategy.broadcast(mixed, src=1)

    # Initial state: templates initialised differently on each rank.
    torch.manual_seed(1000 + rank)
    template = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    out["template"] = {n: p.detach().clone() for n, p in template.named_parameters()}
    out["init_params"] = engine.init(template, optim.sgd(0.1), seed=0, strategy=strategy).params

    # Flags, objects, metrics.
    out["flags"] = {
        (a, b, op): strategy.reduce_flag(a if rank == 0 else b, op)
        for a in (False, True)
        for b in (False, True)
        for op in ("any", "all")
    }
    out["objects"] = strategy.all_gather_object({"rank": rank})
    out["object_from_1"] = strategy.broadcast_object(f"chosen by {rank}", src=1)
    out["synced"] = metrics.compute(strategy.sync_metrics(_local_metrics(rank)))

    # Buffers under each policy (BatchNorm), and an explicit sync_buffers.
    out["buffers"] = {}
    out["bn_params"] = {}
    for mode in hardware.BUFFER_MODES:
        strategy.buffers = mode
        trained = _train(strategy, optim.sgd(0.1), model=_bn_model())
        out["buffers"][mode] = trained.buffers
        out["bn_params"][mode] = trained.params
        out[f"in_sync_{mode}"] = strategy.in_sync(trained)
    strategy.buffers = "broadcast"
    out["sync_buffers_max"] = strategy.sync_buffers(out["buffers"]["local"], "max")
    strategy.barrier()
    strategy.close()
    out["closed"] = not dist.is_initialized()
    return out


def _train_only(rank: int) -> dict:
    strategy = hardware.ddp(timeout=30)
    return {name: _train(strategy, opt).params for name, opt in _optimizers().items()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return hardware.launch(_checks, W, **LAUNCH)


# --------------------------------------------------------------------------- the tests


def test_identity(two_ranks):
    assert [r["rank"] for r in two_ranks] == [0, 1]
    assert all(r["world_size"] == W for r in two_ranks)
    assert two_ranks[1]["data_options"] == {"rank": 1, "world_size": W}
    assert "rank=1/2" in two_ranks[1]["repr"] and "gloo" in two_ranks[1]["repr"]
    assert all(r["objects"] == [{"rank": 0}, {"rank": 1}] for r in two_ranks)
    assert all(r["object_from_1"] == "chosen by 1" for r in two_ranks)
    # hardware.launch created the group; close() leaves a group it did not create alone.
    assert not any(r["closed"] for r in two_ranks)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_matches_one_process_with_the_global_batch(two_ranks, name):
    single = _train(None, _optimizers()[name]).params
    for r in two_ranks:
        tree.assert_trees_close(r["params"][name], single, rtol=1e-6, atol=1e-6)
    tree.assert_trees_equal(two_ranks[0]["params"][name], two_ranks[1]["params"][name])
    # The check is sensitive: training on rank 0's half alone lands far away.
    half = [(x[:B], y[:B]) for x, y in batches(STEPS, seed=0, size=W * B)]
    alone = _train(None, _optimizers()[name], data=half).params
    assert tree.diff(two_ranks[0]["params"][name], alone, rtol=1e-3, atol=1e-3)


def test_accumulation_matches_and_reduces_once_per_window(two_ranks):
    single = _train(None, optim.adam(1e-2), accumulate=2).params
    for r in two_ranks:
        tree.assert_trees_close(r["accum_params"], single, rtol=1e-6, atol=1e-6)
        # (strategy.all_reduce calls, torch.distributed.all_reduce calls) after each
        # micro-batch: one bucket all-reduce when a window of 2 closes (the gradients are
        # reduced by the step's own buckets, not the strategy's tree all-reduce), none in
        # between (a small float32 model: one bucket).
        assert r["accum_counts"]["after_each_call"] == [
            (0, 0),
            (0, 1),
            (0, 1),
            (0, 2),
            (0, 2),
            (0, 3),
        ]


@pytest.mark.bitwise
def test_runs_are_bitwise_identical(two_ranks):
    again = hardware.launch(_train_only, W, **LAUNCH)
    for first, second in zip(two_ranks, again):
        tree.assert_trees_equal(first["params"], second)


def test_all_reduce_is_coalesced_pure_and_correct(two_ranks):
    trees = [_mixed_tree(0), _mixed_tree(1)]
    expected = {
        "sum": tree.map(torch.add, *trees),
        "max": tree.map(torch.maximum, *trees),
        "min": tree.map(torch.minimum, *trees),
    }
    floats = [{k: t[k] for k in ("a", "b", "e")} for t in trees]
    expected["mean"] = tree.map(lambda a, b: (a + b) / 2, *floats)
    for r in two_ranks:
        for op, want in expected.items():
            tree.assert_trees_equal(r["reduced"][op], want)
        # float32, float64 and int64 leaves: three buckets, three collectives (mean: two).
        assert r["dist_calls"] == {"sum": 3, "max": 3, "min": 3, "mean": 2}
        tree.assert_trees_equal(r["input_after"], r["input_before"])
        tree.assert_trees_equal(r["input_after"], trees[r["rank"]])
        tree.assert_trees_equal(r["broadcast"], trees[1])


def test_initial_state_is_rank_zeros(two_ranks):
    rank0, rank1 = two_ranks
    assert tree.diff(rank0["template"], rank1["template"])  # the templates did differ
    for r in two_ranks:
        tree.assert_trees_equal(r["init_params"], rank0["template"])


def test_reduce_flag(two_ranks):
    for r in two_ranks:
        for (a, b, op), got in r["flags"].items():
            assert got == ((a or b) if op == "any" else (a and b)), (a, b, op)


def test_sync_metrics_equals_merging_locally(two_ranks):
    merged = metrics.compute(metrics.merge(_local_metrics(0), _local_metrics(1)))
    for r in two_ranks:
        tree.assert_trees_close(r["synced"], merged)
    # Not trivially equal to a rank's own values.
    assert tree.diff(metrics.compute(_local_metrics(0)), merged)


def test_buffer_policies(two_ranks):
    rank0, rank1 = two_ranks
    local0, local1 = rank0["buffers"]["local"], rank1["buffers"]["local"]
    assert tree.diff(local0, local1)  # each rank's own statistics differ
    assert not rank0["in_sync_local"]
    # broadcast (torch DDP's default): rank 0's statistics everywhere, states identical.
    for r in two_ranks:
        assert r["in_sync_broadcast"] and r["in_sync_mean"]
        tree.assert_trees_equal(r["buffers"]["broadcast"], local0)
        # The parameters do not depend on the policy (train mode uses batch statistics).
        tree.assert_trees_equal(r["bn_params"]["broadcast"], r["bn_params"]["local"])
    # mean: the running averages are linear, so syncing every step averages the ranks' own.
    floats = {n: (local0[n] + local1[n]) / 2 for n in local0 if local0[n].is_floating_point()}
    got = rank1["buffers"]["mean"]
    tree.assert_trees_close({n: got[n] for n in floats}, floats, rtol=1e-5, atol=1e-6)
    assert torch.equal(got["1.num_batches_tracked"], local0["1.num_batches_tracked"])
    # sync_buffers(op="max"): floating buffers element-wise max, integer ones from rank 0.
    for r in two_ranks:
        synced = r["sync_buffers_max"]
        for n, t in synced.items():
            want = torch.maximum(local0[n], local1[n]) if t.is_floating_point() else local0[n]
            assert torch.equal(t, want), n


def test_converted_template_under_sync_batchnorm_keeps_the_names():
    model = _bn_model()
    strategy = hardware.DDP(
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        precision=hardware.precision("32-true"),
        backend="gloo",
        timeout=5.0,
        sync_batchnorm=True,
        buffers="broadcast",
        owns_group=False,
    )
    with pytest.raises(ValueError, match="needs CUDA"):
        strategy.convert_model(model)
    strategy.device = torch.device("cuda", 0)  # conversion itself needs no GPU
    converted = strategy.convert_model(model)
    assert isinstance(converted[1], nn.SyncBatchNorm)
    assert isinstance(model[1], nn.BatchNorm1d)  # the template is left alone
    assert [n for n, _ in converted.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in converted.named_buffers()] == [n for n, _ in model.named_buffers()]
    strategy.sync_batchnorm = False
    assert strategy.convert_model(model) is model
