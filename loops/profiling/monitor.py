"""``Monitor``: an event observer that measures the run and reports metrics for the loggers.

Clock and device readings are effects: they are no function of the computation, so they
must stay out of the ``TrainState`` (a resumed run ends bitwise equal to an uninterrupted
one). A monitor is therefore not a pure callback but an observer, like the progress bar:
the driver calls ``on_event(event, ctx)`` at the events named in ``events``, and what it
returns — ``None``, a mapping of metrics (logged at the driver's logger step, Lightning's
``_batches_that_stepped``) or ``(metrics, step)`` — goes to the loggers (primary process
only) and to ``Trainer.logged_metrics``, never to ``callback_metrics``. The Trainer takes
monitors in ``callbacks=[...]`` (``trainer.monitors`` lists them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..events import Context

__all__ = ["Monitor"]


class Monitor:
    """Base class of monitors: override ``on_event`` and set ``events``."""

    #: The events this monitor watches (the driver builds no context for the others).
    events: frozenset[str] = frozenset()

    def on_event(
        self, event: str, ctx: Context
    ) -> Mapping[str, Any] | tuple[Mapping[str, Any], int] | None:
        """Observe ``event``; return metrics to log (see the module docstring) or None."""
        return None
