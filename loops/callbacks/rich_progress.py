"""A progress bar drawn with rich: the same events as ``ProgressBar``, rendered by
``rich.progress``.

Like ``ProgressBar`` it is an event observer, not a pure callback: drawing is an effect.
``Trainer(callbacks=[RichProgressBar()])`` uses it instead of the default tqdm bar. rich is
an optional dependency (``pip install "purestep[rich]"``): this module imports it only when a
``RichProgressBar`` is made, so ``import purestep`` never needs it.

One live display per run: the training task (``Epoch N``, reset every epoch unless
``leave``), with the progress-bar metrics beside it, and a task per validation, sanity-check,
test and predict run. Evaluation tasks inside ``fit`` disappear when they end; the last one
of a stand-alone ``validate`` / ``test`` / ``predict`` stays on screen. The display is
redrawn every ``refresh_rate`` batches and on the last batch (Lightning's rule), never by a
background thread, so a run draws the same thing however fast it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from ..events import Context, Stage
from .progress_bar import ProgressBarBase, eval_description, several_dataloaders, total_batches

__all__ = ["RichProgressBar"]


def _require_rich() -> Any:
    try:
        import rich.progress
    except ImportError as err:  # pragma: no cover - exercised only without rich installed
        raise ModuleNotFoundError(
            'RichProgressBar needs rich: pip install "purestep[rich]" (or pip install rich); '
            "ProgressBar draws with tqdm and needs nothing more"
        ) from err
    return rich.progress


def _format(value: Any) -> str:
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


class RichProgressBar(ProgressBarBase):
    """Progress drawn with ``rich.progress`` (see the module docstring).

    ``refresh_rate``: redraw every this many batches and at the last (``0`` disables it);
    ``leave``: keep each finished epoch's training task on screen (else one task is reset
    every epoch); ``console``: the ``rich.console.Console`` to draw on (tests pass one that
    records), or ``console_kwargs`` to build one (default: rich's ``Console()``, stdout).
    Only rank 0 draws.
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        console: Any = None,
        console_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(refresh_rate)
        self._rich = _require_rich()
        if console is not None and console_kwargs:
            raise ValueError("RichProgressBar: pass console or console_kwargs, not both")
        self.leave = leave
        self.console = console
        self.console_kwargs = dict(console_kwargs or {})
        self.progress: Any = None
        self.train_task: Any = None
        self.eval_task: Any = None
        self._eval_dataloader = 0
        self._several = False  # whether the running evaluation has several dataloaders
        # (batches done, total) of the training and the evaluation task
        self._train_n: tuple[int, int | None] = (0, None)
        self._eval_n: tuple[int, int | None] = (0, None)

    def handlers(self) -> dict[str, Callable[[Context], None]]:
        handlers: dict[str, Callable[[Context], None]] = {
            "on_train_epoch_start": self._train_epoch_start,
            "on_train_batch_end": self._train_batch_end,
            "on_train_epoch_end": self._train_epoch_end,
            "on_exception": self._stop,
            "teardown": self._stop,
        }
        for stage in ("validation", "test", "predict"):
            handlers[f"on_{stage}_start"] = self._eval_start
            handlers[f"on_{stage}_batch_end"] = self._eval_batch_end
            handlers[f"on_{stage}_end"] = self._eval_end
        return handlers

    # ----------------------------------------------------------------------- helpers

    def _display(self) -> Any:
        """The run's live display, started at its first use."""
        if self.progress is None:
            p = self._rich
            if self.console is None:
                from rich.console import Console

                self.console = Console(**self.console_kwargs)
            self.progress = p.Progress(
                p.TextColumn("[progress.description]{task.description}"),
                p.BarColumn(),
                p.MofNCompleteColumn(),
                p.TimeElapsedColumn(),
                p.TimeRemainingColumn(),
                p.TextColumn("{task.fields[metrics]}"),
                console=self.console,
                auto_refresh=False,  # drawn on due batches only, never by a thread
            )
            self.progress.start()
        return self.progress

    @staticmethod
    def _metrics(ctx: Context) -> str:
        metrics = ctx.extra.get("progress_bar_metrics") or {}
        return " ".join(f"{k}: {_format(v)}" for k, v in metrics.items())

    def _show_metrics(self, ctx: Context) -> None:
        if self.progress is not None and self.train_task is not None:
            self.progress.update(self.train_task, metrics=self._metrics(ctx))
            self.progress.refresh()

    def _stop(self, ctx: Context) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.progress = self.train_task = self.eval_task = None

    # ----------------------------------------------------------------------- training

    def _train_epoch_start(self, ctx: Context) -> None:
        progress = self._display()
        total = total_batches(ctx.num_batches)
        description = f"Epoch {ctx.epoch}"
        initial = ctx.progress.batch_in_epoch
        if self.train_task is not None and not self.leave:
            progress.reset(self.train_task, total=total, completed=initial, description=description)
        else:
            self.train_task = progress.add_task(
                description, total=total, completed=initial, metrics=""
            )
        self._train_n = (initial, total)
        progress.refresh()

    def _train_batch_end(self, ctx: Context) -> None:
        if self.progress is None or self.train_task is None:
            return
        done, total = self._train_n
        n = ctx.batch_idx + 1 if ctx.batch_idx is not None else done + 1
        self._train_n = (n, total)
        if self.should_update(n, total) or ctx.is_last_batch:
            self.progress.update(self.train_task, completed=n, metrics=self._metrics(ctx))
            self.progress.refresh()

    def _train_epoch_end(self, ctx: Context) -> None:
        self._show_metrics(ctx)

    # ----------------------------------------------------------------------- evaluation

    def _eval_start(self, ctx: Context) -> None:
        # the task is added at the first batch, when its dataloader's total is known
        self._several = several_dataloaders(ctx)
        if self.progress is not None and self.eval_task is not None:
            self.progress.remove_task(self.eval_task)
        self.eval_task = None

    def _eval_batch_end(self, ctx: Context) -> None:
        progress = self._display()
        if self.eval_task is None or ctx.dataloader_idx != self._eval_dataloader:
            self._eval_dataloader = ctx.dataloader_idx
            total = total_batches(ctx.num_batches, ctx.dataloader_idx)
            title = eval_description(ctx, self._several)
            if self.eval_task is None:
                self.eval_task = progress.add_task(title, total=total, metrics="")
            else:
                progress.reset(self.eval_task, total=total, description=title)
            self._eval_n = (0, total)
        done, total = self._eval_n
        n = ctx.batch_idx + 1 if ctx.batch_idx is not None else done + 1
        self._eval_n = (n, total)
        if self.should_update(n, total) or ctx.is_last_batch:
            progress.update(self.eval_task, completed=n)
            progress.refresh()

    def _eval_end(self, ctx: Context) -> None:
        if self.progress is None:
            return
        if self.eval_task is not None and ctx.fn == "fit":  # fit's evaluations go away
            self.progress.remove_task(self.eval_task)
            self.eval_task = None
        if ctx.stage == Stage.VALIDATE and ctx.fn == "fit":
            self._show_metrics(ctx)
        else:
            self.progress.refresh()
