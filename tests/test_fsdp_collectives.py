"""FSDP's collectives: one all-gather and one reduce-scatter per unit, and prefetch.

One bounded 2-rank gloo launch (``_work``) runs everything. Collectives are counted with the
profiler: every gloo collective records a ``gloo:<op>`` event whichever API issued it
(``torch.distributed`` calls, DTensor redistributions, torch's FSDP2), so a step that went
back to one collective per parameter would count twice as many. Our step and torch's
``fully_shard`` (each Linear a unit, as our ``auto_wrap_policy={nn.Linear}``) run the same
model in the same processes and are counted the same way.

Prefetch is checked by order: the worker records every ``all_gather_single`` call and the
moment each unit computes (forward) and starts its backward.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from purestep import hardware

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.xdist_group("processes"),
]

DEPTH = 4  # the issue's MLP, 256 -> 12 x Linear(512) -> 10, with 4 hidden layers
UNITS = DEPTH + 2


def _mlp(depth: int = DEPTH, linear: type = nn.Linear) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [linear(256, 512), nn.ReLU()]
    for _ in range(depth):
        layers += [linear(512, 512), nn.ReLU()]
    layers.append(linear(512, 10))
    return nn.Sequential(*layers)


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _collectives(fn) -> collections.Counter:
    """The gloo collectives ``fn()`` issues, by kind."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))


def _counts(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from purestep import engine
    from purestep.engine import optim

    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, 256, generator=g), torch.randint(0, 10, (8,), generator=g))
    out: dict = {}
    for name, reshard in (("ours", True), ("ours_kept", False)):
        strategy = hardware.fsdp(auto_wrap_policy={nn.Linear}, reshard_after_forward=reshard)
        opt = optim.adam(1e-3)
        box = [engine.init(_mlp(), opt, seed=0, strategy=strategy)]
        step = engine.train_step(_mlp(), _loss, opt, strategy=strategy, donate=True)

        def ours(step=step, box=box):
            box[0], _ = step(box[0], batch)

        ours()  # the first call records the units' order
        out[name] = _collectives(ours)
    evaluate = engine.eval_step(_mlp(), _loss, strategy=strategy)
    evaluate(box[0], batch)
    out["eval"] = _collectives(lambda: evaluate(box[0], batch))

    model = _mlp()
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module)
    fully_shard(model)
    torch_opt = torch.optim.Adam(model.parameters(), 1e-3)

    def theirs():
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        torch_opt.step()
        torch_opt.zero_grad()

    theirs()
    out["torch"] = _collectives(theirs)
    return out


class _Mark(torch.autograd.Function):
    """Identity; its backward notes that unit ``i``'s backward pass starts."""

    @staticmethod
    def forward(ctx, x, i, log):
        ctx.i, ctx.log = i, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("bwd", ctx.i))
        return grad, None, None


def _order(rank: int) -> list:
    """The events of one steady-state train step: every all-gather issued, each unit's
    forward computation and the start of its backward."""
    import torch.distributed as dist

    from purestep import engine
    from purestep.engine import optim

    log: list = []

    class Logged(nn.Linear):
        def forward(self, x):
            log.append(("fwd", self.index))
            return _Mark.apply(super().forward(x), self.index, log)

    model = _mlp(linear=Logged)
    for i, m in enumerate(m for m in model if isinstance(m, Logged)):
        m.index = i

    def loss(apply, batch):
        out = _loss(apply, batch)
        log.append(("loss",))
        return out

    strategy = hardware.fsdp(auto_wrap_policy={Logged})
    opt = optim.sgd(0.1)
    state = engine.init(model, opt, seed=0, strategy=strategy)
    step = engine.train_step(model, loss, opt, strategy=strategy)
    batch = (torch.randn(8, 256), torch.randint(0, 10, (8,)))
    state, _ = step(state, batch)  # records the order
    gather = dist.all_gather_single

    def counted(*args, **kwargs):
        log.append(("ag",))
        return gather(*args, **kwargs)

    log.clear()
    dist.all_gather_single = counted
    try:
        step(state, batch)
    finally:
        dist.all_gather_single = gather
    return log


class _Odd(nn.Module):
    """A unit with an uneven shard (3 rows), an empty one (1 row on 2 ranks), a 0-d
    parameter and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(3, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.offset = nn.Parameter(torch.tensor([0.25]), requires_grad=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale + self.offset


def _odd_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), _Odd())


def _odd_loss(apply, batch):
    x, y = batch
    return F.mse_loss(apply(x).squeeze(-1), y)


def _odd_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, generator=g)) for _ in range(3)]


def _train_odd(strategy=None, rank=0, world=1):
    from purestep import engine
    from purestep.engine import optim

    opt = optim.sgd(0.1, momentum=0.9)
    state = engine.init(_odd_model(), opt, seed=0, strategy=strategy)
    step = engine.train_step(_odd_model(), _odd_loss, opt, strategy=strategy)
    b = 8 // world
    for x, y in _odd_batches():
        state, _ = step(state, (x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]))
    if strategy is not None:
        state = strategy.full_state(state)
    return {n: p.detach().clone() for n, p in state.params.items()}


def _odd(rank: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for name, mp in (
        ("fp32", None),
        ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    ):
        strategy = hardware.fsdp(auto_wrap_policy={_Odd}, mixed_precision=mp)
        out[name] = _train_odd(strategy, rank, 2)
    # a parameter laid out otherwise than the state's Shard(0) is refused, by name
    from torch.distributed.tensor import Shard, distribute_tensor

    from purestep import engine
    from purestep.engine import optim

    strategy = hardware.fsdp(auto_wrap_policy={_Odd})
    state = engine.init(_odd_model(), optim.sgd(0.1), seed=0, strategy=strategy)
    weight = state.params["0.weight"]
    odd = distribute_tensor(weight.full_tensor(), weight.device_mesh, [Shard(1)])
    state = state.replace(params={**state.params, "0.weight": odd})
    step = engine.train_step(_odd_model(), _odd_loss, optim.sgd(0.1), strategy=strategy)
    try:
        step(state, _odd_batches()[0])
        out["error"] = None
    except ValueError as err:
        out["error"] = str(err)
    return out


def _work(rank: int) -> dict:
    return {"counts": _counts(rank), "order": _order(rank), "odd": _odd(rank)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return hardware.launch(_work, 2, timeout=30, grace=3.0, threads=1, max_seconds=100)


def test_a_step_issues_no_more_collectives_than_torch_fsdp2(ranks):
    for r in ranks:
        ours, torch_side = r["counts"]["ours"], r["counts"]["torch"]
        assert sum(ours.values()) <= sum(torch_side.values()), (ours, torch_side)
        # one all-gather per unit forward, one per resharded unit backward (the last unit to
        # run forward is kept for the backward pass, which starts with it)
        assert ours["gloo:all_gather"] == 2 * UNITS - 1
        # gloo runs reduce_scatter_single as an all-reduce: one per unit, and the gradient
        # norm's one all-reduce
        assert ours["gloo:all_reduce"] == UNITS + 1
        assert set(ours) == {"gloo:all_gather", "gloo:all_reduce"}


def test_without_resharding_and_in_eval_each_unit_gathers_once(ranks):
    for r in ranks:
        assert r["counts"]["ours_kept"]["gloo:all_gather"] == UNITS
        assert r["counts"]["eval"] == {"gloo:all_gather": UNITS}


def test_the_next_units_all_gather_is_issued_before_the_current_unit_computes(ranks):
    for r in ranks:
        log = r["order"]
        loss_at = log.index(("loss",))
        forward, backward = log[:loss_at], log[loss_at:]
        for i in range(UNITS):
            # forward: units 0..i+1 gathered when unit i computes (the current and the next:
            # no more in flight)
            at = forward.index(("fwd", i))
            assert forward[:at].count(("ag",)) == min(i + 2, UNITS), (i, forward)
            # backward: when unit i's backward starts, every unit after it is done, unit i
            # gathered again (the last unit is kept) and unit i - 1 already prefetched
            at = backward.index(("bwd", i))
            assert backward[:at].count(("ag",)) == min(UNITS - i, UNITS - 1), (i, backward)
        assert forward.count(("ag",)) == UNITS and backward.count(("ag",)) == UNITS - 1


def test_uneven_empty_and_replicated_shards_match_one_process(ranks):
    want = _train_odd()
    for r in ranks:
        for name, tol in (("fp32", 1e-5), ("bf16", 5e-2)):
            got = r["odd"][name]
            assert set(got) == set(want)
            for n, w in want.items():
                # two half-batch means reduced against one mean: the last bits differ; bf16
                # computes (and gathers) in bfloat16
                bound = tol * float(w.abs().max()) + 1e-6
                assert float((got[n] - w).abs().max()) <= bound, (name, n)
        assert torch.equal(r["odd"]["fp32"]["2.offset"], want["2.offset"])  # frozen
        assert "'0.weight'" in r["odd"]["error"] and "Shard(0)" in r["odd"]["error"]
