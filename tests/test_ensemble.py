"""hardware.ensemble: K members trained at once equal K separate runs.

Tolerances: an ensemble step and K separate ``engine.train_step`` runs are two different
computations. A batched (vmapped) matmul or reduction does not promise the accumulation
order of K separate ones; which order it takes depends on the CPU's kernels (on an AVX-512
EPYC, and under ``ATEN_CPU_CAPABILITY=default`` as well, members differ from their
separate runs in the last bits; elsewhere they may agree bitwise). So every floating
tensor of a member (parameters, buffers, optimizer state) is compared with its separate
run to ``|a - b| <= RTOL * max|b| + ATOL`` with ``RTOL=1e-5, ATOL=1e-6``, integer leaves
and the progress exactly; losses and gradient norms to ``rtol=1e-5``. Measured (native and
scalar kernels, both gradient paths, 2-4 steps): at most 6.7e-6 absolute on an RMSprop
momentum buffer of magnitude 16, 2.4e-7 on parameters, 1.2e-7 relative on losses: about
1/20 of the bound at worst. Bitwise (``torch.equal``, marked ``bitwise``) are only claims
about one computation run twice: donation vs no donation, the dropout masks' determinism,
checkpoint resume vs an uninterrupted run, and initialisation under the member keys.
Run time: about 3 s, plus about 10 s for the ensemble benchmark's quick run.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import batches, clone_tree, digest, loss_fn, mlp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from purestep import engine, hardware
from purestep.engine import checkpoint, metrics, optim, rng, tree
from purestep.hardware import member_optim

K = 3

# An ensemble member against its separate run: two different computations (batched kernels
# do not promise the accumulation order of K separate ones; see the module docstring), so
# floating tensors agree to RTOL of their largest magnitude plus ATOL, not bitwise.
RTOL, ATOL = 1e-5, 1e-6


def separate_runs(net, opt, start, data, **kwargs):
    """Each member of ``start`` trained alone with the plain engine step."""
    step = engine.train_step(net, loss_fn, opt, **kwargs)
    states, outs = [hardware.member(start, i) for i in range(start.params["0.weight"].shape[0])], []
    for batch in data:
        results = [step(s, batch) for s in states]
        states = [s for s, _ in results]
        outs.append([o for _, o in results])
    return states, outs


def assert_close(a, b, rtol=RTOL, atol=ATOL):
    """Floating leaves to ``|a - b| <= rtol * max|b| + atol`` (per tensor), the rest exactly.

    The bound is relative to each tensor's largest magnitude, not to each element: a
    reordered sum is off by a few ulps of the magnitudes summed, so an element near zero in
    a tensor of large ones (an RMSprop momentum buffer) carries their rounding; ``atol``
    covers tensors that are rounding noise only (a bias before BatchNorm has a zero
    gradient up to rounding).

    (``tree.assert_trees_close`` reports equal integer tensors as different when a tolerance
    is given, so integer buffers such as ``num_batches_tracked`` are compared here.)
    """
    pa, pb = tree.flatten_with_paths(a), tree.flatten_with_paths(b)
    assert [p for p, _ in pa] == [p for p, _ in pb]
    for (path, x), (_, y) in zip(pa, pb):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            bound = (rtol * y.abs().max().item() if y.numel() else 0.0) + atol
            torch.testing.assert_close(x, y, rtol=0, atol=bound, msg=path)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), path
        else:
            assert x == y, path


def train(step, state, data):
    outs = []
    for batch in data:
        state, out = step(state, batch)
        outs.append(out)
    return state, outs


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("grad", ["autograd", "func"])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optim.adam(1e-2),
        lambda: optim.adamw(3e-3, weight_decay=0.1),
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
        lambda: optim.rmsprop(1e-2, momentum=0.5),
    ],
    ids=["adam", "adamw", "sgd_nesterov", "rmsprop"],
)
def test_members_equal_separate_runs(grad, make_opt):
    net, opt, data = mlp(), make_opt(), batches(3)
    ens = hardware.ensemble(K)
    start = engine.init(net, opt, seed=0, strategy=ens)
    state, outs = train(engine.train_step(net, loss_fn, opt, strategy=ens, grad=grad), start, data)
    solo, solo_outs = separate_runs(net, opt, start, data)
    for i in range(K):
        assert_close(hardware.member(state, i), solo[i])
        for out, alone in zip(outs, solo_outs):
            # the vmapped mean inside cross_entropy may sum in another order
            torch.testing.assert_close(out.loss[i], alone[i].loss, rtol=RTOL, atol=0)
            assert torch.equal(out.metrics["acc"][i], alone[i].metrics["acc"])  # counts
            torch.testing.assert_close(out.grad_norm[i], alone[i].grad_norm, rtol=RTOL, atol=0)
    assert outs[-1].loss.shape == (K,) and outs[-1].grad_norm.shape == (K,)


def test_accumulation_and_frozen_params_match_separate_runs():
    net = mlp()
    net[0].bias.requires_grad_(False)
    opt, data = optim.adam(1e-2), batches(4)
    ens = hardware.ensemble(K)
    start = engine.init(net, opt, seed=1, strategy=ens)
    step = engine.train_step(net, loss_fn, opt, strategy=ens, accumulate=2)
    state, outs = train(step, start, data)
    solo, _ = separate_runs(net, opt, start, data, accumulate=2)
    for i in range(K):
        assert_close(hardware.member(state, i), solo[i])
    assert [o.stepped for o in outs] == [False, True, False, True]
    assert torch.equal(state.params["0.bias"], start.params["0.bias"])


def test_batchnorm_buffers_are_per_member_and_match_separate_runs():
    net, opt, data = mlp(batchnorm=True), optim.sgd(0.05, momentum=0.9), batches(3)
    ens = hardware.ensemble(K)
    start = engine.init(net, opt, seed=2, strategy=ens)
    before = digest(start)
    for grad in ("autograd", "func"):
        step = engine.train_step(net, loss_fn, opt, strategy=ens, grad=grad)
        state, _ = train(step, start, data)
        assert digest(start) == before  # the running statistics came back as new tensors
        assert state.buffers["1.running_mean"].shape == (K, 16)
        assert state.buffers["1.num_batches_tracked"].tolist() == [3] * K
        assert not torch.equal(
            state.buffers["1.running_mean"][0], state.buffers["1.running_mean"][1]
        )
        solo, _ = separate_runs(net, opt, start, data)
        for i in range(K):
            assert_close(hardware.member(state, i), solo[i])


@pytest.mark.bitwise
def test_donating_gives_the_same_bits():
    net, opt, data = mlp(batchnorm=True), optim.adam(1e-2), batches(3)
    ens = hardware.ensemble(K, clip_grad_norm=0.5)
    start = engine.init(net, opt, seed=0, strategy=ens)
    kept, _ = train(engine.train_step(net, loss_fn, opt, strategy=ens), start, data)
    donated, _ = train(
        engine.train_step(net, loss_fn, opt, strategy=ens, donate=True), clone_tree(start), data
    )
    tree.assert_trees_equal(donated, kept)


def test_per_member_batches():
    net, opt = mlp(), optim.adam(1e-2)
    ens = hardware.ensemble(K, per_member_batch=True)
    start = engine.init(net, opt, seed=0, strategy=ens)
    data = [batches(K, seed=s) for s in range(2)]  # K different batches per step
    stacked = [
        tuple(torch.stack([b[j] for b in step_data]) for j in range(2)) for step_data in data
    ]
    state, outs = train(engine.train_step(net, loss_fn, opt, strategy=ens), start, stacked)
    assert state.progress.samples == 2 * 16
    step = engine.train_step(net, loss_fn, opt)
    for i in range(K):
        alone = hardware.member(start, i)
        for step_data in data:
            alone, out = step(alone, step_data[i])
        assert_close(hardware.member(state, i), alone)
        torch.testing.assert_close(outs[-1].loss[i], out.loss, rtol=RTOL, atol=0)
    with pytest.raises(ValueError, match="leading axis of size 3"):
        engine.train_step(net, loss_fn, opt, strategy=ens)(start, batches(1)[0])


def test_eval_and_predict_per_member():
    net, opt = mlp(batchnorm=True), optim.adam(1e-2)
    ens = hardware.ensemble(K)
    state, _ = train(
        engine.train_step(net, loss_fn, opt, strategy=ens),
        engine.init(net, opt, seed=0, strategy=ens),
        batches(2),
    )
    batch = batches(1, seed=9)[0]

    def eval_fn(apply, batch):
        x, y = batch
        logits = apply(x)
        return F.cross_entropy(logits, y), {"acc": metrics.Accuracy.of(logits, y), "n": 16}

    out = engine.eval_step(net, eval_fn, strategy=ens)(state, batch)
    pred = engine.predict_step(net, strategy=ens)(state, batch[0])
    assert out["loss"].shape == (K,) and pred.shape == (K, 16, 3) and out["n"] == 16
    plain_eval, plain_pred = engine.eval_step(net, eval_fn), engine.predict_step(net)
    for i in range(K):
        m = hardware.member(state, i)
        alone = plain_eval(m, batch)
        torch.testing.assert_close(out["loss"][i], alone["loss"], rtol=1e-6, atol=1e-6)
        assert torch.equal(out["acc"].correct[i], alone["acc"].correct)
        torch.testing.assert_close(pred[i], plain_pred(m, batch[0]), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- initialisation


@pytest.mark.bitwise
def test_members_are_independent_initialisations_under_their_keys():
    net = mlp()
    ens = hardware.ensemble(4)
    state = engine.init(net, optim.sgd(0.1), seed=7, strategy=ens)
    weights = state.params["0.weight"]
    assert weights.shape == (4, 16, 8)
    assert all(not torch.equal(weights[i], weights[j]) for i in range(4) for j in range(i))
    run_key = rng.key(7)
    assert state.rng == run_key
    for i in range(4):
        expected = copy.deepcopy(net)
        with rng.scope(rng.fold_in(run_key, rng.Purpose.INIT, i)), torch.no_grad():
            for m in expected.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        for name, p in expected.named_parameters():
            assert torch.equal(state.params[name][i], p)
        assert hardware.member(state, i).rng == rng.fold_in(run_key, "ensemble-member", i)
    again = engine.init(net, optim.sgd(0.1), seed=7, strategy=ens)
    assert digest(again) == digest(state)
    assert digest(engine.init(net, optim.sgd(0.1), seed=8, strategy=ens)) != digest(state)


def test_meta_template_and_init_fn():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ens = hardware.ensemble(2)
    state = engine.init(meta, optim.sgd(0.1), seed=0, strategy=ens)
    real = engine.init(mlp(), optim.sgd(0.1), seed=0, strategy=ens)
    tree.assert_trees_equal(state.params, real.params)

    def init_fn(module):
        for p in module.parameters():
            p.normal_()

    custom = engine.init(meta, optim.sgd(0.1), seed=0, strategy=ens, init_fn=init_fn)
    assert not torch.equal(custom.params["0.weight"][0], custom.params["0.weight"][1])


class _Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.fc(x) * self.gain


def test_a_meta_template_with_tensors_no_reset_initialises_is_refused():
    with torch.device("meta"):
        meta = _Gain()
    ens = hardware.ensemble(2)
    with pytest.raises(ValueError, match=r"\['gain'\] are not initialised.*init_fn="):
        engine.init(meta, optim.sgd(0.1), seed=0, strategy=ens)

    def init_fn(module):
        module.fc.reset_parameters()
        module.gain.fill_(1.0)

    a = engine.init(meta, optim.sgd(0.1), seed=0, strategy=ens, init_fn=init_fn)
    b = engine.init(meta, optim.sgd(0.1), seed=0, strategy=ens, init_fn=init_fn)
    assert digest(a) == digest(b)
    assert torch.equal(a.params["gain"], torch.ones(2, 3))


# --------------------------------------------------------------------------- randomness


@pytest.mark.bitwise
def test_dropout_masks_differ_across_members_and_are_deterministic():
    net = mlp(dropout=0.5)
    opt = optim.sgd(0.1)
    ens = hardware.ensemble(4)
    one = hardware.member(engine.init(net, opt, seed=0, strategy=ens), 0)
    start = hardware.stack([one] * 4, key=rng.key(3))  # identical members
    step = engine.train_step(net, loss_fn, opt, strategy=ens)
    batch = batches(1)[0]
    before = digest(start)
    new, out = step(start, batch)
    assert digest(start) == before  # pure
    assert len(set(out.loss.tolist())) == 4  # each member drew its own mask
    again, out2 = step(start, batch)
    assert digest((again, out2)) == digest((new, out))
    _, out3 = step(new, batch)
    assert not torch.equal(out3.loss, step(new.replace(rng=rng.key(4)), batch)[1].loss)
    no_dropout = copy.deepcopy(net)
    no_dropout[2].p = 0.0
    plain = engine.train_step(no_dropout, loss_fn, opt, strategy=ens)(start, batch)[1]
    assert len(set(plain.loss.tolist())) == 1


# --------------------------------------------------------------------------- hyper-parameters


def test_lr_sweep_matches_separate_runs():
    lrs = [1e-3, 3e-2, 1e-3, 1e-2]  # equal values share an optimizer call; order is kept
    opt = optim.inject_hyperparams(optim.adam)(lr=1e-3)
    net, data = mlp(), batches(3)
    ens = hardware.ensemble(4, hparams={"lr": lrs})
    start = engine.init(net, opt, seed=0, strategy=ens)
    assert start.opt_state.hyperparams["lr"].tolist() == lrs
    state, _ = train(engine.train_step(net, loss_fn, opt, strategy=ens), start, data)
    for i, lr in enumerate(lrs):
        alone = hardware.member(start, i)
        assert float(alone.opt_state.hyperparams["lr"]) == lr
        solo_opt = optim.adam(lr)
        solo_state = alone.replace(opt_state=solo_opt.init(alone.params))
        solo_state, _ = train(engine.train_step(net, loss_fn, solo_opt), solo_state, data)
        m = hardware.member(state, i)
        assert_close(m.params, solo_state.params)
        assert_close(m.opt_state.inner_state, solo_state.opt_state)
        assert float(m.opt_state.hyperparams["lr"]) == lr


def _counting(tx):
    """``tx`` with a count of its ``update`` / ``apply`` calls (its state unchanged)."""
    calls = []

    def update(*args, **kwargs):
        calls.append("update")
        return tx.update(*args, **kwargs)

    def apply(*args, **kwargs):
        calls.append("apply")
        return tx.apply(*args, **kwargs)

    return optim.GradientTransformation(tx.init, update, apply), calls


def test_identical_members_take_the_single_call_path():
    """Equal values in every member: one call of the optimizer itself per step (the
    arithmetic of a separate run)."""
    injected = optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt, calls = _counting(injected)
    net, data = mlp(), batches(3)
    ens = hardware.ensemble(K, hparams={"lr": [0.05] * K}, check_optimizer=False)
    train(
        engine.train_step(net, loss_fn, opt, strategy=ens),
        engine.init(net, opt, seed=0, strategy=ens),
        data,
    )
    assert calls == ["apply"] * len(data)


def test_distinct_members_are_grouped_by_their_values():
    """Distinct values: one call per distinct set of values (two here, for three members),
    every step."""
    opt, calls = _counting(optim.inject_hyperparams(optim.adam)(lr=1e-3))
    net, data = mlp(), batches(2)
    ens = hardware.ensemble(K, hparams={"lr": [1e-3, 1e-2, 1e-3]}, check_optimizer=False)
    train(
        engine.train_step(net, loss_fn, opt, strategy=ens),
        engine.init(net, opt, seed=0, strategy=ens),
        data,
    )
    assert calls == ["apply"] * (2 * len(data))


def test_a_scheduled_lr_with_per_member_momenta_follows_the_schedule():
    """A scheduled lr and per-member momenta: each member follows the schedule as its
    separate run does."""
    schedule = optim.schedules.linear(0.1, 0.0, 10)
    opt = optim.inject_hyperparams(optim.sgd)(lr=schedule, momentum=0.9)
    net, data = mlp(), batches(3)
    ens = hardware.ensemble(2, hparams={"momentum": [0.9, 0.5]})
    start = engine.init(net, opt, seed=0, strategy=ens)
    state, _ = train(engine.train_step(net, loss_fn, opt, strategy=ens), start, data)
    for i, m in enumerate([0.9, 0.5]):
        solo_opt = optim.inject_hyperparams(optim.sgd)(lr=schedule, momentum=m)
        solo, _ = train(engine.train_step(net, loss_fn, solo_opt), hardware.member(start, i), data)
        assert_close(hardware.member(state, i), solo)


def test_the_search_for_injected_hyperparameters_runs_once_per_step(monkeypatch):
    """A step whose optimizer keeps no injected hyper-parameters skips the grouped path after
    its first call (nothing to group); one that keeps them still groups its members."""
    calls = []
    search = member_optim.hyperparameters

    def counting(opt_state):
        calls.append(1)
        return search(opt_state)

    monkeypatch.setattr(member_optim, "hyperparameters", counting)
    net, data = mlp(), batches(3)
    ens = hardware.ensemble(K)
    start = engine.init(net, optim.adam(1e-2), seed=0, strategy=ens)
    train(engine.train_step(net, loss_fn, optim.adam(1e-2), strategy=ens), start, data)
    assert len(calls) == 1  # the first step only

    lrs = [1e-3, 3e-2, 1e-2]
    opt = optim.inject_hyperparams(optim.adam)(lr=1e-3)
    sweep = hardware.ensemble(K, hparams={"lr": lrs})
    state, _ = train(
        engine.train_step(net, loss_fn, opt, strategy=sweep),
        engine.init(net, opt, seed=0, strategy=sweep),
        data,
    )
    assert len(calls) > 1 + len(data)  # every step searches (and groups)
    for i, lr in enumerate(lrs):
        assert float(hardware.member(state, i).opt_state.hyperparams["lr"]) == lr


def test_benchmark_quick_run_with_breakdown():
    """``benchmarks/ensemble.py --quick --breakdown`` runs (its parity check included) and
    ends with its ``speedup=`` line; the figures of a quick run mean nothing."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "benchmarks", "ensemble.py"),
            "--quick",
            "--breakdown",
            "--backend",
            "aot_eager",  # the compiled side's graph on torch's kernels: no code generation
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    # bitwise on some CPUs, to a rounding error on others (the benchmark fails above 1e-5)
    assert "agrees with its sequential run" in done.stdout
    assert any("gradient half" in line for line in lines)
    pairs = dict(item.partition("=")[::2] for item in lines[-1].split())
    assert set(pairs) == {"speedup", "speedup_compiled"}
    for value in pairs.values():
        assert math.isfinite(float(value)) and float(value) > 0


def test_tuple_hyperparameter_and_schedules():
    opt = optim.inject_hyperparams(optim.adam)(
        lr=optim.schedules.linear(1e-2, 0.0, 10), betas=(0.9, 0.99)
    )
    betas = [(0.9, 0.99), (0.5, 0.9)]
    ens = hardware.ensemble(2, hparams={"betas": betas})
    net, data = mlp(), batches(2)
    start = engine.init(net, opt, seed=0, strategy=ens)
    state, _ = train(engine.train_step(net, loss_fn, opt, strategy=ens), start, data)
    hp = state.opt_state.hyperparams
    assert hp["lr"].shape == (2,) and hp["lr"][0] == hp["lr"][1]  # the schedule, per member
    for i in range(2):
        solo_opt = optim.inject_hyperparams(optim.adam)(
            lr=optim.schedules.linear(1e-2, 0.0, 10), betas=betas[i]
        )
        alone = hardware.member(start, i)
        solo, _ = train(engine.train_step(net, loss_fn, solo_opt), alone, data)
        assert_close(hardware.member(state, i), solo)


def random_members(k: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(k)
    return [
        {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)} for _ in range(k)
    ]


@settings(max_examples=15, deadline=None)
@given(
    choice=st.lists(st.integers(0, 2), min_size=1, max_size=5),
    momentum=st.sampled_from([0.0, 0.9]),
)
def test_grouped_optimizer_step_equals_per_member_steps(choice, momentum):
    """Property: however the per-member values group, each member steps as it would alone."""
    values = [1e-3, 5e-2, 1.0]
    k = len(choice)
    tx = optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=momentum)
    members = random_members(k)
    grads = [
        {n: torch.full_like(t, float(i + 1)) * t for n, t in m.items()}
        for i, m in enumerate(members)
    ]
    params = {n: torch.stack([m[n] for m in members]) for n in members[0]}
    stacked_grads = {n: torch.stack([g[n] for g in grads]) for n in members[0]}
    lrs = [values[c] for c in choice]
    state = member_optim.set_hyperparameters(
        tx.init(params), {"lr": lrs, "momentum": [momentum] * k}
    )
    for _ in range(2):
        params, state = member_optim.step(tx, stacked_grads, state, params)
    assert state.count == 2 and state.hyperparams["lr"].tolist() == lrs
    for i, c in enumerate(choice):
        solo = optim.sgd(values[c], momentum=momentum)
        ref, ref_state = members[i], solo.init(members[i])
        for _ in range(2):
            ref, ref_state = optim.step(solo, grads[i], ref_state, ref)
        # a stacked optimizer step against a per-member one: other tensor sizes, so other
        # vectorised/tail splits of the same element-wise kernels
        assert_close({n: t[i] for n, t in params.items()}, ref)


# --------------------------------------------------------------------------- clipping


def test_per_member_clipping_matches_clip_by_global_norm():
    net, data = mlp(), batches(3)
    ens = hardware.ensemble(K, clip_grad_norm=0.3)
    opt = optim.sgd(0.1)
    start = engine.init(net, opt, seed=0, strategy=ens)
    state, outs = train(engine.train_step(net, loss_fn, opt, strategy=ens), start, data)
    assert (outs[0].grad_norm > 0.3).any()  # clipping is active
    solo_opt = optim.chain(optim.clip_by_global_norm(0.3), optim.sgd(0.1))
    for i in range(K):
        alone = hardware.member(start, i)
        solo, _ = train(
            engine.train_step(net, loss_fn, solo_opt),
            alone.replace(opt_state=solo_opt.init(alone.params)),
            data,
        )
        assert_close(hardware.member(state, i).params, solo.params)


def test_optimizer_that_mixes_members_is_refused():
    net = mlp()
    ens = hardware.ensemble(K)
    for opt in (
        optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1)),
        optim.chain(optim.masked(optim.add_decayed_weights(0.1), optim.decay_mask), optim.sgd(0.1)),
    ):
        start = engine.init(net, opt, seed=0, strategy=ens)
        step = engine.train_step(net, loss_fn, opt, strategy=ens)
        with pytest.raises(ValueError, match="does not update ensemble members independently"):
            step(start, batches(1)[0])
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))
    unchecked = hardware.ensemble(K, check_optimizer=False)
    start = engine.init(net, opt, seed=0, strategy=unchecked)
    engine.train_step(net, loss_fn, opt, strategy=unchecked)(start, batches(1)[0])


def test_member_norms_are_the_separate_global_norms():
    g = torch.Generator().manual_seed(0)
    grads = {
        "a": torch.randn(5, 7, 3, generator=g) * 100,
        "b": torch.randn(5, 2, generator=g),
        "c": torch.randn(5, generator=g),
    }
    norms = member_optim.member_norms(grads)
    for i in range(5):
        # a per-row vector_norm against torch._foreach_norm: two kernels
        alone = tree.global_norm({n: t[i] for n, t in grads.items()})
        torch.testing.assert_close(norms[i], alone, rtol=RTOL, atol=0)


# --------------------------------------------------------------------------- state helpers


def test_member_and_stack_round_trip_and_interop():
    net, opt = mlp(batchnorm=True), optim.adam(1e-2)
    ens = hardware.ensemble(K)
    state, _ = train(
        engine.train_step(net, loss_fn, opt, strategy=ens),
        engine.init(net, opt, seed=0, strategy=ens),
        batches(2),
    )
    members = [hardware.member(state, i) for i in range(K)]
    assert not hardware.is_ensemble(members[0]) and hardware.is_ensemble(state)
    tree.assert_trees_equal(hardware.stack(members, key=state.rng), state)
    for i, m in enumerate(members):
        tree.assert_trees_equal(hardware.member(hardware.stack(members), i), m)
        weights = checkpoint.export_state_dict(m, net)
        assert torch.equal(weights["0.weight"], state.params["0.weight"][i])
        assert weights["0.weight"].untyped_storage().nbytes() == 16 * 8 * 4  # a copy, not a view
    engine.train_step(net, loss_fn, opt)(members[1], batches(1)[0])  # an ordinary state
    assert hardware.member(state, -1).rng == members[-1].rng


def test_stack_and_member_errors():
    net, opt = mlp(), optim.adam(1e-2)
    a = engine.init(net, opt, seed=0)
    b = engine.train_step(net, loss_fn, opt)(a, batches(1)[0])[0]
    with pytest.raises(ValueError, match="disagree on progress"):
        hardware.stack([a, b])
    with pytest.raises(ValueError, match="at least one"):
        hardware.stack([])
    c = engine.init(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3)), opt, seed=0)
    with pytest.raises(ValueError, match="cannot stack"):
        hardware.stack([a, c])
    ens_state = hardware.stack([a, a])
    with pytest.raises(ValueError, match="already an ensemble"):
        hardware.stack([ens_state])
    with pytest.raises(TypeError, match="expected an ensemble state"):
        hardware.member(a, 0)
    with pytest.raises(IndexError, match="out of range"):
        hardware.member(ens_state, 2)


@pytest.mark.bitwise
def test_checkpoint_round_trip_and_bitwise_resume(tmp_path):
    net, data = mlp(dropout=0.2, batchnorm=True), batches(4)
    opt = optim.inject_hyperparams(optim.adam)(lr=1e-2)
    ens = hardware.ensemble(K, hparams={"lr": [1e-2, 3e-3, 1e-3]})
    step = engine.train_step(net, loss_fn, opt, strategy=ens)
    start = engine.init(net, opt, seed=0, strategy=ens)
    continuous, _ = train(step, start, data)
    half, _ = train(step, start, data[:2])
    url = str(tmp_path / "ens.ckpt")
    checkpoint.save(half, url)
    loaded, _ = checkpoint.load(url, target=start)
    tree.assert_trees_equal(loaded, half)
    resumed, _ = train(engine.train_step(net, loss_fn, opt, strategy=ens), loaded, data[2:])
    tree.assert_trees_equal(resumed, continuous)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("k", [0, -2, 2.0, True, "3"])
def test_bad_k(k):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        hardware.ensemble(k)


@pytest.mark.parametrize(
    ("hparams", "error", "match"),
    [
        ({"lr": [1e-3, 1e-2]}, ValueError, "has 2 values for an ensemble of 3"),
        ({"lr": 1e-3}, TypeError, "must be a list of 3 values"),
        ([1e-3] * 3, TypeError, "must be a dict"),
        ({"lr": [1e-3, "x", 1e-2]}, ValueError, "finite numbers"),
        ({"lr": [1e-3, float("nan"), 1e-2]}, ValueError, "finite numbers"),
        ({1: [1e-3] * 3}, TypeError, "names must be strings"),
    ],
)
def test_bad_hparams(hparams, error, match):
    with pytest.raises(error, match=match):
        hardware.ensemble(3, hparams=hparams)


def test_hparams_the_optimizer_does_not_inject():
    with pytest.raises(ValueError, match=r"\['lr'\] are not hyper-parameters"):
        engine.init(mlp(), optim.adam(1e-3), strategy=hardware.ensemble(2, hparams={"lr": [1, 2]}))
    opt = optim.inject_hyperparams(optim.adam)(lr=1e-3, betas=(0.9, 0.999))
    with pytest.raises(ValueError, match="tuple of 2 numbers per member"):
        engine.init(mlp(), opt, strategy=hardware.ensemble(2, hparams={"betas": [0.9, 0.8]}))


def test_per_member_values_for_a_scheduled_hyperparameter_are_refused():
    opt = optim.inject_hyperparams(optim.sgd)(lr=optim.schedules.linear(0.1, 0.0, 10))
    ens = hardware.ensemble(2, hparams={"lr": [0.1, 0.2]})
    net = mlp()
    state = engine.init(net, opt, strategy=ens)
    with pytest.raises(ValueError, match="recomputes it every step"):
        engine.train_step(net, loss_fn, opt, strategy=ens)(state, batches(1)[0])


# --------------------------------------------------------------------------- the base strategy


class _RecordingBase(engine.Strategy):
    """A base strategy that records which of its methods the ensemble called."""

    rank, world_size = 1, 2

    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if callable(attr) and not name.startswith("_") and name != "calls":
            self.calls.append(name)
        return attr


# Methods about the shape of the state and the steps, which the ensemble builds itself.
_OWN = {"build_train_step", "build_eval_step", "build_predict_step"}


def _public_strategy_methods():
    return sorted(
        name
        for name in dir(engine.Strategy)
        if not name.startswith("_") and callable(getattr(engine.Strategy, name))
    )


def test_every_strategy_method_is_defined_by_the_ensemble():
    """Fails when ``Strategy`` grows a method that ``Ensemble`` does not forward."""
    properties = [
        name
        for name in dir(engine.Strategy)
        if isinstance(getattr(engine.Strategy, name), property)
    ]
    assert "is_primary" in properties
    inherited = [
        name
        for name in [*_public_strategy_methods(), *properties]
        if name not in hardware.Ensemble.__dict__
    ]
    assert inherited == []


def test_every_strategy_method_reaches_the_base():
    base = _RecordingBase()
    ens = hardware.ensemble(2, base)
    x = {"b": torch.ones(2)}
    calls = {
        "place": lambda: ens.place(x),
        "prepare_state": lambda: ens.prepare_state(x, x),
        "all_reduce": lambda: ens.all_reduce(x),
        "broadcast": lambda: ens.broadcast(x),
        "barrier": lambda: ens.barrier(),
        "reduce_flag": lambda: ens.reduce_flag(True),
        "sync_metrics": lambda: ens.sync_metrics(x),
        "sync_buffers": lambda: ens.sync_buffers(x),
        "sync_step_buffers": lambda: ens.sync_step_buffers(x),
        "all_gather_object": lambda: ens.all_gather_object(1),
        "broadcast_object": lambda: ens.broadcast_object(1),
        "data_options": lambda: ens.data_options(),
        "convert_model": lambda: ens.convert_model(mlp()),
        "rng_devices": lambda: ens.rng_devices(),
        "build_state": lambda: ens.build_state(mlp(), optim.sgd(0.1)),
    }
    assert sorted([*calls, *_OWN]) == _public_strategy_methods()
    for name, call in calls.items():
        base.calls.clear()
        call()
        assert name in base.calls, name
    assert ens.data_options() == {"rank": 1, "world_size": 2}
    assert not ens.is_primary and (ens.rank, ens.world_size) == (1, 2)


def test_a_base_that_builds_its_own_state_is_refused():
    class Builds(engine.Strategy):
        def build_state(self, model, optimizer, **kwargs):
            return "a state"

    with pytest.raises(TypeError, match="builds its own state"):
        engine.init(mlp(), optim.sgd(0.1), strategy=hardware.ensemble(2, Builds()))


def test_the_buffers_follow_the_base_policy_after_every_call():
    class Halving(engine.Strategy):
        world_size = 2

        def all_reduce(self, tree, op="mean"):
            return tree

        def sync_step_buffers(self, buffers):
            return {n: b / 2 if b.is_floating_point() else b for n, b in buffers.items()}

    net, opt = mlp(batchnorm=True), optim.sgd(0.1)
    plain, halving = hardware.ensemble(2), hardware.ensemble(2, Halving())
    state = engine.init(net, opt, strategy=plain)
    batch = batches(1)[0]
    expected, _ = engine.train_step(net, loss_fn, opt, strategy=plain)(state, batch)
    got, _ = engine.train_step(net, loss_fn, opt, strategy=halving)(state, batch)
    assert torch.equal(got.buffers["1.running_mean"], expected.buffers["1.running_mean"] / 2)


def test_other_bad_input():
    with pytest.raises(ValueError, match="scales the loss"):
        hardware.ensemble(2, hardware.single_device("cpu", precision="16-mixed"))
    with pytest.raises(ValueError, match="clip_grad_norm"):
        hardware.ensemble(2, clip_grad_norm=-1.0)
    with pytest.raises(TypeError, match="base must be a Strategy"):
        hardware.ensemble(2, base="cpu")
    net, opt = mlp(), optim.sgd(0.1)
    step = engine.train_step(net, loss_fn, opt, strategy=hardware.ensemble(2))
    with pytest.raises(TypeError, match="this step trains an ensemble"):
        step(engine.init(net, opt), batches(1)[0])
    with pytest.raises(ValueError, match="the state has 3 members"):
        step(engine.init(net, opt, strategy=hardware.ensemble(3)), batches(1)[0])


# --------------------------------------------------------------------------- Trainer validation


def accuracy_loss(apply, batch):
    """examples/digits.py's loss_fn: cross-entropy and an exactly merged accuracy."""
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": metrics.Accuracy.of(logits, y)}


def test_trainer_validation_reports_each_members_metrics():
    """An ensemble's validation logs ``val_acc/<i>`` (member i's accuracy over the whole
    validation set, merged exactly across batches), ``val_acc`` (the members pooled: their
    mean, every member seeing the same batches) and ``val_loss/<i>`` likewise; the values
    ``validate`` returns are numbers."""
    from torch.utils.data import DataLoader, TensorDataset

    from purestep.loops import Trainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)
    val = DataLoader(TensorDataset(x, y), batch_size=16)  # 16 + 16 + 8: unequal batches
    trainer = Trainer(
        max_epochs=1,
        strategy=hardware.ensemble(K),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    net = mlp()
    state = trainer.fit(net, accuracy_loss, optim.sgd(0.5), DataLoader(TensorDataset(x, y), 8), val)
    seen = trainer.callback_metrics
    (result,) = trainer.validate(state=state, dataloaders=val, fn=accuracy_loss, verbose=False)
    for i in range(K):
        member = engine.to_module(hardware.member(state, i), net)
        with torch.no_grad():
            logits = member.eval()(x)
        want_acc = float((logits.argmax(-1) == y).float().mean())
        assert float(seen[f"val_acc/{i}"]) == pytest.approx(want_acc, abs=1e-6)
        assert result[f"val_acc/{i}"] == pytest.approx(want_acc, abs=1e-6)
        losses = [F.cross_entropy(logits[j : j + 16], y[j : j + 16]) for j in (0, 16, 32)]
        want_loss = float(sum(loss * n for loss, n in zip(losses, (16, 16, 8))) / 40)
        assert result[f"val_loss/{i}"] == pytest.approx(want_loss, rel=1e-5)
    members = [result[f"val_acc/{i}"] for i in range(K)]
    assert result["val_acc"] == pytest.approx(sum(members) / K, abs=1e-6)
    assert all(isinstance(v, float) for v in result.values())


def test_per_member_split_keeps_logging_options_and_plain_values():
    from purestep.loops import aggregate
    from purestep.loops.evaluate import per_member

    stacked = metrics.Accuracy(correct=torch.tensor([1.0, 3.0]), total=torch.tensor([4.0, 4.0]))
    plain = metrics.Accuracy.of(torch.tensor([1, 0]), torch.tensor([1, 1]))
    # three per-class counts: not a member axis for two members (a macro metric's state)
    per_class = metrics.Accuracy(correct=torch.ones(3), total=torch.ones(3))
    out = per_member(
        {
            "acc": aggregate.log(stacked, prog_bar=True),
            "plain": plain,
            "classes": per_class,
            "loss": torch.ones(2),
        },
        2,
    )
    assert sorted(out) == ["acc", "acc/0", "acc/1", "classes", "loss", "plain"]
    assert out["plain"] is plain and out["classes"] is per_class
    assert torch.equal(out["loss"], torch.ones(2))
    assert out["acc"].prog_bar is True and out["acc/0"].prog_bar is False
    assert float(out["acc"].value.compute()) == 0.5
    assert [float(out[f"acc/{i}"].value.compute()) for i in range(2)] == [0.25, 0.75]
