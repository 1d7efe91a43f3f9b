"""optim.from_torch: any torch.optim.Optimizer subclass as a pure transform.

Parity: every step equals driving the same torch optimizer by hand on the same gradients,
params and state compared with ``torch.equal`` (the same arithmetic runs on both sides).
Purity: input state, params and gradients bitwise unchanged, and no output tensor shares
storage with an input. Checkpoints: a round trip mid-run continues bitwise.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import batches, loss_fn, mlp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from purestep import engine
from purestep.engine import optim, tree
from purestep.engine.optim import PartitionState, TorchOptimizerState
from purestep.loops.callbacks import LearningRateMonitor


class SignMomentum(torch.optim.Optimizer):
    """A third-party optimizer in torch's style: lazily created state (an int counter and a
    momentum tensor), a group-level counter it keeps in its param group, a learning rate it
    adapts itself in the group, and gradients written in place (weight decay)."""

    def __init__(self, params, lr=0.01, beta=0.9, weight_decay=0.0, decay=1.0):
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay, decay=decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["k"] = group.get("k", 10) + 1  # created by the first step
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["weight_decay"] != 0:
                    grad.add_(p, alpha=group["weight_decay"])  # in place, on purpose
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["momentum"] = torch.zeros_like(p)
                state["step"] += 1
                m = state["momentum"]
                m.mul_(group["beta"]).add_(grad, alpha=1 - group["beta"])
                p.add_(m.sign(), alpha=-group["lr"] / math.sqrt(state["step"]))
            group["lr"] = group["lr"] * group["decay"]
        return None


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(5, 3, generator=g),
        "b": torch.randn(5, generator=g),
        "v": torch.randn(4, generator=g),
    }


def _grads(params, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(p.shape, generator=g) for k, p in params.items()} for _ in range(n)]


class ByHand:
    """The torch optimizer driven the ordinary way, over params named like the dict."""

    def __init__(self, cls, params, groups=None, **kwargs):
        self.params = {n: p.clone() for n, p in params.items()}
        if groups is None:
            spec = [self.params[n] for n in self.params]
        else:
            spec = [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [self.params[n] for n in g["params"]],
                }
                for g in groups
            ]
        self.opt = cls(spec, **kwargs)

    def step(self, grads):
        for n, p in self.params.items():
            p.grad = grads[n].clone() if n in grads else None
        self.opt.step()
        return {n: p.clone() for n, p in self.params.items()}

    def state(self, name):
        return self.opt.state[self.params[name]]


def _group_states(state):
    if isinstance(state, PartitionState):
        return list(state.inner_states.values())
    return [state]


def _assert_state_equal(ours, hand: ByHand):
    for g, group in zip(_group_states(ours), hand.opt.param_groups, strict=True):
        inner = g.inner_state
        assert isinstance(inner, TorchOptimizerState)
        for key, value in group.items():
            if key == "params":
                continue
            if key in g.hyperparams:
                if isinstance(value, tuple):
                    assert tuple(float(v) for v in g.hyperparams[key]) == value
                else:
                    assert float(g.hyperparams[key]) == float(value), key
            else:
                assert inner.group_created[key] and inner.group[key] == value, key
        for name, entries in inner.state.items():
            theirs = hand.state(name)
            assert {k for k, made in inner.created[name].items() if made} == set(theirs)
            for key, value in theirs.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(entries[key], value), (name, key)
                    assert entries[key].dtype == value.dtype
                else:
                    assert entries[key] == value, (name, key)


CASES = {
    "nadam": (torch.optim.NAdam, dict(lr=0.01, weight_decay=0.1, momentum_decay=0.005)),
    "nadam_decoupled": (
        torch.optim.NAdam,
        dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    "radam": (torch.optim.RAdam, dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.01)),
    "radam_foreach": (torch.optim.RAdam, dict(lr=0.02, foreach=True)),
    "adamax": (torch.optim.Adamax, dict(lr=0.02, weight_decay=0.05)),
    "asgd": (torch.optim.ASGD, dict(lr=0.05, t0=2.0, lambd=1e-3, weight_decay=0.01)),
    "asgd_foreach": (torch.optim.ASGD, dict(lr=0.05, t0=2.0, foreach=True)),
    "sgd_lazy_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    # torch's foreach SGD with nesterov adds the momentum into p.grad in place
    "sgd_nesterov_foreach": (
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, nesterov=True, foreach=True, weight_decay=0.0),
    ),
    "adagrad_eager_state": (torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1)),
    "sign_momentum": (SignMomentum, dict(lr=0.05, weight_decay=0.1, decay=0.9)),
    # and the rest of torch's first-order optimizers
    "adam_amsgrad_maximize": (torch.optim.Adam, dict(lr=0.01, amsgrad=True, maximize=True)),
    "adamw_foreach": (torch.optim.AdamW, dict(lr=0.01, foreach=True)),
    "rmsprop_centered": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    "rprop": (torch.optim.Rprop, dict(lr=0.01)),
    "adadelta": (torch.optim.Adadelta, dict(lr=0.5, weight_decay=0.01)),
}
if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
    CASES["adafactor"] = (torch.optim.Adafactor, dict(lr=0.01))


def _step(tx, grads, state, p, donate):
    """``optim.step``; with ``donate`` under ``donating()`` on the caller's own copies (the
    params are then updated in place, as the train step runs it)."""
    if not donate:
        return optim.step(tx, grads, state, p)
    with optim.donating():
        new_p, new_state = optim.step(tx, {n: g.clone() for n, g in grads.items()}, state, p)
    assert all(new_p[n] is p[n] for n in grads)  # in place
    return new_p, new_state


@pytest.mark.bitwise
@pytest.mark.parametrize("donate", [False, True], ids=["plain", "donating"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_equal_the_torch_optimizer_driven_by_hand(case, donate):
    cls, kwargs = CASES[case]
    params = _params()
    hand = ByHand(cls, params, **kwargs)
    tx = optim.from_torch(cls, **kwargs)
    state = tx.init(params)
    p = {n: t.clone() for n, t in params.items()} if donate else params
    for grads in _grads(params, 6):
        want = hand.step(grads)
        p, state = _step(tx, grads, state, p, donate)
        for n in want:
            assert torch.equal(p[n], want[n]), (case, n)
        _assert_state_equal(state, hand)
    assert state.count == 6
    assert state.name == cls.__name__


@pytest.mark.bitwise
@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")
def test_muon_on_matrices():
    params = {n: p for n, p in _params().items() if p.ndim == 2}  # Muon takes 2-D params only
    params["u"] = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    hand = ByHand(torch.optim.Muon, params, lr=0.02, weight_decay=0.01)
    tx = optim.from_torch(torch.optim.Muon, lr=0.02, weight_decay=0.01)
    state, p = tx.init(params), params
    for grads in _grads(params, 4):
        want = hand.step(grads)
        p, state = optim.step(tx, grads, state, p)
        assert all(torch.equal(p[n], want[n]) for n in want)
        _assert_state_equal(state, hand)


@pytest.mark.bitwise
@pytest.mark.parametrize("cls", [torch.optim.NAdam, SignMomentum])
def test_param_groups_with_their_own_hyper_parameters(cls):
    params = _params()
    groups = [
        {"params": ["w"], "weight_decay": 0.1, "lr": 0.03},
        {"params": ["b"], "lr": 0.01, "name": "bias"},
    ]
    # the rest ("v") forms the last group with the class arguments
    hand = ByHand(cls, params, groups=[*groups, {"params": ["v"]}], lr=0.02)
    tx = optim.from_torch(cls, lr=0.02, param_groups=groups)
    state = tx.init(params)
    assert isinstance(state, PartitionState)
    assert list(state.inner_states) == ["pg1", "bias", "pg3"]
    assert list(state.inner_states["pg1"].inner_state.state) == ["w"]
    p = params
    for grads in _grads(params, 4):
        want = hand.step(grads)
        p, state = optim.step(tx, grads, state, p)
        assert all(torch.equal(p[n], want[n]) for n in want)
        _assert_state_equal(state, hand)
    lrs = [float(g.hyperparams["lr"]) for g in _group_states(state)]
    assert lrs == [g["lr"] for g in hand.opt.param_groups]


@pytest.mark.bitwise
def test_param_groups_selected_by_a_function():
    params = _params()
    decay = {"params": optim.decay_mask, "weight_decay": 0.1}
    hand = ByHand(
        torch.optim.RAdam,
        params,
        groups=[{**decay, "params": ["w"]}, {"params": ["b", "v"]}],
        lr=0.01,
    )
    tx = optim.from_torch(torch.optim.RAdam, lr=0.01, param_groups=[decay])
    state = tx.init(params)
    p = params
    for grads in _grads(params, 3):
        want = hand.step(grads)
        p, state = optim.step(tx, grads, state, p)
        assert all(torch.equal(p[n], want[n]) for n in want)


def _storages(t):
    return {x.untyped_storage().data_ptr() for x in tree.leaves(t) if isinstance(x, torch.Tensor)}


@pytest.mark.parametrize(
    "case", ["nadam", "asgd", "sgd_lazy_momentum", "sgd_nesterov_foreach", "sign_momentum"]
)
@pytest.mark.parametrize("path", ["apply", "update"])
def test_purity_leaf_by_leaf(case, path):
    cls, kwargs = CASES[case]
    params = _params()
    tx = optim.from_torch(cls, **kwargs)
    state = tx.init(params)
    p = params
    for grads in _grads(params, 3):
        before = tree.map(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (state, p, grads)
        )
        if path == "apply":
            new_p, new_state = optim.step(tx, grads, state, p)
        else:
            updates, new_state = tx.update(grads, state, p)
            new_p = optim.apply_updates(p, updates)
        for old, now in zip(tree.leaves(before), tree.leaves((state, p, grads)), strict=True):
            if isinstance(old, torch.Tensor):
                assert torch.equal(old, now) and old.dtype == now.dtype
            else:
                assert old == now
        # Nothing the step writes shares storage with the input; the unchanged 0-d
        # hyper-parameters are passed on as they are (as inject_hyperparams does).
        hyper = _storages([g.hyperparams for g in _group_states(state)])
        assert not (_storages((new_state, new_p)) & _storages((state, p, grads))) - hyper
        assert not _storages([g.inner_state for g in _group_states(new_state)]) & _storages(
            (state, p, grads)
        )
        assert tree.structure(new_state) == tree.structure(state)
        state, p = new_state, new_p


@pytest.mark.bitwise
@pytest.mark.parametrize("case", ["nadam", "sign_momentum", "adagrad_eager_state"])
def test_donating_and_owning_updates_give_the_same_bits(case):
    cls, kwargs = CASES[case]
    params = _params()
    seq = _grads(params, 4)
    tx = optim.from_torch(cls, **kwargs)

    def run(mode):
        state, p = tx.init(params), {n: t.clone() for n, t in params.items()}
        for grads in seq:
            grads = {n: g.clone() for n, g in grads.items()}
            if mode == "donate":
                with optim.donating():
                    new_p, state = optim.step(tx, grads, state, p)
                assert all(new_p[n] is p[n] for n in p)  # updated in place
                p = new_p
            elif mode == "own":
                with optim.owning_updates():
                    p, state = optim.step(tx, grads, state, p)
            else:
                p, state = optim.step(tx, grads, state, p)
        return p, state

    plain = run("plain")
    for mode in ("donate", "own"):
        got = run(mode)
        for a, b in zip(tree.leaves(plain), tree.leaves(got), strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.bitwise
def test_a_donating_run_reuses_its_loaded_instance_and_keeps_no_gradients():
    # Once its state exists (Adam creates it in the first step, so from the third donating
    # step on), a torch class's step runs on the instance the step before left loaded (the
    # state's own objects, found by identity): nothing to load or read back, and the
    # gradients are not kept alive between steps.
    params = _params()
    tx = optim.from_torch(torch.optim.Adam, lr=0.01, weight_decay=0.1)
    hand = ByHand(torch.optim.Adam, params, lr=0.01, weight_decay=0.1)
    state, p = tx.init(params), {n: t.clone() for n, t in params.items()}
    for i, grads in enumerate(_grads(params, 5)):
        want = hand.step(grads)
        new_p, new_state = _step(tx, grads, state, p, True)
        assert all(torch.equal(new_p[n], want[n]) for n in want), i
        assert all(t.grad is None for t in new_p.values())
        assert (new_state.inner_state is state.inner_state) == (i >= 2), i
        _assert_state_equal(new_state, hand)
        p, state = new_p, new_state


@pytest.mark.bitwise
@pytest.mark.parametrize("case", ["nadam", "adagrad_eager_state", "sign_momentum"])
def test_one_transform_alternating_between_runs_keeps_each_run_exact(case):
    # Two runs (a copy of one's state, and a plain step) through one transform: a step
    # on another run's state, or on new objects, never uses the instance another run left.
    cls, kwargs = CASES[case]
    tx = optim.from_torch(cls, **kwargs)
    runs = [(_params(seed), _grads(_params(seed), 6, seed + 3)) for seed in (0, 1)]
    alone = []
    for params, seq in runs:
        own = optim.from_torch(cls, **kwargs)
        state, p = own.init(params), {n: t.clone() for n, t in params.items()}
        for grads in seq:
            p, state = _step(own, grads, state, p, True)
        alone.append((p, state))
    live = [[tx.init(params), {n: t.clone() for n, t in params.items()}] for params, _ in runs]
    for i in range(6):
        for r, (_, seq) in enumerate(runs):
            state, p = live[r]
            if r == 0 and i == 3:  # as if restored from a checkpoint: equal, new objects
                state, p = copy.deepcopy((state, p))
            if r == 1 and i == 4:  # one plain step in between
                live[r] = list(optim.step(tx, seq[i], state, p)[::-1])
                continue
            new_p, state = _step(tx, seq[i], state, p, True)
            live[r] = [state, new_p]
    for (p, state), (want_p, want_state) in zip([(p, s) for s, p in live], alone, strict=True):
        assert all(torch.equal(p[n], want_p[n]) for n in want_p)
        for a, b in zip(tree.leaves(state), tree.leaves(want_state), strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.bitwise
def test_a_fresh_optimizer_state_for_the_same_params_starts_afresh():
    # The same param tensors with another optimizer state (a reset, a state.replace): the
    # step must not run on the moments the instance left loaded.
    params = _params()
    tx = optim.from_torch(torch.optim.Adam, lr=0.01)
    state, p = tx.init(params), {n: t.clone() for n, t in params.items()}
    seq = _grads(params, 5)
    for grads in seq[:3]:
        p, state = _step(tx, grads, state, p, True)
    hand = ByHand(torch.optim.Adam, p, lr=0.01)
    state = tx.init(p)
    for grads in seq[3:]:
        want = hand.step(grads)
        p, state = _step(tx, grads, state, p, True)
        assert all(torch.equal(p[n], want[n]) for n in want)
        _assert_state_equal(state, hand)


def test_a_step_on_another_state_never_touches_the_loaded_runs_gradients():
    # Threads sharing one transform: run B's step finds run A's instance parked and empties
    # it while run A's next step (on another instance) has already set A's ``.grad``; that
    # gradient must survive, or A's step would silently skip its params.
    tx = optim.from_torch(torch.optim.Adam, lr=0.01)
    runs = []
    for seed in (0, 1):
        params = _params(seed)
        runs.append([tx.init(params), {n: t.clone() for n, t in params.items()}])
    seq = _grads(_params(), 3)
    for grads in seq[:2]:  # run A parks its instance
        new_p, new_state = _step(tx, grads, *runs[0], True)
        runs[0] = [new_state, new_p]
    in_flight = {n: g.clone() for n, g in seq[2].items()}
    for n, p in runs[0][1].items():
        p.grad = in_flight[n]  # what A's step in flight has just done
    _step(tx, seq[0], *runs[1], True)  # run B: takes A's instance, empties it
    assert all(p.grad is in_flight[n] for n, p in runs[0][1].items())


def test_init_lets_go_of_the_last_runs_tensors():
    import gc
    import weakref

    tx = optim.from_torch(torch.optim.Adam, lr=0.01)
    params = _params()
    state, p = tx.init(params), {n: t.clone() for n, t in params.items()}
    for grads in _grads(params, 3):
        p, state = _step(tx, grads, state, p, True)
    kept = weakref.ref(p["w"])
    del p, state
    gc.collect()
    assert kept() is not None  # the parked instance holds the run's params
    tx.init(_params(1))  # a new run (a sweep reusing the transform)
    gc.collect()
    assert kept() is None


def test_a_failing_step_on_the_loaded_instance_gives_it_up():
    params = _params()
    tx = optim.from_torch(torch.optim.Adam, lr=0.01)
    state, p = tx.init(params), {n: t.clone() for n, t in params.items()}
    seq = _grads(params, 3)
    p, state = _step(tx, seq[0], state, p, True)
    p, state = _step(tx, seq[1], state, p, True)  # leaves its instance loaded
    bad = {**seq[2], "w": torch.zeros(2, 2)}
    with pytest.raises(TypeError, match="gradient of 'w' does not fit"), optim.donating():
        optim.step(tx, bad, state, p)
    # the run goes on (the step failed before torch's step ran), exactly as by hand
    hand = ByHand(torch.optim.Adam, params, lr=0.01)
    for grads in seq:
        want = hand.step(grads)
    new_p, state = _step(tx, seq[2], state, p, True)
    assert all(torch.equal(new_p[n], want[n]) for n in want)
    _assert_state_equal(state, hand)


def test_update_returns_the_step_as_a_difference():
    cls, kwargs = CASES["nadam"]
    params = _params()
    tx = optim.from_torch(cls, **kwargs)
    state = tx.init(params)
    grads = _grads(params, 1)[0]
    want, _ = optim.step(tx, grads, state, params)
    updates, _ = tx.update(grads, state, params)
    for n in params:  # params + (new - params): one rounding away from new
        torch.testing.assert_close(params[n] + updates[n], want[n], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(grads, state)


@pytest.mark.bitwise
@pytest.mark.parametrize("donate", [False, True], ids=["plain", "donating"])
def test_schedules_and_state_changes_reach_the_param_group(donate):
    params = _params()
    lr = optim.schedules.cosine(0.02, 5)
    tx = optim.from_torch(torch.optim.NAdam, lr=lr, betas=(0.8, 0.99), weight_decay=0.01)
    hand = ByHand(torch.optim.NAdam, params, lr=lr(0), betas=(0.8, 0.99), weight_decay=0.01)
    state = tx.init(params)
    assert float(state.hyperparams["lr"]) == lr(0)
    p = {n: t.clone() for n, t in params.items()} if donate else params
    for i, grads in enumerate(_grads(params, 6)):
        hand.opt.param_groups[0]["lr"] = lr(i)
        if i == 3:  # change an injected float in the state, as a callback would
            state = state.replace(
                hyperparams={
                    **state.hyperparams,
                    "weight_decay": torch.tensor(0.2, dtype=torch.float64),
                }
            )
            hand.opt.param_groups[0]["weight_decay"] = 0.2
        want = hand.step(grads)
        p, state = _step(tx, grads, state, p, donate)
        assert all(torch.equal(p[n], want[n]) for n in want), i
        assert float(state.hyperparams["lr"]) == lr(i)  # the value this step used
    assert float(state.hyperparams["weight_decay"]) == 0.2


@pytest.mark.bitwise
@pytest.mark.parametrize("donate", [False, True], ids=["plain", "donating"])
def test_set_hyperparams_reaches_every_group(donate):
    params = _params()
    tx = optim.from_torch(torch.optim.ASGD, lr=0.05, param_groups=[{"params": ["w"]}])
    hand = ByHand(
        torch.optim.ASGD, params, groups=[{"params": ["w"]}, {"params": ["b", "v"]}], lr=0.05
    )
    state = tx.init(params)
    p = {n: t.clone() for n, t in params.items()} if donate else params
    for i, grads in enumerate(_grads(params, 4)):
        if i == 2:  # what ReduceLROnPlateau and callbacks request between steps
            state = optim.set_hyperparams(state, {"lr": 0.01})
            for group in hand.opt.param_groups:
                group["lr"] = 0.01
        want = hand.step(grads)
        p, state = _step(tx, grads, state, p, donate)
        assert all(torch.equal(p[n], want[n]) for n in want), i
    assert optim.injected_values(state, "lr") == [0.01, 0.01]


@pytest.mark.bitwise
def test_a_tensor_learning_rate_stays_a_tensor():
    params = _params()
    lr = torch.tensor(0.01)
    hand = ByHand(torch.optim.Adamax, params, lr=lr)
    tx = optim.from_torch(torch.optim.Adamax, lr=lr)
    state, p = tx.init(params), params
    for grads in _grads(params, 3):
        want = hand.step(grads)
        p, state = optim.step(tx, grads, state, p)
        assert all(torch.equal(p[n], want[n]) for n in want)


def test_learning_rate_monitor_sees_the_hyper_parameters():
    params = _params()
    one = optim.from_torch(torch.optim.NAdam, lr=0.01, betas=(0.85, 0.99))
    mon = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    assert mon.values(one.init(params)) == {
        "lr-NAdam": 0.01,
        "lr-NAdam-momentum": 0.85,
        "lr-NAdam-weight_decay": 0.0,
    }
    two = optim.from_torch(
        torch.optim.ASGD, lr=0.05, param_groups=[{"params": ["w"], "lr": 0.1, "name": "w"}]
    )
    assert LearningRateMonitor().values(two.init(params)) == {
        "lr-ASGD/w": 0.1,
        "lr-ASGD/pg2": 0.05,
    }


def test_lazily_created_state_keeps_its_structure_from_init():
    params = _params()
    tx = optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    s0 = tx.init(params)
    assert s0.inner_state.created["w"] == {"momentum_buffer": False}
    assert torch.equal(s0.inner_state.state["w"]["momentum_buffer"], torch.zeros(5, 3))
    _, s1 = optim.step(tx, _grads(params, 1)[0], s0, params)
    assert s1.inner_state.created["w"] == {"momentum_buffer": True}
    assert tree.structure(s0) == tree.structure(s1)
    eager = optim.from_torch(torch.optim.Adagrad, lr=0.1).init(params)
    assert all(eager.inner_state.created["w"].values())  # made by the constructor
    # the probe step disturbs no global RNG (torch's, Python's, NumPy's), nor the params
    import random

    import numpy as np

    rngs = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    before = {n: t.clone() for n, t in params.items()}
    optim.from_torch(Noisy).init(params)
    assert torch.equal(torch.random.get_rng_state(), rngs[0])
    assert random.getstate() == rngs[1]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), rngs[2]))
    assert all(torch.equal(params[n], before[n]) for n in params)
    s = optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9).init(params)
    assert all(torch.equal(params[n], before[n]) for n in params)
    assert not _storages(s) & _storages(params)


@pytest.mark.bitwise
def test_one_transform_stepped_from_several_threads_at_once():
    # Each step in flight borrows its own scratch instance (an ensemble of runs on threads,
    # or one transform shared by two steps): the results equal the steps run one by one.
    import threading

    cls, kwargs = CASES["sign_momentum"]
    tx = optim.from_torch(cls, **kwargs)
    runs = [(_params(seed), _grads(_params(seed), 3, seed + 7)) for seed in range(4)]

    def run(params, seq):
        state, p = tx.init(params), params
        for grads in seq:
            p, state = optim.step(tx, grads, state, p)
        return p, state

    alone = [run(*r) for r in runs]
    got: list = [None] * len(runs)
    start = threading.Barrier(len(runs))

    def worker(i):
        start.wait()
        got[i] = run(*runs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for a, b in zip(alone, got, strict=True):
        for x, y in zip(tree.leaves(a), tree.leaves(b), strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.Adagrad])  # lazy / eager state
def test_a_stacked_ensemble_state_gets_a_clear_error(cls):
    from purestep import hardware

    tx = optim.from_torch(cls, lr=0.01)
    model, ens = nn.Linear(3, 2), hardware.ensemble(2)
    state = engine.init(model, tx, strategy=ens)
    step = engine.train_step(model, lambda m, b: m(b[0]).pow(2).mean(), tx, strategy=ens)
    with pytest.raises(Exception, match="does not support ensembles") as info:
        step(state, (torch.randn(4, 3),))
    assert "does not support ensembles" in str(info.value) + "".join(
        getattr(info.value, "__notes__", [])
    )


def test_params_without_gradients_are_left_alone():
    params = _params()
    tx = optim.from_torch(torch.optim.NAdam, lr=0.01)
    state = tx.init(params)
    grads = {k: g for k, g in _grads(params, 1)[0].items() if k != "v"}
    hand = ByHand(torch.optim.NAdam, params, lr=0.01)
    want = hand.step(grads)
    p, state = optim.step(tx, grads, state, params)
    assert p["v"] is params["v"]
    assert all(torch.equal(p[n], want[n]) for n in want)
    assert state.inner_state.created["v"] == dict.fromkeys(state.inner_state.state["v"], False)
    _assert_state_equal(state, hand)
    with pytest.raises(KeyError, match="does not cover"):
        optim.step(tx, {"nope": torch.zeros(1)}, state, params)


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.bitwise
@pytest.mark.parametrize("case", ["nadam", "sgd_lazy_momentum", "sign_momentum"])
def test_checkpoint_round_trip_mid_run_continues_bitwise(tmp_path, case):
    cls, kwargs = CASES[case]
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.from_torch(cls, **kwargs))
    data = batches(6)
    step = engine.train_step(mlp(), loss_fn, tx)

    def run(state, data):
        for batch in data:
            state, _ = step(state, batch)
        return state

    straight = run(engine.init(mlp(), tx), data)
    mid = run(engine.init(mlp(), tx), data[:3])
    url = str(tmp_path / "mid.ckpt")
    engine.checkpoint.save(mid, url)
    fresh = engine.init(mlp(), tx)  # a new process: the template is a fresh state
    restored, _ = engine.checkpoint.load(url, target=fresh)
    resumed = run(restored, data[3:])
    for (path, a), b in zip(tree.flatten_with_paths(straight), tree.leaves(resumed), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.dtype == b.dtype, path
        else:
            assert a == b, path


def test_checkpoint_before_the_first_step_matches_a_later_template(tmp_path):
    tx = optim.from_torch(torch.optim.NAdam, lr=0.01)
    fresh = engine.init(mlp(), tx)
    url = str(tmp_path / "s.ckpt")
    engine.checkpoint.save(fresh, url)
    state, _ = engine.checkpoint.load(url, target=engine.init(mlp(), tx))
    state, _ = engine.train_step(mlp(), loss_fn, tx)(state, batches(1)[0])
    assert all(state.opt_state.inner_state.created["0.weight"].values())


def test_the_class_comes_from_the_transform_never_from_the_checkpoint(tmp_path):
    # The checkpoint holds tensors, numbers and the class's name (a label for the LR
    # monitor); which class steps is the transform's, whatever the checkpoint says.
    calls = []

    class Spy(torch.optim.Adam):
        def step(self, closure=None):
            calls.append(type(self))
            return super().step(closure)

    saved = optim.from_torch(torch.optim.Adam, lr=0.01)
    state = engine.init(mlp(), saved)
    state, _ = engine.train_step(mlp(), loss_fn, saved)(state, batches(1)[0])
    url = str(tmp_path / "s.ckpt")
    engine.checkpoint.save(state, url)
    spy = optim.from_torch(Spy, lr=0.01)
    restored, _ = engine.checkpoint.load(url, target=engine.init(mlp(), spy))
    assert all(
        isinstance(x, (torch.Tensor, int, float, str, bool, type(None)))
        for x in tree.leaves(restored.opt_state)
    )
    calls.clear()
    engine.train_step(mlp(), loss_fn, spy)(restored, batches(2)[1])
    assert calls == [Spy]


# --------------------------------------------------------------------------- refusals


class Noisy(torch.optim.Optimizer):
    """Draws from torch's, Python's and NumPy's global RNGs in its step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        import random

        import numpy as np

        for group in self.param_groups:
            for p in group["params"]:
                jitter = random.random() + float(np.random.rand())
                p.add_(p.grad + torch.randn_like(p) * jitter, alpha=-group["lr"])


class NeedsClosure(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure):
        return closure()


class AsksForClosure(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        if closure is None:
            raise RuntimeError("this optimizer requires a closure")
        return closure()


class KeepsAnObject(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["thing"] = object()


class GrowsState(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                if state["n"] == 2:
                    state["late"] = torch.zeros_like(p)
                p.add_(p.grad, alpha=-group["lr"])


class CountsOnItself(torch.optim.Optimizer):
    """Keeps its step count on the instance, where a pure step would lose it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] / self.t)


def test_state_kept_on_the_instance_is_refused():
    params = _params()
    tx = optim.from_torch(CountsOnItself)
    state, p = tx.init(params), params
    grads = _grads(params, 1)[0]
    p, state = optim.step(tx, grads, state, p)
    with pytest.raises(TypeError, match="changed its attribute 't' in step 2"):
        optim.step(tx, grads, state, p)


def test_refused_optimizers_say_why():
    with pytest.raises(ValueError, match="needs a closure"):
        optim.from_torch(torch.optim.LBFGS)
    with pytest.raises(ValueError, match="needs a closure"):
        optim.from_torch(NeedsClosure)
    with pytest.raises(ValueError, match="sparse gradients"):
        optim.from_torch(torch.optim.SparseAdam)
    params = _params()
    tx = optim.from_torch(AsksForClosure)
    with pytest.raises(ValueError, match="without a closure"):
        tx.init(params)
    with pytest.raises(ValueError, match="differentiable=True"):
        optim.from_torch(torch.optim.Adam, differentiable=True)
    with pytest.raises(ValueError, match="differentiable=True"):
        optim.from_torch(torch.optim.Adam, param_groups=[{"params": ["w"], "differentiable": True}])
    with pytest.raises(TypeError, match="Optimizer subclass"):
        optim.from_torch("Adam")
    with pytest.raises(TypeError, match="Optimizer subclass"):
        optim.from_torch(nn.Linear)
    with pytest.raises(TypeError, match=r"instance.*optim.from_torch\(torch.optim.SGD, lr=0.1"):
        optim.from_torch(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))


def test_sparse_gradients_are_refused():
    params = _params()
    tx = optim.from_torch(torch.optim.Adam)
    state = tx.init(params)
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    grads["b"] = grads["b"].to_sparse()
    with pytest.raises(ValueError, match="sparse gradients are not supported"):
        optim.step(tx, grads, state, params)


def test_bad_arguments_get_torch_s_message_at_once():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optim.from_torch(torch.optim.NAdam, lr=-1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'"):
        optim.from_torch(torch.optim.NAdam, lrr=0.1)
    tx = optim.from_torch(torch.optim.SGD, 0.5, 0.9)  # positional, as torch's (lr, momentum)
    assert float(tx.init(_params()).hyperparams["momentum"]) == 0.9


def test_state_a_checkpoint_cannot_hold_or_a_changing_structure_is_refused():
    params = _params()
    with pytest.raises(TypeError, match="checkpoints hold only tensors"):
        optim.from_torch(KeepsAnObject).init(params)
    tx = optim.from_torch(GrowsState)
    state = tx.init(params)
    grads = _grads(params, 1)[0]
    p, state = optim.step(tx, grads, state, params)
    with pytest.raises(TypeError, match="'late'.*first step did not create"):
        optim.step(tx, grads, state, p)


def test_param_groups_are_checked():
    params = _params()
    with pytest.raises(ValueError, match="in param_groups\\[0\\] and param_groups\\[1\\]"):
        optim.from_torch(
            torch.optim.Adam, param_groups=[{"params": ["w"]}, {"params": ["w", "b"]}]
        ).init(params)
    with pytest.raises(KeyError, match="not trained"):
        optim.from_torch(torch.optim.Adam, param_groups=[{"params": ["x"]}]).init(params)
    with pytest.raises(TypeError, match="'params' entry"):
        optim.from_torch(torch.optim.Adam, param_groups=[{"lr": 0.1}])
    with pytest.raises(TypeError, match="param names"):
        optim.from_torch(torch.optim.Adam, param_groups=[{"params": [torch.zeros(1)]}])
    with pytest.raises(ValueError, match="two groups are named"):
        optim.from_torch(
            torch.optim.Adam,
            param_groups=[{"params": ["w"], "name": "a"}, {"params": ["b"], "name": "a"}],
        )
    with pytest.raises(ValueError, match="labels \\['pg2', 'pg2'\\] repeat"):
        optim.from_torch(torch.optim.Adam, param_groups=[{"params": ["w"], "name": "pg2"}]).init(
            params
        )
    with pytest.raises(TypeError, match="list of dicts"):
        optim.from_torch(torch.optim.Adam, param_groups={"params": ["w"]})


def test_no_params_and_no_gradients():
    tx = optim.from_torch(torch.optim.NAdam, lr=0.01)
    state = tx.init({})
    p, state = optim.step(tx, {}, state, {})
    assert p == {} and state.count == 1
    params = _params()
    state = tx.init(params)
    p, s = optim.step(tx, {}, state, params)
    assert s.count == 1 and all(p[n] is params[n] for n in params)
    updates, s = tx.update({}, state, params)
    assert updates == {} and s.count == 1


@settings(max_examples=15, deadline=None)
@given(
    lr=st.floats(1e-4, 0.5),
    beta=st.floats(0.0, 0.99),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_property_sign_momentum_matches_by_hand(lr, beta, steps, seed):
    params = _params(seed)
    hand = ByHand(SignMomentum, params, lr=lr, beta=beta)
    tx = optim.from_torch(SignMomentum, lr=lr, beta=beta)
    state, p = tx.init(params), params
    for grads in _grads(params, steps, seed + 1):
        want = hand.step(grads)
        p, state = optim.step(tx, grads, state, p)
        assert all(torch.equal(p[n], want[n]) for n in want)
    assert state.inner_state.group["k"] == steps + 10


@pytest.mark.bitwise
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.Adam, dict(lr=0.01)),  # torch's CUDA default: foreach
        (torch.optim.Adam, dict(lr=0.01, fused=True)),
        (torch.optim.NAdam, dict(lr=0.01, capturable=True)),
        (torch.optim.ASGD, dict(lr=0.05, capturable=True)),
    ],
)
def test_cuda_flags_keep_parity_and_where_torch_keeps_step(cls, kwargs):
    params = {n: p.cuda() for n, p in _params().items()}
    seq = [{n: g.cuda() for n, g in grads.items()} for grads in _grads(params, 4)]
    hand = ByHand(cls, params, **kwargs)
    tx = optim.from_torch(cls, **kwargs)
    state, p = tx.init(params), params
    for grads in seq:
        want = hand.step(grads)
        with optim.owning_updates():
            p, state = optim.step(tx, {n: g.clone() for n, g in grads.items()}, state, p)
        assert all(torch.equal(p[n], want[n]) for n in want)
        _assert_state_equal(state, hand)
    for name, entries in state.inner_state.state.items():
        assert entries["step"].device == hand.state(name)["step"].device
