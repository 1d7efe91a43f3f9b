"""``ModelCheckpoint``: when to save, under which name, and which files to keep.

Lightning's ModelCheckpoint semantics as a pure callback: it decides and asks; the driver
writes the files at its next commit point (so every checkpoint holds a state the loop can
resume from exactly) and deletes evicted ones afterwards. Its bookkeeping — the best ``k``
files and scores, the best and last files, the step of the last save — is its state inside
``TrainState.callbacks``, so it is saved in every checkpoint and restored on resume.

Paths in that state are file names relative to the checkpoint folder (``dirpath``, else
``<log_dir>/checkpoints``), which is configuration, never read from a checkpoint: a moved
run folder resumes in its new place. On resume, names that are not this callback's own
(its ``filename`` template or ``last``, optionally ``-vN``, ending ``.ckpt``; no ``..``, no
absolute path) are dropped with a message, and bookkeeping none of whose files is in the
folder (a checkpoint written elsewhere) starts afresh, so nothing a checkpoint says makes
the run write or delete outside its folder. ``full_path`` gives the path for the user.

Saves happen at train-batch end (``every_n_train_steps``, ``train_time_interval``), at
train-epoch end or validation end (``every_n_epochs``; which of the two follows
``save_on_train_epoch_end``, resolved as Lightning does), at train end (a ``save_last`` that
never saved) and on an exception (``save_on_exception``). Never twice at one global step,
never before the first optimizer step, never during the sanity check or ``fast_dev_run``.
Names come from ``filename`` (default ``"{epoch}-{step}"``, ``auto_insert_metric_name``
turning ``{epoch}`` into ``epoch=3``), with ``-v1``, ``-v2``... when a file exists.
The time-based trigger reads the driver's clock and keeps its last check outside the state.

A ``monitor`` is looked up among the logged metrics plus ``epoch`` and ``step`` (Lightning's
monitor candidates). When it is missing at a save, Lightning's rule applies: once a
validation of this fit has run (not the sanity check; with at least one batch) the metric
cannot appear any more, so the save is a ``RuntimeError`` listing the available metrics;
before that (no validation data, or a save at train-batch end before the first validation)
it is one message per fit and nothing is saved.

After ``fit`` (or ``validate`` ...) the bookkeeping is readable on the callback object, as
Lightning's attributes: ``best_model_path``, ``best_model_score``, ``best_k_models``,
``kth_best_model_path``, ``kth_value``, ``last_model_path`` and ``current_score``. They are
views of the latest state of the Trainer that last ran with this callback (absolute paths,
scores as tensors), never an input to a run: the run reads its state only.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import schedule
from ..config import default_config
from ..events import NOTHING, Context, Requests, Stage
from .base import Callback

__all__ = ["ModelCheckpoint"]

_EXT = ".ckpt"
_LAST = "last"
# The state entries holding one file name (relative to the folder) each.
_NAMED = ("kth_best_model_path", "best_model_path", "last_model_path", "last_checkpoint_saved")


def _float(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


def _absolute(path: str) -> str:
    """``path`` made absolute when it is local (URLs are returned as they are)."""
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


#: Where a callback's bookkeeping views read from: () -> (its state, the run folder).
View = Callable[[], "tuple[Mapping[str, Any] | None, str | None]"]


def _same_path(a: str, b: str | None) -> bool:
    """Whether two paths name one file (local paths compared absolute and normalized)."""
    if not b:
        return False
    if "://" in a or "://" in b:
        return a == b
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def _template_regex(template: str, auto_insert: bool) -> str:
    """A regex for the stems ``format_name`` makes from ``template`` (fields: no separators)."""
    out = []
    for part in re.split(r"(\{[^{}]*\})", template):
        if part.startswith("{") and part.endswith("}"):
            name = re.split(r"[:}]", part[1:], maxsplit=1)[0]
            out.append((re.escape(name + "=") if auto_insert else "") + r"[^/\\\x00]*")
        else:
            out.append(re.escape(part))
    return "".join(out)


class ModelCheckpoint(Callback):
    """Save checkpoints during fit (see the module docstring for the rules)."""

    monitoring = True
    checkpointing = True

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | str | None = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: Any = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        name: str | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"save_top_k must be an int >= -1, got {save_top_k!r}")
        if save_last not in (None, True, False, "link"):
            raise ValueError(f"save_last must be True, False, None or 'link', got {save_last!r}")
        for flag, value in (
            ("every_n_train_steps", every_n_train_steps),
            ("every_n_epochs", every_n_epochs),
        ):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{flag} must be an int >= 0 or None, got {value!r}")
        interval = _seconds(train_time_interval)
        if every_n_train_steps is None and every_n_epochs is None and interval is None:
            every_n_epochs, every_n_train_steps = 1, 0
        every_n_epochs = every_n_epochs or 0
        every_n_train_steps = every_n_train_steps or 0
        triggers = [every_n_train_steps >= 1, every_n_epochs >= 1, interval is not None]
        if sum(triggers) > 1:
            raise ValueError(
                "every_n_train_steps, every_n_epochs and train_time_interval are mutually "
                f"exclusive (got {every_n_train_steps}, {every_n_epochs}, {train_time_interval!r})"
            )
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ValueError(
                f"save_top_k={save_top_k} needs a monitor: with no quantity to rank, only "
                "-1 (keep all), 0 or 1 (keep the latest) make sense"
            )
        self.dirpath = None if dirpath is None else str(dirpath)
        self.filename = filename
        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_on_exception = save_on_exception
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs
        self.train_time_interval = interval
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.enable_version_counter = enable_version_counter
        self.name = name
        self._last_time_checked: float | None = None
        # whether this fit was told about a missing monitor (one message per fit)
        self._told_missing = False
        # the latest bookkeeping of the Trainer that ran with this callback (bind_view)
        self._view: View | None = None
        self._own_name = re.compile(
            "(?:{}|{})(?:-v\\d+)?{}".format(
                _template_regex(filename or "{epoch}-{step}", auto_insert_metric_name),
                _template_regex(_LAST, auto_insert_metric_name),
                re.escape(_EXT),
            )
        )

    # ------------------------------------------------------------------ state

    def init(self) -> dict[str, Any]:
        worst = math.inf if self.mode == "min" else -math.inf
        return {
            "best_k_models": {},
            "kth_best_model_path": "",
            "kth_value": worst,
            "best_model_path": "",
            "best_model_score": None,
            "current_score": None,
            "last_model_path": "",
            "last_global_step_saved": 0,
            "last_checkpoint_saved": "",
            "deferred": False,
            # whether the latest validation of this fit ran (Lightning's val loop _has_run)
            "validated": False,
        }

    # ------------------------------------------------------------------ views after a run

    def bind_view(self, view: View | None) -> None:
        """Read the bookkeeping attributes from ``view()``: the latest state of this
        callback and the run folder (the Trainer binds itself when a run starts). A view
        only: nothing a run does reads it."""
        self._view = view

    def _latest(self) -> tuple[dict[str, Any], str | None]:
        found, log_dir = self._view() if self._view is not None else (None, None)
        if not isinstance(found, Mapping):
            return self.init(), log_dir
        return {**self.init(), **found}, log_dir

    def shown_path(self, name: Any, log_dir: str | None) -> str:
        """The absolute path a bookkeeping entry ``name`` shows ("" for one that is not
        this callback's name)."""
        return _absolute(self.full_path(name, log_dir)) if self.owns(name) else ""

    @property
    def best_model_path(self) -> str:
        """The absolute path of the best checkpoint so far ("" before any save)."""
        state, log_dir = self._latest()
        return self.shown_path(state["best_model_path"], log_dir)

    @property
    def best_model_score(self) -> torch.Tensor | None:
        """The monitored score of ``best_model_path`` (None without a monitor or a save)."""
        score = self._latest()[0]["best_model_score"]
        return None if score is None else torch.tensor(score)

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:
        """Absolute path -> score of every checkpoint kept among the top ``save_top_k``."""
        state, log_dir = self._latest()
        return {
            self.shown_path(name, log_dir): torch.tensor(score)
            for name, score in state["best_k_models"].items()
            if self.owns(name)
        }

    @property
    def kth_best_model_path(self) -> str:
        """The absolute path of the worst of the kept top-k checkpoints ("" until k saved)."""
        state, log_dir = self._latest()
        return self.shown_path(state["kth_best_model_path"], log_dir)

    @property
    def kth_value(self) -> torch.Tensor:
        """The score of ``kth_best_model_path`` (inf for "min", -inf for "max" until then)."""
        return torch.tensor(self._latest()[0]["kth_value"])

    @property
    def last_model_path(self) -> str:
        """The absolute path of the latest ``last`` checkpoint ("" without ``save_last``)."""
        state, log_dir = self._latest()
        return self.shown_path(state["last_model_path"], log_dir)

    @property
    def current_score(self) -> torch.Tensor | None:
        """The monitored value at the latest save attempt (None before one)."""
        score = self._latest()[0]["current_score"]
        return None if score is None else torch.tensor(score)

    # ------------------------------------------------------------------ helpers

    def _skip(self, ctx: Context, state: dict[str, Any]) -> bool:
        config = ctx.config
        return (
            bool(getattr(config, "fast_dev_run", 0))
            or ctx.fn != "fit"
            or ctx.stage == "sanity_check"
            or state["last_global_step_saved"] == ctx.global_step
        )

    def _on_epoch_end(self, ctx: Context) -> bool:
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        has_val = bool(ctx.extra.get("num_val_batches", 0))
        return schedule.checkpoint_on_train_epoch_end(
            ctx.config or default_config(), has_val_batches=has_val
        )

    def _epoch_due(self, ctx: Context) -> bool:
        return self.every_n_epochs >= 1 and (ctx.epoch + 1) % self.every_n_epochs == 0

    def folder(self, log_dir: str | None) -> str:
        """The checkpoint folder of a run logging to ``log_dir``: ``dirpath``, else
        ``<log_dir>/checkpoints``."""
        if self.dirpath:
            return self.dirpath
        return (log_dir or ".").rstrip("/") + "/checkpoints"

    def owns(self, name: Any) -> bool:
        """Whether ``name`` is a file name this callback writes: its template or ``last``
        (``-vN`` optional) ending ``.ckpt``, with no empty, hidden, ``.`` or ``..`` part."""
        if not isinstance(name, str) or not self._own_name.fullmatch(name):
            return False
        parts = name.split("/")
        return all(p and not p.startswith(".") for p in parts)

    def full_path(self, name: str, log_dir: str | None) -> str:
        """The full path of the bookkeeping entry ``name`` ("" stays "") for the user."""
        if not name:
            return ""
        if not self.owns(name):
            raise ValueError(f"ModelCheckpoint: {name!r} is not a checkpoint name of this callback")
        return _join(self.folder(log_dir), name)

    def format_name(self, metrics: dict[str, Any], filename: str | None = None) -> str:
        """The file stem for ``metrics`` under the template (Lightning's rules)."""
        template = filename or self.filename or "{epoch}-{step}"
        groups = re.findall(r"(\{.*?)[:\}]", template)
        values = dict(metrics)
        for group in sorted(set(groups), key=len, reverse=True):
            name = group[1:]
            if self.auto_insert_metric_name:
                template = template.replace(group, name + "={" + name)
            template = template.replace("{" + name, "{0[" + name + "]")
            values.setdefault(name, 0)
        return template.format(values)

    def _metrics(self, ctx: Context) -> dict[str, Any]:
        out = {k: _float(v) for k, v in ctx.metrics.items()}
        out["epoch"] = int(out["epoch"]) if "epoch" in out else ctx.epoch
        out["step"] = int(out["step"]) if "step" in out else ctx.global_step
        return out

    def _path(self, state: dict[str, Any], ctx: Context, stem: str, replaceable: str | None) -> str:
        """The name (relative to the folder) to save ``stem`` under, ``-vN`` if taken."""
        folder = self.folder(ctx.log_dir)
        name = f"{stem}{_EXT}"
        if not self.enable_version_counter or ctx.exists is None:
            return name
        version = 1
        while name != replaceable and ctx.exists(_join(folder, name)):
            name = f"{stem}-v{version}{_EXT}"
            version += 1
        return name

    def _removable(self, old: str | None, new: str, ctx: Context) -> bool:
        """Whether the file named ``old`` may be deleted now: one of ours, not the file
        being written, and not the checkpoint this run resumed from."""
        if not old or old == new or not self.owns(old):
            return False
        return not _same_path(_join(self.folder(ctx.log_dir), old), ctx.extra.get("resumed_from"))

    def _remove(self, name: str, ctx: Context) -> Requests:
        return Requests(remove=(_join(self.folder(ctx.log_dir), name),))

    def _request_save(self, name: str, ctx: Context) -> Requests:
        path = _join(self.folder(ctx.log_dir), name)
        if self.save_weights_only:
            return Requests(save_weights=(path,))
        return Requests(save=(path,))

    # ------------------------------------------------------------------ saving

    def _save_top_k(self, state: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], Requests]:
        if self.save_top_k == 0:
            return state, NOTHING
        metrics = self._metrics(ctx)
        state = dict(state)
        if self.monitor is None:
            previous = state["best_model_path"]
            path = self._path(state, ctx, self.format_name(metrics), previous)
            requests = self._request_save(path, ctx)
            if self.save_top_k == 1 and self._removable(previous, path, ctx):
                requests = requests | self._remove(previous, ctx)
            state["best_model_path"] = path
            return self._saved(state, ctx, path), requests
        if self.monitor not in metrics:
            return state, self._missing(state, metrics)
        current = float(metrics[self.monitor])
        if math.isnan(current):
            current = math.inf if self.mode == "min" else -math.inf
        state["current_score"] = current
        best_k = dict(state["best_k_models"])
        better = (lambda a, b: a < b) if self.mode == "min" else (lambda a, b: a > b)
        if not (
            self.save_top_k == -1
            or len(best_k) < self.save_top_k
            or better(current, best_k[state["kth_best_model_path"]])
        ):
            if self.verbose:
                return state, Requests(
                    messages=(
                        f"Epoch {ctx.epoch}, global step {ctx.global_step}: {self.monitor!r} "
                        f"was not in top {self.save_top_k}",
                    )
                )
            return state, NOTHING
        k = len(best_k) + 1 if self.save_top_k == -1 else self.save_top_k
        evicted = None
        if len(best_k) == k and k > 0:
            evicted = state["kth_best_model_path"]
            best_k.pop(evicted)
        path = self._path(state, ctx, self.format_name(metrics), evicted)
        best_k[path] = current
        worst = max if self.mode == "min" else min
        best = min if self.mode == "min" else max
        if len(best_k) == k:
            state["kth_best_model_path"] = worst(best_k, key=best_k.get)
            state["kth_value"] = best_k[state["kth_best_model_path"]]
        state["best_model_path"] = best(best_k, key=best_k.get)
        state["best_model_score"] = best_k[state["best_model_path"]]
        state["best_k_models"] = best_k
        requests = self._request_save(path, ctx)
        if self._removable(evicted, path, ctx):
            requests = requests | self._remove(evicted, ctx)
        if self.verbose:
            requests = requests | Requests(
                messages=(
                    f"Epoch {ctx.epoch}, global step {ctx.global_step}: {self.monitor!r} "
                    f"reached {current:.5f} (best {state['best_model_score']:.5f}), saving "
                    f"model to {_join(self.folder(ctx.log_dir), path)!r} as top {k}",
                )
            )
        return self._saved(state, ctx, path), requests

    def _has_monitor(self, ctx: Context) -> bool:
        """Whether the monitored value is among the candidates (the logged metrics, epoch,
        step)."""
        return self.monitor in ctx.metrics or self.monitor in ("epoch", "step")

    def _missing(self, state: dict[str, Any], metrics: Mapping[str, Any]) -> Requests:
        """A save found no monitored value: an error once a validation of this fit has run
        (the metric will not appear later; Lightning raises then too), else one message per
        fit (Lightning warns once)."""
        text = (
            f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric among the "
            f"logged ones: {sorted(metrics)}. Monitor one of these, or log "
            f"{self.monitor!r} (return it in a step's metrics, or from a callback as "
            "Requests(log=...))"
        )
        if state.get("validated", False):
            raise RuntimeError(f"{text}; a validation has run without logging it.")
        if self._told_missing:
            return NOTHING
        self._told_missing = True
        return Requests(messages=(f"{text}. Nothing saved.",))

    def _save_last(self, state: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], Requests]:
        if not self.save_last:
            return state, NOTHING
        state = dict(state)
        previous = state["last_model_path"]
        stem = self.format_name(self._metrics(ctx), _LAST)
        path = self._path(state, ctx, stem, previous)
        state["last_model_path"] = path
        if self.save_last == "link" and state["last_checkpoint_saved"] and self.save_top_k != 0:
            folder = self.folder(ctx.log_dir)
            target = _join(folder, state["last_checkpoint_saved"])
            requests = Requests(link=((target, _join(folder, path)),))
        else:
            requests = self._request_save(path, ctx)
            state = self._saved(state, ctx, path)
        if self._removable(previous, path, ctx):
            requests = requests | self._remove(previous, ctx)
        return state, requests

    def _saved(self, state: dict[str, Any], ctx: Context, path: str) -> dict[str, Any]:
        state["last_global_step_saved"] = ctx.global_step
        state["last_checkpoint_saved"] = path
        return state

    def _save_all(self, state: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], Requests]:
        state, top = self._save_top_k(state, ctx)
        state, last = self._save_last(state, ctx)
        return state, top | last

    # ------------------------------------------------------------------ events

    def on_fit_start(self, state: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], Requests]:
        folder = self.folder(ctx.log_dir)
        remote = "://" in folder and not folder.startswith("file://")
        if self.save_last == "link" and remote:
            raise ValueError(
                f"ModelCheckpoint(save_last='link') needs a local folder, got {folder!r}; "
                "use save_last=True"
            )
        state, messages = self._adopt(state, ctx, folder)
        self._told_missing = False
        return state, Requests(messages=messages) if messages else NOTHING

    def _adopt(
        self, saved: Any, ctx: Context, folder: str
    ) -> tuple[dict[str, Any], tuple[str, ...]]:
        """The restored state ``saved`` checked against this folder (see the module
        docstring): entries that are not our names in it are dropped, with a message."""
        fresh = self.init()
        if not isinstance(saved, Mapping):
            return fresh, (
                f"ModelCheckpoint: ignoring a restored state that is no mapping: {saved!r}",
            )
        state = {key: saved.get(key, value) for key, value in fresh.items()}
        # Before paths were relative, states held full paths and the folder ("dirpath").
        legacy = saved.get("dirpath")
        prefix = legacy.rstrip("/") + "/" if isinstance(legacy, str) and legacy else None
        dropped: list[Any] = []

        def name(value: Any) -> str:
            if value == "":
                return ""
            if isinstance(value, str) and prefix and value.startswith(prefix):
                value = value[len(prefix) :]
            if self.owns(value):
                return value
            dropped.append(value)
            return ""

        best_k: dict[str, float] = {}
        raw = state["best_k_models"] if isinstance(state["best_k_models"], Mapping) else {}
        if raw is not state["best_k_models"]:
            dropped.append(state["best_k_models"])
        for key, score in raw.items():
            key = name(key)
            if key and isinstance(score, (int, float)) and not isinstance(score, bool):
                best_k[key] = float(score)
            elif key:
                dropped.append(key)
        state["best_k_models"] = best_k
        for key in _NAMED:
            state[key] = name(state[key])
        state = self._consistent(state, fresh)
        messages: tuple[str, ...] = ()
        dropped = list(dict.fromkeys(repr(d) for d in dropped))
        if dropped:
            shown = ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else "")
            messages += (
                f"ModelCheckpoint: ignoring {len(dropped)} restored path(s) that are not "
                f"checkpoint names of this callback inside {folder!r}: {shown}; nothing "
                "outside the checkpoint folder is written or deleted",
            )
        names = {*best_k, *(state[key] for key in _NAMED)} - {""}
        if (
            names
            and ctx.exists is not None
            and not any(ctx.exists(_join(folder, n)) for n in sorted(names))
        ):
            messages += (
                f"ModelCheckpoint: none of the checkpoints the restored state names is in "
                f"{folder!r} (written to another folder?): starting its bookkeeping afresh",
            )
            state = fresh
        return state, messages

    def _consistent(self, state: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the k-th and best entries that ``best_k_models`` implies, where
        restoring left them pointing at nothing."""
        best_k = state["best_k_models"]
        if state["kth_best_model_path"] and state["kth_best_model_path"] not in best_k:
            state["kth_best_model_path"] = ""
        if not state["kth_best_model_path"]:
            state["kth_value"] = fresh["kth_value"]
            k = len(best_k) if self.save_top_k == -1 else self.save_top_k
            if best_k and len(best_k) >= k > 0:
                worst = max if self.mode == "min" else min
                state["kth_best_model_path"] = worst(best_k, key=best_k.get)
                state["kth_value"] = best_k[state["kth_best_model_path"]]
        if self.monitor is not None and state["best_model_path"] not in best_k:
            if best_k:
                best = min if self.mode == "min" else max
                state["best_model_path"] = best(best_k, key=best_k.get)
                state["best_model_score"] = best_k[state["best_model_path"]]
            else:
                state["best_model_path"] = ""
                state["best_model_score"] = None
        return state

    def on_train_start(
        self, state: dict[str, Any], ctx: Context
    ) -> tuple[dict[str, Any], Requests]:
        self._last_time_checked = ctx.elapsed
        return state, NOTHING

    def on_train_batch_end(
        self, state: dict[str, Any], ctx: Context
    ) -> tuple[dict[str, Any], Requests]:
        if self._skip(ctx, state):
            return state, NOTHING
        steps_due = (
            self.every_n_train_steps >= 1 and ctx.global_step % self.every_n_train_steps == 0
        )
        time_due = False
        if self.train_time_interval is not None:
            if self._last_time_checked is None:
                self._last_time_checked = ctx.elapsed
            if ctx.elapsed - self._last_time_checked >= self.train_time_interval:
                time_due = True
                self._last_time_checked = ctx.elapsed
        if not (steps_due or time_due):
            return state, NOTHING
        if self.monitor is not None and not self._has_monitor(ctx):
            return {**state, "deferred": True}, NOTHING
        return self._save_all(state, ctx)

    def on_train_epoch_end(
        self, state: dict[str, Any], ctx: Context
    ) -> tuple[dict[str, Any], Requests]:
        if self._skip(ctx, state) or not self._on_epoch_end(ctx):
            return state, NOTHING
        top = NOTHING
        if self._epoch_due(ctx):
            state, top = self._save_top_k(state, ctx)
        state, last = self._save_last(state, ctx)
        return state, top | last

    def on_validation_end(
        self, state: dict[str, Any], ctx: Context
    ) -> tuple[dict[str, Any], Requests]:
        if ctx.fn == "fit":  # the sanity check does not count, an empty validation neither
            ran = ctx.stage != Stage.SANITY_CHECK and sum(ctx.num_batches or ()) > 0
            if state.get("validated") != ran:
                state = {**state, "validated": ran}
        if self._skip(ctx, state) or self._on_epoch_end(ctx):
            return state, NOTHING
        if state["deferred"]:
            state = {**state, "deferred": False}
            return self._save_all(state, ctx)
        top = NOTHING
        if self._epoch_due(ctx):
            state, top = self._save_top_k(state, ctx)
        state, last = self._save_last(state, ctx)
        return state, top | last

    def on_train_end(self, state: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], Requests]:
        never_saved = not state["last_checkpoint_saved"]
        fast = getattr(ctx.config, "fast_dev_run", 0)
        if self.save_last and never_saved and ctx.fn == "fit" and ctx.global_step > 0 and not fast:
            return self._save_last(state, ctx)
        return state, NOTHING

    def on_exception(self, state: dict[str, Any], ctx: Context) -> tuple[dict[str, Any], Requests]:
        if not self.save_on_exception or ctx.fn != "fit" or ctx.stage == "sanity_check":
            return state, NOTHING
        if (
            getattr(ctx.config, "fast_dev_run", 0)
            or state["last_global_step_saved"] == ctx.global_step
        ):
            return state, NOTHING
        # saved whatever the monitored value (Lightning): the template name, and last
        path = self._path(state, ctx, self.format_name(self._metrics(ctx)), None)
        state = self._saved(dict(state), ctx, path)
        state, last = self._save_last(state, ctx)
        return state, self._request_save(path, ctx) | last


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "total_seconds"):
        return float(value.total_seconds())
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise ValueError(f"train_time_interval must be a timedelta or seconds, got {value!r}")
