"""Transforms and wrappers of ``engine.optim``: purity, donation, clipping, accumulation,
non-finite skipping, injected hyper-parameters, masks and partitions, and argument checks."""

from __future__ import annotations

import functools
import inspect
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from purestep.engine import optim, tree
from purestep.engine.optim import schedules
from purestep.engine.tree import assert_trees_close, assert_trees_equal

SHAPES = {"enc.weight": (4, 3), "enc.bias": (4,), "head.weight": (2, 4), "scale": ()}


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def make_grads(steps: int, seed: int = 1, like: dict | None = None) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    like = like or make_params()
    return [
        {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in like.items()}
        for _ in range(steps)
    ]


def clone(x):
    return tree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def run(tx, params, grads, *, fused=True, donate=False):
    """``(params, state)`` after one call per gradient dict (inputs cloned first)."""
    p = clone(params)
    s = tx.init(p)
    for g in grads:
        with optim.donating(donate):
            if fused:
                p, s = optim.step(tx, clone(g), s, p)
            else:
                u, s = tx.update(clone(g), s, p)
                p = optim.apply_updates(p, u)
    return p, s


TRANSFORMS = {
    "sgd": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True),
    "sgd-plain": lambda: optim.sgd(0.1, momentum=0.9),
    "adam": lambda: optim.adam(0.01, weight_decay=0.1, amsgrad=True, maximize=True),
    "adamw": lambda: optim.adamw(0.01, amsgrad=True),
    "rmsprop": lambda: optim.rmsprop(0.01, momentum=0.9, centered=True, weight_decay=0.1),
    "rmsprop-plain": lambda: optim.rmsprop(0.01),
    "adagrad": lambda: optim.adagrad(0.1, lr_decay=0.1, weight_decay=0.1, maximize=True),
    "adagrad-plain": lambda: optim.adagrad(0.1),
    "clip-chain": lambda: optim.chain(
        optim.clip_by_global_norm(0.5), optim.clip_by_value(0.2), optim.adam(0.01)
    ),
    "decay-scale": lambda: optim.chain(
        optim.add_decayed_weights(0.1, mask=optim.decay_mask),
        optim.scale_by_schedule(schedules.linear(1.0, 0.5, 3)),
        optim.scale(-0.1),
    ),
    "accumulate": lambda: optim.accumulate(optim.sgd(0.1, momentum=0.9), 2),
    "skip": lambda: optim.skip_nonfinite(optim.adam(0.01)),
    "inject": lambda: optim.inject_hyperparams(optim.rmsprop)(
        lr=schedules.exponential(0.01, 0.9), momentum=0.5
    ),
    "partition": lambda: optim.partition(
        {"a": optim.adamw(0.01), "b": optim.sgd(0.1, momentum=0.9), "c": optim.set_to_zero()},
        lambda n, t: {"enc": "a", "head": "b"}.get(n.split(".")[0], "c"),
    ),
    "masked": lambda: optim.masked(optim.adagrad(0.1), {n: n != "scale" for n in SHAPES}),
}


# --------------------------------------------------------------------------- purity, donation


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_inputs_unchanged(name):
    tx = TRANSFORMS[name]()
    params = make_params()
    state = tx.init(params)
    for g in make_grads(3):
        before = clone((params, g, state))
        updates, _ = tx.update(g, state, params)
        assert list(updates) == list(g)
        assert_trees_equal((params, g, state), before)
        new_params, new_state = optim.step(tx, g, state, params)
        assert_trees_equal((params, g, state), before)
        assert list(new_params) == list(params)
        params, state = new_params, new_state


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.bitwise
def test_donation_same_bits(name):
    tx = TRANSFORMS[name]()
    params, grads = make_params(), make_grads(5)
    for fused in (True, False):
        expected = run(tx, params, grads, fused=fused)
        got = run(tx, params, grads, fused=fused, donate=True)
        assert_trees_equal(got, expected)


@pytest.mark.parametrize("name", ["sgd", "sgd-plain", "adam", "adamw", "rmsprop", "adagrad"])
def test_donation_writes_in_place(name):
    tx = TRANSFORMS[name]()
    params = make_params()
    params, state = optim.step(tx, make_grads(1)[0], tx.init(params), params)
    ptrs = [t.data_ptr() for t in tree.leaves((params, state)) if isinstance(t, torch.Tensor)]
    with optim.donating():
        new_params, new_state = optim.step(tx, make_grads(1, seed=5)[0], state, params)
    for n in params:
        assert new_params[n] is params[n]
    new_ptrs = [t.data_ptr() for t in tree.leaves((new_params, new_state)) if torch.is_tensor(t)]
    assert new_ptrs == ptrs
    assert not optim.is_donating()


def test_donating_context_nests_and_resets():
    assert not optim.is_donating()
    with optim.donating():
        assert optim.is_donating()
        with optim.donating(False):
            assert not optim.is_donating()
        assert optim.is_donating()
    assert not optim.is_donating()


class _PeakBytes(TorchDispatchMode):
    """Bytes of new storage alive at the peak of a block (storages the ops newly create)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, n):
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                n = t.untyped_storage().nbytes()
                seen.add(t.untyped_storage().data_ptr())
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, n)
        return out


@pytest.mark.parametrize(
    ("cls", "kwargs", "factory"),
    [
        (torch.optim.Adam, dict(lr=0.01), optim.adam),
        (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, maximize=True), optim.adam),
        (torch.optim.AdamW, dict(lr=0.01, amsgrad=True), optim.adamw),
    ],
)
def test_donated_adam_peak_memory_not_above_torch(cls, kwargs, factory):
    """Extra memory of a donated step <= torch.optim's (params, grads and moments aside)."""
    params = {n: torch.randn(64, 64) if "weight" in n else torch.randn(64) for n in SHAPES}
    grads = make_grads(2, like=params)
    ps = [torch.nn.Parameter(p.clone()) for p in params.values()]
    opt = cls(ps, foreach=True, **kwargs)
    for step in range(2):
        for p, g in zip(ps, grads[step].values()):
            p.grad = g.clone()
        if step == 1:
            with _PeakBytes() as torch_mem:
                opt.step()
        else:
            opt.step()
    tx = factory(**kwargs)
    p, s = optim.step(tx, clone(grads[0]), tx.init(clone(params)), clone(params))
    g = clone(grads[1])
    with _PeakBytes() as ours, optim.donating():
        optim.step(tx, g, s, p)
    one_copy = sum(t.numel() * t.element_size() for t in params.values())
    assert ours.peak <= torch_mem.peak
    assert ours.peak <= one_copy + 1024  # only the denominator temporary


# --------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e3])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.bitwise
def test_clip_by_global_norm_matches_torch(max_norm, mixed):
    params = make_params()
    if mixed:
        params["enc.bias"] = params["enc.bias"].double()
    grads = make_grads(1, like=params)[0]
    ps = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for p, g in zip(ps, grads.values()):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=True)
    tx = optim.clip_by_global_norm(max_norm)
    out, _ = tx.update(grads, tx.init(params))
    assert_trees_equal(out, {n: p.grad for n, p in zip(params, ps)})
    assert torch.equal(optim.global_norm(grads), norm)
    assert out["enc.bias"].dtype == params["enc.bias"].dtype


@pytest.mark.bitwise
def test_clip_by_value_matches_torch():
    params = make_params()
    grads = make_grads(1, like=params)[0]
    ps = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for p, g in zip(ps, grads.values()):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_value_(ps, 0.3, foreach=True)
    out, _ = optim.clip_by_value(0.3).update(grads, optim.EmptyState())
    assert_trees_equal(out, {n: p.grad for n, p in zip(params, ps)})
    assert max(float(t.abs().max()) for t in out.values()) == pytest.approx(0.3)


# --------------------------------------------------------------------------- accumulate


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 4), windows=st.integers(1, 3), donate=st.booleans())
@pytest.mark.bitwise
def test_accumulate_equals_one_step_on_mean(k, windows, donate):
    params = make_params()
    grads = make_grads(k * windows, seed=k)
    inner = optim.adam(0.01, weight_decay=0.1)
    tx = optim.accumulate(inner, k)
    p, s = clone(params), tx.init(params)
    ref_p, ref_s = clone(params), inner.init(params)
    for w in range(windows):
        for i in range(k):
            old = p
            with optim.donating(donate):
                p, s = optim.step(tx, clone(grads[w * k + i]), s, p)
            if i < k - 1:
                assert all(p[n] is old[n] for n in p)  # untouched: the same objects
                assert s.mini_step == i + 1
        window = grads[w * k : (w + 1) * k]
        total = (
            list(window[0].values())
            if k == 1
            else torch._foreach_add(
                [torch.zeros_like(t) for t in params.values()], list(window[0].values())
            )
        )
        for g in window[1:]:
            total = torch._foreach_add(total, list(g.values()))
        mean = dict(zip(params, torch._foreach_div(total, float(k))))
        ref_p, ref_s = optim.step(inner, mean, ref_s, ref_p)
        assert_trees_equal(p, ref_p)
        assert_trees_equal(s.inner_state, ref_s)
        assert s.count == w + 1 and s.mini_step == 0


def test_accumulate_update_form_and_schedule():
    """Zero updates inside a window; k from a schedule of completed windows."""
    params = make_params()
    tx = optim.accumulate(optim.sgd(1.0), lambda count: 1 if count < 2 else 3)
    s = tx.init(params)
    stepped = []
    for g in make_grads(8):
        u, s = tx.update(g, s, params)
        nonzero = any(bool(t.any()) for t in u.values())
        stepped.append(nonzero)
        if nonzero:
            assert s.mini_step == 0
    assert stepped == [True, True, False, False, True, False, False, True]
    assert s.count == 4
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        optim.accumulate(optim.sgd(0.1), 0)
    bad = optim.accumulate(optim.sgd(0.1), lambda count: 0)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        bad.update(make_grads(1)[0], bad.init(params), params)


# --------------------------------------------------------------------------- non-finite


def test_skip_nonfinite_counts_and_raises():
    params = make_params()
    tx = optim.skip_nonfinite(optim.adam(0.01), max_consecutive=2)
    good = make_grads(3)
    bad = clone(good[0])
    bad["enc.bias"][1] = float("nan")
    worse = clone(good[0])
    worse["scale"] = torch.tensor(float("inf"))
    s = tx.init(params)
    p, s = optim.step(tx, good[0], s, params)
    assert (s.consecutive, s.skipped, s.inner_state.count) == (0, 0, 1)
    p2, s = optim.step(tx, bad, s, p)
    assert all(p2[n] is p[n] for n in p) and s.inner_state.count == 1
    u, s = tx.update(worse, s, p)
    assert all(not t.any() for t in u.values())
    assert (s.consecutive, s.skipped) == (2, 2)
    p, s = optim.step(tx, good[1], s, p)
    assert (s.consecutive, s.skipped, s.inner_state.count) == (0, 2, 2)
    p, s = optim.step(tx, bad, s, p)
    p, s = optim.step(tx, bad, s, p)
    with pytest.raises(optim.NonFiniteError, match="3 steps in a row.*max_consecutive=2"):
        optim.step(tx, worse, s, p)
    strict = optim.skip_nonfinite(optim.sgd(0.1), max_consecutive=0)
    with pytest.raises(optim.NonFiniteError):
        optim.step(strict, bad, strict.init(params), params)


def test_all_finite_large_values_and_mixed_dtypes():
    big = torch.full((3,), 3e38)  # a sum or L2 norm of these overflows; they are finite
    assert optim.all_finite([big, big.double()])
    assert not optim.all_finite([big, torch.tensor([1.0, float("-inf")], dtype=torch.float64)])
    assert optim.all_finite([])


# --------------------------------------------------------------------------- hyper-parameters


def test_inject_hyperparams_state():
    params = make_params()
    tx = optim.inject_hyperparams(optim.adam)(
        lr=schedules.linear(0.1, 0.0, 10), betas=(0.9, 0.99), amsgrad=True
    )
    s = tx.init(params)
    assert set(s.hyperparams) == {"lr", "betas"}
    assert s.hyperparams["lr"].dtype == torch.float64 and s.hyperparams["lr"].dim() == 0
    assert float(s.hyperparams["lr"]) == 0.1
    assert [float(b) for b in s.hyperparams["betas"]] == [0.9, 0.99]
    assert s.inner_state.max_exp_avg_sq  # the static flag reached the factory
    for g in make_grads(3):
        params, s = optim.step(tx, g, s, params)
    assert float(s.hyperparams["lr"]) == pytest.approx(0.1 * (1 - 2 / 10))
    # a changed beta is used from the next step on
    s = s.replace(hyperparams={**s.hyperparams, "betas": (torch.tensor(0.5), torch.tensor(0.9))})
    g = make_grads(1, seed=9)[0]
    _, s2 = optim.step(tx, g, s, params)
    expected = torch.lerp(s.inner_state.exp_avg["scale"], g["scale"], 0.5)
    assert torch.equal(s2.inner_state.exp_avg["scale"], expected)


def test_inject_hyperparams_static_args_and_errors():
    tx = optim.inject_hyperparams(optim.add_decayed_weights, static_args=("mask",))(
        0.5, mask=optim.decay_mask
    )
    params = make_params()
    s = tx.init(params)
    assert set(s.hyperparams) == {"weight_decay"}
    zero = {n: torch.zeros_like(p) for n, p in params.items()}
    u, _ = tx.update(zero, s, params)
    assert torch.equal(u["enc.weight"], 0.5 * params["enc.weight"])
    assert not u["enc.bias"].any()
    with pytest.raises(TypeError):
        optim.inject_hyperparams(optim.adam)(learning_rate=0.1)
    with pytest.raises(ValueError, match="invalid learning rate"):
        optim.inject_hyperparams(optim.adam)(lr=-0.1)
    with pytest.raises(TypeError, match=r"static_args \['mask_fn'\]"):
        optim.inject_hyperparams(optim.add_decayed_weights, static_args=["mask_fn"])


# --------------------------------------------------------------------------- masks, partitions


def test_masked_and_decay_mask():
    params = make_params()
    mask = optim.decay_mask(params)
    assert mask == {"enc.weight": True, "enc.bias": False, "head.weight": True, "scale": False}
    zero = {n: torch.zeros_like(p) for n, p in params.items()}
    for tx in (
        optim.masked(optim.add_decayed_weights(0.1), optim.decay_mask),
        optim.masked(optim.add_decayed_weights(0.1), mask),
        optim.add_decayed_weights(0.1, mask=optim.decay_mask),
    ):
        u, s = tx.update(zero, tx.init(params), params)
        for n in params:
            expected = 0.1 * params[n] if mask[n] else zero[n]
            assert_trees_close(u[n], expected, rtol=1e-7)
        assert u["enc.bias"] is zero["enc.bias"]  # passed through
    # apply: masked params get the inner step, the others params + grads
    g = make_grads(1)[0]
    tx = optim.masked(optim.sgd(0.5, momentum=0.9), mask)
    s = tx.init(params)
    assert sorted(s.inner_state.momentum_buffer) == ["enc.weight", "head.weight"]
    new, s = optim.step(tx, g, s, params)
    ref, _ = optim.step(optim.sgd(0.5), g, optim.sgd(0.5).init(params), params)
    assert_trees_equal(new["enc.weight"], ref["enc.weight"])
    assert_trees_equal(new["scale"], params["scale"] + g["scale"])


def test_partition_labels_and_freezing():
    params = make_params()
    labels = {"enc.weight": "train", "enc.bias": "train", "head.weight": "frozen", "scale": "x"}
    tx = optim.partition(
        {"train": optim.sgd(0.1), "frozen": optim.set_to_zero(), "x": optim.scale(2.0)}, labels
    )
    g = make_grads(1)[0]
    new, _ = optim.step(tx, g, tx.init(params), params)
    assert new["head.weight"] is params["head.weight"]
    assert_trees_close(new["enc.bias"], params["enc.bias"] - 0.1 * g["enc.bias"])
    assert_trees_equal(new["scale"], params["scale"] + 2.0 * g["scale"])
    u, _ = tx.update(g, tx.init(params), params)
    assert list(u) == list(g) and not u["head.weight"].any()
    with pytest.raises(KeyError, match="label 'nope', which is not one of"):
        optim.partition({"a": optim.sgd(0.1)}, lambda n, t: "nope").init(params)
    with pytest.raises(KeyError, match="labels has no entry for"):
        optim.partition({"a": optim.sgd(0.1)}, {"enc.weight": "a"}).init(params)
    with pytest.raises(TypeError, match="not a GradientTransformation"):
        optim.partition({"a": optim.sgd}, labels)


# --------------------------------------------------------------------------- base


def test_subset_of_grads_leaves_other_params_alone():
    """Params without a gradient (frozen) pass through apply untouched."""
    params = make_params()
    g = {n: t for n, t in make_grads(1)[0].items() if n != "scale"}
    for tx in (optim.adam(0.1), optim.sgd(0.1, momentum=0.9), optim.chain(optim.scale(1.0))):
        new, _ = optim.step(tx, g, tx.init(params), params)
        assert list(new) == list(params)
        assert new["scale"] is params["scale"]
        assert not torch.equal(new["enc.weight"], params["enc.weight"])


def test_update_keys_follow_input_and_state_by_name():
    params = make_params()
    tx = optim.adam(0.1)
    s = tx.init(params)
    g = make_grads(1)[0]
    reordered = {n: g[n] for n in reversed(list(g))}
    u1, s1 = tx.update(g, s, params)
    u2, s2 = tx.update(reordered, s, params)
    assert list(u2) == list(reordered)
    assert_trees_equal(u1, u2)
    assert_trees_equal(s1, s2)
    with pytest.raises(KeyError, match="exp_avg has no entry for 'other'"):
        tx.update({"other": torch.ones(2)}, s)


def test_chain_and_apply_updates():
    params = make_params()
    g = make_grads(1)[0]
    tx = optim.chain(optim.scale(2.0), optim.scale(-0.5))
    s = tx.init(params)
    assert isinstance(s, tuple) and len(s) == 2
    u, _ = tx.update(g, s, params)
    assert_trees_equal(u, {n: -g[n] for n in g})
    new, _ = optim.step(tx, g, s, params)
    assert_trees_equal(new, {n: params[n] - g[n] for n in params})
    with pytest.raises(TypeError, match="tuple of 2 states"):
        tx.update(g, optim.EmptyState(), params)
    with pytest.raises(TypeError, match="must be a GradientTransformation"):
        optim.chain(optim.scale(1.0), "adam")
    with pytest.raises(KeyError, match="unknown params"):
        optim.apply_updates(params, {"nope": torch.ones(1)})
    assert optim.chain().update(g, optim.chain().init(params))[0] == g


def test_empty_params():
    for factory in (optim.sgd, optim.adam, optim.rmsprop, optim.adagrad):
        tx = factory(0.1)
        s = tx.init({})
        assert optim.step(tx, {}, s, {})[0] == {}
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.accumulate(optim.adam(), 2))
    assert optim.step(tx, {}, tx.init({}), {})[0] == {}


def test_bad_arguments():
    cases = [
        (lambda: optim.sgd(-0.1), ValueError, "invalid learning rate: -0.1"),
        (lambda: optim.sgd(0.1, momentum=-1), ValueError, "invalid momentum"),
        (lambda: optim.sgd(0.1, nesterov=True), ValueError, "nesterov momentum requires"),
        (lambda: optim.sgd(0.1, 0.9, 0.1, 0.0, True), ValueError, "nesterov momentum requires"),
        # torch's positional order is (lr, momentum, dampening, weight_decay, nesterov)
        (lambda: optim.sgd(0.1, 0.9, 0.0, True), TypeError, "weight_decay must be a number"),
        (lambda: optim.sgd(0.1, nesterov=1), TypeError, "nesterov must be a bool"),
        (lambda: optim.adam(betas=(0.9, 1.0)), ValueError, r"beta2 \(betas\[1\]\)"),
        (lambda: optim.adam(betas=(-0.1, 0.9)), ValueError, r"beta1 .*must be in \[0, 1\)"),
        (lambda: optim.adam(betas=0.9), TypeError, "betas must be a pair"),
        (lambda: optim.adamw(weight_decay=-1e-2), ValueError, "invalid weight_decay"),
        (lambda: optim.adam(eps=float("nan")), ValueError, "invalid eps"),
        (lambda: optim.adam(lr="fast"), TypeError, "learning rate must be a number"),
        (lambda: optim.adam(lr=torch.ones(2)), ValueError, "one-element tensor"),
        (lambda: optim.rmsprop(alpha=1.5), ValueError, "invalid alpha"),
        (lambda: optim.adagrad(lr_decay=-1), ValueError, "invalid lr_decay"),
        (lambda: optim.adagrad(initial_accumulator_value=-1), ValueError, "initial_accum"),
        (lambda: optim.clip_by_global_norm(-1.0), ValueError, "invalid max_norm"),
        (lambda: optim.clip_by_value(-1.0), ValueError, "invalid clip_value"),
        (lambda: optim.skip_nonfinite(optim.sgd(0.1), -1), ValueError, "max_consecutive"),
        (lambda: optim.scale_by_schedule(0.1), TypeError, "schedule must be callable"),
        (lambda: optim.masked(optim.sgd(0.1), 3), TypeError, "mask must be a dict"),
    ]
    for make, exc, message in cases:
        with pytest.raises(exc, match=message):
            make()
    tx = optim.adam(weight_decay=0.1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(make_grads(1)[0], tx.init(make_params()))


def test_inject_hyperparams_positional_and_varargs():
    params = make_params()
    g = make_grads(1)[0]
    tx = optim.inject_hyperparams(optim.sgd)(0.5, 0.9)
    s = tx.init(params)
    assert sorted(s.hyperparams) == ["lr", "momentum"]
    new, _ = optim.step(tx, g, s, params)
    ref, _ = optim.step(optim.sgd(0.5, 0.9), g, optim.sgd(0.5, 0.9).init(params), params)
    assert_trees_equal(new, ref)
    # a factory with *args: the transforms pass through, the float is injected
    tx = optim.inject_hyperparams(lambda *txs, factor=1.0: optim.chain(*txs, optim.scale(factor)))(
        optim.scale(2.0), factor=-0.25
    )
    s = tx.init(params)
    assert list(s.hyperparams) == ["factor"]
    u, _ = tx.update(g, s, params)
    assert_trees_equal(u, {n: t * -0.5 for n, t in g.items()})


@pytest.mark.bitwise
def test_owning_updates_reuses_only_the_gradients_and_keeps_results_bitwise():
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    tx = optim.adamw(1e-2, amsgrad=True)
    state = tx.init(params)
    for _ in range(3):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        expected = optim.step(tx, grads, state, params)
        params_before = {k: v.clone() for k, v in params.items()}
        state_before = tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
        owned = {k: v.clone() for k, v in grads.items()}
        with optim.owning_updates():
            assert optim.owns_updates() and not optim.is_donating()
            got = optim.step(tx, owned, state, params)
        tree.assert_trees_equal(got, expected)
        tree.assert_trees_equal(params, params_before)
        tree.assert_trees_equal(state, state_before)
        assert not tree.trees_equal(owned, grads)  # the gradients were used as scratch space
        params, state = expected
    assert not optim.owns_updates()


# --------------------------------------------------------------------------- torch's signatures

TORCH_ONLY = {"params", "foreach", "capturable", "differentiable", "fused"}


@pytest.mark.parametrize(
    ("factory", "cls"),
    [
        (optim.sgd, torch.optim.SGD),
        (optim.adam, torch.optim.Adam),
        (optim.adamw, torch.optim.AdamW),
        (optim.rmsprop, torch.optim.RMSprop),
        (optim.adagrad, torch.optim.Adagrad),
    ],
)
def test_named_optimizers_take_torchs_arguments_in_torchs_order(factory, cls):
    ours = inspect.signature(factory).parameters
    theirs = {
        n: p
        for n, p in inspect.signature(cls).parameters.items()
        if n not in TORCH_ONLY and n != "decoupled_weight_decay"
    }
    assert list(ours) == list(theirs)
    for name, p in ours.items():
        assert p.default == theirs[name].default, name
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    torch_positional = [
        n for n, p in inspect.signature(cls).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD
    ][1:]
    assert positional == torch_positional[: len(positional)]
    assert ours["maximize"].kind is inspect.Parameter.KEYWORD_ONLY


def test_sgd_defaults_are_torchs():
    params = make_params()
    grads = make_grads(3)
    ps = [torch.nn.Parameter(p.clone()) for p in params.values()]
    opt = torch.optim.SGD(ps, foreach=True)
    for g in grads:
        for p, t in zip(ps, g.values()):
            p.grad = t.clone()
        opt.step()
    p, _ = run(optim.sgd(), params, grads)
    assert_trees_equal(p, {n: t.detach() for n, t in zip(params, ps)})


# --------------------------------------------------------------------------- owning updates


def _snapshot(x):
    return clone(x)


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.bitwise
def test_owning_updates_keeps_params_state_and_bits(name, fused):
    tx = TRANSFORMS[name]()
    params = make_params()
    state = tx.init(params)
    for g in make_grads(3):
        expected = optim.step(tx, g, state, params) if fused else tx.update(g, state, params)
        before = _snapshot((params, state))
        owned = clone(g)
        with optim.owning_updates():
            got = optim.step(tx, owned, state, params) if fused else tx.update(owned, state, params)
        assert_trees_equal(got, expected)
        assert_trees_equal((params, state), before)
        params, state = optim.step(tx, g, state, params)


UPDATE_ONLY = {
    "clip_by_global_norm": lambda: optim.clip_by_global_norm(0.1),
    "clip_by_value": lambda: optim.clip_by_value(0.1),
    "scale": lambda: optim.scale(-0.5),
    "scale_by_schedule": lambda: optim.scale_by_schedule(schedules.linear(1.0, 0.5, 3)),
    "add_decayed_weights": lambda: optim.add_decayed_weights(0.1),
}


@pytest.mark.parametrize("name", list(UPDATE_ONLY))
@pytest.mark.parametrize("mixed", [False, True])
def test_update_only_transforms_work_in_place_on_owned_updates(name, mixed):
    tx = UPDATE_ONLY[name]()
    params = make_params()
    if mixed:
        params["enc.bias"] = params["enc.bias"].double()
    g = make_grads(1, like=params)[0]
    expected, _ = tx.update(clone(g), tx.init(params), params)
    owned = clone(g)
    with optim.owning_updates():
        out, _ = tx.update(owned, tx.init(params), params)
    assert all(out[n] is owned[n] for n in g)  # no new tensors
    assert_trees_equal(out, expected)
    out, _ = tx.update(g, tx.init(params), params)
    assert all(out[n] is not g[n] for n in g)  # not owned: a copy


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.sgd(0.1, maximize=True),
        lambda: optim.sgd(0.1, weight_decay=0.1),
        lambda: optim.sgd(0.1, 0.9, weight_decay=0.1, maximize=True),
        lambda: optim.sgd(0.1, 0.9, nesterov=True, maximize=True),
        lambda: optim.rmsprop(0.01, maximize=True),
        lambda: optim.rmsprop(0.01, weight_decay=0.1, momentum=0.9, centered=True),
        lambda: optim.adagrad(0.1, maximize=True),
        lambda: optim.adagrad(0.1, weight_decay=0.1),
    ],
)
def test_named_optimizers_use_owned_gradients_as_scratch(make):
    tx = make()
    params = make_params()
    state = tx.init(params)
    for g in make_grads(3):
        expected = optim.step(tx, g, state, params)
        owned = clone(g)
        before = _snapshot((params, state))
        with optim.owning_updates():
            got = optim.step(tx, owned, state, params)
        assert_trees_equal(got, expected)
        assert_trees_equal((params, state), before)
        assert not tree.trees_equal(owned, g)  # the gradients held the temporaries
        # an owned gradient never becomes state (the caller may still hold it)
        owned_ptrs = {t.untyped_storage().data_ptr() for t in owned.values()}
        state_ptrs = {
            t.untyped_storage().data_ptr() for t in tree.leaves(got[1]) if torch.is_tensor(t)
        }
        assert not owned_ptrs & state_ptrs
        params, state = expected


# --------------------------------------------------------------------------- inject, schedules


def _counting(factory):
    calls = []

    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        calls.append(kwargs.get("lr", args[0] if args else None))
        return factory(*args, **kwargs)

    return wrapped, calls


@pytest.mark.parametrize("factory", [optim.adam, optim.sgd, optim.rmsprop, optim.adagrad])
@pytest.mark.bitwise
def test_inject_hyperparams_hands_schedules_on_without_rebuilding(factory):
    sched = schedules.cosine(0.05, 10, 0.001)
    counted, calls = _counting(factory)
    tx = optim.inject_hyperparams(counted)(lr=sched)
    params = make_params()
    grads = make_grads(6)
    p, s = run(tx, params, grads)
    assert len(calls) == 1 and calls[0] is sched  # built once, with the schedule itself
    ref_p, ref_s = run(factory(lr=sched), params, grads)
    assert_trees_equal(p, ref_p)
    assert_trees_equal(s.inner_state, ref_s)
    assert float(s.hyperparams["lr"]) == sched(len(grads) - 1)  # the value the last step used
    p, s = run(tx, params, grads, fused=False)
    ref_p, _ = run(factory(lr=sched), params, grads, fused=False)
    assert_trees_equal(p, ref_p)


def test_inject_hyperparams_rebuilds_only_when_a_constant_changes():
    counted, calls = _counting(optim.adamw)
    tx = optim.inject_hyperparams(counted)(lr=schedules.linear(0.01, 0.0, 10), weight_decay=0.1)
    params = make_params()
    s = tx.init(params)
    for g in make_grads(3):
        params, s = optim.step(tx, g, s, params)
    assert len(calls) == 1
    s = s.replace(hyperparams={**s.hyperparams, "weight_decay": torch.tensor(0.5)})
    for g in make_grads(3, seed=4):
        params, s = optim.step(tx, g, s, params)
    assert len(calls) == 2


def test_inject_hyperparams_evaluates_schedules_a_factory_cannot_take():
    """``add_decayed_weights`` takes no schedule: it is rebuilt with each new value."""
    tx = optim.inject_hyperparams(optim.add_decayed_weights)(schedules.linear(1.0, 0.0, 4))
    params = make_params()
    zero = {n: torch.zeros_like(p) for n, p in params.items()}
    s = tx.init(params)
    for count in range(3):
        u, s = tx.update(zero, s, params)
        factor = 1.0 - count / 4
        assert_trees_close(u, {n: factor * p for n, p in params.items()}, rtol=1e-7)
        assert float(s.hyperparams["weight_decay"]) == factor


def test_inject_hyperparams_of_scale_by_schedule():
    sched = schedules.linear(1.0, 0.5, 4)
    tx = optim.inject_hyperparams(optim.scale_by_schedule)(sched)
    params, grads = make_params(), make_grads(3)
    p, s = run(tx, params, grads, fused=False)
    ref, _ = run(optim.scale_by_schedule(sched), params, grads, fused=False)
    assert_trees_equal(p, ref)
    assert float(s.hyperparams["schedule"]) == sched(2)


# --------------------------------------------------------------------------- masked vs partition


def test_masked_step_is_update_then_apply_updates_and_partition_freezes():
    """``masked`` as the whole optimizer: unmasked params get ``p + g`` on both paths (optax's
    semantics); ``partition`` with ``set_to_zero`` is the way to freeze them."""
    params = make_params()
    mask = optim.decay_mask(params)
    g = make_grads(1)[0]
    tx = optim.masked(optim.adam(0.1), mask)
    fused, _ = optim.step(tx, g, tx.init(params), params)
    u, _ = tx.update(g, tx.init(params), params)
    unfused = optim.apply_updates(params, u)
    for n in params:
        if not mask[n]:
            assert_trees_equal(fused[n], params[n] + g[n])
            assert_trees_equal(unfused[n], fused[n])
    frozen = optim.partition({True: optim.adam(0.1), False: optim.set_to_zero()}, mask)
    new, _ = optim.step(frozen, g, frozen.init(params), params)
    for n in params:
        if mask[n]:
            assert_trees_equal(new[n], fused[n])
        else:
            assert new[n] is params[n]


# --------------------------------------------------------------------------- clipping, mixed


@pytest.mark.skipif(
    not hasattr(torch.nn.utils, "get_total_norm"),
    reason="torch < 2.6: mixed dtypes are grouped by first appearance, not torch's order",
)
@pytest.mark.bitwise
def test_clip_by_global_norm_mixed_dtypes_matches_torch_bitwise():
    """Several dtypes: torch groups them in an internal hash order; we must agree."""
    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    for _ in range(60):
        picks = torch.randint(0, 4, (6,), generator=gen).tolist()
        grads = {f"p{i}": torch.randn(5, generator=gen).to(dtypes[k]) for i, k in enumerate(picks)}
        ps = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads.values()]
        for p, t in zip(ps, grads.values()):
            p.grad = t.clone()
        norm = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        assert torch.equal(optim.global_norm(grads), norm)
        out, _ = optim.clip_by_global_norm(1.0).update(grads, optim.EmptyState())
        assert_trees_equal(out, {n: p.grad for n, p in zip(grads, ps)})
