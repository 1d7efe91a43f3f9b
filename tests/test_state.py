import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from purestep import engine
from purestep.engine import optim, tree
from purestep.engine.bind import Binder
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
    from purestep import hardware

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


# --------------------------------------------------------------------------- meta templates


class _Rotary(nn.Module):
    """Tensors no ``reset_parameters`` recreates: a bare gain, a computed table, a counter
    and a bool mask."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2) / 4))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool))

    def forward(self, x):
        return self.fc(x) * self.gain


def _on_meta(cls):
    with torch.device("meta"):
        return cls()


def test_a_meta_template_with_uninitialised_tensors_is_refused_by_name():
    meta = _on_meta(_Rotary)
    message = r"\['gain', 'inv_freq', 'count', 'mask'\] are not initialised.*init_fn="
    with pytest.raises(ValueError, match=message):
        engine.init(meta, optim.sgd(0.1), seed=0)
    with pytest.raises(ValueError, match=r"\['count', 'mask'\] are not initialised by init_fn"):
        engine.init(
            meta,
            optim.sgd(0.1),
            init_fn=lambda m: (m.fc.reset_parameters(), m.gain.zero_(), m.inv_freq.zero_()),
        )


def _full_init(module):
    module.fc.reset_parameters()
    module.gain.fill_(1.0)
    module.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, 4, 2) / 4))
    module.count.data = torch.zeros((), dtype=torch.long)  # a .data write counts as one
    module.mask.data.fill_(True)


def test_a_meta_template_with_init_fn_is_a_pure_function_of_the_seed():
    meta = _on_meta(_Rotary)
    a = engine.init(meta, optim.sgd(0.1), seed=3, init_fn=_full_init)
    _ = torch.empty(10_000).fill_(7.0)  # leave other bytes in the allocator
    b = engine.init(meta, optim.sgd(0.1), seed=3, init_fn=_full_init)
    c = engine.init(meta, optim.sgd(0.1), seed=4, init_fn=_full_init)
    tree.assert_trees_equal(a.params, b.params)
    tree.assert_trees_equal(a.buffers, b.buffers)
    assert not torch.equal(a.params["fc.weight"], c.params["fc.weight"])
    assert torch.equal(a.params["gain"], torch.ones(4))
    tree.assert_trees_equal(a.buffers, dict(_Rotary().named_buffers()))
    assert all(p.is_meta for p in meta.parameters())


def test_materialize_resets_a_real_template_and_keeps_what_no_reset_writes():
    net = _Rotary()
    net.gain.data.fill_(2.0)
    key = engine.rng.key(0)
    copy = engine.materialize(net, key)
    assert copy is not net and torch.equal(copy.gain, net.gain)
    assert not torch.equal(copy.fc.weight, net.fc.weight)
    tree.assert_trees_equal(
        dict(engine.materialize(net, key).named_parameters()), dict(copy.named_parameters())
    )


# --------------------------------------------------------------------------- train() overrides


class _KeepsNormFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self


def test_binder_calls_a_train_override_when_the_mode_changes_and_restores_the_flags():
    net = _KeepsNormFrozen()
    binder = Binder(net)
    params = dict(net.named_parameters())
    buffers = dict(net.named_buffers())
    net.eval()
    with binder.bind(params, buffers, training=True):
        assert net.training and net.fc.training and not net.bn.training
    assert not any(m.training for m in net.modules())
    net.train()
    flags = [m.training for m in net.modules()]
    with binder.bind(params, buffers, training=True):
        assert [m.training for m in net.modules()] == flags  # already in its train mode
    with binder.bind(params, buffers, training=False):
        assert not any(m.training for m in net.modules())
    assert [m.training for m in net.modules()] == flags


def test_binder_without_overrides_keeps_the_fast_flag_flipping():
    net = mlp(batchnorm=True)
    net.train()
    net[1].eval()  # set by hand, not by a train() override: train mode means all modules
    with Binder(net).bind(dict(net.named_parameters()), dict(net.named_buffers()), True):
        assert all(m.training for m in net.modules())
    assert not net[1].training and net.training
