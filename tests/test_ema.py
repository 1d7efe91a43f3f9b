"""The EMA of the weights: equal to torch's ``AveragedModel`` with the EMA average fed the
same parameters (every n steps, from a start step, with and without warm-up, buffers
too), evaluation with the averaged weights that leaves training untouched, and bad input.
The kill-and-resume case (SWA and EMA together) is in tests/test_swa.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim import swa_utils
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.engine.tree import assert_trees_equal
from purestep.loops import Trainer
from purestep.loops.callbacks import EMA, LambdaCallback


def data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def net(batchnorm=False):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(8, 2))


def loss_fn(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def trainer(**flags):
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("logger", False)
    flags.setdefault("enable_checkpointing", False)
    flags.setdefault("num_sanity_val_steps", 0)
    return Trainer(**flags)


def recorder(seen):
    def end(ctx):
        if ctx.outputs.stepped:
            seen.append(
                (
                    ctx.global_step - 1,
                    {k: v.clone() for k, v in ctx.state.params.items()},
                    {k: v.clone() for k, v in ctx.state.buffers.items()},
                )
            )

    return LambdaCallback(name="recorder", on_train_batch_end=end)


def _load(module, params, buffers):
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(params[name])
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    return module


@pytest.mark.bitwise
@settings(max_examples=6, deadline=None)
@given(
    decay=st.sampled_from([0.5, 0.9, 0.999]),
    every=st.integers(1, 3),
    start=st.integers(0, 4),
    accumulate=st.sampled_from([1, 2]),
)
def test_ema_equals_averaged_model(decay, every, start, accumulate):
    template, seen = net(), []
    ema = EMA(decay=decay, every_n_steps=every, start_step=start)
    tr = trainer(max_epochs=2, accumulate_grad_batches=accumulate, callbacks=[recorder(seen), ema])
    state = tr.fit(
        template, loss_fn, optim.sgd(0.1, momentum=0.9), DataLoader(data(), batch_size=4)
    )
    reference = swa_utils.AveragedModel(
        template, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(decay)
    )
    used = [s for s in seen if s[0] >= start and s[0] % every == 0]
    work = copy.deepcopy(template)
    for _, params, buffers in used:
        reference.update_parameters(_load(work, params, buffers))
    assert state.callbacks[ema.key]["n_averaged"] == len(used)
    if not used:  # no step was due: nothing averaged, the trained weights stay
        assert state.callbacks[ema.key]["average"] is None
        assert_trees_equal(state.params, seen[-1][1])
        return
    for name, p in reference.module.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name  # apply_at_end


@pytest.mark.bitwise
def test_ema_warmup_and_buffers():
    template, seen = net(batchnorm=True), []
    ema = EMA(decay=0.99, warmup=True, use_buffers=True)
    tr = trainer(max_epochs=1, callbacks=[recorder(seen), ema])
    state = tr.fit(template, loss_fn, optim.sgd(0.1), DataLoader(data(), batch_size=4))
    # torch's EMA arithmetic, with the warm-up decay of each update, params and buffers
    avg = None
    for n, (_, params, buffers) in enumerate(seen):
        current = [*params.values(), *buffers.values()]
        if avg is None:
            avg = [t.clone() for t in current]
            continue
        decay = min(0.99, (1 + n) / (10 + n))
        floats = [i for i, t in enumerate(avg) if t.is_floating_point()]
        ints = [i for i, t in enumerate(avg) if not t.is_floating_point()]
        for group in (floats, ints):
            swa_utils.get_ema_multi_avg_fn(decay)(
                [avg[i] for i in group], [current[i] for i in group], None
            )
    names = [*seen[0][1], *seen[0][2]]
    final = {**state.params, **state.buffers}
    for name, want in zip(names, avg):
        assert torch.equal(final[name], want), name
    assert ema.decay_at(0) == min(0.99, 1 / 10) and ema.decay_at(1000) == 0.99


@pytest.mark.bitwise
def test_evaluation_uses_the_average_and_training_is_untouched():
    loader, val = DataLoader(data(), batch_size=4), DataLoader(data(8, 1), batch_size=4)

    def run(callbacks):
        tr = trainer(max_epochs=2, callbacks=callbacks)
        seen = []
        tr.callbacks.append(
            LambdaCallback(
                name="val_params",
                on_validation_batch_start=lambda ctx: seen.append(
                    {k: v.clone() for k, v in ctx.state.params.items()}
                ),
            )
        )
        state = tr.fit(net(), loss_fn, optim.sgd(0.1), loader, val)
        return tr, state, seen

    ema = EMA(decay=0.8, apply_at_end=False)
    tr, state, seen = run([ema])
    _, plain, plain_seen = run([])
    assert_trees_equal(state.params, plain.params)  # swapping in and out changed nothing
    average = state.callbacks[ema.key]["average"]
    assert state.callbacks[ema.key]["stash"] is None
    assert_trees_equal(seen[-1], average)  # the last validation ran with the average
    assert not all(torch.equal(seen[-1][k], plain_seen[-1][k]) for k in average)
    # trainer.validate / test with the fitted state: the averaged weights again
    got = tr.validate(state, val, verbose=False)
    want = tr.validate(state.replace(params=dict(average)), val, verbose=False)
    assert got == want
    assert tr.test(state, val, verbose=False) == tr.test(
        state.replace(params=dict(average)), val, verbose=False
    )
    off = EMA(decay=0.8, evaluate_with_average=False, apply_at_end=False)
    _, _, seen_off = run([off])
    assert_trees_equal(seen_off[-1], plain_seen[-1])


@pytest.mark.bitwise
@pytest.mark.parametrize(
    "accelerator",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_resumed_averages_continue_on_the_parameters_device(tmp_path, accelerator):
    """A checkpoint loads the callbacks' averages on the CPU: the EMA (kept with the
    parameters) and SWA with ``device=None`` move them back, and validation's swapped-in
    weights land on the parameters' device; the resumed run ends bitwise like the
    uninterrupted one."""
    from purestep.loops.callbacks import ModelCheckpoint, StochasticWeightAveraging

    loader, val = DataLoader(data(), batch_size=4), DataLoader(data(8, 1), batch_size=4)

    def run(ckpt_path=None, saver=()):
        callbacks = [
            EMA(decay=0.9, apply_at_end=False),
            StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, device=None),
            *saver,
        ]
        tr = trainer(
            max_epochs=3,
            accelerator=accelerator,
            callbacks=callbacks,
            enable_checkpointing=bool(saver),
        )
        opt = optim.inject_hyperparams(optim.sgd)(lr=0.1)
        return tr.fit(net(), loss_fn, opt, loader, val, ckpt_path=ckpt_path)

    saver = ModelCheckpoint(
        dirpath=str(tmp_path), every_n_train_steps=9, save_top_k=-1, filename="{step}"
    )
    full = run(saver=[saver])
    resumed = run(ckpt_path=str(tmp_path / "step=9.ckpt"))  # epoch 1, both averaging
    assert_trees_equal(resumed.params, full.params)
    for part in ("EMA", "StochasticWeightAveraging"):
        assert_trees_equal(resumed.callbacks[part], full.callbacks[part])
        for k, v in resumed.callbacks[part]["average"].items():
            assert v.device == resumed.params[k].device, (part, k)


def test_parameter_names_with_a_colon_are_kept():
    """Without buffers the average is keyed by the parameters' own names, whatever they are
    (``"p:..."`` is only how averaged buffers and parameters are told apart)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"p:in": nn.Linear(4, 2)})

    def fn(apply, batch):
        x, y = batch
        return F.cross_entropy(apply["p:in"](x), y)

    ema = EMA(decay=0.5)
    state = trainer(max_epochs=1, callbacks=[ema]).fit(
        model, fn, optim.sgd(0.1), DataLoader(data(), batch_size=4)
    )
    assert set(state.callbacks[ema.key]["average"]) == {"p:in.weight", "p:in.bias"}
    assert_trees_equal(state.params, state.callbacks[ema.key]["average"])  # apply_at_end


def test_ema_bad_input():
    for kwargs, match in (
        ({"decay": 1.5}, "decay"),
        ({"decay": True}, "decay"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"start_step": -1}, "start_step"),
    ):
        with pytest.raises(ValueError, match=match):
            EMA(**kwargs)
    with pytest.raises(TypeError, match="warmup"):
        EMA(warmup="yes")


def test_weights_requests_merge_copy_and_refuse_unknown_names():
    from purestep import engine
    from purestep.loops.driver import Driver
    from purestep.loops.events import Requests

    a = Requests(weights={"params": {"x": 1, "y": 2}})
    b = Requests(weights={"params": {"y": 3}, "buffers": {"z": 4}})
    assert (a | b).weights == {"params": {"x": 1, "y": 3}, "buffers": {"z": 4}}
    assert bool(b) and not bool(Requests())
    state = engine.init(net(), optim.sgd(0.1))
    driver = Driver(fn="fit")
    t = torch.full((8,), 2.0)
    new = driver.carry_out(state, Requests(weights={"params": {"0.bias": t}}))
    assert torch.equal(new.params["0.bias"], t) and new.params["0.bias"] is not t
    assert new.params["0.weight"] is state.params["0.weight"]  # the rest untouched
    assert not torch.equal(state.params["0.bias"], t)  # the input state is not written
    with pytest.raises(KeyError, match="does not have"):
        driver.carry_out(state, Requests(weights={"params": {"nope": t}}))
    with pytest.raises(KeyError, match="takes 'params' and 'buffers'"):
        driver.carry_out(state, Requests(weights={"opt_state": {}}))
    for wrong in (torch.zeros(3), torch.zeros(8, dtype=torch.float64), [0.0] * 8):
        with pytest.raises(ValueError, match="'0.bias' as a"):
            driver.carry_out(state, Requests(weights={"params": {"0.bias": wrong}}))
