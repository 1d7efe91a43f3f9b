"""engine.per_sample: per-example gradients, clipping, noise and the DP-SGD step.

Tolerances: per-example gradients agree with one-example-at-a-time autograd to
``rtol=1e-5, atol=1e-6`` (vmapped kernels round differently); with no noise and a huge
clipping bound the DP step matches the ordinary mean-loss step to ``rtol=1e-5, atol=1e-7``
after 3 SGD steps (a sum of per-example gradients divided by B versus the gradient of the
mean); ``chunk_size`` changes results to the same tolerance. Purity and reproducibility
are bitwise. Run time: about 2 s.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import batches, digest, loss_fn, mlp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from purestep import engine
from purestep.engine import metrics, optim, per_sample, rng, tree


def dp_step(net, opt=None, **kwargs):
    kwargs.setdefault("max_grad_norm", 1.0)
    kwargs.setdefault("noise_multiplier", 1.0)
    return engine.per_sample_step(net, loss_fn, opt or optim.sgd(0.1), **kwargs)


def test_per_sample_grads_equal_one_example_at_a_time():
    net = mlp()
    net[0].bias.requires_grad_(False)  # frozen: no per-example gradient
    state = engine.init(net, optim.sgd(0.1), seed=0)
    x, y = batches(1, size=6)[0]
    grads, losses, _ = dp_step(net).per_sample_grads(state, (x, y))
    assert set(grads) == {"0.weight", "2.weight", "2.bias"}
    for i in range(6):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        model.load_state_dict(engine.checkpoint.export_state_dict(state, net))
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        expected = torch.autograd.grad(loss, [model[0].weight, model[2].weight, model[2].bias])
        for name, g in zip(["0.weight", "2.weight", "2.bias"], expected):
            torch.testing.assert_close(grads[name][i], g, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses[i], loss.detach(), rtol=1e-6, atol=1e-7)


@settings(max_examples=30, deadline=None)
@given(
    scales=st.lists(st.floats(1e-4, 1e4), min_size=1, max_size=6),
    max_norm=st.floats(1e-3, 10.0),
)
def test_clipping_bounds_every_example_and_keeps_its_direction(scales, max_norm):
    g = torch.Generator().manual_seed(len(scales))
    grads = {
        "a": torch.randn(len(scales), 4, 3, generator=g) * torch.tensor(scales).view(-1, 1, 1),
        "b": torch.randn(len(scales), 2, generator=g) * torch.tensor(scales).view(-1, 1),
    }
    before = per_sample.per_sample_norms(grads)
    clipped = per_sample.clip_per_sample(grads, max_norm)
    after = per_sample.per_sample_norms(clipped)
    assert (after <= max_norm * (1 + 1e-5)).all()
    for i, norm in enumerate(before.tolist()):
        if norm <= max_norm:  # left alone (up to the 1e-6 of the coefficient)
            torch.testing.assert_close(clipped["a"][i], grads["a"][i], rtol=1e-5, atol=0)
        else:  # scaled down onto the bound (less the 1e-6 of the coefficient), same direction
            assert after[i] == pytest.approx(max_norm * norm / (norm + 1e-6), rel=1e-4)
            ratio = clipped["a"][i] / grads["a"][i]
            torch.testing.assert_close(ratio, torch.full_like(ratio, ratio.flatten()[0].item()))
    summed = per_sample.clipped_sum(grads, max_norm)
    for name in grads:
        torch.testing.assert_close(summed[name], clipped[name].sum(0), rtol=1e-5, atol=1e-6)


def test_the_step_averages_the_clipped_per_example_gradients():
    net = mlp()
    state = engine.init(net, optim.sgd(0.1), seed=0)
    batch = batches(1, size=10)[0]
    step = dp_step(net, max_grad_norm=0.05, noise_multiplier=0.0)
    grads, _, _ = step.per_sample_grads(state, batch)
    assert (per_sample.per_sample_norms(grads) > 0.05).any()  # clipping is active
    _, out = step.backward(state, batch)
    clipped = per_sample.clip_per_sample(grads, 0.05)
    for name, g in clipped.items():
        torch.testing.assert_close(out.grads[name], g.mean(0), rtol=1e-5, atol=1e-8)


def test_no_noise_and_no_clipping_equals_the_mean_loss_step():
    net, opt = mlp(), optim.sgd(0.1, momentum=0.9)
    dp = dp_step(net, opt, max_grad_norm=1e9, noise_multiplier=0.0)
    plain = engine.train_step(net, loss_fn, opt)
    a = b = engine.init(net, opt, seed=0)
    for batch in batches(3):
        a, out_a = dp(a, batch)
        b, out_b = plain(b, batch)
        torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-6, atol=0)
        assert out_a.metrics["acc"] == out_b.metrics["acc"]
    assert tree.diff(a, b, rtol=1e-5, atol=1e-7) == []


@pytest.mark.bitwise
def test_step_is_pure_and_reproducible_and_noise_changes_every_step():
    net = mlp(dropout=0.3)
    step = dp_step(net)
    state = engine.init(net, optim.sgd(0.1), seed=0)
    batch = batches(1)[0]
    before = digest(state)
    new, out = step(state, batch)
    assert digest(state) == before
    assert digest(step(state, batch)) == digest((new, out))
    no_dropout = mlp()  # chunks draw their dropout masks separately: compare without dropout
    plain_state = engine.init(no_dropout, optim.sgd(0.1), seed=0)
    chunked = dp_step(no_dropout, chunk_size=5)(plain_state, batch)
    whole = dp_step(no_dropout)(plain_state, batch)  # chunked kernels round differently
    assert tree.diff(chunked[0], whole[0], rtol=1e-5, atol=1e-7) == []
    _, g1 = step.backward(new, batch)
    _, g2 = step.backward(new.replace(progress=new.progress.replace(step=7)), batch)
    assert not torch.equal(g1.grads["0.weight"], g2.grads["0.weight"])


def test_noise_has_the_stated_distribution():
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    state = engine.init(net, optim.sgd(0.1), seed=0)
    x, y = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 10
    sigma, c, b = 1.3, 0.7, 16

    def lf(apply, batch):
        return F.cross_entropy(apply(batch[0]), batch[1])

    noisy = engine.per_sample_step(net, lf, optim.sgd(0.1), max_grad_norm=c, noise_multiplier=sigma)
    clean = engine.per_sample_step(net, lf, optim.sgd(0.1), max_grad_norm=c, noise_multiplier=0.0)
    _, with_noise = noisy.backward(state, (x, y))
    _, without = clean.backward(state, (x, y))
    noise = torch.cat([(with_noise.grads[n] - without.grads[n]).flatten() for n in without.grads])
    assert noise.numel() > 9000
    expected = sigma * c / b
    assert noise.std().item() == pytest.approx(expected, rel=0.03)
    assert abs(noise.mean().item()) < 4 * expected / math.sqrt(noise.numel())
    key = rng.fold_in(state.rng, rng.Purpose.NOISE, 0, 0)
    drawn = per_sample.gaussian_noise(without.grads, sigma * c, key)
    for n in without.grads:
        torch.testing.assert_close(
            with_noise.grads[n] - without.grads[n], drawn[n] / b, rtol=1e-4, atol=1e-6
        )


def test_metrics_are_combined_over_examples():
    net = mlp()
    state = engine.init(net, optim.sgd(0.1), seed=0)
    batch = batches(1, size=7)[0]

    def lf(apply, batch):
        x, y = batch
        logits = apply(x)
        acc = metrics.Accuracy.of(logits, y)
        return F.cross_entropy(logits, y), {"acc": acc, "top": logits.max(), "tag": "x"}

    _, out = engine.per_sample_step(
        net, lf, optim.sgd(0.1), max_grad_norm=1.0, noise_multiplier=0.0
    )(state, batch)
    plain = engine.eval_step(net, lf)(state, batch)
    assert torch.equal(out.metrics["acc"].correct, plain["acc"].correct)
    assert out.metrics["acc"].total == 7
    assert out.metrics["tag"] == "x"
    logits = engine.predict_step(net)(state, batch[0])
    torch.testing.assert_close(out.metrics["top"], logits.max(-1).values.mean())


def test_batchnorm_is_refused():
    with pytest.raises(
        ValueError, match="per-sample gradients are undefined for a model with BatchNorm"
    ):
        dp_step(mlp(batchnorm=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_grad_norm": 0.0}, "max_grad_norm must be a finite number > 0"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be a finite number >= 0"),
        ({"noise_multiplier": True}, "noise_multiplier"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dp_step(mlp(), **kwargs)


def test_loss_scaling_precision_is_refused():
    from purestep import hardware

    strategy = hardware.single_device("cpu", precision="16-mixed")
    with pytest.raises(ValueError, match="scales the loss"):
        dp_step(mlp(), strategy=strategy)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


def _unused_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


def test_unused_parameters_are_an_error_unless_allowed():
    net = _WithUnused()
    state = engine.init(net, optim.sgd(0.1), seed=0)
    step = per_sample.per_sample_step(
        net, loss_fn, optim.sgd(0.1), max_grad_norm=1.0, noise_multiplier=0.0
    )
    with pytest.raises(RuntimeError, match=r"unused\.weight.*received no gradient"):
        step(state, _unused_batch())
    with pytest.raises(RuntimeError, match="received no gradient"):
        step.per_sample_grads(state, _unused_batch())
    allowed = per_sample.per_sample_step(
        net, loss_fn, optim.sgd(0.1), max_grad_norm=1.0, noise_multiplier=0.0, allow_unused=True
    )
    new, _ = allowed(state, _unused_batch())
    assert torch.equal(new.params["unused.weight"], state.params["unused.weight"])
    assert not torch.equal(new.params["used.weight"], state.params["used.weight"])
