"""CI runs the README's test command, and that command's bitwise rerun selects tests.

``.ci/run`` must contain the test part (the pytest commands) of the README's "Fresh
machine" test command verbatim, so the two cannot drift. The second pytest command reruns
the tests marked ``bitwise`` under ``ATEN_CPU_CAPABILITY=default``; pytest exits 5 when a
marker selects nothing, so this file's own tests carry the marker (the selection is never
empty) and one of them counts what the marker selects. Run time: about 10 s (one
collection of the suite in a subprocess).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.bitwise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = 'pip install -e ".[test]" && '


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def readme_test_command() -> str:
    """The second ``bash`` block of the README's "Fresh machine" section, as one line."""
    text = _read("README.md")
    section = text.split("## Fresh machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "the Fresh machine section should hold two bash blocks"
    lines = [line for line in blocks[1].splitlines() if line.strip()]
    assert len(lines) == 1, "the test command should be one line"
    return lines[0]


def readme_test_part() -> str:
    command = readme_test_command()
    assert INSTALL in command, command
    return command.split(INSTALL, 1)[1]


def test_ci_runs_the_readmes_exact_test_command():
    tests = readme_test_part()
    assert tests == (
        "python -m pytest -q -n 2 --dist loadfile && "
        "ATEN_CPU_CAPABILITY=default python -m pytest -q -n 2 --dist loadfile -m bitwise"
    )
    ci = [line.strip() for line in _read(".ci", "run").splitlines()]
    assert tests in ci, ".ci/run does not run the README's test command as one line"
    assert ci.index(tests) > ci.index('pip install torch==2.13.0 && pip install -e ".[test]"')
    assert "ruff check ." in ci and "ruff format --check ." in ci
    development = _read("README.md").split("## Development", 1)[1]
    assert tests in development, "the Development section's command has drifted"


def test_the_bitwise_marker_is_registered_and_selects_the_bitwise_claims():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "bitwise", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    files = {i.split("::", 1)[0] for i in ids}
    assert len(ids) >= 150, f"only {len(ids)} tests are marked bitwise"
    for name in ("test_optim_parity.py", "test_resume.py", "test_donation.py", "test_step.py"):
        assert f"tests/{name}" in files, f"{name} lost its bitwise marks"
    assert "bitwise:" in _read("pyproject.toml")  # registered, so -m bitwise is no typo


def test_the_scalar_kernels_are_in_effect_when_asked_for():
    """``ATEN_CPU_CAPABILITY=default`` must reach torch, or the rerun would prove nothing."""
    wanted = os.environ.get("ATEN_CPU_CAPABILITY")
    if wanted != "default":
        pytest.skip("ATEN_CPU_CAPABILITY=default is not set (the first pytest command)")
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
