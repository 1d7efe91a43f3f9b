"""Ctrl-C held back while a loop writes its state in place.

A loop that donates its state to the step (``FitLoop(donate=True)``, the Trainer's default)
lets the optimizer update parameters and optimizer state in place. A ``KeyboardInterrupt``
raised between two of those writes would leave a torn state, and Ctrl-C must return a whole
one. ``InterruptGuard`` installs a SIGINT handler for the run: outside a critical section it
raises ``KeyboardInterrupt`` at once, as Python's default handler does; inside one it notes
the signal and raises when the section ends, where the state is whole again. It installs
itself only in the main thread (the only one Python delivers signals to) and only over
Python's default handler or another guard's (a fit inside a fit), so a handler of the
user's own is left alone.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["InterruptGuard"]


class InterruptGuard:
    """Defers SIGINT over critical sections: ``install()``, then ``enter()`` / ``leave()``
    around each in-place update, ``uninstall()`` at the end of the run."""

    def __init__(self) -> None:
        self.installed = False
        self._critical = False
        self._pending = False
        self._previous: Any = None

    def install(self) -> bool:
        """Take over SIGINT if this is the main thread and Python's default handler (or
        another guard's) is in place; returns whether it did."""
        if threading.current_thread() is not threading.main_thread():
            return False
        current = signal.getsignal(signal.SIGINT)
        nested = isinstance(getattr(current, "__self__", None), InterruptGuard)
        if current is not signal.default_int_handler and not nested:
            return False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Give SIGINT back to the handler that was there before ``install``."""
        if self.installed:
            signal.signal(signal.SIGINT, self._previous)
            self.installed = False
        self._critical = self._pending = False

    def enter(self) -> None:
        """Start a critical section: Ctrl-C waits until ``leave``."""
        self._critical = True

    def leave(self) -> None:
        """End a critical section; raise the ``KeyboardInterrupt`` that arrived during it."""
        self._critical = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._critical:
            self._pending = True
            return
        raise KeyboardInterrupt
