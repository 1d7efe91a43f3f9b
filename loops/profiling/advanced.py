"""``AdvancedProfiler``: ``cProfile`` per action, the top functions of each (``pstats``).

One ``cProfile.Profile`` per action name, enabled while the action runs. Actions nest (a
training batch holds its step and its callbacks) but only one ``cProfile`` can be active at a
time (Python 3.12 refuses a second; 3.11 silently replaces the first), so an action's
profile is *exclusive*: while a nested action runs, the outer action's profile is paused and
the nested one's is active. Each function call is thus counted once, in the innermost action
around it. ``dump_stats=True`` also writes each action's raw profile to
``<dirpath>/<stage>-<filename>-<action>.prof`` (``pstats.Stats(path)`` reads it back).
"""

from __future__ import annotations

import cProfile
import io
import marshal
import os
import pstats
from typing import Any

from .base import Profiler

__all__ = ["AdvancedProfiler"]


class AdvancedProfiler(Profiler):
    """cProfile every action (see the module docstring).

    ``line_count_restriction``: how many functions each action's report lists (an int), or
    the fraction of them (a float in (0, 1]; Lightning's default 1.0: all); ``sort_by``: the
    ``pstats`` sort key (default ``"cumulative"``); ``dump_stats``: write each action's
    profile as a ``.prof`` file beside the report.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        line_count_restriction: float = 1.0,
        sort_by: str = "cumulative",
        dump_stats: bool = False,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        limit = line_count_restriction
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
            raise ValueError(
                "line_count_restriction must be a positive int (functions) or a fraction "
                f"in (0, 1], got {limit!r}"
            )
        if isinstance(limit, float) and limit > 1:
            raise ValueError(f"a fractional line_count_restriction must be <= 1, got {limit!r}")
        if sort_by not in pstats.Stats.sort_arg_dict_default:  # else refused at the end
            raise ValueError(
                f"sort_by={sort_by!r} is not a pstats sort key; one of "
                f"{', '.join(sorted(pstats.Stats.sort_arg_dict_default))}"
            )
        self.line_count_restriction = limit
        self.sort_by = sort_by
        self.dump_stats = dump_stats
        self.profiled_actions: dict[str, cProfile.Profile] = {}
        self._stack: list[str] = []

    def setup(self, *args: Any, **kwargs: Any) -> None:
        """A new run: forget earlier runs' profiles."""
        super().setup(*args, **kwargs)
        self._pause_all()
        self.profiled_actions = {}

    def _pause_all(self) -> None:
        if self._stack:
            self.profiled_actions[self._stack[-1]].disable()
        self._stack.clear()

    def start(self, action: str) -> None:
        if action in self._stack:
            raise ValueError(f"Attempted to start {action} which has already started.")
        if self._stack:
            self.profiled_actions[self._stack[-1]].disable()
        prof = self.profiled_actions.get(action)
        if prof is None:
            prof = self.profiled_actions[action] = cProfile.Profile()
        self._stack.append(action)
        prof.enable()

    def stop(self, action: str) -> None:
        if not self._stack or self._stack[-1] != action:
            if action not in self._stack:
                raise ValueError(
                    f"Attempting to stop recording an action ({action}) which was never started."
                )
            raise ValueError(
                f"Attempting to stop {action} while {self._stack[-1]} (started inside it) runs"
            )
        self.profiled_actions[action].disable()
        self._stack.pop()
        if self._stack:
            self.profiled_actions[self._stack[-1]].enable()

    def stats(self, action: str) -> pstats.Stats:
        """The ``pstats.Stats`` of ``action`` (a ``KeyError`` if it never ran)."""
        return pstats.Stats(self.profiled_actions[action])

    def summary(self) -> str:
        paused = self._stack[-1] if self._stack else None
        if paused is not None:  # reporting from inside an action: don't profile the report
            self.profiled_actions[paused].disable()
        try:
            parts = []
            for action, prof in self.profiled_actions.items():
                stream = io.StringIO()
                stats = pstats.Stats(prof, stream=stream)
                if self.dump_stats:
                    path = self.output_path(action, ".prof")
                    if path is not None:
                        from ..loggers.run_files import write_file

                        # what ``Stats.dump_stats`` writes, never through a planted link
                        data = marshal.dumps(stats.stats)
                        write_file(self.report_base(path), os.path.abspath(path), data)
                stats.strip_dirs().sort_stats(self.sort_by).print_stats(self.line_count_restriction)
                parts.append(f"Profile stats for: {action}\n{stream.getvalue()}")
            return "\n".join(parts)
        finally:
            if paused is not None:
                self.profiled_actions[paused].enable()

    def teardown(self, stage: str | None = None) -> None:
        self._pause_all()
