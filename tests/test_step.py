import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from purestep import engine
from purestep.engine import optim, tree
from tests.helpers import batches, clone_tree, digest, loss_fn, mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state_and_step(dropout=0.5, batchnorm=True, **kwargs):
    net = mlp(dropout=dropout, batchnorm=batchnorm)
    opt = optim.adam(1e-2)
    return net, engine.init(net, opt, seed=0), engine.train_step(net, loss_fn, opt, **kwargs)


# ------------------------------------------------------------------ purity and determinism


@pytest.mark.parametrize("grad", ["autograd", "func"])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.bitwise
def test_step_leaves_every_leaf_of_the_input_state_bitwise_unchanged(grad, accumulate):
    _, state, step = _state_and_step(grad=grad, accumulate=accumulate)
    for batch in batches(4):
        snapshot = clone_tree(state)
        new_state, _ = step(state, batch)
        tree.assert_trees_equal(state, snapshot)
        state = new_state


@pytest.mark.bitwise
def test_same_state_and_batch_give_bitwise_identical_results_twice():
    _, state, step = _state_and_step()
    batch = batches(1)[0]
    a = step(state, batch)
    b = step(state, batch)
    tree.assert_trees_equal(a, b)


def test_step_does_not_touch_the_callers_global_rng():
    _, state, step = _state_and_step()
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    step(state, batches(1)[0])
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.bitwise
def test_dropout_masks_depend_on_the_step_key_only():
    _, state, step = _state_and_step(batchnorm=False)
    batch = batches(1)[0]
    s1, out1 = step(state, batch)
    # A different run key gives different masks (so a different loss on the same params).
    _, out_other = step(state.replace(rng=engine.rng.key(1)), batch)
    assert not torch.equal(out1.loss, out_other.loss)
    # The next optimizer step uses a new key, even on the same parameters.
    _, out_next = step(s1.replace(params=state.params, opt_state=state.opt_state), batch)
    assert not torch.equal(out1.loss, out_next.loss)


_DIGEST_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from purestep import engine
from purestep.engine import optim
from tests.helpers import batches, digest, loss_fn, mlp
net = mlp(dropout=0.5, batchnorm=True)
opt = optim.adam(1e-2)
state = engine.init(net, opt, seed=0)
step = engine.train_step(net, loss_fn, opt)
for batch in batches(3):
    state, out = step(state, batch)
print(digest((state, out)))
"""


@pytest.mark.bitwise
def test_results_are_bitwise_identical_in_a_separate_process():
    net = mlp(dropout=0.5, batchnorm=True)
    opt = optim.adam(1e-2)
    state = engine.init(net, opt, seed=0)
    step = engine.train_step(net, loss_fn, opt)
    for batch in batches(3):
        state, out = step(state, batch)
    script = _DIGEST_SCRIPT.format(root=ROOT)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == digest((state, out))


def test_the_template_module_is_never_mutated():
    net, state, step = _state_and_step()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    modes = [m.training for m in net.modules()]
    net.eval()
    eval_modes = [m.training for m in net.modules()]
    for batch in batches(3):
        state, _ = step(state, batch)
    engine.eval_step(net, loss_fn)(state, batches(1)[0])
    assert [m.training for m in net.modules()] == eval_modes
    net.train()
    assert [m.training for m in net.modules()] == modes
    tree.assert_trees_equal(dict(net.state_dict()), before)
    assert all(p.grad is None for p in net.parameters())


# ------------------------------------------------------------------ parity with plain PyTorch


@pytest.mark.bitwise
def test_matches_a_hand_written_pytorch_loop_bitwise():
    """SGD with momentum and BatchNorm: params and running stats equal a plain loop's."""
    engine_net = mlp(batchnorm=True)
    raw_net = mlp(batchnorm=True)
    opt = optim.sgd(0.1, momentum=0.9)
    state = engine.init(engine_net, opt)
    step = engine.train_step(engine_net, loss_fn, opt)
    torch_opt = torch.optim.SGD(raw_net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    for batch in batches(10):
        state, out = step(state, batch)
        torch_opt.zero_grad()
        loss, _ = loss_fn(raw_net, batch)
        loss.backward()
        torch_opt.step()
        assert torch.equal(out.loss, loss.detach())
    tree.assert_trees_equal(state.params, dict(raw_net.named_parameters()))
    tree.assert_trees_equal(state.buffers, dict(raw_net.named_buffers()))


@pytest.mark.bitwise
def test_gradient_accumulation_matches_a_hand_written_loop_bitwise():
    engine_net, raw_net = mlp(), mlp()
    opt = optim.sgd(0.1)
    state = engine.init(engine_net, opt)
    step = engine.train_step(engine_net, loss_fn, opt, accumulate=3)
    torch_opt = torch.optim.SGD(raw_net.parameters(), lr=0.1, foreach=True)
    data = batches(7)
    for i, batch in enumerate(data):
        last = i == len(data) - 1
        state, out = step(state, batch, end_window=True if last else None)
        (loss_fn(raw_net, batch)[0] / 3).backward()
        if (i + 1) % 3 == 0 or last:
            torch_opt.step()
            torch_opt.zero_grad()
        assert out.stepped == ((i + 1) % 3 == 0 or last)
    tree.assert_trees_equal(state.params, dict(raw_net.named_parameters()))
    assert state.progress.step == 3
    assert state.progress.total_batches == 7
    assert state.progress.micro_step == 0
    assert state.grad_accum is None


def test_accumulation_schedule_is_a_function_of_progress():
    _, state, step = _state_and_step(accumulate=lambda p: 1 if p.step < 2 else 2)
    stepped = []
    for batch in batches(6):
        state, out = step(state, batch)
        stepped.append(out.stepped)
    assert stepped == [True, True, False, True, False, True]
    _, state, bad = _state_and_step(accumulate=lambda p: 0)
    with pytest.raises(ValueError, match="accumulation schedule returned 0"):
        bad(state, batches(1)[0])


@pytest.mark.bitwise
def test_backward_then_apply_is_the_same_step_and_exposes_the_gradients():
    net, state, step = _state_and_step(dropout=0.0, batchnorm=False)
    batch = batches(1)[0]
    whole = step(state, batch)
    half, grads = step.backward(state, batch)
    assert grads.ready and grads.finite
    assert half.progress.step == 0
    loss, _ = loss_fn(net, batch)
    loss.backward()
    tree.assert_trees_equal(grads.grads, {n: p.grad for n, p in net.named_parameters()})
    tree.assert_trees_equal(step.apply(half, grads), whole)
    _, _, acc_step = _state_and_step(dropout=0.0, batchnorm=False, accumulate=2)
    opened, pending = acc_step.backward(state, batch)
    assert not pending.ready and opened.progress.micro_step == 1
    with pytest.raises(ValueError, match="not ready"):
        acc_step.apply(opened, pending)


@pytest.mark.bitwise
def test_func_gradients_equal_autograd_gradients_bitwise():
    _, state, step = _state_and_step()
    _, _, step_func = _state_and_step(grad="func")
    for batch in batches(3):
        a, out_a = step(state, batch)
        b, out_b = step_func(state, batch)
        tree.assert_trees_equal((a, out_a), (b, out_b))
        state = a


@pytest.mark.bitwise
def test_donation_gives_the_same_result_and_reuses_storage():
    _, state, step = _state_and_step()
    _, _, donating = _state_and_step(donate=True)
    data = batches(4)
    plain = state
    for batch in data:
        plain, _ = step(plain, batch)
    donated = clone_tree(state)
    for batch in data:
        before = {n: p.data_ptr() for n, p in donated.params.items()}
        donated, _ = donating(donated, batch)
        assert {n: p.data_ptr() for n, p in donated.params.items()} == before
    tree.assert_trees_equal(plain, donated)


# ------------------------------------------------------------------ state bookkeeping


def test_batchnorm_statistics_come_back_in_the_new_state_only():
    _, state, step = _state_and_step(dropout=0.0)
    before = clone_tree(state.buffers)
    new, _ = step(state, batches(1)[0])
    tree.assert_trees_equal(state.buffers, before)
    assert int(new.buffers["1.num_batches_tracked"]) == 1
    assert not torch.equal(new.buffers["1.running_mean"], before["1.running_mean"])


def test_progress_counts_steps_batches_and_samples():
    _, state, step = _state_and_step()
    for batch in batches(5, size=4):
        state, _ = step(state, batch)
    p = state.progress
    assert (p.step, p.batch_in_epoch, p.total_batches, p.samples) == (5, 5, 5, 20)


def test_output_carries_loss_metrics_and_gradient_norm():
    net, state, step = _state_and_step(dropout=0.0, batchnorm=False)
    batch = batches(1)[0]
    _, out = step(state, batch)
    loss, metrics = loss_fn(net, batch)
    loss.backward()
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
    assert torch.equal(out.loss, loss.detach())
    assert torch.equal(out.metrics["acc"], metrics["acc"])
    assert torch.equal(out.grad_norm, expected_norm)
    assert out.stepped and not out.skipped
    assert not out.loss.requires_grad


def test_frozen_parameters_stay_fixed_and_have_no_optimizer_state():
    net = mlp()
    net[0].weight.requires_grad_(False)
    opt = optim.sgd(0.1, momentum=0.9)
    state = engine.init(net, opt)
    assert all("0.weight" not in path for path, _ in tree.flatten_with_paths(state.opt_state))
    step = engine.train_step(net, loss_fn, opt)
    new, _ = step(state, batches(1)[0])
    assert torch.equal(new.params["0.weight"], state.params["0.weight"])
    assert not torch.equal(new.params["0.bias"], state.params["0.bias"])


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x):
        return self.used(self.body(x))


def test_unused_parameters_are_a_clear_error_unless_allowed():
    net = _TwoHeads()
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    with pytest.raises(RuntimeError, match=r"unused\.weight.*requires_grad_\(False\)"):
        engine.train_step(net, loss_fn, opt)(state, batches(1)[0])
    new, _ = engine.train_step(net, loss_fn, opt, allow_unused=True)(state, batches(1)[0])
    assert torch.equal(new.params["unused.weight"], state.params["unused.weight"])


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.b(torch.relu(self.a(x))))


@pytest.mark.bitwise
def test_tied_weights_are_one_parameter_and_match_pytorch():
    engine_net, raw_net = _Tied(), _Tied()
    raw_net.load_state_dict(engine_net.state_dict())
    opt = optim.sgd(0.1)
    state = engine.init(engine_net, opt)
    assert sorted(state.params) == ["a.weight", "head.bias", "head.weight"]
    step = engine.train_step(engine_net, loss_fn, opt)
    torch_opt = torch.optim.SGD(raw_net.parameters(), lr=0.1, foreach=True)
    for batch in batches(3):
        state, _ = step(state, batch)
        torch_opt.zero_grad()
        loss_fn(raw_net, batch)[0].backward()
        torch_opt.step()
    tree.assert_trees_equal(state.params, dict(raw_net.named_parameters()))


# ------------------------------------------------------------------ loss function contract


@pytest.mark.parametrize(
    "fn",
    [
        lambda apply, b: F.cross_entropy(apply(b[0]), b[1]),
        lambda apply, b: (F.cross_entropy(apply(b[0]), b[1]), {}),
        lambda apply, b: {"loss": F.cross_entropy(apply(b[0]), b[1]), "n": torch.tensor(1.0)},
    ],
)
def test_loss_functions_may_return_a_loss_a_pair_or_a_dict(fn):
    net = mlp()
    opt = optim.sgd(0.1)
    _, out = engine.train_step(net, fn, opt)(engine.init(net, opt), batches(1)[0])
    assert out.loss.dim() == 0


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda apply, b: [apply(b[0]).sum()], "must return a scalar loss"),
        (lambda apply, b: apply(b[0]).sum(-1), "the loss must be a scalar"),
        (lambda apply, b: apply(b[0]).sum().detach(), "does not depend on any trainable"),
        (lambda apply, b: (apply(b[0]).sum(), [1]), "metrics of \\(loss, metrics\\)"),
    ],
)
def test_bad_loss_functions_get_clear_errors(fn, message):
    net = mlp()
    opt = optim.sgd(0.1)
    with pytest.raises((TypeError, ValueError, RuntimeError), match=message):
        engine.train_step(net, fn, opt)(engine.init(net, opt), batches(1)[0])


def test_bad_arguments_and_mismatched_states_are_refused():
    net = mlp()
    opt = optim.sgd(0.1)
    with pytest.raises(ValueError, match="grad must be"):
        engine.train_step(net, loss_fn, opt, grad="jax")
    with pytest.raises(ValueError, match="accumulate must be"):
        engine.train_step(net, loss_fn, opt, accumulate=0)
    with pytest.raises(TypeError, match="GradientTransformation"):
        engine.train_step(net, loss_fn, torch.optim.SGD(net.parameters(), lr=0.1))
    other = engine.init(mlp(batchnorm=True), opt)
    with pytest.raises(KeyError, match="do not match the model template"):
        engine.train_step(net, loss_fn, opt)(other, batches(1)[0])


# ------------------------------------------------------------------ eval and predict


def test_eval_step_runs_in_eval_mode_without_gradients():
    net = mlp(dropout=0.5, batchnorm=True)
    opt = optim.sgd(0.1)
    state, _ = engine.train_step(net, loss_fn, opt)(engine.init(net, opt), batches(1)[0])
    batch = batches(1, seed=1)[0]
    metrics = engine.eval_step(net, loss_fn)(state, batch)
    reference = mlp(dropout=0.5, batchnorm=True)
    reference.load_state_dict({**state.params, **state.buffers})
    reference.eval()
    with torch.no_grad():
        loss, extra = loss_fn(reference, batch)
    assert torch.equal(metrics["loss"], loss)
    assert torch.equal(metrics["acc"], extra["acc"])
    assert not metrics["loss"].requires_grad


def test_eval_step_accepts_a_dict_of_metrics_and_predict_defaults_to_apply():
    net = mlp()
    state = engine.init(net, optim.sgd(0.1))
    x, y = batches(1)[0]
    out = engine.eval_step(net, lambda apply, b: {"mse": apply(b[0]).pow(2).mean()})(state, (x, y))
    assert set(out) == {"mse"}
    prediction = engine.predict_step(net)(state, x)
    with torch.no_grad():
        assert torch.equal(prediction, net(x))


class _MutatesInEval(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x)


def test_eval_step_refuses_a_model_that_mutates_buffers_in_eval_mode():
    net = _MutatesInEval()
    state = engine.init(net, optim.sgd(0.1))
    with pytest.raises(RuntimeError, match=r"modified buffers \['calls'\]"):
        engine.eval_step(net, loss_fn)(state, batches(1)[0])


# ------------------------------------------------------------------ templates on meta


def test_a_meta_template_is_materialised_from_the_seed():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = optim.sgd(0.1)
    a = engine.init(net, opt, seed=1)
    b = engine.init(net, opt, seed=1)
    c = engine.init(net, opt, seed=2)
    tree.assert_trees_equal(a.params, b.params)
    assert not tree.trees_equal(a.params, c.params)
    assert all(p.device.type == "cpu" for p in a.params.values())
    assert all(p.is_meta for p in net.parameters())
    new, out = engine.train_step(net, loss_fn, opt)(a, batches(1)[0])
    assert torch.isfinite(out.loss)
    assert not tree.trees_equal(new.params, a.params)
