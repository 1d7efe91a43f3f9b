"""``SimpleProfiler``: how often each action ran, how long it took, and its share of the run.

The report is Lightning's table: one row per action, ``Action | Mean duration (s) | Num
calls | Total time (s) | Percentage %`` (``extended=False``: ``Action | Mean duration (s) |
Total time (s)``), the busiest first, after a ``Total`` row for the whole run (from
``setup`` to the report). ``parse_report`` reads such a table back.

Each action keeps a count and a sum (O(1) memory however long the run); a start and a stop
cost two clock reads and two dictionary updates.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .base import Profiler

__all__ = ["SimpleProfiler", "parse_report"]

_HEADER_EXTENDED = ("Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %")
_HEADER = ("Action", "Mean duration (s)", "Total time (s)")


class SimpleProfiler(Profiler):
    """Count and time every action (see the module docstring).

    ``dirpath`` / ``filename``: the report file (see ``Profiler``); ``extended``: the count
    and share columns; ``clock``: the time source (seconds; inject a fake one in tests).
    Starting an action that is running, or stopping one that is not, is a ``ValueError``.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        extended: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        if not isinstance(extended, bool):
            raise TypeError(f"extended must be a bool, got {extended!r}")
        self.extended = extended
        self.clock = clock
        self._running: dict[str, float] = {}
        self._records: dict[str, list[float]] = {}  # action -> [count, total seconds]
        self._began = clock()

    def setup(self, *args: Any, **kwargs: Any) -> None:
        """A new run: forget what earlier runs recorded, start the run's clock."""
        super().setup(*args, **kwargs)
        self._running.clear()
        self._records.clear()
        self._began = self.clock()

    def start(self, action: str) -> None:
        if action in self._running:
            raise ValueError(f"Attempted to start {action} which has already started.")
        self._running[action] = self.clock()

    def stop(self, action: str) -> None:
        end = self.clock()
        began = self._running.pop(action, None)
        if began is None:
            raise ValueError(
                f"Attempting to stop recording an action ({action}) which was never started."
            )
        record = self._records.get(action)
        if record is None:
            self._records[action] = [1, end - began]
        else:
            record[0] += 1
            record[1] += end - began

    @property
    def recorded(self) -> dict[str, tuple[int, float]]:
        """``action -> (calls, total seconds)`` so far."""
        return {a: (int(c), t) for a, (c, t) in self._records.items()}

    def summary(self) -> str:
        if not self._records:
            return ""
        total = max(self.clock() - self._began, 1e-12)
        rows = sorted(self._records.items(), key=lambda kv: kv[1][1], reverse=True)
        if self.extended:
            header = _HEADER_EXTENDED
            calls = sum(int(c) for c, _ in self._records.values())
            table = [("Total", "-", str(calls), f"{total:.6g}", "100 %")]
            table += [
                (a, f"{t / c:.6g}", str(int(c)), f"{t:.6g}", f"{100 * t / total:.4g}")
                for a, (c, t) in rows
            ]
        else:
            header = _HEADER
            table = [(a, f"{t / c:.6g}", f"{t:.6g}") for a, (c, t) in rows]
        widths = [max(len(r[i]) for r in (header, *table)) for i in range(len(header))]

        def line(cells: tuple[str, ...]) -> str:
            return "|  " + "  |  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  |"

        rule = "-" * len(line(header))
        out = ["Profiler Report" + (f" ({self._stage})" if self._stage else "")]
        out += [rule, line(header), rule]
        out += [line(r) for r in table]
        out.append(rule)
        return "\n".join(out)


def parse_report(text: str) -> dict[str, dict[str, float]]:
    """The rows of a ``SimpleProfiler`` report: ``action -> {column: value}`` (numbers as
    floats; the ``Total`` row included, its mean as NaN)."""
    rows: dict[str, dict[str, float]] = {}
    header: list[str] | None = None
    for raw in text.splitlines():
        if not raw.startswith("|"):
            continue
        cells = [c.strip() for c in raw.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        values: dict[str, float] = {}
        for name, cell in zip(header[1:], cells[1:]):
            cell = cell.removesuffix("%").strip()
            values[name] = float("nan") if cell == "-" else float(cell)
        rows[cells[0]] = values
    return rows
