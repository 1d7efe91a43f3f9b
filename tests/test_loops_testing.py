"""loops.testing: the README example of property-testing a custom loop, and the strategies."""

from __future__ import annotations

import math
import re
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from purestep.loops import schedule, testing
from purestep.loops.config import LoopConfig

# --- the README example (also in the loops.testing docstring) ---------------------------


def my_steps(config, length):  # a custom loop: how many optimizer steps does it take?
    steps, batches = 0, schedule.train_batches(config, length)
    for epoch in range(config.max_epochs):
        factor = schedule.accumulation_factor(config, epoch)
        for i in range(batches):
            if schedule.reached(steps, config.max_steps):
                return steps
            steps += schedule.is_optimizer_step(i, factor, batches, i + 1 == batches)
    return steps


@given(testing.configs(max_epochs=st.integers(0, 3)), testing.data_sizes())
def test_my_loop_steps_like_fit(config, sizes):
    trace = testing.simulate_fit(config, sizes.train)
    assert my_steps(config, sizes.train) == trace.global_step


# --- the docstring copy runs too ----------------------------------------------------------


def test_the_docstring_example_runs_and_matches_this_file():
    doc = testing.__doc__
    block = doc[doc.index("::\n") + 3 : doc.index("\nDefaults are")]
    code = textwrap.dedent(block)
    namespace: dict = {}
    exec(compile(code, "loops.testing docstring", "exec"), namespace)
    namespace["test_my_loop_steps_like_fit"]()
    with open(__file__) as f:
        source = f.read()
    for line in code.strip().splitlines():
        if line.strip() and not line.startswith(("from ", "import ")):
            assert line in source, f"docstring line differs from the test file: {line!r}"


# --- strategies ----------------------------------------------------------------------------


@given(testing.configs(max_epochs=2, limit_val_batches=st.sampled_from([0, 3])))
def test_configs_respect_fixed_and_drawn_overrides(config):
    assert config.max_epochs == 2 and config.limit_val_batches in (0, 3)
    assert not config.fast_dev_run and not config.overfit_batches  # they would override limits


def test_unknown_overrides_are_refused_with_a_suggestion():
    with pytest.raises(TypeError, match=r"Did you mean `max_steps`"):
        testing.configs(max_step=3)
    with pytest.raises(TypeError, match=r"unknown Progress fields \['epochs'\]"):
        testing.progress(epochs=1)


@given(testing.progress(epoch=st.integers(0, 3)))
def test_progress_counters_are_consistent(p):
    assert 0 <= p.epoch <= 3
    assert 0 <= p.step <= p.total_batches and p.batch_in_epoch <= p.total_batches
    assert p.samples >= p.total_batches and 0 <= p.micro_step <= p.batch_in_epoch


@given(testing.data_sizes(max_loaders=3, unsized=True))
def test_data_sizes_are_within_bounds(sizes):
    assert sizes.train == math.inf or 2 <= sizes.train <= 12
    assert 1 <= len(sizes.val) <= 3 and len(sizes.test) <= 3
    assert all(2 <= n <= 12 for n in (*sizes.val, *sizes.test, *sizes.predict))


def test_simulate_fit_refuses_a_run_that_never_ends():
    config = LoopConfig.create(max_epochs=2)
    with pytest.raises(ValueError, match=re.escape("nothing that ends the first epoch")):
        testing.simulate_fit(config, math.inf)
    trace = testing.simulate_fit(config, math.inf, stop_at=4)
    assert len(trace.batches) == 5 and trace.reason.endswith("a stop was requested.")
