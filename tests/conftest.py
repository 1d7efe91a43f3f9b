"""Shared test settings: a single intra-op thread keeps timings and results stable."""

import fcntl
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(1)

settings.register_profile(
    "ci", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _work_in_a_temporary_folder(tmp_path, monkeypatch):
    """Every test runs in its own folder, so default run folders never land in the repo."""
    monkeypatch.chdir(tmp_path)


_SEED_VARIABLES = (
    "PURESTEP_GLOBAL_SEED",
    "PURESTEP_SEED_WORKERS",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


@pytest.fixture(autouse=True)
def _forget_recorded_seeds():
    """``seed_everything`` records its seed in the environment (spawned ranks read it, and
    ``Trainer.fit`` defaults to it): no test's seed reaches the next test."""
    saved = {name: os.environ.get(name) for name in _SEED_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def cores_to_ourselves(tmp_path_factory):
    """Holds a lock shared by every pytest-xdist worker of this run while a test module
    that starts a local cluster (Ray) runs, so two clusters never share the two cores: the
    suite runs with ``--dist loadfile``, and the other worker waits here for its turn."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' folders share this one
    with open(root / "cores.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
