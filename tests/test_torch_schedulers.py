"""torch.optim.lr_scheduler objects in purestep: their translations give torch's own values
bitwise (every class, hypothesis-drawn settings, past T_max, restarts, cycles, phases,
milestones, chains), the (torch optimizer, torch scheduler) pair trains in the Trainer
bitwise like torch's own pair driven by hand, and a resumed run sets what an uninterrupted
one had."""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim import lr_scheduler as S
from torch.utils.data import DataLoader, TensorDataset

from purestep import Task, Trainer
from purestep.engine import optim
from purestep.engine.optim import schedules
from purestep.engine.optim.torch_instances import beta1_as_momentum, from_instance
from purestep.engine.optim.torch_schedules import MOMENTUM_NAMES, from_torch_scheduler
from purestep.loops.callbacks import Callback, ModelCheckpoint
from purestep.loops.events import NOTHING
from purestep.loops.loggers import MemoryLogger
from purestep.loops.optimizers import parse_optimizers
from purestep.loops.schedulers import scheduled_values

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# --------------------------------------------------------------------------- the reference


def _optimizer(cls=torch.optim.SGD, lrs=(0.1,), **kwargs):
    """A torch optimizer with one param group per learning rate."""
    groups = [{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return cls(groups, **kwargs)


def _momenta(opt, key):
    return tuple(g["betas"][0] if key == "betas" else g["momentum"] for g in opt.param_groups)


def assert_follows_torch(make, steps, cls=torch.optim.SGD, lrs=(0.1, 0.03), **kwargs):
    """The translation of ``make(opt)`` (taken right after construction) gives, for every
    step count up to ``steps``, exactly the lrs (and cycled momenta) torch's scheduler
    leaves in the optimizer's groups after that many ``step()`` calls."""
    opt = _optimizer(cls, lrs, **kwargs)
    sched = make(opt)
    ours = from_torch_scheduler(sched)
    for k in range(steps + 1):
        want = tuple(g["lr"] for g in opt.param_groups)
        assert ours.lrs(k) == want, (type(sched).__name__, k, ours.lrs(k), want)
        if ours.momentum_key is not None:
            assert ours.momentums(k) == _momenta(opt, ours.momentum_key), k
        if k < steps:
            opt.step()
            sched.step()
    return ours


_gamma = st.floats(0.05, 0.999)
_steps = st.integers(1, 70)
_two_lrs = st.tuples(st.floats(1e-3, 1.0), st.floats(1e-3, 1.0))


# --------------------------------------------------------------------------- each class


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(a=_gamma, b=st.floats(0.0, 2.0), steps=_steps, lrs=_two_lrs)
def test_lambda_lr(a, b, steps, lrs):
    fns = [lambda k: a**k, lambda k: 1 / (1 + b * k)]
    assert_follows_torch(lambda o: S.LambdaLR(o, fns), steps, lrs=lrs)
    assert_follows_torch(lambda o: S.LambdaLR(o, lambda k: a ** (k // 3)), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(a=_gamma, steps=_steps, lrs=_two_lrs)
def test_multiplicative_lr(a, steps, lrs):
    assert_follows_torch(lambda o: S.MultiplicativeLR(o, lambda k: a), steps, lrs=lrs)
    varying = [lambda k: 1 - a / (k + 2), lambda k: a]
    assert_follows_torch(lambda o: S.MultiplicativeLR(o, varying), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 10), gamma=_gamma, steps=_steps, lrs=_two_lrs)
def test_step_lr(size, gamma, steps, lrs):
    assert_follows_torch(lambda o: S.StepLR(o, size, gamma), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(
    marks=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    gamma=_gamma,
    steps=_steps,
    lrs=_two_lrs,
)
def test_multistep_lr(marks, gamma, steps, lrs):
    # repeated milestones decay several times at once, as in torch
    assert_follows_torch(lambda o: S.MultiStepLR(o, sorted(marks), gamma), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(factor=st.floats(0.01, 1.0), total=st.integers(0, 12), steps=_steps, lrs=_two_lrs)
def test_constant_lr(factor, total, steps, lrs):
    assert_follows_torch(lambda o: S.ConstantLR(o, factor, total), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(
    start=st.floats(0.01, 1.0),
    end=st.floats(0.0, 1.0),
    total=st.integers(1, 25),
    steps=_steps,
    lrs=_two_lrs,
)
def test_linear_lr(start, end, total, steps, lrs):
    assert_follows_torch(lambda o: S.LinearLR(o, start, end, total), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(gamma=_gamma, steps=_steps, lrs=_two_lrs)
def test_exponential_lr(gamma, steps, lrs):
    assert_follows_torch(lambda o: S.ExponentialLR(o, gamma), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(total=st.integers(1, 25), power=st.floats(0.3, 3.0), steps=_steps, lrs=_two_lrs)
def test_polynomial_lr(total, power, steps, lrs):
    assert_follows_torch(lambda o: S.PolynomialLR(o, total, power), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(t_max=st.integers(1, 15), eta=st.floats(0.0, 1e-3), data=st.data(), lrs=_two_lrs)
def test_cosine_annealing_lr_also_past_t_max(t_max, eta, data, lrs):
    steps = data.draw(st.integers(t_max, 5 * t_max + 3))  # several rises and falls
    assert_follows_torch(lambda o: S.CosineAnnealingLR(o, t_max, eta), steps, lrs=lrs)


@pytest.mark.bitwise
@settings(max_examples=100, deadline=None)
@given(
    t_0=st.integers(1, 6),
    t_mult=st.integers(1, 3),
    eta=st.floats(0.0, 1e-3),
    steps=st.integers(10, 80),
    lrs=_two_lrs,
)
def test_cosine_annealing_warm_restarts_over_several_restarts(t_0, t_mult, eta, steps, lrs):
    make = lambda o: S.CosineAnnealingWarmRestarts(o, t_0, t_mult, eta)
    assert_follows_torch(make, steps, lrs=lrs)


_cyclic_optimizers = st.sampled_from(
    [
        (torch.optim.SGD, {"momentum": 0.9}),
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {"betas": (0.8, 0.99)}),
        (torch.optim.RMSprop, {"momentum": 0.5}),
    ]
)


@pytest.mark.bitwise
@settings(max_examples=120, deadline=None)
@given(
    bounds=st.tuples(st.floats(1e-4, 0.05), st.floats(0.06, 1.0)),
    up=st.integers(1, 6),
    down=st.one_of(st.none(), st.integers(1, 6)),
    mode=st.sampled_from(["triangular", "triangular2", "exp_range"]),
    gamma=st.floats(0.9, 1.0),
    custom=st.sampled_from([None, "cycle", "iterations"]),
    cycle_momentum=st.booleans(),
    momenta=st.tuples(st.floats(0.5, 0.8), st.floats(0.81, 0.99)),
    optimizer=_cyclic_optimizers,
    steps=st.integers(1, 60),
)
def test_cyclic_lr_both_modes_and_scale_functions(
    bounds, up, down, mode, gamma, custom, cycle_momentum, momenta, optimizer, steps
):
    base, top = bounds
    extra = {}
    if custom is not None:
        extra = {"scale_fn": lambda x: 0.97**x, "scale_mode": custom}

    def make(o):
        return S.CyclicLR(
            o,
            base_lr=[base, base / 2],
            max_lr=top,
            step_size_up=up,
            step_size_down=down,
            mode=mode,
            gamma=gamma,
            cycle_momentum=cycle_momentum,
            base_momentum=momenta[0],
            max_momentum=[momenta[1], momenta[1] - 0.005],
            **extra,
        )

    cls, kwargs = optimizer
    ours = assert_follows_torch(make, steps, cls=cls, **kwargs)
    adam_like = cls in (torch.optim.Adam, torch.optim.AdamW)
    assert ours.momentum_key == (
        None if not cycle_momentum else "betas" if adam_like else "momentum"
    )


@pytest.mark.bitwise
@settings(max_examples=120, deadline=None)
@given(
    total=st.integers(8, 60),
    pct=st.floats(0.05, 0.95),
    anneal=st.sampled_from(["cos", "linear"]),
    three_phase=st.booleans(),
    div=st.floats(2.0, 50.0),
    final_div=st.floats(10.0, 1e4),
    cycle_momentum=st.booleans(),
    optimizer=_cyclic_optimizers,
)
def test_one_cycle_lr_strategies_and_phases(
    total, pct, anneal, three_phase, div, final_div, cycle_momentum, optimizer
):
    ends = [pct * total - 1, 2 * pct * total - 2] if three_phase else [pct * total - 1]
    assume(all(b - a >= 0.5 for a, b in zip([0.0, *ends], [*ends, total - 1])))

    def make(o):
        return S.OneCycleLR(
            o,
            max_lr=[0.5, 0.2],
            total_steps=total,
            pct_start=pct,
            anneal_strategy=anneal,
            three_phase=three_phase,
            div_factor=div,
            final_div_factor=final_div,
            cycle_momentum=cycle_momentum,
        )

    cls, kwargs = optimizer
    ours = assert_follows_torch(make, total, cls=cls, **kwargs)  # every step torch allows
    with pytest.raises(ValueError, match=f"total_steps={total}.*torch raises here too"):
        ours.lrs(total + 1)
    assert ours.lrs(total) == ours.lrs(total)  # the schedule is intact after the error


def _simple(kind, p):
    """A chainable sub-scheduler for SequentialLR / ChainedScheduler."""
    return {
        "step": lambda o: S.StepLR(o, 1 + int(p * 5), 0.5 + p / 3),
        "exp": lambda o: S.ExponentialLR(o, 0.8 + p / 6),
        "linear": lambda o: S.LinearLR(o, 0.1 + p / 2, 1.0, 2 + int(p * 8)),
        "constant": lambda o: S.ConstantLR(o, 0.2 + p / 2, 1 + int(p * 6)),
        "cosine": lambda o: S.CosineAnnealingLR(o, 2 + int(p * 6), p / 100),
        "restarts": lambda o: S.CosineAnnealingWarmRestarts(o, 1 + int(p * 4), 2),
        "poly": lambda o: S.PolynomialLR(o, 3 + int(p * 6), 1 + p),
        "multistep": lambda o: S.MultiStepLR(o, [2, 3 + int(p * 5)], 0.5),
        "lambda": lambda o: S.LambdaLR(o, lambda k: (1 - p / 2) ** k),
        "multiplicative": lambda o: S.MultiplicativeLR(o, lambda k: 1 - p / 10),
        "cyclic": lambda o: S.CyclicLR(o, 0.01, 0.1, 2 + int(p * 3)),
    }[kind]


_kinds = st.sampled_from(
    [
        "step",
        "exp",
        "linear",
        "constant",
        "cosine",
        "restarts",
        "poly",
        "multistep",
        "lambda",
        "multiplicative",
        "cyclic",
    ]
)


@pytest.mark.bitwise
@settings(max_examples=120, deadline=None)
@given(
    kinds=st.lists(st.tuples(_kinds, st.floats(0.0, 1.0)), min_size=1, max_size=3),
    gaps=st.lists(st.integers(1, 12), min_size=2, max_size=2),
    steps=st.integers(1, 50),
)
def test_sequential_lr_over_its_milestones(kinds, gaps, steps):
    marks = [sum(gaps[: i + 1]) for i in range(len(kinds) - 1)]

    def make(o):
        return S.SequentialLR(o, [_simple(k, p)(o) for k, p in kinds], milestones=marks)

    assert_follows_torch(make, steps, momentum=0.9)


@pytest.mark.bitwise
@settings(max_examples=120, deadline=None)
@given(
    first=st.tuples(_kinds, st.floats(0.0, 1.0)),
    second=st.tuples(_kinds, st.floats(0.0, 1.0)),
    steps=st.integers(1, 50),
)
def test_chained_scheduler_of_two(first, second, steps):
    def make(o):
        return S.ChainedScheduler([_simple(*first)(o), _simple(*second)(o)])

    assert_follows_torch(make, steps, momentum=0.9)


@pytest.mark.bitwise
def test_nested_composites_and_a_one_cycle_inside_a_sequence():
    def nested(o):
        inner = S.ChainedScheduler([S.ExponentialLR(o, 0.9), S.StepLR(o, 3, 0.5)])
        return S.SequentialLR(o, [inner, S.OneCycleLR(o, 0.3, total_steps=30)], [5])

    assert_follows_torch(nested, 33, cls=torch.optim.AdamW)  # beta1 cycled after step 5

    def late(o):  # torch cannot restart a composite at a milestone: it raises at step 2
        chained = S.ChainedScheduler([S.ExponentialLR(o, 0.9)])
        return S.SequentialLR(o, [S.ConstantLR(o, 0.5, 3), chained], [2])

    with pytest.raises(ValueError, match="cannot restart at a milestone"):
        from_torch_scheduler(late(_optimizer()))
    sched = late(_optimizer())
    sched.step()
    with pytest.raises(NotImplementedError):
        sched.step()


@pytest.mark.bitwise
@settings(max_examples=120, deadline=None)
@given(
    metrics=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=30),
    mode=st.sampled_from(["min", "max"]),
    factor=st.sampled_from([0.1, 0.5, 0.9]),
    patience=st.integers(0, 3),
    threshold=st.sampled_from([0.0, 1e-4, 0.1]),
    threshold_mode=st.sampled_from(["rel", "abs"]),
    cooldown=st.integers(0, 2),
    min_lr=st.one_of(st.sampled_from([0, 1e-3]), st.just([0.02, 0.0])),
    eps=st.sampled_from([1e-8, 1e-3]),
)
def test_reduce_lr_on_plateau_becomes_the_engine_rule_with_its_settings(
    metrics, mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps
):
    opt = _optimizer(lrs=(0.1, 0.5))
    torch_plateau = S.ReduceLROnPlateau(
        opt, mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps
    )
    ours = from_torch_scheduler(torch_plateau)
    assert isinstance(ours, optim.ReduceLROnPlateau)
    state, lrs = ours.init(), [0.1, 0.5]
    for value in metrics:
        torch_plateau.step(value)
        lrs, state = ours.update(state, value, lrs)
        assert lrs == [g["lr"] for g in opt.param_groups]
        assert state.num_bad_epochs == torch_plateau.num_bad_epochs
        assert state.cooldown_counter == torch_plateau.cooldown_counter
    torch_plateau.step(0.0)
    with pytest.raises(ValueError, match="stepped already"):
        from_torch_scheduler(torch_plateau)


# --------------------------------------------------------------------------- the schedule


@pytest.mark.bitwise
def test_values_are_a_pure_function_of_the_count():
    """Replays are memoised; any access order, a jump back past the kept states, a fresh
    translation and a pickled copy give the same floats (resuming at k is exact)."""
    opt = _optimizer()
    sched = S.ExponentialLR(opt, 0.999)
    a, b = from_torch_scheduler(sched), from_torch_scheduler(sched)
    forward = [a.lrs(k) for k in range(3000)]
    assert [a.lrs(k) for k in (2999, 5, 2048, 1023, 1024, 0, 2999)] == [
        forward[k] for k in (2999, 5, 2048, 1023, 1024, 0, 2999)
    ]
    assert b.lrs(2500) == forward[2500]
    import pickle

    c = pickle.loads(pickle.dumps(a))
    assert c.lrs(2999) == forward[2999] and c.lrs(7) == forward[7]
    reference = []
    for _ in range(3000):
        reference.append(tuple(g["lr"] for g in opt.param_groups))
        opt.step()
        sched.step()
    assert forward == reference


def test_one_group_schedules_are_plain_schedules_and_several_say_how():
    one = from_torch_scheduler(S.StepLR(_optimizer(lrs=(0.2,)), 2, 0.5))
    assert [one(k) for k in range(5)] == [0.2, 0.2, 0.1, 0.1, 0.05]
    two = from_torch_scheduler(S.StepLR(_optimizer(lrs=(0.2, 0.4)), 2, 0.5))
    with pytest.raises(TypeError, match=r"2 param groups: use \.lrs\(k\)"):
        two(0)
    assert [two.group(1)(k) for k in range(3)] == [0.4, 0.4, 0.2]
    with pytest.raises(ValueError, match="does not cycle momentum"):
        two.momentums(0)
    with pytest.raises(ValueError, match="int >= 0"):
        two.lrs(-1)


def test_cosine_holds_past_t_max_where_torch_and_its_translation_rise():
    """``schedules.cosine`` keeps its documented behaviour: the end value after decay_steps;
    torch's class (and so its translation) rises again there."""
    t_max = 10
    ours = schedules.cosine(0.1, t_max, 0.001)
    torch_like = from_torch_scheduler(S.CosineAnnealingLR(_optimizer(lrs=(0.1,)), t_max, 0.001))
    assert [ours(k) for k in range(t_max, 3 * t_max)] == [ours(t_max)] * (2 * t_max)
    assert torch_like(2 * t_max) > torch_like(t_max + 1) > torch_like(t_max)
    assert all(
        math.isclose(ours(k), torch_like(k), rel_tol=1e-9) for k in range(t_max + 1)
    )  # the same curve up to T_max, to rounding


# --------------------------------------------------------------------------- refusals


class MyStepLR(S.StepLR):
    pass


class Warmup(S.LRScheduler):
    def get_lr(self):
        return [b * min(1.0, (self.last_epoch + 1) / 5) for b in self.base_lrs]


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda o: MyStepLR(o, 3), "a subclass of torch's StepLR"),
        (lambda o: Warmup(o), "not one of torch's own LR scheduler classes"),
        (lambda o: torch.optim.swa_utils.SWALR(o, 0.05), "not one of torch's own"),
    ],
)
def test_an_untranslatable_class_is_refused_naming_the_way_out(make, kind):
    with pytest.raises(TypeError) as err:
        from_torch_scheduler(make(_optimizer()))
    msg = str(err.value)
    assert kind in msg
    assert "pure function of the step count" in msg and "engine.optim.schedules" in msg
    assert "LambdaLR(opt, lambda k: factor(k))" in msg


def test_the_trainer_refuses_an_untranslatable_class_with_the_way_out():
    class Custom(_Pair):
        def pair(self, model):
            o = torch.optim.SGD(model.parameters(), lr=0.1)
            return o, Warmup(o), "step", 1

    with pytest.raises(TypeError, match=r"\['lr_scheduler'\].*Warmup.*LambdaLR"):
        _fit(Custom())


def test_a_touched_optimizer_alone_gets_a_message_that_works():
    """The reported bug: a torch optimizer a scheduler touched was refused with a from_torch
    call naming initial_lr, which from_torch then rejected. The message names the pair, and
    the call it suggests works; a stray initial_lr gets a hint."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.002)
    S.LinearLR(opt, start_factor=0.5)  # touches it: lr 0.001, initial_lr 0.002
    with pytest.raises(TypeError) as err:
        _fit(_Fixed(opt))
    msg = str(err.value)
    assert "initial_lr" not in msg and "decoupled_weight_decay" not in msg
    assert "optim.from_torch(torch.optim.AdamW, lr=0.002)" in msg
    assert "return the two together" in msg
    optim.from_torch(torch.optim.AdamW, lr=0.002).init({"w": torch.zeros(2)})
    with pytest.raises(TypeError, match="initial_lr is what a torch LR scheduler writes"):
        optim.from_torch(torch.optim.Adam, initial_lr=0.001)


def test_a_scheduler_must_come_with_its_own_optimizer():
    model = _net()
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    named = dict(model.named_parameters())
    with pytest.raises(ValueError, match="another SGD instance"):
        parse_optimizers({"optimizer": mine, "lr_scheduler": S.StepLR(other, 1)}, params=named)
    with pytest.raises(ValueError, match="not among the optimizers"):
        parse_optimizers(([mine], [S.StepLR(other, 1)]), params=named)
    with pytest.raises(ValueError, match="has two schedulers.*ChainedScheduler"):
        parse_optimizers(([mine, other], [S.StepLR(mine, 1), S.StepLR(mine, 2)]), params=named)
    foreign = torch.optim.SGD(_net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the module"):
        parse_optimizers(([foreign], [S.StepLR(foreign, 1)]), params=named)


# --------------------------------------------------------------------------- names and parsing


def test_the_momentum_name_mapping():
    """torch writes ``momentum`` (SGD-like) or ``betas[0]`` (Adam-like); both reach the
    optimizer state as the injected ``momentum``."""
    assert MOMENTUM_NAMES == {"momentum": "momentum", "betas": "momentum"}
    sgd = _optimizer(momentum=0.9)
    cyc = from_torch_scheduler(S.CyclicLR(sgd, 0.01, 0.1, 2))
    assert cyc.momentum_key == "momentum"
    assert scheduled_values(cyc, 1) == {"lr": cyc(1), "momentum": cyc.momentums(1)[0]}
    adam = _optimizer(torch.optim.Adam, lrs=(0.1, 0.2))
    one = from_torch_scheduler(S.OneCycleLR(adam, [0.1, 0.2], total_steps=10))
    assert one.momentum_key == "betas"
    values = scheduled_values(one, 3)
    assert values == {"lr": list(one.lrs(3)), "momentum": list(one.momentums(3))}
    fresh = _optimizer(torch.optim.Adam, lrs=(0.1, 0.2))
    assert scheduled_values(from_torch_scheduler(S.StepLR(fresh, 2)), 0) == {"lr": [0.1, 0.2]}
    assert scheduled_values(schedules.constant(0.3), 5) == {"lr": 0.3}


@pytest.mark.bitwise
def test_beta1_as_momentum_steps_with_the_injected_momentum_as_beta1():
    """The alias a betas-cycling scheduler drives: after set_hyperparams({"momentum": m})
    the step is torch's with betas[0] = m, bitwise; its state says which beta1 it used."""
    torch.manual_seed(0)
    w = torch.randn(5)
    grad = torch.randn(5)
    for base in (
        functools.partial(optim.from_torch, torch.optim.Adam),
        optim.inject_hyperparams(optim.adam),
    ):
        tx = beta1_as_momentum(base(lr=0.01, betas=(0.9, 0.99)))
        state = tx.init({"w": w})
        (hp,) = [s.hyperparams for s in optim.find_injected(state) if "betas" in s.hyperparams]
        assert float(hp["momentum"]) == float(hp["betas"][0]) == 0.9
        state = optim.set_hyperparams(state, {"momentum": 0.7})
        new, state = optim.step(tx, {"w": grad}, state, {"w": w})
        ref = nn.Parameter(w.clone())
        torch_adam = torch.optim.Adam([ref], lr=0.01, betas=(0.7, 0.99), foreach=True)
        ref.grad = grad.clone()
        torch_adam.step()
        assert torch.equal(new["w"], ref.detach())
        (hp,) = [s.hyperparams for s in optim.find_injected(state) if "betas" in s.hyperparams]
        assert float(hp["momentum"]) == float(hp["betas"][0]) == 0.7
    with pytest.raises(ValueError, match="no injected betas"):
        beta1_as_momentum(optim.from_torch(torch.optim.SGD, lr=0.1)).init({"w": w})


def test_an_instance_becomes_from_torch_with_its_groups_named_by_the_module():
    model = _net()
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "weight_decay": 0.0, "name": "first"},
            {"params": model[2].parameters(), "lr": 0.05},
        ],
        lr=0.01,
    )
    S.OneCycleLR(opt, max_lr=[0.1, 0.2], total_steps=20)  # writes max_lr, min_lr, momenta
    tx, names = from_instance(opt, model.named_parameters(), momentum_alias=True)
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    state = tx.init({n: p.detach() for n, p in model.named_parameters()})
    groups = state.inner_states
    assert list(groups) == ["first", "pg2"]
    lrs = [float(g.hyperparams["lr"]) for g in groups.values()]
    assert lrs == [g["lr"] for g in opt.param_groups]  # OneCycle's step-0 rates
    assert [float(g.hyperparams["momentum"]) for g in groups.values()] == [0.95, 0.95]
    assert [float(g.hyperparams["weight_decay"]) for g in groups.values()] == [0.0, 0.01]
    entries = parse_optimizers(([opt], [S.StepLR(opt, 1)]), params=dict(model.named_parameters()))
    assert entries[0].params == names and entries[0].scheduler.scheduler.num_groups == 2


def test_two_lists_match_torch_schedulers_to_their_optimizers_by_identity():
    model = _net()
    named = dict(model.named_parameters())
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.Adam(model[2].parameters(), lr=0.01)
    entries = parse_optimizers(
        ([first, second], [S.ExponentialLR(second, 0.9), S.StepLR(first, 2)]), params=named
    )
    assert [e.scheduler.scheduler.name for e in entries] == ["StepLR", "ExponentialLR"]
    assert [e.params for e in entries] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]


# --------------------------------------------------------------------------- in the Trainer


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


class Recorder(Callback):
    """The lr and momentum each optimizer step uses (read just before the update)."""

    name = "recorder"

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, state, ctx):
        opt = ctx.state.opt_state
        moms = optim.injected_values(opt, "momentum")
        self.seen.append((tuple(optim.injected_values(opt, "lr")), tuple(moms)))
        return state, NOTHING


class _Pair(Task):
    """A task whose configure_optimizers returns a torch optimizer and its scheduler."""

    shape = "dict"

    def __init__(self):
        super().__init__(_net())

    def training_step(self, apply, batch):
        return _loss(apply, batch)

    def configure_optimizers(self):
        opt, sched, interval, frequency = self.pair(self.model)
        if self.shape == "lists" and interval == "epoch" and frequency == 1:
            return [opt], [sched]
        config = {"scheduler": sched, "interval": interval, "frequency": frequency}
        return {"optimizer": opt, "lr_scheduler": config}


class _Fixed(Task):
    def __init__(self, value):
        super().__init__(_net())
        self.value = value

    def training_step(self, apply, batch):
        return _loss(apply, batch)

    def configure_optimizers(self):
        return self.value


def _fit(task, epochs=3, val=None, ckpt_path=None, callbacks=(), **flags):
    rec = Recorder()
    flags.setdefault("enable_checkpointing", False)
    trainer = Trainer(
        max_epochs=epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=MemoryLogger(),
        callbacks=[rec, *callbacks],
        num_sanity_val_steps=0,
        **flags,
    )
    trainer._printer = lambda s: None
    state = trainer.fit(task, train_dataloaders=_loader(), val_dataloaders=val, ckpt_path=ckpt_path)
    return state, rec.seen


def _by_hand(task, epochs=3):
    """torch's own optimizer and scheduler over the same batches in the same order: the
    final weights and the (lrs, cycled momenta) each step used."""
    model = _net()
    opt, sched, interval, frequency = task.pair(model)
    key = from_torch_scheduler(sched).momentum_key  # the group entry it cycles, if any
    used, steps = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in range(epochs):
            for batch in _loader():
                used.append((tuple(g["lr"] for g in opt.param_groups), _momentum_used(opt, key)))
                opt.zero_grad()
                _loss(model, batch).backward()
                opt.step()
                steps += 1
                if interval == "step" and steps % frequency == 0:
                    sched.step()
            if interval == "epoch" and (epoch + 1) % frequency == 0:
                sched.step()
    return model, used


def _momentum_used(opt, cycled):
    """What the Recorder reads as ``momentum``: SGD-like groups' own, or ``betas[0]`` of an
    Adam-like one whose beta1 a scheduler cycles (its state's alias)."""
    if "momentum" in opt.param_groups[0]:
        return _momenta(opt, "momentum")
    return _momenta(opt, "betas") if cycled == "betas" else ()


class AdamWOneCycle(_Pair):
    def pair(self, model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
        return opt, S.OneCycleLR(opt, max_lr=0.05, total_steps=12), "step", 1


class SGDStepPerEpoch(_Pair):
    shape = "lists"

    def pair(self, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return opt, S.StepLR(opt, step_size=1, gamma=0.5), "epoch", 1


class SGDMomentumCyclic(_Pair):
    def pair(self, model):
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.05}]
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
        return opt, S.CyclicLR(opt, [0.01, 0.02], 0.1, step_size_up=2), "step", 2


class AdamWarmupCosineEvery2Epochs(_Pair):
    def pair(self, model):
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        warm = S.LinearLR(opt, start_factor=0.1, total_iters=1)
        return opt, S.SequentialLR(opt, [warm, S.CosineAnnealingLR(opt, 2)], [1]), "epoch", 2


@pytest.mark.bitwise
@pytest.mark.parametrize(
    "task",
    [AdamWOneCycle, SGDStepPerEpoch, SGDMomentumCyclic, AdamWarmupCosineEvery2Epochs],
    ids=lambda t: t.__name__,
)
def test_the_pair_trains_bitwise_like_torch_s_own_pair_by_hand(task):
    state, seen = _fit(task())
    model, used = _by_hand(task())
    assert state.progress.step == len(used) == 12
    assert seen == used  # every step's rates (and cycled momenta), exactly
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


@pytest.mark.bitwise
def test_an_optimizer_converted_before_takes_its_torch_scheduler_by_position():
    """An instance someone converted before the scheduler is read (as loops.lightning does
    for a LightningModule): the schedule still drives it, beta1 included."""

    class Converted(AdamWOneCycle):
        def configure_optimizers(self):
            opt, sched, interval, _ = self.pair(self.model)
            tx, _ = from_instance(opt, self.model.named_parameters())  # no momentum alias
            return [tx], [{"scheduler": sched, "interval": interval}]

    state, seen = _fit(Converted())
    model, used = _by_hand(Converted())
    assert seen == used
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name


@pytest.mark.bitwise
def test_a_resumed_run_sets_what_the_uninterrupted_one_had(tmp_path):
    """Stopped mid-epoch at step 5 and resumed from its checkpoint: the rates and momenta
    of steps 6 to 12 and the final weights are the uninterrupted run's."""
    full, seen_full = _fit(SGDMomentumCyclic())
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_last=True)
    _fit(SGDMomentumCyclic(), max_steps=5, callbacks=[ckpt], enable_checkpointing=True)
    resumed, seen = _fit(SGDMomentumCyclic(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.progress.step == 12 and seen == seen_full[5:]
    for name, p in full.params.items():
        assert torch.equal(resumed.params[name], p), name


def test_the_lr_monitor_logs_the_cycled_beta1_as_momentum():
    from purestep.loops.callbacks import LearningRateMonitor

    logger = MemoryLogger()
    monitor = LearningRateMonitor(logging_interval="step", log_momentum=True)
    trainer = Trainer(
        max_epochs=3,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[monitor],
    )
    trainer._printer = lambda s: None
    trainer.fit(AdamWOneCycle(), train_dataloaders=_loader())
    _, used = _by_hand(AdamWOneCycle())
    logged = [row["lr-AdamW-momentum"] for _, row in logger.metrics if "lr-AdamW-momentum" in row]
    assert logged == pytest.approx([m for _, (m,) in used], rel=1e-6)  # loggers keep float32


def test_a_torch_plateau_in_the_trainer_follows_the_monitored_metric_as_torch_s_does():
    class Plateau(_Fixed):
        def validation_step(self, apply, batch):
            return {"loss": _loss(apply, batch), "val_metric": torch.tensor(1.0)}

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            sched = S.ReduceLROnPlateau(opt, mode="max", patience=0, factor=0.5)
            return {"optimizer": opt, "lr_scheduler": sched, "monitor": "val_metric"}

    state, seen = _fit(Plateau(None), epochs=4, val=_loader())
    opt = _optimizer(lrs=(0.1,))
    reference = S.ReduceLROnPlateau(opt, mode="max", patience=0, factor=0.5)
    want = []
    for _ in range(4):
        want.append(opt.param_groups[0]["lr"])
        reference.step(1.0)
    assert [lrs for (lrs, _) in seen[::4]] == [(lr,) for lr in want]
    assert state.extra["lr_schedulers"]["0"].last_epoch == 4
