"""Who this process is in a multi-process run: the variables ``torchrun`` sets, read and written.

``torchrun`` (and ``hardware.launch``) start each worker with ``RANK`` (its place among all
processes), ``WORLD_SIZE`` (how many there are), ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (the
same on this machine; ``LOCAL_RANK`` picks the GPU) and ``MASTER_ADDR`` / ``MASTER_PORT``
(where rank 0 listens for the others to meet). ``ProcessEnv.from_environ`` reads them with
one clear error when they are missing or inconsistent; ``to_environ`` writes them. Other
launchers (``srun``, ``jsrun``, ``mpirun``) say the same in their own variables:
``hardware.cluster.process_env()`` detects which one started the process and reads its.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

__all__ = ["ProcessEnv"]

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the run (all ranks count from 0)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"WORLD_SIZE must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside [0, WORLD_SIZE={self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"LOCAL_RANK={self.local_rank} is outside "
                f"[0, LOCAL_WORLD_SIZE={self.local_world_size})"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"MASTER_PORT={self.master_port} is not a TCP port")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ProcessEnv:
        """Read the torchrun variables; ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` default to
        ``RANK`` / ``WORLD_SIZE`` (one machine)."""
        env = os.environ if environ is None else environ
        missing = [name for name in _REQUIRED if name not in env]
        if missing:
            raise RuntimeError(
                f"this process was not started as one of several ranks: {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set. Start the script with "
                "`torchrun --nproc_per_node=N script.py`, or call the training function "
                "through hardware.launch(fn, N)"
            )
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        return cls(
            rank, world, local_rank, local_world, env["MASTER_ADDR"], _int(env, "MASTER_PORT")
        )

    def to_environ(self) -> dict[str, str]:
        """The variables as ``torchrun`` sets them (single machine: ``GROUP_RANK=0``)."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
