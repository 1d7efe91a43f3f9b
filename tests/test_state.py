import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import engine
from engine import optim, tree
from engine.bind import Binder
from tests.helpers import loss_fn, mlp


def test_init_copies_parameters_and_buffers_without_touching_the_module():
    net = mlp(batchnorm=True)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    state = engine.init(net, optim.sgd(0.1), seed=3)
    for name, p in net.named_parameters():
        assert torch.equal(state.params[name], p)
        assert state.params[name].data_ptr() != p.data_ptr()
        assert not state.params[name].requires_grad
    assert set(state.buffers) == {n for n, _ in net.named_buffers()}
    tree.assert_trees_equal(dict(net.state_dict()), before)
    assert state.rng == engine.rng.key(3)
    assert state.progress == state.progress and state.progress.step == 0
    assert state.callbacks == {} and state.grad_accum is None and state.extra == {}


def test_train_state_is_an_immutable_pytree():
    state = engine.init(mlp(), optim.sgd(0.1))
    with pytest.raises(AttributeError):
        state.rng = 1
    leaves = dict(tree.flatten_with_paths(state))
    assert ".params['0.weight']" in leaves
    assert leaves[".progress.step"] == 0
    assert leaves[".rng"] == state.rng
    moved = tree.map(lambda x: x, state)
    assert isinstance(moved, engine.TrainState)
    tree.assert_trees_equal(moved, state)


def test_init_applies_the_strategy_precision():
    import hardware

    state = engine.init(mlp(), optim.sgd(0.1), strategy=hardware.single_device("cpu", "64-true"))
    assert {p.dtype for p in state.params.values()} == {torch.float64}
    assert state.precision is None
    scaled = engine.init(mlp(), optim.sgd(0.1), strategy=hardware.single_device("cpu", "16-mixed"))
    assert scaled.precision.scale == 2.0**16


def test_binder_puts_everything_back():
    net = mlp(batchnorm=True)
    binder = Binder(net)
    originals = {n: p for n, p in net.named_parameters()}
    replacement = {n: torch.zeros_like(p) for n, p in originals.items()}
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    net.eval()
    with binder.bind(replacement, buffers, training=True) as bound:
        assert bound is net and net.training
        assert net[0].weight is replacement["0.weight"]
    assert not net.training
    assert all(net.get_parameter(n) is p for n, p in originals.items())


def test_binder_restores_after_an_exception():
    net = mlp()
    binder = Binder(net)
    weight = net[0].weight
    with (
        pytest.raises(ValueError),
        binder.bind({n: p * 0 for n, p in net.named_parameters()}, {}, False),
    ):
        raise ValueError
    assert net[0].weight is weight and net.training


def test_binder_reports_missing_tensors():
    net = mlp()
    binder = Binder(net)
    with pytest.raises(KeyError, match="missing \\['2.bias'\\]"):
        binder.check({"0.weight": 1, "0.bias": 1, "2.weight": 1}, {})


def test_parametrized_modules_train_through_their_original_tensor():
    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(-1, -2)

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    parametrize.register_parametrization(net[0], "weight", Symmetric())
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    assert "0.parametrizations.weight.original" in state.params
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    new, _ = engine.train_step(net, loss_fn, opt)(state, (x, y))
    changed = new.params["0.parametrizations.weight.original"]
    assert not torch.equal(changed, state.params["0.parametrizations.weight.original"])
