"""Fit donating its own state to the step (``FitLoop(donate=True)``, ``Trainer(donate_state)``):
bitwise the same results, the caller's state never written, the storage really reused, and
the exception paths — latest state for the handlers, nothing saved from a torn state, Ctrl-C
held back until an in-place update is whole."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import engine, hardware
from purestep.engine import optim, tree
from purestep.engine.tree import assert_trees_equal
from purestep.loops import Trainer, fit
from purestep.loops.callbacks import LambdaCallback, ModelCheckpoint
from purestep.loops.config import LoopConfig
from purestep.loops.interrupts import InterruptGuard
from purestep.loops.loggers import MemoryLogger

pytestmark = pytest.mark.bitwise

# --------------------------------------------------------------------------- helpers


def loader(n=24, batch_size=4):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def net(norm=False, dropout=0.0):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8)]
    if norm:
        layers.append(nn.BatchNorm1d(8))
    layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def loss_fn(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def trainer(**flags):
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("enable_checkpointing", False)
    flags.setdefault("logger", MemoryLogger())
    flags.setdefault("max_epochs", 2)
    return Trainer(**flags)


def hook_after(tx, hook):
    """``tx`` followed by a transform that calls ``hook(count)`` and passes the updates on
    (``tx``'s in-place writes under donation have happened by then)."""

    def init(params):
        return torch.zeros((), dtype=torch.int64)

    def update(updates, count, params=None):
        hook(int(count))
        return updates, count + 1

    return optim.chain(tx, optim.GradientTransformation(init, update))


def needs_default_sigint():
    """Skip unless Python's default SIGINT handler is in place (the guard installs over it)."""
    guard = InterruptGuard()
    if not guard.install():
        pytest.skip("SIGINT is not Python's default handler here")
    guard.uninstall()


def sigint_at(count):
    """A ``hook_after`` hook that sends this process SIGINT at update ``count``."""

    def hook(n):
        if n == count:
            signal.raise_signal(signal.SIGINT)

    return hook


def clone(state):
    return tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize(
    "model, flags",
    [
        (dict(norm=True, dropout=0.3), {}),
        (dict(), {"accumulate_grad_batches": 2}),
        (dict(norm=True), {"gradient_clip_val": 0.5, "accumulate_grad_batches": {0: 1, 1: 3}}),
        (dict(dropout=0.2), {"strategy": "ensemble"}),
        (dict(), {"strategy": "ensemble-lr-sweep"}),
    ],
    ids=[
        "batchnorm-dropout",
        "accumulation",
        "clipping-accumulation-schedule",
        "ensemble",
        "ensemble-lr-sweep",
    ],
)
def test_donated_fit_is_bitwise_the_immutable_one(model, flags):
    opt = optim.adam(1e-2)
    if flags.get("strategy") == "ensemble":
        flags = {**flags, "strategy": hardware.ensemble(3)}
    elif flags.get("strategy") == "ensemble-lr-sweep":
        flags = {**flags, "strategy": hardware.ensemble(3, hparams={"lr": [1e-3, 1e-2, 3e-2]})}
        opt = optim.inject_hyperparams(optim.adam)(lr=1e-3)
    runs = {}
    for donate in (False, True):
        logger = MemoryLogger()
        t = trainer(donate_state=donate, logger=logger, **flags)
        state = t.fit(net(**model), loss_fn, opt, loader(), loader(8))
        runs[donate] = (state, logger.metrics)
    assert_trees_equal(runs[True][0], runs[False][0])
    assert [(s, sorted(m)) for s, m in runs[True][1]] == [(s, sorted(m)) for s, m in runs[False][1]]
    for (_, a), (_, b) in zip(runs[True][1], runs[False][1]):
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def test_donated_fit_never_writes_the_callers_state():
    model = net(norm=True)
    opt = optim.adam(1e-2)
    state = engine.init(model, opt, seed=3)
    before = clone(state)
    step = engine.train_step(model, loss_fn, opt)
    out = fit(state, step, loader(), donate=True, config=LoopConfig.create(max_epochs=2))
    assert out.progress.step == 12
    assert_trees_equal(state, before)
    # and the Trainer, given a state to continue from
    state = engine.init(model, opt, seed=3)
    trainer(donate_state=True).fit(model, loss_fn, opt, loader(), state=state)
    assert_trees_equal(state, before)


@pytest.mark.parametrize("donate", [False, True])
def test_donation_reuses_the_parameters_storage(donate):
    """From the second update on, a donating fit writes the same tensors; without donation
    every update makes new ones (the old state is still alive as the last commit)."""
    pointers = []

    def record(ctx):
        pointers.append(ctx.state.params["0.weight"].untyped_storage().data_ptr())

    cb = LambdaCallback(name="ptr", on_train_batch_end=record)
    trainer(donate_state=donate, callbacks=[cb]).fit(net(), loss_fn, optim.adam(1e-2), loader())
    assert len(pointers) == 12
    if donate:
        assert len(set(pointers[1:])) == 1 and pointers[0] == pointers[1]
    else:
        assert pointers[1] != pointers[2]


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("donate", [False, True])
def test_on_exception_sees_the_last_commit_or_the_latest_whole_state(donate):
    seen = []

    def boom(ctx):
        if ctx.batch_idx == 3:
            raise ValueError("boom")

    callbacks = [
        LambdaCallback(name="boom", on_train_batch_end=boom),
        LambdaCallback(name="exc", on_exception=lambda ctx: seen.append(clone(ctx.state))),
    ]
    t = trainer(donate_state=donate, callbacks=callbacks)
    with pytest.raises(ValueError, match="boom"):
        t.fit(net(), loss_fn, optim.adam(1e-2), loader())
    (state,) = seen
    # without donation: the commit before batch 3; with it: the state after batch 3's step
    expected_steps = 4 if donate else 3
    assert state.progress.step == expected_steps
    reference = trainer(max_steps=expected_steps).fit(net(), loss_fn, optim.adam(1e-2), loader())
    assert_trees_equal(state.params, reference.params)
    assert_trees_equal(state.opt_state, reference.opt_state)


def test_a_failure_inside_a_donated_update_saves_nothing_and_says_why(tmp_path):
    def fail(count):
        if count == 3:
            raise RuntimeError("optimizer exploded")

    said = []
    files = {}
    for donate in (False, True):
        root = tmp_path / f"donate_{donate}"
        ckpt = ModelCheckpoint(dirpath=str(root), save_on_exception=True, save_top_k=0)
        t = trainer(donate_state=donate, enable_checkpointing=True, callbacks=[ckpt])
        t._printer = said.append
        with pytest.raises(RuntimeError, match="optimizer exploded"):
            t.fit(net(), loss_fn, hook_after(optim.adam(1e-2), fail), loader())
        files[donate] = sorted(os.listdir(root)) if root.exists() else []
        # a half-written state is not offered as the trainer's state
        assert (t.train_state is None) == donate and (t.global_step == 0) == donate
    assert files[False], "without donation the last commit is saved on the exception"
    assert files[True] == []
    assert any("not saving the checkpoint" in line for line in said)


def test_ctrl_c_during_a_donated_update_waits_for_the_whole_state():
    needs_default_sigint()
    interrupt = sigint_at(3)  # lands after Adam's in-place writes
    t = trainer(donate_state=True)
    t._printer = lambda s: None
    state = t.fit(net(), loss_fn, hook_after(optim.adam(1e-2), interrupt), loader())
    assert t.interrupted and state.progress.step == 4
    reference = trainer(max_steps=4).fit(
        net(), loss_fn, hook_after(optim.adam(1e-2), lambda c: None), loader()
    )
    assert_trees_equal(state.params, reference.params)
    assert_trees_equal(state.opt_state, reference.opt_state)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_async_checkpoints_copy_the_state_when_donating(tmp_path):
    saved = {}
    for donate in (False, True):
        root = tmp_path / f"d{donate}"
        ckpt = ModelCheckpoint(dirpath=str(root), every_n_train_steps=1, save_top_k=-1)
        t = trainer(
            donate_state=donate, enable_checkpointing=True, callbacks=[ckpt], async_checkpoint=True
        )
        assert t.checkpointing.saver.copy == ("always" if donate else "auto")
        t.fit(net(), loss_fn, optim.adam(1e-2), loader())
        saved[donate] = {
            name: engine.checkpoint.load(str(root / name))[0] for name in sorted(os.listdir(root))
        }
    assert sorted(saved[True]) == sorted(saved[False]) and len(saved[True]) == 12
    for name in saved[True]:
        assert_trees_equal(saved[True][name].params, saved[False][name].params)
        assert_trees_equal(saved[True][name].opt_state, saved[False][name].opt_state)


def test_donate_state_must_be_a_bool():
    with pytest.raises(TypeError, match="donate_state must be a bool"):
        Trainer(donate_state="yes")


# --------------------------------------------------------------------------- the guard


def test_interrupt_guard_defers_sigint_over_a_critical_section():
    guard = InterruptGuard()
    if not guard.install():
        pytest.skip("SIGINT is not Python's default handler here")
    try:
        guard.enter()
        signal.raise_signal(signal.SIGINT)  # held back
        reached = True
        with pytest.raises(KeyboardInterrupt):
            guard.leave()
        assert reached
        with pytest.raises(KeyboardInterrupt):  # outside a section: at once
            signal.raise_signal(signal.SIGINT)
        guard.enter()
        guard.leave()  # nothing pending: no raise
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interrupt_guard_leaves_other_threads_and_custom_handlers_alone():
    results = []
    thread = threading.Thread(target=lambda: results.append(InterruptGuard().install()))
    thread.start()
    thread.join()
    assert results == [False]

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, mine)
    try:
        guard = InterruptGuard()
        assert guard.install() is False
        assert signal.getsignal(signal.SIGINT) is mine
        guard.uninstall()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


# --------------------------------------------------------------------------- ownership


def _nan_once():
    """A loss function whose first call gives NaN gradients (a step skip_nonfinite skips)."""
    calls = []

    def loss(apply, batch):
        calls.append(1)
        value = loss_fn(apply, batch)
        return value * float("nan") if len(calls) == 1 else value

    return loss


@pytest.mark.parametrize(
    "opt, loss",
    [
        (optim.accumulate(optim.adam(1e-2), 2), loss_fn),  # returns the input until it steps
        (optim.skip_nonfinite(optim.sgd(0.1, momentum=0.9)), None),  # skips the first update
    ],
    ids=["accumulate", "skip-nonfinite"],
)
def test_optimizers_that_pass_the_input_through_never_expose_the_callers_state(opt, loss):
    model = net()
    for run in ("loops.fit", "Trainer"):
        state = engine.init(model, opt, seed=0)
        before = clone(state)
        fn = loss or _nan_once()
        if run == "loops.fit":
            step = engine.train_step(model, fn, opt)
            fit(state, step, loader(), donate=True, config=LoopConfig.create(max_epochs=1))
        else:
            trainer(max_epochs=1).fit(model, fn, opt, loader(), state=state)
        assert_trees_equal(state, before)


def test_a_fit_loop_run_twice_copies_each_callers_state():
    from purestep.loops.data import source
    from purestep.loops.driver import Driver
    from purestep.loops.fit import FitLoop

    model, opt = net(), optim.adam(1e-2)
    step = engine.train_step(model, loss_fn, opt)
    train = source(loader())
    loop = FitLoop(
        step,
        train,
        driver=Driver(fn="fit", config=LoopConfig.create(max_epochs=1)),
        config=LoopConfig.create(max_epochs=1),
        donate=True,
    )
    for seed in (0, 1):
        state = engine.init(model, opt, seed=seed)
        before = clone(state)
        loop.run(state)
        assert_trees_equal(state, before)


def test_a_metric_that_is_a_parameter_reports_the_value_the_step_saw():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 3)
            self.temp = nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return self.lin(x) * self.temp, self.temp

    def scaled_loss(apply, batch):
        x, y = batch
        logits, temp = apply(x)
        return F.cross_entropy(logits, y), {"temp": temp}

    logged = {}
    for donate in (False, True):
        logger = MemoryLogger()
        t = trainer(max_epochs=1, log_every_n_steps=1, logger=logger, donate_state=donate)
        t.fit(Scaled(), scaled_loss, optim.sgd(0.5), loader())
        logged[donate] = [float(m["train_temp"]) for _, m in logger.metrics if "train_temp" in m]
    assert len(logged[True]) == 6 and logged[True][0] == 1.0
    assert logged[True] == logged[False]


def test_an_exception_checkpoint_past_the_commit_point_says_so(tmp_path):
    def boom(ctx):
        raise RuntimeError("validation failed")

    said = []
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_on_exception=True, save_top_k=0)
    t = trainer(
        enable_checkpointing=True,
        callbacks=[ckpt, LambdaCallback(name="boom", on_validation_batch_start=boom)],
        val_check_interval=3,
        num_sanity_val_steps=0,
    )
    t._printer = said.append
    with pytest.raises(RuntimeError, match="validation failed"):
        t.fit(net(), loss_fn, optim.adam(1e-2), loader(), loader(8))
    assert os.listdir(tmp_path) == ["epoch=0-step=3.ckpt"]  # after batch 2's step
    assert any("past the last commit point" in line for line in said)


def test_a_custom_step_without_donating_is_refused_up_front():
    from purestep.loops.driver import Driver
    from purestep.loops.fit import FitLoop

    class Wrapped:
        def backward(self, state, batch, end_window=None): ...

        def apply(self, state, grads): ...

    config = LoopConfig.create(max_epochs=1)
    with pytest.raises(TypeError, match=r"donate=True\) needs a step with donating"):
        FitLoop(Wrapped(), [], driver=Driver(fn="fit", config=config), config=config, donate=True)


def test_evaluating_after_a_torn_fit_needs_a_checkpoint_or_a_state():
    def fail(count):
        if count == 2:
            raise RuntimeError("optimizer exploded")

    t = trainer()
    model = net()
    with pytest.raises(RuntimeError, match="optimizer exploded"):
        t.fit(model, loss_fn, hook_after(optim.adam(1e-2), fail), loader())
    with pytest.raises(RuntimeError, match="left no whole state"):
        t.validate(verbose=False, dataloaders=loader(8))


def test_ctrl_c_in_a_fit_inside_a_fit_waits_for_the_whole_state():
    needs_default_sigint()
    interrupt = sigint_at(3)
    inner = {}

    def run_inner(ctx):
        if ctx.batch_idx == 0 and not inner:
            t = trainer()
            t._printer = lambda s: None
            opt = hook_after(optim.adam(1e-2), interrupt)
            inner["state"] = t.fit(net(), loss_fn, opt, loader())
            inner["interrupted"] = t.interrupted

    nested = LambdaCallback(name="inner", on_train_batch_end=run_inner)
    outer = trainer(max_epochs=1, callbacks=[nested])
    outer.fit(net(), loss_fn, optim.sgd(0.1), loader())
    assert inner["interrupted"] and inner["state"].progress.step == 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
