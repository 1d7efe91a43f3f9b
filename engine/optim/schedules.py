"""Learning-rate (or any hyper-parameter) schedules: pure functions ``count -> float``.

``count`` is the number of updates the consuming transform has made, so the first step
sees ``schedule(0)``, as with a torch LR scheduler stepped after each optimizer step.
Every schedule is a closed form of ``count`` (no hidden state), and the arguments are
checked when the schedule is made. Names follow torch's schedulers where one exists:
``step`` ~ ``StepLR``, ``multistep`` ~ ``MultiStepLR``, ``exponential`` ~ ``ExponentialLR``,
``linear`` ~ ``LinearLR``, ``cosine`` ~ ``CosineAnnealingLR`` (up to ``T_max`` only),
``one_cycle`` ~ ``OneCycleLR`` (without its momentum cycling). They are closed forms, so they
agree with torch's recursive ("chainable") forms to rounding only; for torch's exact values
translate the torch scheduler object itself (``engine.optim.from_torch_scheduler``, which the
Trainer does for a scheduler returned from ``configure_optimizers``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from . import _util

__all__ = [
    "Schedule",
    "constant",
    "cosine",
    "exponential",
    "join",
    "linear",
    "multistep",
    "one_cycle",
    "step",
    "warmup_cosine",
]

Schedule = Callable[[int], float]


def _steps(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _finite(name: str, value: Any) -> float:
    x = _util.scalar(name, value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return x


def constant(value: float) -> Schedule:
    """``value`` at every step."""
    value = _finite("value", value)

    def schedule(count: int) -> float:
        return value

    return schedule


def linear(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """``init_value`` until ``transition_begin``, then linearly to ``end_value`` over
    ``transition_steps`` steps, then ``end_value``."""
    init_value = _finite("init_value", init_value)
    end_value = _finite("end_value", end_value)
    transition_steps = _steps("transition_steps", transition_steps, 1)
    transition_begin = _steps("transition_begin", transition_begin)

    def schedule(count: int) -> float:
        t = min(max(count - transition_begin, 0), transition_steps)
        return init_value + (end_value - init_value) * (t / transition_steps)

    return schedule


def cosine(init_value: float, decay_steps: int, end_value: float = 0.0) -> Schedule:
    """``end_value + (init_value - end_value) * (1 + cos(pi * t / decay_steps)) / 2`` with
    ``t = min(count, decay_steps)``: half a cosine from ``init_value`` down to ``end_value``
    over ``decay_steps`` steps, then ``end_value`` for ever.

    Up to ``decay_steps`` this is the closed form of ``CosineAnnealingLR(T_max=decay_steps,
    eta_min=end_value)`` (equal to rounding: torch's steps are recursive). Past ``T_max``
    torch's rate rises again, along the continued cosine, where this one holds at
    ``end_value``; for torch's exact values, past ``T_max`` too, translate the scheduler
    object (``engine.optim.from_torch_scheduler``)."""
    init_value = _finite("init_value", init_value)
    end_value = _finite("end_value", end_value)
    decay_steps = _steps("decay_steps", decay_steps, 1)

    def schedule(count: int) -> float:
        t = min(max(count, 0), decay_steps)
        return end_value + (init_value - end_value) * (1 + math.cos(math.pi * t / decay_steps)) / 2

    return schedule


def warmup_cosine(
    peak_value: float,
    warmup_steps: int,
    total_steps: int,
    init_value: float = 0.0,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then a
    cosine decay to ``end_value`` reached at ``total_steps`` (counted from step 0)."""
    warmup_steps = _steps("warmup_steps", warmup_steps)
    total_steps = _steps("total_steps", total_steps, 1)
    if total_steps <= warmup_steps:
        raise ValueError(
            f"total_steps ({total_steps}) must be greater than warmup_steps ({warmup_steps})"
        )
    decay = cosine(peak_value, total_steps - warmup_steps, end_value)
    if warmup_steps == 0:
        return decay
    return join([linear(init_value, peak_value, warmup_steps), decay], [warmup_steps])


def exponential(
    init_value: float,
    decay_rate: float,
    transition_steps: int = 1,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """``init_value * decay_rate ** (count / transition_steps)`` (the exponent floored when
    ``staircase``), never past ``end_value`` if given (``ExponentialLR(gamma=decay_rate)``
    with the defaults)."""
    init_value = _finite("init_value", init_value)
    decay_rate = _finite("decay_rate", decay_rate)
    if decay_rate <= 0:
        raise ValueError(f"decay_rate must be > 0, got {decay_rate!r}")
    transition_steps = _steps("transition_steps", transition_steps, 1)
    staircase = _util.flag("staircase", staircase)
    end = None if end_value is None else _finite("end_value", end_value)

    def schedule(count: int) -> float:
        count = max(count, 0)
        p = count // transition_steps if staircase else count / transition_steps
        value = init_value * decay_rate**p
        if end is not None:
            value = max(value, end) if decay_rate < 1 else min(value, end)
        return value

    return schedule


def step(init_value: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """``init_value * gamma ** (count // step_size)`` (``StepLR``)."""
    init_value = _finite("init_value", init_value)
    step_size = _steps("step_size", step_size, 1)
    gamma = _finite("gamma", gamma)

    def schedule(count: int) -> float:
        return init_value * gamma ** (max(count, 0) // step_size)

    return schedule


def multistep(init_value: float, milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    """``init_value * gamma ** (number of milestones <= count)`` (``MultiStepLR``)."""
    init_value = _finite("init_value", init_value)
    gamma = _finite("gamma", gamma)
    marks = [_steps("milestones", m, 1) for m in milestones]
    if any(b <= a for a, b in itertools.pairwise(marks)):
        raise ValueError(f"milestones must be strictly increasing, got {list(milestones)}")

    def schedule(count: int) -> float:
        return init_value * gamma ** bisect.bisect_right(marks, count)

    return schedule


def one_cycle(
    max_lr: float,
    total_steps: int,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal_strategy: str = "cos",
    three_phase: bool = False,
) -> Schedule:
    """The 1cycle policy of ``OneCycleLR``: from ``max_lr / div_factor`` up to ``max_lr``
    at step ``pct_start * total_steps - 1``, then down to ``initial / final_div_factor`` at
    step ``total_steps - 1`` (with ``three_phase``: back to the initial value at
    ``2 * pct_start * total_steps - 2`` first). Cosine or linear annealing. Past the last
    step the value stays at the final one (torch raises there). Momentum cycling is not
    part of this schedule.
    """
    max_lr = _finite("max_lr", max_lr)
    if max_lr <= 0:
        raise ValueError(f"max_lr must be > 0, got {max_lr!r}")
    total_steps = _steps("total_steps", total_steps, 1)
    pct_start = _util.check("pct_start", pct_start, low=0.0, high=1.0)
    div_factor = _util.check("div_factor", div_factor, low=0.0, low_open=True)
    final_div_factor = _util.check("final_div_factor", final_div_factor, low=0.0, low_open=True)
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
    three_phase = _util.flag("three_phase", three_phase)
    initial = max_lr / div_factor
    final = initial / final_div_factor
    rise_end = pct_start * total_steps - 1
    if three_phase:
        phases = [(rise_end, initial, max_lr), (2 * rise_end, max_lr, initial)]
        phases.append((total_steps - 1, initial, final))
    else:
        phases = [(rise_end, initial, max_lr), (total_steps - 1, max_lr, final)]
    start = 0.0
    for end, _, _ in phases:
        if not end > start:
            raise ValueError(
                f"one_cycle phases must be non-empty: with total_steps={total_steps}, "
                f"pct_start={pct_start} and three_phase={three_phase} the phase boundaries "
                f"are {[0.0] + [p[0] for p in phases]}; raise total_steps or change pct_start"
            )
        start = end
    cos = anneal_strategy == "cos"

    def schedule(count: int) -> float:
        t = min(max(count, 0), total_steps - 1)
        begin = 0.0
        for end, first, last in phases:
            if t <= end or end == phases[-1][0]:
                pct = (t - begin) / (end - begin)
                if cos:
                    return last + (first - last) * (1 + math.cos(math.pi * pct)) / 2
                return first + (last - first) * pct
            begin = end
        raise AssertionError("unreachable")

    return schedule


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``boundaries[i-1]`` on (boundaries[-1] = 0), each called with
    the steps since its own start."""
    schedules = list(schedules)
    bounds = [_steps("boundaries", b) for b in boundaries]
    if not schedules:
        raise ValueError("join() needs at least one schedule")
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(f"join(): schedules[{i}] is not callable")
    if len(bounds) != len(schedules) - 1:
        raise ValueError(
            f"join() needs len(boundaries) == len(schedules) - 1, got {len(bounds)} boundaries "
            f"for {len(schedules)} schedules"
        )
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"boundaries must be strictly increasing, got {list(boundaries)}")
    starts = [0, *bounds]

    def schedule(count: int) -> float:
        i = bisect.bisect_right(bounds, count)
        return schedules[i](count - starts[i])

    return schedule
