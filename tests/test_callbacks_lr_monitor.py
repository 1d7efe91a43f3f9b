"""LearningRateMonitor: names and values of injected hyper-parameters in nested states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from purestep import engine
from purestep.engine import optim
from purestep.engine.state import Progress
from purestep.loops.callbacks import (
    LearningRateMonitor,
    find_hyperparams,
    init_states,
    should_log_step,
)
from purestep.loops.config import LoopConfig
from purestep.loops.events import Context, dispatch

inject = optim.inject_hyperparams


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))


def _is_matrix(name, tensor):
    return "decay" if tensor.ndim >= 2 else "no_decay"


def _fire(cb, event, opt, step=0, config=None, should_stop=False, extra=None, state=None):
    if state is None:
        state = engine.init(_net(), opt)
    state = init_states([cb], state.replace(progress=Progress(step=step)))
    ctx = Context(
        stage="train",
        fn="fit",
        state=state,
        config=config,
        should_stop=should_stop,
        extra=extra or {},
    )
    return dispatch(event, [cb], state, ctx)[1]


def test_chain_of_clip_and_injected_adamw():
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        inject(optim.adamw)(lr=1e-3, betas=(0.8, 0.99), weight_decay=0.05),
    )
    req = _fire(LearningRateMonitor(), "on_train_epoch_start", opt)
    assert req.log == {"lr-AdamW": 1e-3}
    cb = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    req = _fire(cb, "on_train_epoch_start", opt)
    assert req.log == {"lr-AdamW": 1e-3, "lr-AdamW-momentum": 0.8, "lr-AdamW-weight_decay": 0.05}


def test_partition_labels_become_group_suffixes():
    opt = optim.partition(
        {
            "decay": inject(optim.sgd)(lr=0.1, momentum=0.9),
            "no_decay": inject(optim.sgd)(lr=0.01),
        },
        _is_matrix,
    )
    cb = LearningRateMonitor(log_momentum=True)
    req = _fire(cb, "on_train_epoch_start", opt)
    assert req.log == {"lr-SGD/decay": 0.1, "lr-SGD/decay-momentum": 0.9, "lr-SGD/no_decay": 0.01}
    # the group without injected momentum is explained once, at the start of training
    start = _fire(cb, "on_train_start", opt)
    assert len(start.messages) == 1 and "lr-SGD/no_decay" in start.messages[0]


def test_non_string_labels_are_numbered_param_groups():
    opt = optim.partition(
        {0: inject(optim.adam)(lr=0.2), 1: inject(optim.adam)(lr=0.3)},
        lambda name, t: 0 if t.ndim >= 2 else 1,
    )
    req = _fire(LearningRateMonitor(), "on_train_epoch_start", opt)
    assert req.log == {"lr-Adam/pg1": 0.2, "lr-Adam/pg2": 0.3}


def test_masked_and_chain_inside_partition():
    opt = optim.chain(
        optim.masked(optim.add_decayed_weights(0.1), optim.decay_mask),
        optim.partition(
            {
                "decay": optim.chain(optim.clip_by_value(1.0), inject(optim.rmsprop)(lr=0.5)),
                "no_decay": optim.set_to_zero(),
            },
            _is_matrix,
        ),
    )
    req = _fire(LearningRateMonitor(), "on_train_epoch_start", opt)
    assert req.log == {"lr-RMSprop/decay": 0.5}


def test_repeated_optimizers_get_numbered():
    # a loop with two optimizers (e.g. a GAN) keeps both states in one tree
    params = {"w": torch.zeros(2, 2)}
    opt_state = {
        "generator": inject(optim.adam)(lr=1e-4).init(params),
        "discriminator": inject(optim.adam)(lr=4e-4).init(params),
    }
    found = find_hyperparams(opt_state)
    assert [f.key for f in found] == ["lr-Adam", "lr-Adam-1"]
    # dict keys are visited in insertion order
    assert [float(f.hyperparams["lr"]) for f in found] == [1e-4, 4e-4]


# Lightning names the key after the optimizer's class: torch.optim.AdamW -> "lr-AdamW".
NAMED = [
    (optim.sgd, "SGD", torch.optim.SGD),
    (optim.adam, "Adam", torch.optim.Adam),
    (optim.adamw, "AdamW", torch.optim.AdamW),
    (optim.rmsprop, "RMSprop", torch.optim.RMSprop),
    (optim.adagrad, "Adagrad", torch.optim.Adagrad),
]


@pytest.mark.parametrize(("factory", "name", "torch_class"), NAMED)
def test_every_named_optimizer_is_named_after_its_torch_class(factory, name, torch_class, tmp_path):
    assert name == torch_class.__name__
    assert factory.optimizer_name == name
    state = inject(factory)(lr=0.1).init({"w": torch.zeros(2)})
    assert state.name == name
    assert [f.key for f in find_hyperparams(state)] == [f"lr-{name}"]
    # the name survives steps, tree maps (it is static) and checkpoints
    opt = inject(factory)(lr=0.1)
    net = _net()
    step = engine.train_step(
        net, lambda apply, b: F.mse_loss(apply(b[0]), b[1]), opt, grad_norm=False
    )
    trained, _ = step(engine.init(net, opt), (torch.randn(5, 4), torch.randn(5, 2)))
    assert trained.opt_state.name == name
    mapped = engine.tree.map(lambda t: t.clone() if torch.is_tensor(t) else t, trained.opt_state)
    assert [f.key for f in find_hyperparams(mapped)] == [f"lr-{name}"]
    engine.checkpoint.save(trained, str(tmp_path / "s.ckpt"))
    loaded, _ = engine.checkpoint.load(str(tmp_path / "s.ckpt"))
    assert loaded.opt_state.name == name
    req = _fire(LearningRateMonitor(), "on_train_epoch_start", opt, state=loaded)
    assert list(req.log) == [f"lr-{name}"]


def test_named_optimizers_inside_chains_partitions_and_repeats():
    opt = optim.partition(
        {
            "decay": optim.chain(optim.clip_by_global_norm(1.0), inject(optim.adamw)(lr=0.1)),
            "no_decay": inject(optim.sgd)(lr=0.2),
        },
        _is_matrix,
    )
    req = _fire(LearningRateMonitor(), "on_train_epoch_start", opt)
    assert req.log == {"lr-AdamW/decay": 0.1, "lr-SGD/no_decay": 0.2}
    params = {"w": torch.zeros(2, 2)}
    two = {
        "g": inject(optim.adamw)(lr=1.0).init(params),
        "d": inject(optim.adam)(lr=2.0).init(params),
    }
    assert [f.key for f in find_hyperparams(two)] == ["lr-AdamW", "lr-Adam"]


def test_factories_without_a_name_are_named_after_their_state():
    def my_adam(lr):  # a custom factory: no optimizer_name, so the inner state's class
        return optim.chain(optim.clip_by_value(1.0), optim.adam(lr))

    state = inject(my_adam)(lr=0.1).init({"w": torch.zeros(2)})
    assert state.name == ""
    assert [f.key for f in find_hyperparams(state)] == ["lr-Adam"]


def test_name_recorded_in_the_state_wins():
    state = inject(optim.adam)(lr=0.1).init({"w": torch.zeros(2)})
    state = state.replace(name="adamw")  # a lower-case factory name maps to torch's
    assert [f.key for f in find_hyperparams(state)] == ["lr-AdamW"]


def test_values_follow_the_state():
    opt = inject(optim.sgd)(lr=0.1)
    state = engine.init(_net(), opt)
    hp = {**state.opt_state.hyperparams, "lr": torch.tensor(0.025, dtype=torch.float64)}
    state = state.replace(opt_state=state.opt_state.replace(hyperparams=hp))
    req = _fire(LearningRateMonitor(), "on_train_epoch_start", opt, state=state)
    assert req.log == {"lr-SGD": 0.025}


def test_scheduled_lr_after_real_steps():
    schedule = optim.schedules.linear(1.0, 0.0, 10)
    opt = inject(optim.sgd)(lr=schedule)
    net = _net()
    state = engine.init(net, opt)
    step = engine.train_step(
        net, lambda apply, b: F.mse_loss(apply(b[0]), b[1]), opt, grad_norm=False
    )
    batch = (torch.randn(5, 4), torch.randn(5, 2))
    for _ in range(3):
        state, _ = step(state, batch)
    req = _fire(LearningRateMonitor(), "on_train_epoch_start", opt, state=state)
    assert req.log == {"lr-SGD": float(state.opt_state.hyperparams["lr"])}
    assert req.log["lr-SGD"] != 1.0


def test_nothing_injected_logs_nothing_and_explains_once():
    opt = optim.adamw(1e-3)
    cb = LearningRateMonitor()
    assert not _fire(cb, "on_train_epoch_start", opt)
    assert not _fire(cb, "on_train_batch_end", opt, step=50)
    start = _fire(cb, "on_train_start", opt)
    assert len(start.messages) == 1 and "inject_hyperparams" in start.messages[0]
    assert not start.log


def test_no_logger_is_an_error_only_when_the_loop_says_so():
    opt = inject(optim.sgd)(lr=0.1)
    with pytest.raises(ValueError, match="no logger"):
        _fire(LearningRateMonitor(), "on_train_start", opt, extra={"num_loggers": 0})
    assert not _fire(LearningRateMonitor(), "on_train_start", opt, extra={"num_loggers": 1})
    assert not _fire(LearningRateMonitor(), "on_train_start", opt)


@given(
    step=st.integers(0, 200),
    every=st.integers(0, 7),
    should_stop=st.booleans(),
    interval=st.sampled_from([None, "step", "epoch"]),
)
def test_step_logging_cadence(step, every, should_stop, interval):
    config = LoopConfig.create(log_every_n_steps=every)
    opt = inject(optim.sgd)(lr=0.1)
    cb = LearningRateMonitor(logging_interval=interval)
    # logged at the end of the batch that stepped (the counter then includes it)
    req = _fire(cb, "on_train_batch_end", opt, step + 1, config, should_stop)
    due = every > 0 and ((step + 1) % every == 0 or should_stop)
    assert bool(req.log) == (due and interval != "epoch")
    req = _fire(cb, "on_train_epoch_start", opt, step, config, should_stop)
    assert bool(req.log) == (interval != "step")


def test_default_cadence_is_every_50_steps():
    ctx = Context(stage="train", fn="fit", state=engine.init(_net(), optim.sgd(0.1)))
    steps = [s for s in range(200) if should_log_step(ctx.replace(state=_at(ctx.state, s)))]
    assert steps == [49, 99, 149, 199]


def _at(state, step):
    return state.replace(progress=Progress(step=step))


def test_bad_logging_interval():
    with pytest.raises(ValueError, match="logging_interval='batch'"):
        LearningRateMonitor(logging_interval="batch")


@pytest.mark.parametrize(
    "opt",
    [
        inject(optim.sgd)(lr=0.1, momentum=0.9),
        optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9),
        torch.optim.SGD,  # torch's default lr, 1e-3
    ],
)
def test_the_logged_rate_is_the_optimizers_float_not_its_float32_rounding(opt, tmp_path):
    """Lightning logs ``param_group["lr"]``, a Python float: 0.1 is 0.1 in every logger, not
    0.10000000149011612 (its float32 rounding)."""
    from purestep.loops import Trainer
    from purestep.loops.loggers import CSVLogger, MemoryLogger

    want = 1e-3 if opt is torch.optim.SGD else 0.1
    memory = MemoryLogger()
    trainer = Trainer(
        max_epochs=1,
        logger=[memory, CSVLogger(str(tmp_path))],
        callbacks=[LearningRateMonitor()],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = (torch.randn(8, 4), torch.randn(8, 2))
    trainer.fit(_net(), lambda apply, b: F.mse_loss(apply(b[0]), b[1]), opt, data)
    logged = [m["lr-SGD"] for _, m in memory.metrics if "lr-SGD" in m]
    assert logged and all(type(v) is float and v == want for v in logged)
    assert want != float(torch.tensor(want))  # what the float32 detour would have logged
    (csv_file,) = tmp_path.rglob("metrics.csv")
    rows = csv_file.read_text().splitlines()
    column = rows[0].split(",").index("lr-SGD")
    assert {float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]} == {want}
