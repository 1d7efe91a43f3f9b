"""Numerical parity of the named optimizers with ``torch.optim.X(foreach=True)``.

Each case runs 100 steps over the same pre-generated gradients on a small dict of params of
several shapes (a matrix, vectors, a 0-d scalar) and compares the params and every state
tensor with torch's. ``optim.step`` (the fused ``apply``) must be bitwise equal, with and
without donation. The ``update`` + ``apply_updates`` path is only close: it adds the update
as a separate op where torch fuses the multiply-add, which rounds once more per step
(about one ulp of |param|), and over 100 steps that drifts by ~1e-7 absolute; hence
``rtol=1e-6`` plus ``atol=1e-6`` for elements near zero.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purestep.engine import optim
from purestep.engine.optim import schedules
from purestep.engine.tree import assert_trees_close, assert_trees_equal

pytestmark = pytest.mark.bitwise

SHAPES = {"fc1.weight": (6, 5), "fc1.bias": (6,), "fc2.weight": (3, 6), "fc2.bias": (3,), "t": ()}
STEPS = 100


def make_params(seed: int = 0, dtypes: dict | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    if dtypes:
        out = {n: t.to(dtypes.get(n, t.dtype)) for n, t in out.items()}
    return out


def make_grads(params: dict, steps: int = STEPS, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {n: torch.randn(p.shape, generator=g).to(p.device, p.dtype) for n, p in params.items()}
        for _ in range(steps)
    ]


def run_torch(cls, kwargs, params, grads, scheduler=None, on_step=None, groups=None):
    """Params and state (state key -> name -> tensor) after torch's optimizer ran."""
    ps = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    if groups is None:
        opt = cls(list(ps.values()), foreach=True, **kwargs)
    else:
        opt = cls([{**g, "params": [ps[n] for n in g["params"]]} for g in groups], foreach=True)
    sched = scheduler(opt) if scheduler else None
    for i, g in enumerate(grads):
        if on_step:
            on_step(i, opt)
        for n, p in ps.items():
            p.grad = g[n].clone()
        opt.step()
        if sched:
            sched.step()
    state: dict[str, dict] = {}
    steps = set()
    for n, p in ps.items():
        for k, v in opt.state[p].items():
            if k == "step":
                steps.add(int(v.item()))
            else:
                state.setdefault(k, {})[n] = v
    assert steps <= {len(grads)}  # SGD keeps no step count
    return {n: p.detach() for n, p in ps.items()}, state


def run_ours(tx, params, grads, donate=False, fused=True, on_step=None, owning=False):
    p = {n: t.clone() for n, t in params.items()}
    s = tx.init(p)
    for i, g in enumerate(grads):
        if on_step:
            s = on_step(i, s)
        g = {n: t.clone() for n, t in g.items()}
        with optim.donating(donate), optim.owning_updates(owning):
            if fused:
                p, s = optim.step(tx, g, s, p)
            else:
                u, s = tx.update(g, s, p)
                p = optim.apply_updates(p, u)
    return p, s


CASES = [
    ("sgd", torch.optim.SGD, dict(lr=0.1), optim.sgd),
    ("sgd-momentum", torch.optim.SGD, dict(lr=0.05, momentum=0.9), optim.sgd),
    ("sgd-dampening", torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3), optim.sgd),
    ("sgd-nesterov", torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True), optim.sgd),
    ("sgd-wd", torch.optim.SGD, dict(lr=0.1, weight_decay=0.05), optim.sgd),
    (
        "sgd-all",
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True),
        optim.sgd,
    ),
    ("sgd-maximize", torch.optim.SGD, dict(lr=0.1, momentum=0.5, maximize=True), optim.sgd),
    ("adam", torch.optim.Adam, dict(lr=0.01), optim.adam),
    ("adam-wd", torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, betas=(0.8, 0.99)), optim.adam),
    ("adam-amsgrad", torch.optim.Adam, dict(lr=0.01, amsgrad=True, eps=1e-6), optim.adam),
    (
        "adam-all",
        torch.optim.Adam,
        dict(lr=0.01, weight_decay=0.1, amsgrad=True, maximize=True),
        optim.adam,
    ),
    ("adamw", torch.optim.AdamW, dict(lr=0.01), optim.adamw),
    (
        "adamw-amsgrad",
        torch.optim.AdamW,
        dict(lr=0.01, weight_decay=0.1, amsgrad=True),
        optim.adamw,
    ),
    ("adamw-maximize", torch.optim.AdamW, dict(lr=0.01, maximize=True), optim.adamw),
    ("rmsprop", torch.optim.RMSprop, dict(lr=0.01), optim.rmsprop),
    ("rmsprop-alpha", torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, eps=1e-6), optim.rmsprop),
    ("rmsprop-momentum", torch.optim.RMSprop, dict(lr=0.01, momentum=0.9), optim.rmsprop),
    ("rmsprop-centered", torch.optim.RMSprop, dict(lr=0.01, centered=True), optim.rmsprop),
    (
        "rmsprop-all",
        torch.optim.RMSprop,
        dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1, maximize=True),
        optim.rmsprop,
    ),
    ("adagrad", torch.optim.Adagrad, dict(lr=0.1), optim.adagrad),
    ("adagrad-decay", torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01), optim.adagrad),
    ("adagrad-wd", torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.1), optim.adagrad),
    (
        "adagrad-all",
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.5, maximize=True),
        optim.adagrad,
    ),
]


def _state_of(state, torch_state):
    """Our state's dicts under torch's state keys (they share names)."""
    return {k: getattr(state, k) for k in torch_state}


@pytest.fixture(scope="module")
def data():
    params = make_params()
    return params, make_grads(params)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_step_bitwise_equals_torch(case, data):
    _, cls, kwargs, factory = case
    params, grads = data
    tp, ts = run_torch(cls, kwargs, params, grads)
    tx = factory(**kwargs)
    for donate, owning in ((False, False), (False, True), (True, False)):
        p, s = run_ours(tx, params, grads, donate=donate, owning=owning)
        assert_trees_equal(p, tp)
        assert_trees_equal(_state_of(s, ts), ts)
        assert s.count == STEPS
        # every state dict the optimizer keeps is either compared or empty
        for field in type(s).__struct_fields__ - {"count"}:
            assert field in ts or getattr(s, field) == {}, field


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_update_path_close_to_torch(case, data):
    _, cls, kwargs, factory = case
    params, grads = data
    tp, ts = run_torch(cls, kwargs, params, grads)
    p, s = run_ours(factory(**kwargs), params, grads, fused=False)
    assert_trees_close(p, tp, rtol=1e-6, atol=1e-6)
    owned_p, owned_s = run_ours(factory(**kwargs), params, grads, fused=False, owning=True)
    assert_trees_equal((owned_p, owned_s), (p, s))
    assert_trees_close(_state_of(s, ts), ts, rtol=1e-6, atol=1e-6)


def test_adagrad_update_path_is_bitwise(data):
    """torch's last Adagrad op is ``addcdiv`` with value 1, i.e. no fused scaling."""
    params, grads = data
    kwargs = dict(lr=0.1, lr_decay=0.01, weight_decay=0.1)
    tp, ts = run_torch(torch.optim.Adagrad, kwargs, params, grads)
    p, s = run_ours(optim.adagrad(**kwargs), params, grads, fused=False)
    assert_trees_equal(p, tp)
    assert_trees_equal(_state_of(s, ts), ts)


def test_mixed_dtypes_bitwise(data):
    """float64 and float32 params in one dict: grouped like torch, same bits."""
    params = make_params(dtypes={"fc1.bias": torch.float64, "t": torch.float64})
    grads = make_grads(params, steps=20)
    for cls, kwargs, factory in [
        (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1), optim.adam),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), optim.sgd),
    ]:
        tp, ts = run_torch(cls, kwargs, params, grads)
        p, s = run_ours(factory(**kwargs), params, grads)
        assert p["fc1.bias"].dtype == torch.float64
        assert_trees_equal(p, tp)
        assert_trees_equal(_state_of(s, ts), ts)


def test_step_lr_schedule_matches_step_lr(data):
    """A StepLR-shaped schedule (gamma 0.5: exact products) gives torch's bits."""
    params, grads = data
    tp, ts = run_torch(
        torch.optim.Adam,
        dict(lr=0.02),
        params,
        grads,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5),
    )
    p, s = run_ours(optim.adam(lr=schedules.step(0.02, 10, 0.5)), params, grads)
    assert_trees_equal(p, tp)
    assert_trees_equal(_state_of(s, ts), ts)


def test_multistep_and_cosine_lr_close_to_torch(data):
    """Schedules whose torch counterpart compounds factors step by step agree to rounding."""
    params, grads = data
    for sched, ours in [
        (
            lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, [20, 50, 70], gamma=0.3),
            schedules.multistep(0.1, [20, 50, 70], gamma=0.3),
        ),
        (
            lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.01),
            schedules.cosine(0.1, STEPS, 0.01),
        ),
    ]:
        tp, _ = run_torch(torch.optim.SGD, dict(lr=0.1, momentum=0.9), params, grads, sched)
        p, _ = run_ours(optim.sgd(ours, momentum=0.9), params, grads)
        assert_trees_close(p, tp, rtol=1e-6, atol=1e-6)


def test_inject_hyperparams_lr_change_matches_param_groups(data):
    """Changing the injected lr in the state == editing ``param_groups[0]['lr']``."""
    params, grads = data

    def torch_edit(i, opt):
        if i == 40:
            opt.param_groups[0]["lr"] = 0.003
        if i == 70:
            opt.param_groups[0]["weight_decay"] = 0.5

    def ours_edit(i, s):
        if i == 40:
            s = s.replace(
                hyperparams={**s.hyperparams, "lr": torch.tensor(0.003, dtype=torch.float64)}
            )
        if i == 70:
            s = s.replace(hyperparams={**s.hyperparams, "weight_decay": torch.tensor(0.5)})
        return s

    kwargs = dict(lr=0.01, weight_decay=0.1)
    tp, ts = run_torch(torch.optim.AdamW, kwargs, params, grads, on_step=torch_edit)
    tx = optim.inject_hyperparams(optim.adamw)(**kwargs)
    p, s = run_ours(tx, params, grads, on_step=ours_edit)
    assert_trees_equal(p, tp)
    assert_trees_equal(_state_of(s.inner_state, ts), ts)
    assert s.count == STEPS
    assert float(s.hyperparams["lr"]) == 0.003


def test_partition_matches_param_groups(data):
    """``partition`` with one transform per label == torch param groups (bitwise)."""
    params, grads = data
    decay = [n for n in params if params[n].ndim >= 2]
    no_decay = [n for n in params if n not in decay]
    groups = [
        dict(params=decay, lr=0.01, weight_decay=0.1),
        dict(params=no_decay, lr=0.02, weight_decay=0.0),
    ]
    tp, ts = run_torch(torch.optim.AdamW, {}, params, grads, groups=groups)
    tx = optim.partition(
        {True: optim.adamw(0.01, weight_decay=0.1), False: optim.adamw(0.02, weight_decay=0.0)},
        optim.decay_mask,
    )
    p, s = run_ours(tx, params, grads)
    assert_trees_equal(p, tp)
    for label in (True, False):
        inner = s.inner_states[label]
        names = decay if label else no_decay
        assert sorted(inner.exp_avg) == sorted(names)
        assert_trees_equal(
            _state_of(inner, ts), {k: {n: v[n] for n in names} for k, v in ts.items()}
        )


def test_clip_then_adamw_matches_torch(data):
    """``chain(clip_by_global_norm, adamw)`` == ``clip_grad_norm_`` then ``AdamW.step``."""
    params, grads = data
    ps = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    opt = torch.optim.AdamW(list(ps.values()), lr=0.01, foreach=True)
    for g in grads:
        for n, p in ps.items():
            p.grad = g[n].clone()
        torch.nn.utils.clip_grad_norm_(list(ps.values()), 2.0, foreach=True)
        opt.step()
    tx = optim.chain(optim.clip_by_global_norm(2.0), optim.adamw(0.01))
    for donate, owning in ((False, False), (False, True), (True, False)):
        p, _ = run_ours(tx, params, grads, donate=donate, owning=owning)
        assert_trees_equal(p, {n: t.detach() for n, t in ps.items()})


def test_wrappers_keep_bitwise_parity(data):
    """accumulate(k=1), skip_nonfinite, masked(all) and inject add no rounding to Adam."""
    params, grads = data
    tp, _ = run_torch(torch.optim.Adam, dict(lr=0.01), params, grads)
    for tx in [
        optim.accumulate(optim.adam(0.01), 1),
        optim.skip_nonfinite(optim.adam(0.01)),
        optim.masked(optim.adam(0.01), lambda n, t: True),
        optim.inject_hyperparams(optim.adam)(lr=0.01),
        optim.chain(optim.identity(), optim.adam(0.01)),
    ]:
        p, _ = run_ours(tx, params, grads)
        assert_trees_equal(p, tp)


def test_sgd_schedule_and_tensor_lr(data):
    """lr as a 0-d tensor, and a schedule through ``inject_hyperparams``."""
    params, grads = data
    grads = grads[:30]
    tp, _ = run_torch(torch.optim.SGD, dict(lr=0.05, momentum=0.9), params, grads)
    p, _ = run_ours(optim.sgd(torch.tensor(0.05, dtype=torch.float64), momentum=0.9), params, grads)
    assert_trees_equal(p, tp)
    tp, _ = run_torch(
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9),
        params,
        grads,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 7, gamma=0.5),
    )
    tx = optim.inject_hyperparams(optim.sgd)(lr=schedules.step(0.05, 7, 0.5), momentum=0.9)
    p, s = run_ours(tx, params, grads)
    assert_trees_equal(p, tp)
    assert float(s.hyperparams["lr"]) == 0.05 * 0.5 ** (29 // 7)
    assert s.hyperparams["lr"].dtype == torch.float64


# --------------------------------------------------------------------------- random configs

HYPER = dict(max_examples=25, deadline=None)


def _short_parity(cls, kwargs, factory, steps=8, seed=0):
    params = make_params(seed)
    grads = make_grads(params, steps=steps, seed=seed + 1)
    tp, ts = run_torch(cls, kwargs, params, grads)
    for owning in (False, True):
        p, s = run_ours(factory(**kwargs), params, grads, owning=owning)
        assert_trees_equal(p, tp)
        assert_trees_equal(_state_of(s, ts), ts)


lrs = st.floats(1e-4, 0.5)
decays = st.sampled_from([0.0, 1e-3, 0.1])


@settings(**HYPER)
@given(
    lr=lrs,
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    dampening=st.sampled_from([0.0, 0.2]),
    nesterov=st.booleans(),
    weight_decay=decays,
    maximize=st.booleans(),
)
def test_sgd_random_configs_bitwise(lr, momentum, dampening, nesterov, weight_decay, maximize):
    if nesterov and (momentum == 0 or dampening != 0):
        return
    kwargs = dict(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
    )
    _short_parity(torch.optim.SGD, kwargs, optim.sgd)


@settings(**HYPER)
@given(
    lr=lrs,
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    weight_decay=decays,
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    decoupled=st.booleans(),
)
def test_adam_random_configs_bitwise(lr, b1, b2, eps, weight_decay, amsgrad, maximize, decoupled):
    kwargs = dict(
        lr=lr,
        betas=(b1, b2),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
    )
    if decoupled:
        _short_parity(torch.optim.AdamW, kwargs, optim.adamw)
    else:
        _short_parity(torch.optim.Adam, kwargs, optim.adam)


@settings(**HYPER)
@given(
    lr=lrs,
    alpha=st.floats(0.5, 0.999),
    momentum=st.sampled_from([0.0, 0.9]),
    centered=st.booleans(),
    weight_decay=decays,
    maximize=st.booleans(),
)
def test_rmsprop_random_configs_bitwise(lr, alpha, momentum, centered, weight_decay, maximize):
    kwargs = dict(
        lr=lr,
        alpha=alpha,
        momentum=momentum,
        centered=centered,
        weight_decay=weight_decay,
        maximize=maximize,
    )
    _short_parity(torch.optim.RMSprop, kwargs, optim.rmsprop)


@settings(**HYPER)
@given(
    lr=lrs,
    lr_decay=st.sampled_from([0.0, 0.01, 0.5]),
    weight_decay=decays,
    initial=st.sampled_from([0.0, 0.1, 1.0]),
    maximize=st.booleans(),
)
def test_adagrad_random_configs_bitwise(lr, lr_decay, weight_decay, initial, maximize):
    kwargs = dict(
        lr=lr,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        initial_accumulator_value=initial,
        maximize=maximize,
    )
    _short_parity(torch.optim.Adagrad, kwargs, optim.adagrad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_step_bitwise_equals_torch_on_cuda(case):
    """The same parity on CUDA, where torch's foreach ops take the fused multi-tensor path."""
    _, cls, kwargs, factory = case
    params = {n: t.cuda() for n, t in make_params().items()}
    grads = make_grads(params, steps=20)
    tp, ts = run_torch(cls, kwargs, params, grads)
    for donate in (False, True):
        p, s = run_ours(factory(**kwargs), params, grads, donate=donate)
        assert_trees_equal(p, tp)
        assert_trees_equal(_state_of(s, ts), ts)


@pytest.mark.bitwise
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_on_large_tensors_roots_into_the_gradients_bitwise(amsgrad):
    """Tensors of 2**16 elements and more take the one-pass square root into the owned
    gradients (a transposed gradient view included, as a Linear weight's is)."""
    g = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(300, 256, generator=g), "b": torch.randn(70_000, generator=g)}
    grads = [
        {"w": torch.randn(256, 300, generator=g).t(), "b": torch.randn(70_000, generator=g)}
        for _ in range(3)
    ]
    kwargs = dict(lr=0.01, amsgrad=amsgrad)
    tp, ts = run_torch(torch.optim.Adam, kwargs, params, grads)
    for donate, owning in ((False, True), (True, False)):
        p, s = run_ours(optim.adam(**kwargs), params, grads, donate=donate, owning=owning)
        assert_trees_equal(p, tp)
        assert_trees_equal(_state_of(s, ts), ts)
