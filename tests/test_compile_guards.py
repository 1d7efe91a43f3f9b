"""The guard floor of compiled steps (``engine.compile_guards``): what ``guards="engine"``
still checks on every call (so a changed input never runs a stale graph), what it no longer
checks (the identity of the step's own code and modules), and the direct call that skips
torch.compile's entry.

Every test compares against the same step built with ``guards="dynamo"`` (every guard of
torch.compile kept) or against the eager step, with ``torch.equal`` where the same graph
runs. The ``eager`` dynamo backend keeps them fast (dynamo traces, no code generation).
"""

from __future__ import annotations

import enum

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from purestep import engine, optim
from purestep.engine import compile_guards
from purestep.engine.compile import CompileOptions

FAST = {"backend": "eager"}
floor = pytest.mark.skipif(not compile_guards.supports_guard_filter(), reason="torch < 2.8")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_fn(apply, batch):
    x, y = batch["x"], batch["y"]
    out = F.cross_entropy(apply(x), y)
    if "w" in batch:  # a Python number or a tensor, read from the batch
        out = out * batch["w"]
    return out


def batch(n: int = 8, seed: int = 1, **extra):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, 8, generator=g),
        "y": torch.randint(0, 4, (n,), generator=g),
        **extra,
    }


def build(guards: str = "engine", tx=None, fn=loss_fn, model=None):
    model = model if model is not None else mlp()
    tx = tx if tx is not None else optim.adam(1e-2)
    step = engine.train_step(model, fn, tx, compile={**FAST, "guards": guards})
    return step, engine.init(model, tx)


def run(step, state, batches):
    losses = []
    for b in batches:
        state, out = step(state, b)
        losses.append(out.loss)
    return state, losses


def graph_of(step):
    (graph,) = step._graphs.values()
    return graph


def test_the_options_name_the_two_floors():
    assert CompileOptions().guards == "engine"
    with pytest.raises(ValueError, match="guards must be 'engine' or 'dynamo'"):
        CompileOptions(guards="none")
    assert compile_guards.GUARD_MODES == ("engine", "dynamo")


@floor
def test_after_the_first_call_the_engine_calls_the_graph_directly():
    step, state = build()
    state, _ = step(state, batch())
    graph = graph_of(step)
    assert graph._direct is not None and graph._direct._entries

    def refused(*args):
        raise AssertionError("went through torch.compile")

    graph.compiled = refused  # a matching input must not need torch.compile's entry
    state, out = step(state, batch(seed=2))
    assert torch.isfinite(out.loss)


@floor
def test_the_floor_runs_the_same_graphs_as_every_guard():
    batches = [batch(seed=s) for s in range(5)]
    fast, s1 = build("engine")
    full, s2 = build("dynamo")
    s1, l1 = run(fast, s1, batches)
    s2, l2 = run(full, s2, batches)
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(s1.params[n], s2.params[n]) for n in s1.params)
    assert fast.compilations == full.compilations
    assert graph_of(full)._direct is None


CHANGES = {
    "shape": lambda: batch(n=5),
    "dtype": lambda: batch(w=torch.tensor(0.5, dtype=torch.float64)),
    "new leaf": lambda: batch(w=0.5),
    "leaf turns tensor": lambda: batch(w=torch.tensor(0.5)),
    "strides": lambda: {**batch(), "x": batch()["x"].t().contiguous().t()},
    "requires_grad": lambda: {**batch(), "x": batch()["x"].requires_grad_()},
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_input_recompiles_instead_of_running_a_stale_graph(change):
    """After a few steps on one kind of batch, a changed one (and the original kind again)
    gives what the step with every guard gives."""
    first = {"leaf turns tensor": batch(w=1.5), "dtype": batch(w=torch.tensor(1.5))}.get(
        change, batch()
    )
    steps = [first, first, CHANGES[change](), first]
    fast, s1 = build("engine")
    full, s2 = build("dynamo")
    s1, l1 = run(fast, s1, steps)
    s2, l2 = run(full, s2, steps)
    assert all(torch.equal(a, b) for a, b in zip(l1, l2)), change
    assert all(torch.equal(s1.params[n], s2.params[n]) for n in s1.params)
    assert fast.compilations == full.compilations


def test_a_removed_leaf_recompiles():
    steps = [batch(w=2.0), batch(w=2.0), batch(), batch(w=2.0)]
    fast, s1 = build("engine")
    s1, losses = run(fast, s1, steps)
    eager = engine.train_step(mlp(), loss_fn, optim.adam(1e-2))
    _, expected = run(eager, engine.init(mlp(), optim.adam(1e-2)), steps)
    for got, want in zip(losses, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert fast.compilations >= 2


@floor
def test_a_changed_device_is_a_new_graph():
    """A meta-device batch fails the tensor guards (dynamo then traces it anew and the step
    fails on its device mismatch, not silently on the old graph)."""
    fast, state = build("engine")
    state, _ = fast(state, batch())
    meta = {k: v.to("meta") for k, v in batch().items()}
    frame_check = graph_of(fast)._direct
    args = (state.params, state.buffers, state.opt_state, None, meta)
    assert frame_check.run(args) is frame_check.MISS


def test_a_value_read_from_outside_the_state_is_still_checked():
    """A number the loss function reads from an outside object (as a LightningModule reads
    ``self.current_epoch``) changes between calls: the floor keeps value guards."""
    knobs = {"scale": 1.0}

    def scaled(apply, b):
        return F.cross_entropy(apply(b["x"]), b["y"]) * knobs["scale"]

    fast, state = build("engine", fn=scaled)
    b = batch()
    state, first = fast(state, b)
    knobs["scale"] = 3.0
    state, second = fast(state, b)
    eager = engine.train_step(mlp(), scaled, optim.adam(1e-2))
    knobs["scale"] = 1.0
    s0, want1 = eager(engine.init(mlp(), optim.adam(1e-2)), b)
    knobs["scale"] = 3.0
    _, want2 = eager(s0, b)
    torch.testing.assert_close(first.loss, want1.loss)
    torch.testing.assert_close(second.loss, want2.loss)
    assert fast.compilations == 2


def test_a_schedule_crossing_a_phase_boundary_takes_the_new_phase():
    """The symbolic guards on the traced count stay checked: a joined schedule whose Python
    branch changes at step 3 switches the learning rate to 0 there."""
    lr = optim.schedules.join([optim.schedules.constant(0.1), optim.schedules.constant(0.0)], [3])
    fast, state = build("engine", tx=optim.sgd(lr))
    b = batch()
    seen = []
    for _ in range(6):
        state, _ = fast(state, b)
        seen.append({n: p.clone() for n, p in state.params.items()})
    assert not torch.equal(seen[1]["0.weight"], seen[2]["0.weight"])  # lr 0.1: moving
    for later in seen[3:]:  # lr 0 from the boundary on: frozen
        assert all(torch.equal(later[n], seen[2][n]) for n in later)


@floor
def test_a_torch_compile_stance_goes_through_torch_compile():
    fast, state = build("engine")
    state, _ = fast(state, batch())
    direct = graph_of(fast)._direct
    args = (state.params, state.buffers, state.opt_state, None, batch())
    assert direct.run(args) is not direct.MISS
    with torch.compiler.set_stance("force_eager"):
        assert direct.run(args) is direct.MISS


@floor
def test_what_the_floor_no_longer_sees_is_the_identity_of_the_steps_own_code():
    """The contract it rests on, pinned: a method patched onto one of the model's modules
    after the step is built is seen with every guard and not at the floor (build a new
    step instead)."""
    for guards, patched in (("dynamo", True), ("engine", False)):
        model = mlp()
        step, state = build(guards, model=model)
        b = batch()
        state, _ = step(state, b)
        model[1].forward = lambda x: torch.zeros_like(x)  # the hidden layer now outputs 0
        _, after = step(state, b)
        # with the hidden layer zeroed, the loss is that of the last layer's bias alone
        zeroed = F.cross_entropy(state.params["2.bias"].expand(8, 4), b["y"])
        assert torch.allclose(after.loss, zeroed) is patched, guards


def test_the_filter_keeps_input_and_value_guards_and_drops_identity_ones():
    class Entry:
        def __init__(self, name, kind, value=None, is_global=False):
            self.name, self.guard_type, self.is_global = name, kind, is_global
            self.has_value, self.value, self.orig_guard = value is not None, value, None

    keep = compile_guards.guard_filter(["params", "batch"])
    entries = [
        Entry("params['0.weight']", "TENSOR_MATCH"),
        Entry("batch", "TYPE_MATCH"),
        Entry("batch['w']", "ID_MATCH", Phase.WARM),  # on an input: kept whatever its kind
        Entry("inner.loss_fn", "CLOSURE_MATCH", loss_fn),
        Entry("inner.binder._modules[0]", "TYPE_MATCH"),
        Entry("inner.model.epoch", "CONSTANT_MATCH", 3),
        Entry("inner.model.phase", "ID_MATCH", Phase.MAIN),  # data: an enum member
        Entry("inner.model[0]", "ID_MATCH", nn.Linear(1, 1)),  # code: a module
        Entry("G['torch']", "MODULE_MATCH", torch, is_global=True),
        Entry("G['knobs']", "DICT_NOT_CONTAINS", {}, is_global=True),  # data: a plain dict
        Entry("dict(type(inner).__mro__[1].__dict__)", "DICT_NOT_CONTAINS", {}),
        Entry("", "GLOBAL_STATE"),
        Entry("", "SHAPE_ENV"),
    ]
    assert keep(entries) == [
        True, True, True, False, True, True, True, False, False, True, False, True, True
    ]  # fmt: skip


def test_two_inputs_that_alias_recompile():
    """The same tensor given as two inputs the loss reads (aliasing is an input guard)."""

    def two(apply, b):
        return F.cross_entropy(apply(b["x"]), b["y"]) + (apply(b["x2"]) ** 2).mean()

    g = batch()
    apart = {**g, "x2": g["x"].clone()}
    alias = {**g, "x2": g["x"]}
    steps = [apart, apart, alias, apart]
    fast, s1 = build("engine", fn=two)
    full, s2 = build("dynamo", fn=two)
    _, l1 = run(fast, s1, steps)
    _, l2 = run(full, s2, steps)
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert fast.compilations == full.compilations


class Phase(enum.Enum):
    WARM = 1
    MAIN = 2


class Config:
    scale = 1.0  # a class-level default an instance may shadow


KNOBS: dict = {}
BOX = Config()


def outside(apply, b):
    out = F.cross_entropy(apply(b["x"]), b["y"])
    if "scale" in KNOBS:  # a key added to a plain dict
        out = out * KNOBS["scale"]
    if BOX.phase is Phase.MAIN:  # an enum member, compared by identity
        out = out * 2.0
    return out * BOX.scale  # an instance attribute shadowing the class default


@pytest.mark.parametrize("change", ["dict key", "enum member", "shadowed class attribute"])
def test_data_compared_by_identity_or_presence_stays_guarded(change):
    """Identity and presence guards on data (not on the step's code) are kept: each change
    gives what the eager step gives, through a new graph."""
    KNOBS.clear()
    BOX.phase = Phase.WARM
    BOX.__dict__.pop("scale", None)
    step, state = build("engine", fn=outside, tx=optim.sgd(0.0))
    b = batch()
    state, before = step(state, b)
    if change == "dict key":
        KNOBS["scale"] = 3.0
    elif change == "enum member":
        BOX.phase = Phase.MAIN
    else:
        BOX.scale = 3.0
    _, after = step(state, b)
    eager = engine.train_step(mlp(), outside, optim.sgd(0.0))
    _, want = eager(engine.init(mlp(), optim.sgd(0.0)), b)
    torch.testing.assert_close(after.loss, want.loss)
    assert not torch.allclose(after.loss, before.loss)
    assert step.compilations == 2


@floor
def test_dynamo_reset_empties_the_engines_entries_too():
    step, state = build("engine")
    state, _ = step(state, batch())
    assert graph_of(step)._direct._entries
    torch._dynamo.reset()
    assert not graph_of(step)._direct._entries
    state, _ = step(state, batch())
    assert step.compilations == 2  # compiled anew, as with every guard


@floor
def test_a_forced_backend_goes_through_torch_compile():
    step, state = build("engine")
    state, _ = step(state, batch())
    seen = []

    def spy(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    with torch.compiler.set_stance("default", force_backend=spy):
        step(state, batch())
    assert seen


@floor
def test_the_most_recently_hit_graph_is_checked_first():
    """As dynamo moves a cache hit to the front of its list, so do the direct calls."""
    step, state = build("engine")
    state, _ = step(state, batch())
    direct = graph_of(step)._direct
    checked = []

    def entry(name, passes):
        return (lambda frame: checked.append(name) or passes, lambda *a: name)

    direct._entries = [entry("a", False), entry("b", True)]
    assert direct.run((1, 2, 3, 4, 5)) == "b"
    checked.clear()
    assert direct.run((1, 2, 3, 4, 5)) == "b"
    assert checked == ["b"]
