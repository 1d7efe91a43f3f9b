"""``MemoryLogger``: keeps everything logged in Python lists, for tests of the loops.

Nothing is written anywhere. Metric values are converted to Python numbers (one-element
tensors via ``item()``), so tests compare them with ``==``. ``state``/``restore`` count the
records, so a "killed and resumed" loop test can check the records end up as an
uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import Logger, check_status, check_step, params_dict, prepare_metrics

__all__ = ["MemoryLogger"]


class MemoryLogger(Logger):
    """Record everything in memory.

    ``metrics``: ``[(step, {name: number}), ...]`` in logging order; ``hyperparams``: the
    merged hyper-parameters; ``hyperparam_metrics``: the metrics given with them;
    ``texts``: ``[(step, tag, text), ...]``; ``saves``: how many times ``save()`` ran;
    ``status``: the ``finalize`` status (``None`` until then; the last one if finalized twice).
    """

    def __init__(self, name: str | None = "memory", version: int | str | None = 0) -> None:
        self._name = name
        self._version = version
        self.metrics: list[tuple[int, dict[str, float | int]]] = []
        self.hyperparams: dict[str, Any] = {}
        self.hyperparam_metrics: dict[str, float | int] = {}
        self.texts: list[tuple[int, str, str]] = []
        self.saves = 0
        self.status: str | None = None

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def version(self) -> int | str | None:
        return self._version

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        step = check_step(step)
        self.metrics.append((step, prepare_metrics(metrics)))

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        self.hyperparams.update(params_dict(params))
        if metrics is not None:
            self.hyperparam_metrics.update(prepare_metrics(metrics))

    def log_text(self, tag: str, text: str, step: int) -> None:
        step = check_step(step)
        if not isinstance(tag, str) or not isinstance(text, str):
            raise TypeError(f"log_text takes a str tag and a str text, got {tag!r}, {text!r}")
        self.texts.append((step, tag, text))

    def save(self) -> None:
        self.saves += 1

    def finalize(self, status: str) -> None:
        self.status = check_status(status)

    def history(self, name: str) -> list[tuple[int, float | int]]:
        """``[(step, value), ...]`` of every record of metric ``name``."""
        return [(step, values[name]) for step, values in self.metrics if name in values]

    def state(self) -> dict[str, Any]:
        """``{"rows", "texts"}``: how many metric and text records there are."""
        return {"rows": len(self.metrics), "texts": len(self.texts)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Keep only the records that existed when ``state`` was taken."""
        super().restore(state)
        for key in ("rows", "texts"):
            count = state.get(key, 0)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"logger state {key!r} must be an int >= 0, got {count!r}")
        del self.metrics[state.get("rows", 0) :]
        del self.texts[state.get("texts", 0) :]
        self.status = None

    def truncate_after(self, step: int) -> None:
        step = check_step(step)
        self.metrics = [(s, values) for s, values in self.metrics if s <= step]
        self.texts = [record for record in self.texts if record[0] <= step]
        self.status = None
