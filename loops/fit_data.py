"""The data a ``fit`` runs on: given or built, measured, and rebuilt when the rule says.

Data may be given ready (``train``, ``val``) or as functions that build it
(``reload_train``, ``reload_val``), which the loop calls when it first needs the data and
again as ``reload_dataloaders_every_n_epochs`` says (Lightning's lazy loading: validation
data is built for the sanity check, before the training data). The epochs of the last
reloads are part of the loop state, so a resumed run reloads when the uninterrupted one
would. ``FitData`` is the part of ``FitLoop`` that holds this; ``numbered`` numbers an
epoch's batches and tells which is the last.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import schedule
from .data import length

__all__ = ["FitData", "numbered"]


def numbered(batches: Iterator[Any], start: int, num: int | float) -> Iterator[Any]:
    """``(batch_idx, batch, is_last)`` from ``start``; an unsized epoch (``num = inf``)
    looks one batch ahead to know its last batch, as Lightning's prefetcher does."""
    if num != math.inf:
        for batch_idx, batch in zip(range(start, int(num)), batches):
            yield batch_idx, batch, batch_idx + 1 == num
        return
    it = iter(batches)
    sentinel = object()
    current = next(it, sentinel)
    batch_idx = start
    while current is not sentinel:
        following = next(it, sentinel)
        yield batch_idx, current, following is sentinel
        current, batch_idx = following, batch_idx + 1


class FitData:
    """The training and validation data of a ``FitLoop`` and their batch counts: ``train``,
    ``val`` (a list of streams, or None until built), ``num_train``, ``val_max`` (per
    validation stream), ``val_check_batch`` and ``enable_val``. Uses the loop's
    ``config``, ``driver``, ``eval_step``, ``state`` and ``step``."""

    def _init_data(
        self,
        train: Any,
        val: Sequence[Any] | None,
        reload_train: Callable[[], Any] | None,
        reload_val: Callable[[], Sequence[Any]] | None,
    ) -> None:
        self.train = train
        self.val = list(val) if val is not None else None
        self.reload_train = reload_train
        self.reload_val = reload_val
        self.num_train: int | float | None = None
        self.val_max: list[int | float] = []
        self.val_check_batch: int | float = math.inf
        has_val_data = bool(self.val) or (self.val is None and reload_val is not None)
        self.enable_val = self.eval_step is not None and schedule.validation_enabled(
            self.config, has_val_data
        )
        self._warned_few = False
        if not self.enable_val:
            self.driver.extra["num_val_batches"] = 0
        if self.train is not None:
            self._measure_train()
        if self.val is not None:
            self._measure_val()

    def _measure_train(self) -> None:
        c = self.config
        self.num_train = schedule.train_batches(c, length(self.train))
        # weight averaging recomputes BatchNorm statistics over the training data at the end
        self.driver.extra["train_data"] = (self.train, self.num_train)
        if self.enable_val:
            self.val_check_batch = schedule.val_check_batch(c, self.num_train)
        message = schedule.few_batches_warning(c, self.num_train, bool(self.driver.loggers))
        if message and not self._warned_few:
            self.driver.say(message)
            self._warned_few = True

    def _measure_val(self) -> None:
        lengths = [length(v) for v in self.val]
        self.val_max = list(schedule.eval_batches(self.config, "val", lengths))
        # checkpointing decides where to save from whether there is validation data
        self.driver.extra["num_val_batches"] = sum(self.val_max) if self.enable_val else 0

    def _ensure_train(self, epoch: int) -> None:
        """Build the training data if missing, or rebuild it when the reload rule says so.

        Data given to the loop counts as loaded at the first epoch it serves. Data built only
        because it is missing (a resumed run) does not move the recorded reload epoch, so a
        resumed run reloads when the uninterrupted one would.
        """
        last = self.state.loop.last_train_reload
        if self.train is None:
            self.train = self.reload_train()
            self._measure_train()
            if last is None:
                self._record_reload(last_train_reload=epoch)
        elif last is None:
            self._record_reload(last_train_reload=epoch)
        elif self.reload_train is not None and schedule.should_reload(self.config, epoch, last):
            self.train = self.reload_train()
            self._measure_train()
            self._record_reload(last_train_reload=epoch)

    def _ensure_val(self, epoch: int, sanity: bool = False) -> None:
        """The validation counterpart of ``_ensure_train``, with Lightning's rule for what a
        load counts as: data loaded for the sanity check (or given to the loop) counts as
        ``epoch``'s load only if ``epoch`` validates; otherwise the first validation loads
        the data again when a reload function exists."""
        c = self.config
        last = self.state.loop.last_val_reload
        missing = self.val is None
        due = not sanity and self.reload_val is not None and schedule.should_reload(c, epoch, last)
        if not (missing or due):
            return
        self.val = list(self.reload_val())
        self._measure_val()
        first = last is None and (not sanity or schedule.sanity_check_sets_val_reload(c, epoch))
        if due or first:
            self._record_reload(last_val_reload=epoch)

    def _record_reload(self, **epochs: int) -> None:
        self.state = self.state.replace(loop=self.state.loop.replace(**epochs))
