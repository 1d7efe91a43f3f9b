"""Schedules: values against torch's LR schedulers, properties, argument checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purestep.engine.optim import schedules

BASE = 0.1


def torch_lrs(make_scheduler, steps: int, base: float = BASE) -> list[float]:
    """The lr torch's scheduler gives each of ``steps`` optimizer steps (stepped after each)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def assert_close(ours: list[float], theirs: list[float], rel: float = 1e-9) -> None:
    assert len(ours) == len(theirs)
    for t, (a, b) in enumerate(zip(ours, theirs)):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-15), (t, a, b)


S = torch.optim.lr_scheduler
CASES = [
    ("step", lambda o: S.StepLR(o, step_size=7, gamma=0.3), schedules.step(BASE, 7, 0.3), 60),
    (
        "multistep",
        lambda o: S.MultiStepLR(o, milestones=[5, 12, 30], gamma=0.5),
        schedules.multistep(BASE, [5, 12, 30], 0.5),
        50,
    ),
    ("exponential", lambda o: S.ExponentialLR(o, 0.95), schedules.exponential(BASE, 0.95), 80),
    (
        "linear",
        lambda o: S.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=20),
        schedules.linear(0.1 * BASE, BASE, 20),
        40,
    ),
    (
        "linear-decay",
        lambda o: S.LinearLR(o, start_factor=1.0, end_factor=0.25, total_iters=15),
        schedules.linear(BASE, 0.25 * BASE, 15),
        30,
    ),
    (
        "cosine",
        lambda o: S.CosineAnnealingLR(o, T_max=50, eta_min=0.001),
        schedules.cosine(BASE, 50, 0.001),
        51,
    ),
    (
        "one-cycle",
        lambda o: S.OneCycleLR(o, max_lr=0.5, total_steps=100, cycle_momentum=False),
        schedules.one_cycle(0.5, 100),
        100,
    ),
    (
        "one-cycle-linear-3",
        lambda o: S.OneCycleLR(
            o,
            max_lr=0.2,
            total_steps=90,
            pct_start=0.25,
            anneal_strategy="linear",
            div_factor=10.0,
            final_div_factor=100.0,
            three_phase=True,
            cycle_momentum=False,
        ),
        schedules.one_cycle(
            0.2,
            90,
            pct_start=0.25,
            anneal_strategy="linear",
            div_factor=10.0,
            final_div_factor=100.0,
            three_phase=True,
        ),
        90,
    ),
    (
        "one-cycle-cos-3",
        lambda o: S.OneCycleLR(
            o, max_lr=1.0, total_steps=37, pct_start=0.4, three_phase=True, cycle_momentum=False
        ),
        schedules.one_cycle(1.0, 37, pct_start=0.4, three_phase=True),
        37,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_scheduler(case):
    _, make, ours, steps = case
    assert_close([ours(t) for t in range(steps)], torch_lrs(make, steps))


def test_warmup_cosine_matches_torch_sequential():
    """LinearLR warm-up then CosineAnnealingLR, joined with SequentialLR."""

    def make(o):
        warm = S.LinearLR(o, start_factor=0.01, end_factor=1.0, total_iters=10)
        cos = S.CosineAnnealingLR(o, T_max=40, eta_min=0.002)
        return S.SequentialLR(o, [warm, cos], milestones=[10])

    ours = schedules.warmup_cosine(BASE, 10, 50, init_value=0.01 * BASE, end_value=0.002)
    assert_close([ours(t) for t in range(50)], torch_lrs(make, 50))


def test_values_are_python_floats_and_clamped():
    for s in [
        schedules.constant(0.5),
        schedules.linear(1.0, 0.0, 10),
        schedules.cosine(1.0, 10),
        schedules.exponential(1.0, 0.5, end_value=0.1),
        schedules.one_cycle(1.0, 20),
    ]:
        assert all(type(s(t)) is float for t in range(30))
    assert schedules.linear(1.0, 0.0, 10)(100) == 0.0
    assert schedules.cosine(1.0, 10, 0.1)(100) == pytest.approx(0.1)
    assert schedules.exponential(1.0, 0.5, end_value=0.1)(100) == 0.1
    assert schedules.exponential(1.0, 2.0, end_value=3.0)(100) == 3.0
    assert schedules.exponential(1.0, 0.5, 4, staircase=True)(7) == 0.5
    assert schedules.one_cycle(1.0, 20)(1000) == schedules.one_cycle(1.0, 20)(19)
    assert schedules.linear(2.0, 4.0, 4, transition_begin=3)(2) == 2.0
    assert schedules.linear(2.0, 4.0, 4, transition_begin=3)(5) == 3.0


# --------------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(
    peak=st.floats(1e-5, 10.0),
    init_frac=st.floats(0.0, 1.0),
    warmup=st.integers(1, 200),
    decay=st.integers(1, 500),
)
def test_warmup_cosine_continuous_at_boundary(peak, init_frac, warmup, decay):
    s = schedules.warmup_cosine(peak, warmup, warmup + decay, init_value=init_frac * peak)
    assert s(warmup) == pytest.approx(peak, rel=1e-12)
    slope = peak * (1 - init_frac) / warmup
    assert abs(s(warmup) - s(warmup - 1)) <= slope * (1 + 1e-9) + 1e-15
    assert abs(s(warmup + 1) - s(warmup)) <= peak * (math.pi / decay) ** 2 + 1e-15
    assert max(s(t) for t in range(0, warmup + decay + 2, max(1, (warmup + decay) // 50))) <= (
        peak * (1 + 1e-12)
    )


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(4, 400),
    data=st.data(),
    max_lr=st.floats(1e-4, 10.0),
    cos=st.booleans(),
    three=st.booleans(),
)
def test_one_cycle_peaks_at_max_lr(total, data, max_lr, cos, three):
    top = (total - 1) // 2 if three else total - 2
    k = data.draw(st.integers(2, max(2, top)))
    pct = k / total
    s = schedules.one_cycle(
        max_lr, total, pct_start=pct, anneal_strategy="cos" if cos else "linear", three_phase=three
    )
    values = [s(t) for t in range(total)]
    assert max(values) <= max_lr * (1 + 1e-12)
    assert s(round(pct * total) - 1) == pytest.approx(max_lr, rel=1e-9)
    assert values[0] == pytest.approx(max_lr / 25.0, rel=1e-12)
    assert values[-1] == pytest.approx(max_lr / 25.0 / 1e4, rel=1e-9)
    assert min(values) >= values[-1] * (1 - 1e-9)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-5, 5), min_size=1, max_size=5),
    gaps=st.lists(st.integers(1, 20), min_size=4, max_size=4),
)
def test_join_switches_at_boundaries(values, gaps):
    bounds = [sum(gaps[: i + 1]) for i in range(len(values) - 1)]
    # each piece is a ramp of its own local count, so the offset is visible
    pieces = [lambda t, v=v: v + t for v in values]
    s = schedules.join(pieces, bounds)
    starts = [0, *bounds]
    for i, start in enumerate(starts):
        assert s(start) == values[i]
        end = starts[i + 1] if i + 1 < len(starts) else start + 5
        assert s(end - 1) == values[i] + (end - 1 - start)


@settings(max_examples=60, deadline=None)
@given(
    init=st.floats(1e-4, 10.0),
    end_frac=st.floats(0.0, 1.0),
    steps=st.integers(1, 300),
    gamma=st.floats(0.01, 0.99),
    size=st.integers(1, 50),
)
def test_decays_are_monotone(init, end_frac, steps, gamma, size):
    for s in [
        schedules.cosine(init, steps, init * end_frac),
        schedules.linear(init, init * end_frac, steps),
        schedules.exponential(init, gamma),
        schedules.step(init, size, gamma),
    ]:
        vals = [s(t) for t in range(0, 2 * steps + 2)]
        assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(vals))
        assert vals[0] == pytest.approx(init, rel=1e-12)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: schedules.linear(1.0, 0.0, 0), "transition_steps must be an int >= 1"),
        (lambda: schedules.cosine(1.0, 2.5), "decay_steps must be an int >= 1"),
        (lambda: schedules.warmup_cosine(1.0, 10, 10), r"total_steps \(10\) must be greater"),
        (lambda: schedules.exponential(1.0, 0.0), "decay_rate must be > 0"),
        (lambda: schedules.step(1.0, 0), "step_size must be an int >= 1"),
        (lambda: schedules.multistep(1.0, [5, 3]), "strictly increasing"),
        (lambda: schedules.one_cycle(1.0, 10, pct_start=1.5), "invalid pct_start"),
        (lambda: schedules.one_cycle(1.0, 3, pct_start=0.3), "phases must be non-empty"),
        (lambda: schedules.one_cycle(1.0, 10, anneal_strategy="cosine"), "anneal_strategy"),
        (lambda: schedules.one_cycle(-1.0, 10), "max_lr must be > 0"),
        (lambda: schedules.join([schedules.constant(1.0)], [3]), "len\\(boundaries\\)"),
        (
            lambda: schedules.join([schedules.constant(1.0)] * 3, [5, 5]),
            "boundaries must be strictly increasing",
        ),
        (lambda: schedules.constant(float("inf")), "value must be finite"),
    ],
)
def test_bad_arguments(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()
