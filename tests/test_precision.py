import pytest
import torch
import torch.nn.functional as F

from purestep import engine, hardware
from purestep.engine import optim, tree
from tests.helpers import batches, loss_fn, mlp


def _run(precision, n=3, **kwargs):
    net = mlp()
    strategy = hardware.single_device("cpu", precision, **kwargs)
    opt = optim.sgd(0.1)
    state = engine.init(net, opt, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy)
    outs = []
    for batch in batches(n):
        state, out = step(state, batch)
        outs.append(out)
    return state, outs


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("64-true", torch.float64), ("32-true", torch.float32), ("bf16-true", torch.bfloat16)],
)
def test_true_precisions_hold_parameters_in_their_dtype(name, dtype):
    state, outs = _run(name)
    assert {p.dtype for p in state.params.values()} == {dtype}
    assert outs[-1].loss.dtype == dtype
    assert all(torch.isfinite(o.loss) for o in outs)


def test_64_true_converts_floating_inputs_and_keeps_integer_targets():
    seen = {}

    def fn(apply, batch):
        seen["x"], seen["y"] = batch[0].dtype, batch[1].dtype
        return loss_fn(apply, batch)

    net = mlp()
    strategy = hardware.single_device("cpu", 64)
    opt = optim.sgd(0.1)
    engine.train_step(net, fn, opt, strategy=strategy)(
        engine.init(net, opt, strategy=strategy), batches(1)[0]
    )
    assert seen == {"x": torch.float64, "y": torch.int64}


@pytest.mark.parametrize(
    ("name", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)]
)
def test_mixed_precisions_autocast_the_forward_pass_and_keep_float32_parameters(name, dtype):
    seen = {}

    def fn(apply, batch):
        logits = apply(batch[0])
        seen["logits"] = logits.dtype
        return F.cross_entropy(logits, batch[1])

    net = mlp()
    strategy = hardware.single_device("cpu", name)
    opt = optim.sgd(0.1)
    state = engine.init(net, opt, strategy=strategy)
    new, out = engine.train_step(net, fn, opt, strategy=strategy)(state, batches(1)[0])
    assert seen["logits"] == dtype
    assert {p.dtype for p in new.params.values()} == {torch.float32}
    assert out.loss.dtype == torch.float32


@pytest.mark.bitwise
def test_16_mixed_matches_torch_autocast_with_grad_scaler_bitwise():
    engine_net, raw_net = mlp(), mlp()
    strategy = hardware.single_device("cpu", "16-mixed")
    opt = optim.sgd(0.1, momentum=0.9)
    state = engine.init(engine_net, opt, strategy=strategy)
    step = engine.train_step(engine_net, loss_fn, opt, strategy=strategy)
    torch_opt = torch.optim.SGD(raw_net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    scaler = torch.amp.GradScaler("cpu")
    for batch in batches(5):
        state, out = step(state, batch)
        torch_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss, _ = loss_fn(raw_net, batch)
        scaler.scale(loss).backward()
        scaler.step(torch_opt)
        scaler.update()
        assert torch.equal(out.loss, loss.detach())
    tree.assert_trees_equal(state.params, dict(raw_net.named_parameters()))
    assert state.precision.scale == scaler.get_scale()


def test_loss_scaler_skips_non_finite_steps_and_backs_off_then_grows():
    net = mlp()
    scale = engine.DynamicLossScale(init_scale=2.0**10, growth_interval=2)
    strategy = hardware.single_device("cpu", "16-mixed", loss_scale=scale)
    opt = optim.sgd(0.1, momentum=0.9)
    state = engine.init(net, opt, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy)
    x, y = batches(1)[0]
    bad = (torch.full_like(x, float("inf")), y)

    skipped, out = step(state, bad)
    assert out.skipped and out.stepped
    tree.assert_trees_equal(skipped.params, state.params)
    tree.assert_trees_equal(skipped.opt_state, state.opt_state)
    assert skipped.precision.scale == 2.0**9
    assert skipped.progress.step == 1

    s1, out1 = step(skipped, (x, y))
    assert not out1.skipped and s1.precision.growth_tracker == 1
    s2, _ = step(s1, (x, y))
    assert s2.precision.scale == 2.0**10 and s2.precision.growth_tracker == 0
    assert not tree.trees_equal(s2.params, state.params)


def test_loss_scale_policy_is_validated():
    with pytest.raises(ValueError, match="growth_factor"):
        engine.DynamicLossScale(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        engine.DynamicLossScale(backoff_factor=1.5)
    with pytest.raises(ValueError, match="applies to '16-mixed' only"):
        hardware.single_device("cpu", "bf16-mixed", loss_scale=engine.DynamicLossScale())


def test_unknown_precisions_are_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown precision 'fp8'.*64-true"):
        hardware.precision("fp8")


def test_a_device_without_fp16_autocast_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
    with pytest.raises(RuntimeError, match="'16-mixed' is not supported on device type 'cpu'"):
        hardware.single_device("cpu", "16-mixed")


def test_a_scaled_precision_needs_its_state():
    net = mlp()
    strategy = hardware.single_device("cpu", "16-mixed")
    opt = optim.sgd(0.1)
    state = engine.init(net, opt)
    with pytest.raises(ValueError, match="no loss-scaler state"):
        engine.train_step(net, loss_fn, opt, strategy=strategy)(state, batches(1)[0])


def test_aliases_map_to_canonical_names():
    assert hardware.precision(64).name == "64-true"
    assert hardware.precision("32").name == "32-true"
    assert hardware.precision(16).name == "16-mixed"
    assert hardware.precision("bf16").name == "bf16-mixed"


def test_single_device_places_batches_and_reports_identity_collectives():
    s = hardware.single_device("cpu")
    x = torch.ones(2)
    assert s.place(x) is x
    assert s.all_reduce({"a": x})["a"] is x
    assert s.is_primary and s.world_size == 1 and s.rank == 0
    s.barrier()
