"""examples/ddp.py runs both ways (hardware.launch and torchrun) and learns.

Run time: about 15 s on 2 shared cores (two 2-rank runs of 3 epochs each, in subprocesses).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(150)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ddp.py")


def _run(command: list[str]) -> str:
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _test_acc(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"test_acc=(\d\.\d+)", last)
    assert match, f"the last line is {last!r}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def runs() -> dict[str, str]:
    """The example's output under hardware.launch and under torchrun (3 epochs, 2 ranks)."""
    spawned = _run([sys.executable, EXAMPLE, "--spawn", "2", "--epochs", "3"])
    torchrun = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            EXAMPLE,
            "--epochs",
            "3",
        ]
    )
    return {"spawn": spawned, "torchrun": torchrun}


def test_spawned_ranks_learn_the_digits(runs):
    out = runs["spawn"]
    assert "DDP(rank=0/2" in out and "DDP(rank=1/2" not in out  # rank 0 alone prints
    assert _test_acc(out) > 0.8  # ~0.92 after 3 epochs; a tenth of that is chance


def test_torchrun_ranks_learn_the_digits(runs):
    out = runs["torchrun"]
    assert out.count("test_acc=") == 1
    assert _test_acc(out) > 0.8


def _results(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("epoch", "test_acc="))]


def test_the_seed_fixes_the_run_however_the_ranks_are_started(runs):
    # seed_everything(--seed) before the template is built: the same initial weights, so
    # the same losses and accuracies to the printed digit, launched either way
    spawned, torchrun = _results(runs["spawn"]), _results(runs["torchrun"])
    assert len(spawned) == 4 and spawned == torchrun
