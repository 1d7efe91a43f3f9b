"""Asynchronous checkpoint writes: snapshot now, serialise and write in a background thread.

Because steps never modify their input state, a snapshot of a state is the state itself:
nothing needs copying unless the state's storage will be reused (``donate=True`` steps, or
tensors on an accelerator, which are copied to the CPU so the device can move on). One write
is in flight at a time; a new save waits for the previous one. ``wait()`` blocks until the
writes are done and re-raises a failed write's error; ``close()`` waits and stops the
thread. An ``atexit`` hook waits too, so a process never exits with a save in flight.

The metadata is not the state: it can hold the caller's live objects (the Trainer's holds
what the save hooks returned and the task's hparams), which the caller may change as soon
as ``save`` returns. So ``save`` encodes it with the codec in the caller's thread, copying
its tensors (to the CPU, like the state's accelerator tensors), whatever ``copy`` says: the
file holds the metadata as it was when ``save`` was called, and a metadata value the codec
cannot write is an error from ``save`` itself.
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

from .codec import encode
from .files import serialize, versions, write_payload

__all__ = ["AsyncCheckpointer"]

_LIVE: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


def _wait_all() -> None:
    for saver in list(_LIVE):
        saver.close()


atexit.register(_wait_all)


def _copy_tensors(encoded: Any) -> Any:
    """``encoded`` (the codec's plain data: dicts, lists, leaves) with fresh containers and
    every tensor copied, so nothing in it is shared with the caller's objects."""
    if isinstance(encoded, torch.Tensor):
        if encoded.device.type != "cpu":
            return encoded.detach().to("cpu", copy=True)
        return encoded.detach().clone()
    if isinstance(encoded, dict):
        return {k: _copy_tensors(v) for k, v in encoded.items()}
    if isinstance(encoded, list):
        return [_copy_tensors(v) for v in encoded]
    return encoded


def _snapshot_metadata(metadata: Mapping[str, Any] | None) -> Any:
    """The payload's ``metadata`` entry, as ``serialize`` would encode it, taken now."""
    return _copy_tensors(encode({"versions": versions(), **dict(metadata or {})}, "metadata"))


class AsyncCheckpointer:
    """Writes checkpoints in a background thread (see the module docstring).

    ``copy``: ``"auto"`` copies only tensors not on the CPU; ``"always"`` copies every
    tensor (use it when the state will be donated to a step); ``"never"`` trusts the
    caller to leave the state alone. The metadata is always snapshotted (module doc).
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
        """Queue a write of ``state`` to ``url``; returns once the snapshots of the state
        and of ``metadata`` are taken (the caller may change either afterwards)."""
        if self._closed:
            raise RuntimeError("this AsyncCheckpointer is closed")
        meta = _snapshot_metadata(metadata)
        snapshot = self._snapshot(state)
        with self._lock:
            self.wait()
            self._pending = self._executor.submit(self._write, snapshot, url, meta)

    def _write(self, state: Any, url: str, encoded_metadata: Any) -> None:
        payload = serialize(state)
        payload["metadata"] = encoded_metadata  # encoded in ``save``, the caller's thread
        write_payload(payload, url, **self.write_options)

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
