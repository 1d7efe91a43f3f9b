"""A local Ray cluster for one test module: 2 CPUs, loopback only, torn down at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import pytest


@contextlib.contextmanager
def local_cluster(ray: Any, env: Mapping[str, str]) -> Iterator[Any]:
    """``ray.init`` of a fresh single-machine cluster on 127.0.0.1 with ``env`` set for it and
    the processes it starts; ``ray.shutdown()`` (its processes with it) on the way out."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        # ray may have been imported before the test module set the variable (another test
        # module): its constant, read when the node address is resolved, says the same
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        info = ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
        try:
            yield info
        finally:
            ray.shutdown()
