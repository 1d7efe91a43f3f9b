"""The gradient-accumulation window's counters: its size at a point of the run, and the
``Progress`` after one micro-batch (which closes the window or leaves it open)."""

from __future__ import annotations

from collections.abc import Callable

from .state import Progress

__all__ = ["advance_progress", "window_size"]


def window_size(accumulate: Callable[[Progress], int], progress: Progress) -> int:
    """The micro-batches of the accumulation window a schedule gives at ``progress``."""
    k = accumulate(progress)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"the accumulation schedule returned {k!r}; it must be an int >= 1")
    return k


def advance_progress(progress: Progress, samples: int, stepped: bool) -> Progress:
    """The counters after one micro-batch of ``samples`` (closing its window if ``stepped``)."""
    if stepped:
        return progress.replace(
            step=progress.step + 1,
            batch_in_epoch=progress.batch_in_epoch + 1,
            total_batches=progress.total_batches + 1,
            samples=progress.samples + samples,
            micro_step=0,
        )
    return progress.replace(
        batch_in_epoch=progress.batch_in_epoch + 1,
        total_batches=progress.total_batches + 1,
        samples=progress.samples + samples,
        micro_step=progress.micro_step + 1,
    )
