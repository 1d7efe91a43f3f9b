"""Asynchronous checkpoint writes: snapshot now, serialise and write in a background thread.

Because steps never modify their input state, a snapshot of a state is the state itself:
nothing needs copying unless the state's storage will be reused (``donate=True`` steps, or
tensors on an accelerator, which are copied to the CPU so the device can move on). One write
is in flight at a time; a new save waits for the previous one. ``wait()`` blocks until the
writes are done and re-raises a failed write's error; ``close()`` waits and stops the
thread. An ``atexit`` hook waits too, so a process never exits with a save in flight.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from purestep.engine import tree

from .files import serialize, write_payload

__all__ = ["AsyncCheckpointer"]

_LIVE: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


def _wait_all() -> None:
    for saver in list(_LIVE):
        saver.close()


atexit.register(_wait_all)


class AsyncCheckpointer:
    """Writes checkpoints in a background thread (see the module docstring).

    ``copy``: ``"auto"`` copies only tensors not on the CPU; ``"always"`` copies every
    tensor (use it when the state will be donated to a step); ``"never"`` trusts the
    caller to leave the state alone.
    """

    def __init__(self, *, copy: str = "auto", **write_options: Any) -> None:
        if copy not in ("auto", "always", "never"):
            raise ValueError(f"copy must be 'auto', 'always' or 'never', got {copy!r}")
        self.copy = copy
        self.write_options = write_options
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="purestep-ckpt")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self._closed = False
        _LIVE.add(self)

    def _snapshot(self, state: Any) -> Any:
        if self.copy == "never":
            return state

        def one(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if x.device.type != "cpu":
                return x.detach().to("cpu", copy=True)
            return x.detach().clone() if self.copy == "always" else x

        return tree.map(one, state)

    def save(self, state: Any, url: str, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Queue a write of ``state`` to ``url``; returns once the snapshot is taken."""
        if self._closed:
            raise RuntimeError("this AsyncCheckpointer is closed")
        snapshot = self._snapshot(state)
        meta = dict(metadata or {})
        with self._lock:
            self.wait()
            self._pending = self._executor.submit(self._write, snapshot, url, meta)

    def _write(self, state: Any, url: str, metadata: dict[str, Any]) -> None:
        write_payload(serialize(state, metadata), url, **self.write_options)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the queued write is done; re-raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the queued write and stop the background thread."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
