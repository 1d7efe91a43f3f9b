"""Edge cases of the train, eval and predict steps found in review.

Gradients that alias each other, constant buffers bound without copying, forward passes
that write parameters or buffers in place, ``grad="func"`` and unused parameters, ``train()``
overrides, and the devices a strategy without one seeds. Run time: about 3 s.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from purestep import engine, hardware
from purestep.engine import optim, tree
from purestep.engine.step import owned_gradients
from tests.helpers import batches, clone_tree, loss_fn

# --------------------------------------------------------------------------- aliasing gradients


class _Sum(nn.Module):
    """``a + b``: autograd hands both parameters the same gradient tensor."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.b = nn.Parameter(torch.tensor([3.0, -1.0]))

    def forward(self, x):
        return ((self.a + self.b) * x).sum()


class _View(nn.Module):
    """``p + q.view(4)``: q's gradient is a view of p's (another object, the same storage)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0]))
        self.q = nn.Parameter(torch.tensor([[0.25, 1.0], [-1.0, 2.0]]))

    def forward(self, x):
        return ((self.p + self.q.view(4)) * x).sum()


class _Summed(nn.Module):
    """``w.sum()``: w's gradient is an expanded tensor with stride 0."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
        self.v = nn.Parameter(torch.tensor([0.5, 1.5, -1.0, 2.0]))

    def forward(self, x):
        return self.w.sum() * x.sum() + (self.v * x).pow(2).sum()


_X = {_Sum: torch.tensor([0.5, 4.0]), _View: torch.tensor([0.5, 4.0, -1.0, 2.0])}
_X[_Summed] = _X[_View]


def _apply(apply, x):
    return apply(x)


def _torch_run(cls, make_opt, steps):
    ref = cls()
    opt = make_opt(list(ref.parameters()))
    for _ in range(steps):
        opt.zero_grad()
        ref(_X[cls]).backward()
        opt.step()
    return {n: p.detach() for n, p in ref.named_parameters()}


def test_autograd_really_hands_out_aliasing_gradients():
    """The premise of the fix: without it these models train wrong (see the tests below)."""
    m = _Sum()
    ga, gb = torch.autograd.grad(m(_X[_Sum]), [m.a, m.b])
    assert ga is gb
    m = _View()
    gp, gq = torch.autograd.grad(m(_X[_View]), [m.p, m.q])
    assert gp is not gq and gp.untyped_storage().data_ptr() == gq.untyped_storage().data_ptr()
    m = _Summed()
    gw, _ = torch.autograd.grad(m(_X[_Summed]), [m.w, m.v])
    assert gw.stride() == (0,)


@pytest.mark.parametrize("cls", [_Sum, _View, _Summed])
@pytest.mark.parametrize("grad", ["autograd", "func"])
@pytest.mark.bitwise
def test_adam_on_aliasing_gradients_equals_torch_adam_bitwise(cls, grad):
    opt = optim.adam(0.1, weight_decay=0.01)
    state = engine.init(cls(), opt)
    step = engine.train_step(cls(), _apply, opt, grad=grad)
    for _ in range(3):
        state, _ = step(state, _X[cls])
    expected = _torch_run(
        cls, lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01, foreach=True), 3
    )
    tree.assert_trees_equal(state.params, expected)


@pytest.mark.parametrize("cls", [_Sum, _View, _Summed])
@pytest.mark.bitwise
def test_sgd_momentum_with_donation_keeps_one_buffer_per_parameter(cls):
    opt = optim.sgd(0.1, momentum=0.9)
    state = engine.init(cls(), opt)
    step = engine.train_step(cls(), _apply, opt, donate=True)
    for _ in range(3):
        state, _ = step(state, _X[cls])
    buffers = list(state.opt_state.momentum_buffer.values())
    storages = {b.untyped_storage().data_ptr() for b in buffers}
    assert len(storages) == len(buffers)
    expected = _torch_run(
        cls, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True), 3
    )
    tree.assert_trees_equal(state.params, expected)


@pytest.mark.bitwise
def test_16_mixed_unscales_aliasing_gradients_once():
    """The scale is a power of two and nothing here autocasts: SGD must match float32 torch."""
    strategy = hardware.single_device("cpu", "16-mixed")
    opt = optim.sgd(0.1)
    state = engine.init(_Sum(), opt, strategy=strategy)
    step = engine.train_step(_Sum(), _apply, opt, strategy=strategy)
    for _ in range(3):
        state, out = step(state, _X[_Sum])
        assert not out.skipped
    expected = _torch_run(_Sum, lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True), 3)
    tree.assert_trees_equal(state.params, expected)


@pytest.mark.parametrize("grad", ["autograd", "func"])
def test_ensemble_members_on_aliasing_gradients_equal_torch_adam(grad):
    ens = hardware.ensemble(2)
    opt = optim.adam(0.1)
    state = engine.init(_Sum(), opt, strategy=ens)
    step = engine.train_step(_Sum(), _apply, opt, strategy=ens, grad=grad)
    for _ in range(3):
        state, _ = step(state, _X[_Sum])
    expected = _torch_run(_Sum, lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True), 3)
    # An ensemble member against a separate torch run: batched kernels promise no order of
    # accumulation, so a tolerance (tests/test_ensemble.py says why), not bitwise.
    for i in range(2):
        tree.assert_trees_close(hardware.member(state, i).params, expected, rtol=1e-5, atol=1e-6)


# Each gradient is made as: a fresh tensor, one of the earlier ones again, a view of an
# earlier one's storage, an expanded scalar (stride 0), or a transposed fresh tensor.
_KINDS = st.lists(
    st.tuples(
        st.sampled_from(["fresh", "same", "view", "expand", "transposed"]), st.integers(0, 9)
    ),
    min_size=1,
    max_size=6,
)


def _gradients_of(kinds):
    grads, g = {}, torch.Generator().manual_seed(0)
    for i, (kind, j) in enumerate(kinds):
        earlier = list(grads.values())
        if kind == "same" and earlier:
            t = earlier[j % len(earlier)]
        elif kind == "view" and earlier:
            t = earlier[j % len(earlier)].reshape(-1)[:2]
        elif kind == "expand":
            t = torch.randn((), generator=g).expand(3, 2)
        elif kind == "transposed":
            t = torch.randn(2, 3, generator=g).t()
        else:
            t = torch.randn(3, 2, generator=g)
        grads[f"g{i}"] = t
    return grads


def _writes_stay_separate(out):
    """Writing each output in place changes no other output (what the optimizer relies on)."""
    before = {n: t.clone() for n, t in out.items()}
    separate = True
    for name, t in out.items():
        t.neg_()
        for other, u in out.items():
            expected = -before[other] if other == name else before[other]
            separate = separate and torch.equal(u, expected)
        t.neg_()  # exact: the inputs are left as they were
    return separate


@given(_KINDS)
def test_owned_gradients_are_separate_dense_equal_and_copied_only_when_needed(kinds):
    grads = _gradients_of(kinds)
    values = {n: t.clone() for n, t in grads.items()}
    for contiguous in (False, True):
        out = owned_gradients(dict(grads), contiguous=contiguous)
        assert list(out) == list(grads)
        tree.assert_trees_equal(out, values)
        assert _writes_stay_separate(out)
        if contiguous:
            assert all(t.is_contiguous() for t in out.values())
        seen = set()
        for name, t in grads.items():
            storage = t.untyped_storage().data_ptr()
            fine = storage not in seen and (
                t.is_contiguous() or (not contiguous and 0 not in t.stride())
            )
            if fine:
                assert out[name] is t  # nothing copied that did not need it
                seen.add(storage)


# --------------------------------------------------------------------------- constant buffers


class _MaskedNet(nn.Module):
    """A constant mask buffer next to BatchNorm, whose statistics the forward pass updates."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)), persistent=False)

    def forward(self, x):
        return self.head(self.bn(self.fc(x) @ self.mask))


@pytest.mark.parametrize("grad", ["autograd", "func"])
@pytest.mark.bitwise
def test_constant_buffers_are_bound_uncopied_and_results_match_pytorch(grad):
    net, raw = _MaskedNet(), _MaskedNet()
    opt = optim.sgd(0.1, momentum=0.9)
    state = engine.init(net, opt)
    step = engine.train_step(net, loss_fn, opt, grad=grad)
    torch_opt = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9, foreach=True)
    for i, batch in enumerate(batches(4)):
        snapshot = clone_tree(state)
        new, _ = step(state, batch)
        tree.assert_trees_equal(state, snapshot)  # purity holds
        if i > 0:  # learnt on the first call: the mask is bound as it is, BatchNorm's copied
            assert new.buffers["mask"] is state.buffers["mask"]
            assert new.buffers["bn.running_mean"] is not state.buffers["bn.running_mean"]
        state = new
        torch_opt.zero_grad()
        loss_fn(raw, batch)[0].backward()
        torch_opt.step()
    tree.assert_trees_equal(state.params, dict(raw.named_parameters()))
    tree.assert_trees_equal(state.buffers, dict(raw.named_buffers()))


class _HandNorm(nn.Module):
    """Running statistics updated by ``F.batch_norm`` in a module that is not a norm layer:
    the kernel writes them without moving their version counter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, x):
        return self.fc(F.batch_norm(x, self.mean, self.var, training=True))


def test_buffers_written_without_a_version_bump_are_still_copied():
    net = _HandNorm()
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    step = engine.train_step(net, loss_fn, opt)
    for batch in batches(3):
        snapshot = clone_tree(state)
        new, _ = step(state, batch)
        tree.assert_trees_equal(state, snapshot)
        assert not torch.equal(new.buffers["mean"], state.buffers["mean"])
        state = new


def test_norm_layer_statistics_are_copied_even_when_the_first_call_leaves_them_equal():
    """A first batch with mean 0 and variance 1 leaves cumulative running statistics as they
    were; later batches change them, and the batch-norm kernel moves no version counter."""
    net = nn.Sequential(nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 3))
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    step = engine.train_step(net, loss_fn, opt)
    first = torch.tensor([1.0, -1.0, 0.0]).repeat(8, 1).t().contiguous()
    data = [(first, torch.tensor([0, 1, 2])), *batches(2)]
    for i, batch in enumerate(data):
        snapshot = clone_tree(state)
        new, _ = step(state, batch)
        tree.assert_trees_equal(state, snapshot)
        same = torch.equal(new.buffers["0.running_var"], state.buffers["0.running_var"])
        assert same == (i == 0)
        state = new


class _LateWriter(nn.Module):
    """Writes its buffer in place once ``write`` is set (and replaces another every time)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("offset", torch.zeros(3))
        self.write = False

    def forward(self, x):
        self.offset = self.offset + 0.0
        if self.write:
            self.scale.mul_(0.5)
        return self.fc(x) * self.scale + self.offset


@pytest.mark.parametrize("grad", ["autograd", "func"])
def test_a_buffer_written_only_on_a_later_call_is_restored_and_refused(grad):
    net = _LateWriter()
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    step = engine.train_step(net, loss_fn, opt, grad=grad)
    data = batches(2)
    state, _ = step(state, data[0])
    net.write = True
    snapshot = clone_tree(state)
    with pytest.raises(RuntimeError, match=r"modified buffers \['scale'\].*restored"):
        step(state, data[1])
    tree.assert_trees_equal(state, snapshot)  # nothing lost
    # The step copies the buffer from now on: the same call now succeeds and stays pure.
    new, _ = step(state, data[1])
    tree.assert_trees_equal(state, snapshot)
    assert torch.equal(new.buffers["scale"], torch.full((3,), 0.5))


def test_the_ensemble_step_learns_its_buffers_too():
    ens = hardware.ensemble(2)
    opt = optim.sgd(0.1)
    net = _LateWriter()
    state = engine.init(net, opt, strategy=ens)
    step = engine.train_step(net, loss_fn, opt, strategy=ens)
    data = batches(2)
    state, _ = step(state, data[0])
    net.write = True
    snapshot = clone_tree(state)
    with pytest.raises(RuntimeError, match=r"modified buffers \['scale'\]"):
        step(state, data[1])
    tree.assert_trees_equal(state, snapshot)


# --------------------------------------------------------------------------- parameters written


class _Clamp(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([5.0, -5.0, 0.5]))

    def forward(self, x):
        with torch.no_grad():
            self.w.clamp_(-1, 1)
        return (x @ torch.ones(8, 3)) * self.w


_PARAM_ERROR = r"modified parameters \['w'\] in place"


@pytest.mark.parametrize("grad", ["autograd", "func"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_forward_pass_that_writes_a_parameter_is_refused_in_training(grad, donate):
    opt = optim.sgd(0.1)
    step = engine.train_step(_Clamp(), loss_fn, opt, grad=grad, donate=donate)
    with pytest.raises(RuntimeError, match=_PARAM_ERROR):
        step(engine.init(_Clamp(), opt), batches(1)[0])


def test_a_forward_pass_that_writes_a_parameter_is_refused_in_eval_and_predict():
    state = engine.init(_Clamp(), optim.sgd(0.1))
    with pytest.raises(RuntimeError, match=_PARAM_ERROR):
        engine.eval_step(_Clamp(), loss_fn)(state, batches(1)[0])
    with pytest.raises(RuntimeError, match=_PARAM_ERROR):
        engine.predict_step(_Clamp(), lambda apply, b: apply(b[0]))(state, batches(1)[0])


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_a_forward_pass_that_writes_a_parameter_is_refused_in_ensembles_and_per_sample():
    ens = hardware.ensemble(2)
    opt = optim.sgd(0.1)
    state = engine.init(_Clamp(), opt, strategy=ens)
    for grad in ("autograd", "func"):
        with pytest.raises(RuntimeError, match=_PARAM_ERROR):
            engine.train_step(_Clamp(), loss_fn, opt, strategy=ens, grad=grad)(state, batches(1)[0])
    with pytest.raises(RuntimeError, match=_PARAM_ERROR):
        engine.eval_step(_Clamp(), loss_fn, strategy=ens)(state, batches(1)[0])
    step = engine.per_sample_step(_Clamp(), loss_fn, opt, max_grad_norm=1.0, noise_multiplier=0)
    with pytest.raises(RuntimeError, match=_PARAM_ERROR):
        step(engine.init(_Clamp(), opt), batches(1)[0])


# --------------------------------------------------------------------------- unused parameters


class _OneUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 3)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("ensemble", [False, True])
def test_func_gradients_refuse_unused_parameters_like_autograd(ensemble):
    strategy = hardware.ensemble(2) if ensemble else None
    opt = optim.sgd(0.1)
    state = engine.init(_OneUnused(), opt, strategy=strategy)
    step = engine.train_step(_OneUnused(), loss_fn, opt, grad="func", strategy=strategy)
    with pytest.raises(RuntimeError, match=r"\['unused.weight', 'unused.bias'\] received no"):
        step(state, batches(1)[0])
    allowed = engine.train_step(
        _OneUnused(), loss_fn, opt, grad="func", allow_unused=True, strategy=strategy
    )
    autograd = engine.train_step(_OneUnused(), loss_fn, opt, allow_unused=True, strategy=strategy)
    batch = batches(1)[0]
    tree.assert_trees_equal(allowed(state, batch), autograd(state, batch))


# --------------------------------------------------------------------------- train() overrides


class _FrozenNorm(nn.Module):
    """The fine-tuning idiom: ``train()`` keeps the BatchNorm in eval mode."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)
        self.bn.running_mean.fill_(0.5)

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x):
        return self.head(self.bn(self.fc(x)))


@pytest.mark.parametrize("template_mode", ["train", "eval"])
@pytest.mark.bitwise
def test_train_overrides_are_respected_and_the_template_restored(template_mode):
    net, raw = _FrozenNorm(), _FrozenNorm()
    getattr(net, template_mode)()
    flags = [m.training for m in net.modules()]
    raw.train()
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    step = engine.train_step(net, loss_fn, opt)
    torch_opt = torch.optim.SGD(raw.parameters(), lr=0.1, foreach=True)
    for batch in batches(3):
        state, _ = step(state, batch)
        torch_opt.zero_grad()
        loss_fn(raw, batch)[0].backward()
        torch_opt.step()
    assert torch.equal(state.buffers["bn.running_mean"], torch.full((8,), 0.5))
    tree.assert_trees_equal(state.params, dict(raw.named_parameters()))
    engine.eval_step(net, loss_fn)(state, batches(1)[0])
    assert [m.training for m in net.modules()] == flags


# --------------------------------------------------------------------------- devices to seed


def test_a_strategy_without_a_device_seeds_the_devices_the_state_lives_on():
    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")
    assert engine.Local().rng_devices() == ()
    assert engine.Local().rng_devices([cpu, cpu]) == ()
    assert engine.Local().rng_devices([cpu, meta, meta]) == (torch.device("meta"),)
    on_cpu = hardware.single_device("cpu")
    assert on_cpu.rng_devices([meta]) == ()
    assert hardware.ensemble(2).rng_devices([meta]) == (torch.device("meta"),)


def test_steps_take_their_devices_from_the_first_state():
    seen = []

    class Recording(engine.Local):
        def rng_devices(self, tensors=()):
            seen.append([t.device.type for t in tensors])
            return super().rng_devices(tensors)

    net = _OneUnused()
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    step = engine.train_step(net, loss_fn, opt, strategy=Recording(), allow_unused=True)
    for batch in batches(2):
        state, _ = step(state, batch)
    engine.eval_step(net, loss_fn, strategy=Recording())(state, batches(1)[0])
    # once per step, on its first call, with the first state's params
    assert seen == [["cpu"] * 4, ["cpu"] * 4]


def test_the_step_api_is_exported():
    for name in ("TrainStep", "Gradients", "EvalStep", "PredictStep", "batch_size"):
        assert getattr(engine, name) is getattr(engine.step, name)
    assert not hasattr(engine.Strategy, "wrap_step")


@pytest.mark.bitwise
def test_scalar_gradients_equal_the_public_api_bitwise():
    from purestep.engine.step import scalar_gradients

    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    unused = torch.randn(2, requires_grad=True)
    x = torch.randn(4, 5)

    def loss():
        return ((x @ w + b).relu() ** 2).mean()

    ours = scalar_gradients(loss(), (w, b, unused))
    public = torch.autograd.grad(loss(), (w, b, unused), allow_unused=True)
    assert ours[2] is None and public[2] is None
    tree.assert_trees_equal(list(ours[:2]), list(public[:2]))
