"""One seed fixes the whole run: each example, run twice in fresh processes, prints the same
result and (where it writes one) saves bitwise the same final state.

The examples build their models from torch's global generator, which they seed with
``seed_everything``; the runs are short (an epoch or a dozen steps) and run two at a time.
Run time: about 25 s on 2 cores.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from purestep.engine import checkpoint, tree

pytest.importorskip("sklearn")
pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

# name -> its arguments ("{root}" is the run's folder); the checkpoints a run writes there
# are compared too
RUNS = {
    "digits.py": ["--epochs", "2", "--no-progress-bar", "--root", "{root}"],
    "dp_sgd.py": ["--epochs", "1"],
    "custom_loop.py": ["--epochs", "1", "--samples", "256", "--root", "{root}"],
    "gan.py": ["--epochs", "1", "--samples", "256", "--root", "{root}"],
    "char_lm.py": [
        *("--steps", "6", "--bytes", "6000", "--width", "16", "--layers", "1"),
        *("--context", "8", "--batch-size", "8", "--backend", "aot_eager", "--root", "{root}"),
    ],
}
_SEEDS = ("PURESTEP_GLOBAL_SEED", "PL_GLOBAL_SEED")


def _run(name: str, root: str) -> str:
    args = [a.replace("{root}", root) for a in RUNS[name]]
    env = {k: v for k, v in os.environ.items() if k not in _SEEDS}
    done = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _checkpoints(root: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in pathlib.Path(root).glob("**/*.ckpt"))


def _result(name: str, stdout: str) -> str:
    """The line that states the run's result, without figures that measure time."""
    last = stdout.strip().splitlines()[-1]
    if name == "char_lm.py":  # tokens per second vary; the losses may not
        return " ".join(re.findall(r"\w+_val_loss=\S+", last))
    return last


@pytest.mark.parametrize("name", sorted(RUNS))
def test_an_example_run_twice_in_fresh_processes_gives_the_same_result(name, tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    for root in roots:
        os.makedirs(root)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda root: _run(name, root), roots))
    first, second = (_result(name, out) for out in outs)
    assert first and first == second
    saved = _checkpoints(roots[0])
    assert saved == _checkpoints(roots[1])
    for path in saved:
        states = [checkpoint.load(os.path.join(root, path))[0] for root in roots]
        assert tree.trees_equal(states[0], states[1]), path
