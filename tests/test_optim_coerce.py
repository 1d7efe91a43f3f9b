"""optim.as_transformation and the forms the Trainer and configure_optimizers accept:
engine.optim transforms, torch optimizer classes (bare or as functools.partial), and a clear
error for an already-built torch optimizer."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Task, Trainer
from purestep.engine import optim, tree
from purestep.engine.optim import InjectHyperparamsState, TorchOptimizerState
from purestep.loops.callbacks import LearningRateMonitor
from purestep.loops.loggers import MemoryLogger


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _loader(n=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)


def _trainer(**flags):
    flags.setdefault("logger", False)
    flags.setdefault("max_epochs", 1)
    t = Trainer(enable_progress_bar=False, enable_checkpointing=False, **flags)
    t._printer = lambda s: None
    return t


def _hyper(tx, params=None):
    state = tx.init(params or {"w": torch.zeros(2)})
    assert isinstance(state, InjectHyperparamsState)
    assert isinstance(state.inner_state, TorchOptimizerState)
    return state.name, {k: float(v) for k, v in state.hyperparams.items() if k == "lr"}


def test_transforms_pass_through_and_classes_become_from_torch():
    tx = optim.adam(1e-3)
    assert optim.as_transformation(tx) is tx
    assert _hyper(optim.as_transformation(torch.optim.NAdam)) == ("NAdam", {"lr": 0.002})
    part = functools.partial(torch.optim.RAdam, lr=0.05, weight_decay=0.1)
    assert _hyper(optim.as_transformation(part)) == ("RAdam", {"lr": 0.05})


def test_an_instance_gets_the_accepted_form():
    net = _net()
    inst = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError) as err:
        optim.as_transformation(inst, "configure_optimizers()'s optimizer")
    msg = str(err.value)
    assert msg.startswith("configure_optimizers()'s optimizer is a torch.optim.SGD instance")
    assert "optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)" in msg
    assert "functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)" in msg
    two = torch.optim.Adam(
        [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.1}]
    )
    with pytest.raises(TypeError, match="2 param groups: give from_torch param_groups="):
        optim.as_transformation(two)


def test_other_values_get_the_list_of_accepted_forms():
    with pytest.raises(TypeError, match=r"must be an engine.optim transform.*partial.*got a str"):
        optim.as_transformation("adam")
    with pytest.raises(TypeError, match="keyword arguments only"):
        optim.as_transformation(functools.partial(torch.optim.SGD, [torch.zeros(1)], lr=0.1))
    with pytest.raises(ValueError, match="needs a closure"):
        optim.as_transformation(functools.partial(torch.optim.LBFGS, lr=1))
    with pytest.raises(TypeError, match="the class torch.nn"):
        optim.as_transformation(nn.Linear)


@pytest.mark.bitwise
def test_trainer_fit_takes_a_partial_or_a_class_and_matches_from_torch():
    kwargs = dict(lr=0.01, weight_decay=0.01)
    explicit = _trainer().fit(
        _net(), _loss, optim.from_torch(torch.optim.NAdam, **kwargs), _loader()
    )
    partial = _trainer().fit(
        _net(), _loss, functools.partial(torch.optim.NAdam, **kwargs), _loader()
    )
    for a, b in zip(tree.leaves(explicit), tree.leaves(partial), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert explicit.progress.step == 4
    bare = _trainer().fit(_net(), _loss, torch.optim.Adamax, _loader())
    assert bare.opt_state.name == "Adamax" and bare.progress.step == 4


class _Task(Task):
    def __init__(self, value):
        super().__init__(_net())
        self.value = value

    def training_step(self, apply, batch):
        return _loss(apply, batch)

    def configure_optimizers(self):
        return self.value


def test_configure_optimizers_takes_them_too_and_the_monitor_logs_the_lr():
    logger = MemoryLogger()
    t = _trainer(logger=logger, log_every_n_steps=1, callbacks=[LearningRateMonitor()])
    state = t.fit(_Task(functools.partial(torch.optim.ASGD, lr=0.05)), train_dataloaders=_loader())
    assert state.opt_state.name == "ASGD"
    logged = [v for _, v in logger.history("lr-ASGD")]  # each step (and the epoch start)
    assert len(logged) >= 4 and logged == pytest.approx([0.05] * len(logged))
    with pytest.raises(TypeError, match="torch.optim.Adam instance.*optim.from_torch"):
        _trainer().fit(
            _Task(torch.optim.Adam(_net().parameters(), lr=0.1)), train_dataloaders=_loader()
        )
    with pytest.raises(TypeError, match="optim.from_torch\\(torch.optim.Adam, lr=0.1\\)"):
        Task.wrap(_net(), _loss, torch.optim.Adam(_net().parameters(), lr=0.1))


@pytest.mark.bitwise
def test_trainer_resume_from_a_checkpoint_continues_bitwise(tmp_path):
    """A from_torch optimizer inside the Trainer: fit 1 epoch, resume from its checkpoint
    for a second, and end bitwise where a 2-epoch run does."""
    opt = functools.partial(torch.optim.NAdam, lr=0.02, weight_decay=0.01)

    def fit(root, epochs, **kwargs):
        t = Trainer(
            max_epochs=epochs,
            default_root_dir=str(root),
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
        )
        t._printer = lambda s: None
        loader = DataLoader(_loader().dataset, batch_size=4, shuffle=True)
        return t, t.fit(_net(), _loss, opt, loader, **kwargs)

    _, straight = fit(tmp_path / "a", 2)
    first, _ = fit(tmp_path / "b", 1)
    _, resumed = fit(tmp_path / "b", 2, ckpt_path=first.best_model_path)
    assert resumed.progress.step == straight.progress.step == 8
    for (path, a), b in zip(
        tree.flatten_with_paths(straight.opt_state), tree.leaves(resumed.opt_state), strict=True
    ):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, path
    for n, p in straight.params.items():
        assert torch.equal(p, resumed.params[n]), n


def test_lightning_dicts_and_several_optimizers_take_torch_classes():
    one = _Task({"optimizer": functools.partial(torch.optim.Adamax, lr=0.01)})
    state = _trainer().fit(one, train_dataloaders=_loader())
    assert state.opt_state.name == "Adamax" and state.opt_state.count == 4

    class Two(_Task):
        def training_step(self, apply, batch, optimizer_idx):
            return _loss(apply, batch)

    two = Two(
        [
            {"optimizer": functools.partial(torch.optim.Adamax, lr=0.01), "params": "0"},
            {"optimizer": torch.optim.NAdam, "params": "2"},
        ]
    )
    state = _trainer().fit(two, train_dataloaders=_loader())
    names = [s.name for s in optim.find_injected(state.opt_state)]
    assert names == ["Adamax", "NAdam"]
    inner = [s.inner_state for s in optim.find_injected(state.opt_state)]
    assert [list(i.state) for i in inner] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    # every entry of both states created by their steps
    assert all(all(made.values()) for i in inner for made in i.created.values())


@pytest.mark.bitwise
def test_trainer_fit_with_a_torch_class_equals_the_hand_loop_on_a_loaded_instance(monkeypatch):
    """The fit loop donates, so from the third step on ``from_torch`` steps the instance the
    step before left loaded; two epochs still end bitwise where a plain PyTorch loop with
    the same optimizer does."""
    import sys

    module = sys.modules["purestep.engine.optim.from_torch"]  # the name is the function
    warm_steps = []
    original = module._warm_step

    def counted(*args):
        out = original(*args)
        warm_steps.append(out is not None)  # None: it declined, the full path ran
        return out

    monkeypatch.setattr(module, "_warm_step", counted)

    opt = functools.partial(torch.optim.Adam, lr=0.02, weight_decay=0.01)
    state = _trainer(max_epochs=2).fit(_net(), _loss, opt, _loader())
    net = _net()
    hand = opt(net.parameters())
    for _ in range(2):
        for batch in _loader():
            hand.zero_grad()
            _loss(net, batch).backward()
            hand.step()
    assert state.progress.step == 8 and sum(warm_steps) == 6  # steps 3 to 8
    for n, p in net.named_parameters():
        assert torch.equal(state.params[n], p.detach()), n
