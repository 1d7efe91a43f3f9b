"""Form the default process group within one stated timeout, naming the ranks that are missing.

``init_process_group`` with ``env://`` can wait longer than its ``timeout``: the store
connection and the backend's own rendezvous each wait up to it (a rank killed during
set-up left the others waiting 61-102 s for a 60 s timeout). ``form_group`` spends one
deadline on three steps: reach the TCP store at ``MASTER_ADDR:MASTER_PORT`` (rank 0 hosts
it, or the ``torchrun`` agent does), wait for every rank to check in (the error names the
ranks that did not), then create the group with what is left; the group's collective timeout
is then set to the full ``timeout``.

The store outlives the group: ``form_group(..., store=store)`` forms the group again over
the same store (each formation in a process uses its own keys), so a strategy can destroy
its group between runs and form it again for the next one. ``Formation`` is such a group:
formed, destroyed and formed again over one store, and able to tell whether the live default
group is the one it formed.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import time

import torch.distributed as dist

from .process_env import ProcessEnv

__all__ = ["Formation", "form_group"]

_PROBE = 0.05  # seconds between attempts to reach the store's port

# Every formation in this process gets fresh store keys; every rank forms its groups in the
# same order, so the numbers agree across ranks.
_GENERATIONS = itertools.count()


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _connect(env: ProcessEnv, deadline: float) -> dist.Store:
    """The run's TCP store (rank 0 hosts it unless the ``torchrun`` agent does), reached
    before ``deadline`` (a ``time.monotonic()`` time)."""
    where = f"{env.master_addr}:{env.master_port}"
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = env.rank == 0 and not agent
    if not host:  # wait for the port quietly (a store client logs every failed attempt)
        while True:
            try:
                with socket.create_connection(
                    (env.master_addr, env.master_port), timeout=max(min(1.0, _left(deadline)), 0.01)
                ):
                    break
            except OSError as err:
                if _left(deadline) <= 0:
                    owner = "the torchrun agent" if agent else "rank 0"
                    raise RuntimeError(
                        f"nothing answered at {where} ({owner} hosts the store there: "
                        f"is it running?): {err}"
                    ) from None
                time.sleep(_PROBE)
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=host,
        timeout=_delta(_left(deadline)),
        wait_for_workers=False,
        multi_tenant=True,
    )


def _check_in(store: dist.Store, env: ProcessEnv, deadline: float) -> None:
    """Announce this rank and wait for all the others; name the ranks that do not come."""
    store.set(f"joined/{env.rank}", "1")
    if store.add("joined", 1) == env.world_size:
        store.set("all_joined", "1")
    try:
        store.wait(["all_joined"], _delta(_left(deadline)))
    except RuntimeError as err:
        try:
            missing = [r for r in range(env.world_size) if not store.check([f"joined/{r}"])]
        except RuntimeError:
            missing = None  # the store itself went away (rank 0 died)
        if missing is None:
            why = f"lost the store (did rank 0 die?): {err}"
        else:
            names = ", ".join(map(str, missing))
            why = f"rank(s) {names} of {env.world_size} did not join"
        raise RuntimeError(why) from None


def form_group(
    backend: str,
    env: ProcessEnv,
    timeout: float,
    *,
    store: dist.Store | None = None,
) -> dist.Store:
    """Initialise the default process group within ``timeout`` seconds; return the store
    (pass it back as ``store`` to form the group again after destroying it).

    Raises ``RuntimeError`` saying what was missing (the store, or which ranks); the
    caller adds who and where.
    """
    deadline = time.monotonic() + timeout
    if store is None:
        store = _connect(env, deadline)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    scoped = dist.PrefixStore(f"purestep/{restart}/{next(_GENERATIONS)}/", store)
    _check_in(scoped, env, deadline)
    left = _left(deadline)
    if left <= 0:
        raise RuntimeError("every rank joined, but too late to create the group")
    store.set_timeout(_delta(left))
    dist.init_process_group(
        backend, store=scoped, rank=env.rank, world_size=env.world_size, timeout=_delta(left)
    )
    store.set_timeout(_delta(timeout))
    dist.group.WORLD.set_timeout(_delta(timeout))
    return store


class Formation:
    """A default group ``form_group`` formed with ``backend``, ``env`` and ``timeout``, which
    ``destroy()`` ends and ``form()`` forms again over the same store."""

    def __init__(self, backend: str, env: ProcessEnv, timeout: float) -> None:
        self.backend = backend
        self.env = env
        self.timeout = timeout
        self.store: dist.Store | None = None
        self._world: object | None = None  # the default group this formed, while alive

    @property
    def alive(self) -> bool:
        """Whether the live default group is the one this formed."""
        return self._world is not None and dist.is_initialized() and dist.group.WORLD is self._world

    def form(self) -> None:
        """Form the group (every rank must call it, as for a collective) unless it is alive;
        ``RuntimeError`` if another default group is alive."""
        if self.alive:
            return
        if dist.is_initialized():
            raise RuntimeError(
                "another default process group was initialised meanwhile (destroy it with "
                "torch.distributed.destroy_process_group() before the next run, or pass "
                "strategy=hardware.ddp(), whose group lives until close())"
            )
        self._world = None
        self.store = form_group(self.backend, self.env, self.timeout, store=self.store)
        self._world = dist.group.WORLD

    def destroy(self, *, final: bool = False) -> None:
        """Destroy the group if it is alive; ``final``: drop the store too."""
        if self.alive:
            dist.destroy_process_group()
        self._world = None
        if final:
            self.store = None
