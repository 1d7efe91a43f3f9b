"""``per_sample_step(..., compile=...)``: DP-SGD in two compiled pieces.

The per-example gradients, their clipping and their sum are one graph; the noise is drawn
eagerly from the key-derived generator (bitwise the eager step's noise); the update is a
second graph. Compiled vs eager tolerance: ``rtol=1e-4, atol=1e-5`` on float32 parameters
after 3 Adam steps (different kernels); against itself a compiled run is compared with
``torch.equal``. Most tests use the ``aot_eager`` backend (traced, no code generation); one
uses inductor. Run time: about 15 s.
"""

from __future__ import annotations

import math
import os
from dataclasses import astuple

import pytest
import torch
from helpers import batches, clone_tree, loss_fn, mlp

from purestep import engine
from purestep.engine import optim, per_sample, rng
from purestep.engine.compile import CompileError

RTOL, ATOL = 1e-4, 1e-5
AOT = {"backend": "aot_eager"}
# Inductor cannot build its CPU kernels under ATEN_CPU_CAPABILITY=default (see test_compile).
INDUCTOR = AOT if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else True


def dp_step(net, tx, compile=AOT, **kwargs):
    kwargs.setdefault("max_grad_norm", 1.0)
    kwargs.setdefault("noise_multiplier", 1.0)
    loss = kwargs.pop("loss", loss_fn)
    return engine.per_sample_step(net, loss, tx, compile=compile, **kwargs)


def run(step, state, data):
    outs = []
    for b in data:
        state, out = step(state, b)
        outs.append(out)
    return state, outs


def assert_equal_trees(a, b):
    la, lb = engine.tree.leaves(a), engine.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


def assert_close_params(a, b):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=RTOL, atol=ATOL, msg=n)


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_compiled_dp_step_matches_the_eager_step(noise):
    net, tx = mlp(), optim.adam(1e-2)
    state = engine.init(net, tx, seed=0)
    step = dp_step(net, tx, noise_multiplier=noise)
    eager = dp_step(net, tx, compile=False, noise_multiplier=noise)
    assert type(step).__name__ == "CompiledPerSampleStep"
    assert isinstance(step, per_sample.PerSampleStep)
    data = batches(3, size=6)
    s, outs = run(step, state, data)
    se, outs_e = run(eager, state, data)
    assert step.fused is False and step.compilations == 2  # per-example graph, update graph
    assert_close_params(s.params, se.params)
    assert astuple(s.progress) == astuple(se.progress)
    for o, oe in zip(outs, outs_e):
        torch.testing.assert_close(o.loss, oe.loss, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(o.metrics["acc"], oe.metrics["acc"])
        torch.testing.assert_close(o.grad_norm, oe.grad_norm, rtol=RTOL, atol=ATOL)
    # the noise moved the parameters away from the noise-free run
    if noise:
        quiet, _ = run(dp_step(net, tx, compile=False, noise_multiplier=0.0), state, data)
        assert not torch.allclose(s.params["0.weight"], quiet.params["0.weight"], atol=1e-3)


@pytest.mark.bitwise
def test_compiled_dp_step_is_pure_and_repeats_bitwise():
    net, tx = mlp(dropout=0.25), optim.adam(1e-2)
    step = dp_step(net, tx)
    state = engine.init(net, tx, seed=3)
    state, _ = step(state, batches(1, size=6)[0])  # non-zero moments
    before = clone_tree(state)
    batch = batches(1, seed=1, size=6)[0]
    new, out = step(state, batch)
    assert_equal_trees(state, before)  # every leaf of the input is bitwise unchanged
    again, out2 = step(state, batch)
    assert_equal_trees(new, again)
    assert torch.equal(out.loss, out2.loss) and torch.equal(out.grad_norm, out2.grad_norm)
    # dropout is a function of the key: another key, other masks and noise
    other, _ = step(state.replace(rng=rng.key(7)), batch)
    assert not torch.equal(other.params["0.weight"], new.params["0.weight"])


def zero_grad_loss(apply, batch):
    x, _ = batch
    return (apply(x) * 0.0).sum(), {}


@pytest.mark.bitwise
def test_the_noise_is_bitwise_the_eager_steps_noise():
    # a loss whose gradients are exactly zero: the step's gradient is the noise over B
    net, tx = mlp(), optim.sgd(0.1)
    state = engine.init(net, tx, seed=4)
    state = state.replace(progress=state.progress.replace(step=5))
    batch = batches(1, size=4)[0]
    kw = {"loss": zero_grad_loss, "noise_multiplier": 0.7, "max_grad_norm": 2.0}
    _, grads = dp_step(net, tx, **kw).backward(state, batch)
    _, eager = dp_step(net, tx, compile=False, **kw).backward(state, batch)
    key = rng.fold_in(state.rng, rng.Purpose.NOISE, 5, 0)
    noise = per_sample.gaussian_noise(grads.grads, 0.7 * 2.0, key)
    for n in grads.grads:
        assert torch.equal(grads.grads[n], eager.grads[n])
        assert torch.equal(grads.grads[n], noise[n] / 4.0)
        assert grads.grads[n].abs().sum() > 0


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_no_recompilation_as_the_key_and_the_step_change(noise):
    net, tx = mlp(dropout=0.1), optim.adam(1e-2)
    step = dp_step(net, tx, noise_multiplier=noise)
    state = engine.init(net, tx, seed=0)
    data = batches(10, size=4)
    for i, b in enumerate(data):
        state = state.replace(rng=rng.key(100 + i))  # a new key every step
        state, out = step(state, b)
        assert math.isfinite(out.loss.item())
    assert state.progress.step == 10
    assert step.compilations == 2


def test_inductor_compiled_dp_step_matches_eager():
    net, tx = mlp(), optim.adam(1e-2)
    state = engine.init(net, tx, seed=1)
    data = batches(3, size=6)
    step = dp_step(net, tx, compile=INDUCTOR, noise_multiplier=0.5)
    s, _ = run(step, state, data)
    se, _ = run(dp_step(net, tx, compile=False, noise_multiplier=0.5), state, data)
    assert_close_params(s.params, se.params)
    assert step.compilations == 2


def test_an_untraceable_loss_raises_compile_error_and_a_broken_one_its_own_error():
    def breaks(apply, batch):
        torch._dynamo.graph_break()
        return loss_fn(apply, batch)

    net, tx = mlp(), optim.sgd(0.1)
    state = engine.init(net, tx, seed=0)
    batch = batches(1, size=4)[0]
    with pytest.raises(CompileError, match="per-example gradients.*fullgraph"):
        dp_step(net, tx, loss=breaks)(state, batch)

    def broken(apply, batch):
        raise KeyError("no such column")

    with pytest.raises(KeyError, match="no such column"):
        dp_step(net, tx, loss=broken)(state, batch)


def test_bad_compile_options_are_refused():
    net, tx = mlp(), optim.sgd(0.1)
    with pytest.raises(TypeError, match="unknown compile options"):
        dp_step(net, tx, compile={"backnd": "aot_eager"})
    with pytest.raises(TypeError, match="compile must be"):
        dp_step(net, tx, compile="yes")
