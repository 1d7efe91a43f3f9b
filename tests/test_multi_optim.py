"""Several optimizers in the Trainer: automatic (optimizer_idx, frequencies) and manual mode."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Task, Trainer
from purestep.engine import optim
from purestep.loops.multi_optim import OptimizerHandle
from purestep.loops.optimizers import active_optimizers, parse_optimizers
from tests.helpers import digest


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(4, 6), "b": nn.Linear(6, 1)})


def _forward(apply, x):
    return apply["b"](torch.tanh(apply["a"](x))).squeeze(-1)


def _data(n=24):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, 0] - 2 * x[:, 1])


def _loader(n=24):
    return DataLoader(_data(n), batch_size=4)


def _trainer(**kw):
    kw.setdefault("max_epochs", 1)
    return Trainer(
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        logger=kw.pop("logger", False),
        **kw,
    )


def _loss(out, y, idx):
    # the two optimizers see different objectives, so an optimizer_idx mix-up shows
    return F.mse_loss(out, y) if idx == 0 else F.l1_loss(out, y)


class Auto(Task):
    def __init__(self, opts=None):
        super().__init__(_net())
        self.opts = opts
        self.calls = []

    def training_step(self, apply, batch, optimizer_idx):
        self.calls.append(optimizer_idx)
        x, y = batch
        return _loss(_forward(apply, x), y, optimizer_idx)

    def configure_optimizers(self):
        if self.opts is not None:
            return self.opts
        return [
            {"optimizer": optim.adam(1e-2), "params": "a"},
            {"optimizer": optim.sgd(0.05, momentum=0.9), "params": "b"},
        ]


@pytest.mark.bitwise
def test_automatic_mode_equals_torch_optimizers_driven_by_hand():
    task = Auto()
    state = _trainer(max_epochs=2).fit(task, train_dataloaders=_loader())
    net = copy.deepcopy(_net())
    opt_a = torch.optim.Adam(net["a"].parameters(), lr=1e-2, foreach=True)
    opt_b = torch.optim.SGD(net["b"].parameters(), lr=0.05, momentum=0.9, foreach=True)
    for _ in range(2):
        for x, y in _loader():
            for idx, (opt, other) in enumerate(((opt_a, net["b"]), (opt_b, net["a"]))):
                other.requires_grad_(False)  # Lightning's toggle_optimizer
                opt.zero_grad()
                _loss(_forward(net, x), y, idx).backward()
                opt.step()
                other.requires_grad_(True)
    for name, p in net.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name
    assert task.calls[:4] == [0, 1, 0, 1]


def test_global_step_counts_batches_and_each_optimizer_its_own_updates():
    from purestep.loops.loggers import MemoryLogger

    logger = MemoryLogger()
    trainer = _trainer(max_epochs=2, logger=logger, log_every_n_steps=1)
    state = trainer.fit(Auto(), train_dataloaders=_loader())
    assert trainer.global_step == state.progress.step == 12  # Lightning 1.5: batches
    assert state.opt_state.steps == {"0": 12, "1": 12}
    assert set(state.opt_state.states) == {"0", "1"}
    # the loggers' x-axis: one training row per batch, at the batch's step
    rows = [step for step, row in logger.metrics if "train_loss/0" in row]
    assert rows == list(range(12))


@given(
    freqs=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    batch_idx=st.integers(0, 200),
)
def test_frequencies_cycle_like_lightning(freqs, batch_idx):
    expanded = [i for i, f in enumerate(freqs) for _ in range(f)]
    assert active_optimizers(freqs, len(freqs), batch_idx) == [expanded[batch_idx % len(expanded)]]
    assert active_optimizers(None, len(freqs), batch_idx) == list(range(len(freqs)))


def test_frequencies_in_the_trainer():
    opts = [
        {"optimizer": optim.sgd(0.1), "params": "a", "frequency": 2},
        {"optimizer": optim.sgd(0.1), "params": "b", "frequency": 1},
    ]
    task = Auto(opts)
    trainer = _trainer()
    state = trainer.fit(task, train_dataloaders=_loader())
    assert task.calls == [0, 0, 1, 0, 0, 1]
    assert state.opt_state.steps == {"0": 4, "1": 2}
    assert trainer.global_step == 6


def test_each_optimizer_updates_only_its_parameters():
    # "a" trains every batch of the epoch (frequencies 1000, 1), with weight decay, which
    # must not reach "b"'s parameters
    opts = [
        {"optimizer": optim.adamw(1e-2, weight_decay=0.5), "params": "a", "frequency": 1000},
        {"optimizer": optim.sgd(0.1), "params": ["b.weight", "b.bias"], "frequency": 1},
    ]
    start = {n: p.detach().clone() for n, p in _net().named_parameters()}
    state = _trainer().fit(Auto(opts), train_dataloaders=_loader())
    assert state.opt_state.steps == {"0": 6, "1": 0}
    assert not torch.equal(state.params["a.weight"], start["a.weight"])
    for n in ("b.weight", "b.bias"):
        assert torch.equal(state.params[n], start[n]), n


def test_every_optimizer_state_checkpoints_and_resumes_bitwise(tmp_path):
    from purestep.loops.callbacks import ModelCheckpoint

    def opts():
        return [
            {"optimizer": optim.adam(1e-2), "params": "a"},
            {
                "optimizer": optim.inject_hyperparams(optim.sgd)(lr=0.05, momentum=0.9),
                "params": "b",
                "lr_scheduler": optim.schedules.step(0.05, 1, 0.5),
            },
        ]

    full = _trainer(max_epochs=3).fit(Auto(opts()), train_dataloaders=_loader())
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_last=True)
    _trainer(max_epochs=3, max_steps=8, callbacks=[ckpt], enable_checkpointing=True).fit(
        Auto(opts()), train_dataloaders=_loader()
    )
    resumed = _trainer(max_epochs=3).fit(
        Auto(opts()), train_dataloaders=_loader(), ckpt_path=str(tmp_path / "last.ckpt")
    )
    assert digest(resumed.params) == digest(full.params)
    assert digest(resumed.opt_state) == digest(full.opt_state)
    assert digest(resumed.progress) == digest(full.progress)


class Manual(Task):
    automatic_optimization = False

    def __init__(self, opts=None, pattern=("d", "d", "g")):
        super().__init__(_net())
        self.opts = opts
        self.pattern = pattern

    def d_loss(self, apply, batch):
        x, y = batch
        return _loss(_forward(apply, x), y, 0)

    def g_loss(self, apply, batch):
        x, y = batch
        return _loss(_forward(apply, x), y, 1)

    def training_step(self, opt, batch):
        assert isinstance(opt, OptimizerHandle) and opt.names == ["d", "g"]
        for name in self.pattern:
            out = opt.step(name, self.d_loss if name == "d" else self.g_loss, batch)
        return {"loss": out.loss}

    def configure_optimizers(self):
        return self.opts or {
            "d": {"optimizer": optim.adam(1e-2), "params": "a"},
            "g": {"optimizer": optim.sgd(0.05, momentum=0.9), "params": "b"},
        }


def test_manual_mode_runs_the_steps_the_training_step_asks_for():
    trainer = _trainer(max_epochs=2)
    state = trainer.fit(Manual(), train_dataloaders=_loader())
    assert state.opt_state.steps == {"d": 24, "g": 12}  # the discriminator twice per batch
    assert trainer.global_step == 12


@pytest.mark.bitwise
def test_manual_steps_equal_automatic_mode_for_the_same_schedule():
    auto = _trainer(max_epochs=2).fit(
        Auto(
            {
                "d": {"optimizer": optim.adam(1e-2), "params": "a"},
                "g": {"optimizer": optim.sgd(0.05, momentum=0.9), "params": "b"},
            }
        ),
        train_dataloaders=_loader(),
    )
    manual = _trainer(max_epochs=2).fit(Manual(pattern=("d", "g")), train_dataloaders=_loader())
    assert digest(manual.params) == digest(auto.params)
    assert digest(manual.opt_state.states) == digest(auto.opt_state.states)


@pytest.mark.bitwise
def test_manual_per_optimizer_accumulation_equals_the_loops_accumulation():
    def opts(k):
        return {
            "d": {"optimizer": optim.adam(1e-2), "params": "a", "accumulate": k},
            "g": {"optimizer": optim.sgd(0.05), "params": "b", "accumulate": k},
        }

    manual = _trainer(max_epochs=2).fit(
        Manual(opts(2), pattern=("d", "g")), train_dataloaders=_loader()
    )
    auto_opts = {
        "d": {"optimizer": optim.adam(1e-2), "params": "a"},
        "g": {"optimizer": optim.sgd(0.05), "params": "b"},
    }
    auto = _trainer(max_epochs=2, accumulate_grad_batches=2).fit(
        Auto(auto_opts), train_dataloaders=_loader()
    )
    assert manual.opt_state.steps == {"d": 6, "g": 6}
    assert digest(manual.params) == digest(auto.params)


def test_per_optimizer_clipping():
    opts = {
        "d": {"optimizer": optim.sgd(0.0), "params": "a"},
        "g": {"optimizer": optim.sgd(1.0), "params": "b", "gradient_clip_val": 1e-3},
    }
    start = {n: p.detach().clone() for n, p in _net().named_parameters()}
    state = _trainer(max_steps=1).fit(Manual(opts, ("d", "g")), train_dataloaders=_loader())
    moved = torch.cat([(state.params[n] - start[n]).flatten() for n in ("b.weight", "b.bias")])
    assert 0 < float(moved.norm()) <= 1e-3 * (1 + 1e-4)  # float32 rounding


@pytest.mark.parametrize(
    "opts, match",
    [
        (
            [{"optimizer": optim.sgd(0.1), "params": "a"}, {"optimizer": optim.sgd(0.1)}],
            "does not say which parameters",
        ),
        (
            [
                {"optimizer": optim.sgd(0.1), "params": "a"},
                {"optimizer": optim.sgd(0.1), "params": ["a.weight", "b"]},
            ],
            "is in optimizers '0' and '1'",
        ),
        ([{"optimizer": optim.sgd(0.1), "params": "c"}], "matches no trainable parameter"),
        (
            [
                {"optimizer": optim.sgd(0.1), "params": "a", "frequency": 1},
                {"optimizer": optim.sgd(0.1), "params": "b"},
            ],
            "give every optimizer a 'frequency'",
        ),
        ([{"optimizer": optim.sgd(0.1), "params": "a", "betas": 1}], "unknown keys"),
        ([{"optimizer": torch.zeros(1), "params": "a"}], "engine.optim transform"),
    ],
)
def test_bad_optimizer_configs_say_what_is_wrong(opts, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _trainer().fit(Auto(opts), train_dataloaders=_loader())


def test_frequencies_with_accumulation_are_refused():
    opts = [
        {"optimizer": optim.sgd(0.1), "params": "a", "frequency": 1},
        {"optimizer": optim.sgd(0.1), "params": "b", "frequency": 1},
    ]
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        _trainer(accumulate_grad_batches=2).fit(Auto(opts), train_dataloaders=_loader())


def test_an_unknown_optimizer_name_in_manual_mode():
    with pytest.raises(KeyError, match="no such optimizer"):
        _trainer().fit(Manual(pattern=("x",)), train_dataloaders=_loader())


def test_shapes_lightning_returns_are_read():
    a, b = optim.sgd(0.1), optim.adam(1e-3)
    assert [e.name for e in parse_optimizers([a, b])] == ["0", "1"]
    assert [e.name for e in parse_optimizers((a, b))] == ["0", "1"]
    both = parse_optimizers(([a, b], [optim.schedules.constant(0.1)]))
    assert both[0].scheduler is not None and both[1].scheduler is None
    one = parse_optimizers(
        {
            "optimizer": a,
            "lr_scheduler": {"scheduler": optim.schedules.constant(1.0), "interval": "step"},
        }
    )
    assert one[0].scheduler.interval == "step"


def test_a_training_step_without_optimizer_idx_is_refused_with_the_shape():
    class NoIdx(Auto):
        def training_step(self, apply, batch):
            return super().training_step(apply, batch, 0)

    with pytest.raises(TypeError, match=r"training_step\(self, apply, batch, optimizer_idx\)"):
        _trainer().fit(NoIdx(), train_dataloaders=_loader())


def test_loss_functions_made_anew_each_batch_reuse_one_step():
    class Fresh(Manual):
        def training_step(self, opt, batch):
            out = opt.step("d", lambda a, b: self.d_loss(a, b), batch)
            opt.step("g", lambda a, b: self.g_loss(a, b), batch)
            return {"loss": out.loss}

    task = Fresh()
    trainer = _trainer()
    state = trainer.fit(task, train_dataloaders=_loader())
    assert state.opt_state.steps == {"d": 6, "g": 6}
    assert len(trainer._loop.step._loss_fns) == 2  # one per (optimizer, code)


def test_torch_optimizer_classes_as_entries_with_a_scheduler():
    import functools

    opts = [
        {
            "optimizer": functools.partial(torch.optim.NAdam, lr=1e-2),
            "params": "a",
            "lr_scheduler": optim.schedules.step(1e-2, 1, 0.5),
        },
        {"optimizer": torch.optim.RAdam, "params": "b"},
    ]
    state = _trainer(max_epochs=2).fit(Auto(opts), train_dataloaders=_loader())
    assert state.opt_state.steps == {"0": 12, "1": 12}
    assert optim.injected_values(state.opt_state.states["0"], "lr") == [5e-3]


def test_manual_accumulation_windows_stay_open_across_epochs():
    opts = {
        "d": {"optimizer": optim.sgd(0.1), "params": "a", "accumulate": 4},
        "g": {"optimizer": optim.sgd(0.1), "params": "b"},
    }
    # 6 batches an epoch, one "d" call each: 12 calls in two epochs make 3 windows of 4
    state = _trainer(max_epochs=2).fit(Manual(opts, ("d", "g")), train_dataloaders=_loader())
    assert state.opt_state.steps == {"d": 3, "g": 12}
    assert state.extra["optimizer_micro"]["d"] == 0 and state.grad_accum is None
    one = _trainer(max_epochs=1).fit(Manual(opts, ("d", "g")), train_dataloaders=_loader())
    assert one.extra["optimizer_micro"]["d"] == 2 and set(one.grad_accum) == {"a.weight", "a.bias"}


def test_a_misspelt_key_of_one_optimizer_dict_is_named():
    # not read as a dict of two optimizers named "optimizer" and "lr_schedular"
    with pytest.raises(ValueError, match=r"unknown keys \['lr_schedular'\]"):
        parse_optimizers(
            {"optimizer": optim.sgd(0.1), "lr_schedular": optim.schedules.constant(0.1)}
        )
    named = parse_optimizers({"optimizer": optim.sgd(0.1), "other": optim.adam(1e-3)})
    assert [e.name for e in named] == ["optimizer", "other"]  # every value an optimizer


def test_a_step_schedule_moves_with_each_manual_update():
    """The discriminator updates twice a batch: its second update runs at the next value of
    its step schedule (once, both ran at the batch's first value)."""
    from purestep.loops.callbacks import Callback
    from purestep.loops.events import NOTHING

    seen = []

    class Rec(Callback):
        name = "rec"

        def on_before_optimizer_step(self, state, ctx):
            if ctx.extra.get("optimizer_name") == "d":
                (lr,) = optim.injected_values(ctx.state.opt_state.states["d"], "lr")
                seen.append((ctx.state.opt_state.steps["d"], lr))
            return state, NOTHING

    sched = optim.schedules.linear(1.0, 0.0, 100)
    opts = {
        "d": {
            "optimizer": optim.inject_hyperparams(optim.sgd)(lr=1.0),
            "params": "a",
            "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 3},
        },
        "g": {"optimizer": optim.sgd(0.05), "params": "b"},
    }
    state = _trainer(callbacks=[Rec()]).fit(Manual(opts), train_dataloaders=_loader())
    assert [k for k, _ in seen] == list(range(12))
    assert [lr for _, lr in seen] == [sched(k // 3) for k in range(12)]
    assert optim.injected_values(state.opt_state.states["d"], "lr") == [sched(11 // 3)]


@pytest.mark.bitwise
@pytest.mark.parametrize("manual", [False, True])
def test_a_several_optimizer_step_leaves_its_input_state_unchanged(manual):
    from purestep import engine
    from purestep.loops.multi_optim import MultiOptimizer, MultiStep
    from purestep.loops.optimizers import OptimizerConfig

    net = _net()
    adam = optim.inject_hyperparams(optim.adamw)(lr=1e-2, weight_decay=0.1)
    sgd = optim.sgd(0.05, momentum=0.9)
    configs = [
        (OptimizerConfig("d", adam, accumulate=2 if manual else 1), adam, ["a.weight", "a.bias"]),
        (OptimizerConfig("g", sgd), sgd, ["b.weight", "b.bias"]),
    ]
    task = Manual() if manual else Auto()
    step = MultiStep(net, task.training_step, configs, manual=manual)
    state = engine.init(net, MultiOptimizer(configs), seed=0)
    batches = list(_loader())
    for i, batch in enumerate(batches[:3]):  # into an open accumulation window (manual)
        before = digest(state)
        new, _ = step.run(state, batch, batch_idx=i, end_window=True)
        again, _ = step.run(state, batch, batch_idx=i, end_window=True)
        assert digest(state) == before  # the input is not modified ...
        assert digest(again) == digest(new)  # ... and the step is a function of it
        changed = optim.set_hyperparams(new.opt_state, {"d/lr": 0.5})
        assert optim.injected_values(new.opt_state.states["d"], "lr") == [1e-2]
        assert optim.injected_values(changed.states["d"], "lr") == [0.5]
        state = new
    # manual: "d" runs twice a batch with a window of 2, so it too updates once a batch
    assert state.opt_state.steps == {"d": 3, "g": 3}
    assert (state.grad_accum is None) and state.progress.step == 3


def test_the_two_list_shape_as_lightning_reads_it():
    a, b = optim.sgd(0.1), optim.adam(1e-3)
    sched = optim.schedules.constant(0.1)
    one = parse_optimizers(([a], sched))  # one scheduler, not in a list
    assert len(one) == 1 and one[0].scheduler.scheduler is sched
    outer_list = parse_optimizers([[a, b], [sched]])  # the outer pair as a list
    assert [e.name for e in outer_list] == ["0", "1"]
    assert outer_list[0].scheduler is not None and outer_list[1].scheduler is None
    with pytest.raises(ValueError, match="returned no optimizer"):
        parse_optimizers(([], []))
