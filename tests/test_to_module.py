"""``engine.to_module(state, net)``: a trained module from a state and its template."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import purestep
from purestep import engine, hardware
from purestep.engine import optim, tree


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _batch(seed=0, n=16, d=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _trained(net, steps=3, opt=None):
    opt = opt or optim.adamw(1e-2)
    state = engine.init(net, opt, seed=0)
    step = engine.train_step(net, _loss, opt)
    for i in range(steps):
        state, _ = step(state, _batch(i))
    return state


def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict(keep_vars=False).items()}


@pytest.mark.bitwise
def test_forward_equals_the_engine_bitwise_and_batchnorm_stats_come_back():
    net = _net()
    before = _snapshot(net)
    state = _trained(net)
    trained = engine.to_module(state, net)
    assert trained is not net
    x, _ = _batch(7)
    with torch.no_grad():
        got = trained.eval()(x)
    assert torch.equal(got, engine.predict_step(net)(state, x))
    loss = engine.eval_step(net, _loss)(state, _batch(7))["loss"]
    with torch.no_grad():
        assert torch.equal(F.cross_entropy(trained(x), _batch(7)[1]), loss)
    # BatchNorm statistics (buffers) are the state's, which training moved
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(trained.state_dict()[name], state.buffers[name])
    assert int(trained[1].num_batches_tracked) == 3
    assert not torch.equal(trained[1].running_mean, before["1.running_mean"])
    # the template is untouched, and the module does not alias the state
    tree.assert_trees_equal(_snapshot(net), before)
    assert all(p.data_ptr() != state.params[n].data_ptr() for n, p in trained.named_parameters())
    assert all(p.requires_grad for p in trained.parameters())
    assert net.training and not trained.training  # eval() above changed the copy only


def test_the_copy_keeps_the_templates_mode_and_requires_grad():
    net = _net().eval()
    net[0].bias.requires_grad_(False)
    trained = engine.to_module(_trained(net, steps=1), net)
    assert not trained.training
    assert not trained[0].bias.requires_grad and trained[0].weight.requires_grad
    assert isinstance(trained[0].weight, nn.Parameter)


def test_inplace_loads_into_the_given_module():
    net = _net()
    state = _trained(net)
    target = copy.deepcopy(net)
    weight = target[0].weight
    out = engine.to_module(state, target, inplace=True)
    assert out is target and target[0].weight is weight  # same tensor objects
    tree.assert_trees_equal(dict(target.state_dict()), {**state.params, **state.buffers})


def test_a_meta_template_is_materialised_on_the_states_device():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    state = _trained(net, steps=2)
    trained = engine.to_module(state, net)
    assert all(t.device.type == "cpu" for t in trained.state_dict().values())
    assert all(p.is_meta for p in net.parameters())  # the template stays on meta
    x, _ = _batch(3)
    with torch.no_grad():
        assert torch.equal(trained.eval()(x), engine.predict_step(net)(state, x))
    with pytest.raises(ValueError, match="meta device"):
        engine.to_module(state, net, inplace=True)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(6), persistent=False)

    def forward(self, idx):
        return self.head(self.embed(idx) * self.scale)


def test_tied_weights_stay_tied_and_non_persistent_buffers_come_back():
    torch.manual_seed(0)
    net = _Tied()
    opt = optim.sgd(0.5)
    state = engine.init(net, opt)
    assert "head.weight" not in state.params  # a tied weight appears once
    state = state.replace(buffers={"scale": torch.full((6,), 2.0)})
    step = engine.train_step(net, lambda apply, idx: apply(idx).square().mean(), opt)
    state, _ = step(state, torch.arange(10))
    trained = engine.to_module(state, net)
    assert trained.head.weight is trained.embed.weight
    assert len(list(trained.parameters())) == 1
    assert torch.equal(trained.embed.weight, state.params["embed.weight"])
    assert torch.equal(trained.scale, torch.full((6,), 2.0))
    idx = torch.arange(10)
    with torch.no_grad():
        assert torch.equal(trained.eval()(idx), engine.predict_step(net)(state, idx))
    assert torch.equal(net.scale, torch.ones(6))


def test_an_ensemble_state_asks_for_a_member():
    net = nn.Linear(4, 2)
    ens = hardware.ensemble(3)
    state = engine.init(net, optim.sgd(0.1), strategy=ens)
    with pytest.raises(ValueError, match=r"hardware\.member\(state, i\)"):
        engine.to_module(state, net)
    one = engine.to_module(hardware.member(state, 1), net)
    assert torch.equal(one.weight, state.params["weight"][1])


def test_a_wrong_template_is_refused():
    state = engine.init(nn.Linear(4, 2), optim.sgd(0.1))
    with pytest.raises(ValueError, match="shapes differ"):
        engine.to_module(state, nn.Linear(4, 3))
    with pytest.raises(KeyError):
        engine.to_module(state, nn.Sequential(nn.Linear(4, 2)))
    with pytest.raises(TypeError):
        engine.to_module(nn.Linear(4, 2), state)


def test_after_trainer_fit_and_from_the_root_package(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    net = _net()
    x, y = _batch(0, n=64)
    trainer = purestep.Trainer(
        max_epochs=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    state = trainer.fit(
        net, _loss, optim.adamw(1e-2), DataLoader(TensorDataset(x, y), batch_size=16)
    )
    trained = purestep.to_module(state, net)
    with torch.no_grad():
        assert torch.equal(trained.eval()(x), engine.predict_step(net)(state, x))
    assert purestep.to_module is engine.to_module
