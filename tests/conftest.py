"""Shared test settings: a single intra-op thread keeps timings and results stable."""

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
