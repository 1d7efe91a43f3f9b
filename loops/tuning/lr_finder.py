"""The learning-rate range test (Lightning's ``lr_find``), as a pure sweep.

``lr_find`` trains for up to ``num_training`` optimizer steps from the state the next
``fit`` would start from, raising the learning rate after every step from ``min_lr`` to
``max_lr`` ("exponential" or "linear", on Lightning's schedule: the first step runs at
``min_lr``, step ``k > 0`` at ``min_lr * (max_lr / min_lr) ** ((k + 1) / num_training)``,
or linearly), and records the loss of each step smoothed as Lightning does (a running mean
with ``beta = 0.98``, bias-corrected). It stops early once the smoothed loss exceeds
``early_stop_threshold`` times the best one. ``LRFinder.suggestion()`` is the learning rate
where the smoothed loss falls fastest (the most negative gradient of loss over learning
rate, skipping the first 10 points and the last one).

The sweep is a ``fit`` on a private trainer (``trial.trial_trainer``) whose result is
dropped: the caller's state and trainer are never written, so the run after the sweep starts
from exactly the state before it — Lightning has to save a checkpoint before the sweep and
load it back after.

The learning rate itself is set before each step, as Lightning's sweep scheduler sets
``param_group["lr"]``: through the optimizer state's injected ``lr`` (a
``Requests(hyperparams={"lr": ...})``, as the schedulers do; every injected ``lr``, one per
parameter group, gets the same value), when the optimizer has one — built with
``optim.inject_hyperparams``, or a torch optimizer (``optim.from_torch``, a
``torch.optim`` class or ``functools.partial`` of one). The steps then compute what
Lightning's do, bitwise. An injected ``lr`` that is a schedule would override the sweep's
value: that is an error. An optimizer without an injected ``lr`` (``optim.sgd(0.1)``) gets
its updates scaled by ``lr / base_lr`` instead (``optim.scale_by_schedule`` chained after
it): the learning rate ``lr`` for every optimizer whose update is proportional to it (all
of torch's and ``engine.optim``'s), up to the rounding of that product; ``base_lr`` is then
the task's ``lr`` / ``learning_rate``.
``configure_optimizers`` may return any of its shapes with one optimizer; its scheduler is
left out of the sweep (Lightning swaps the schedulers for the sweep's own), and several
optimizers are refused, as in Lightning.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch

from purestep.engine import optim

from ..callbacks.base import Callback
from ..callbacks.lr_monitor import find_hyperparams
from ..events import NOTHING, Context, Requests
from ..optimizers import OptimizerConfig, parse_optimizers
from . import attrs
from .trial import trial_trainer

__all__ = ["LRFinder", "lr_find", "sweep_lrs"]

MODES = ("exponential", "linear")
LR_ATTRS = ("lr", "learning_rate")


def sweep_lrs(min_lr: float, max_lr: float, num_training: int, mode: str) -> list[float]:
    """The learning rate of each sweep step, on Lightning's schedule (see the module doc)."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'exponential' or 'linear', got {mode!r}")
    out = []
    for k in range(num_training):
        if k == 0:
            out.append(float(min_lr))
            continue
        r = (k + 1) / num_training
        if mode == "exponential":
            out.append(min_lr * (max_lr / min_lr) ** r)
        else:
            out.append(min_lr + r * (max_lr - min_lr))
    return out


class LRFinder:
    """What ``lr_find`` found: ``results = {"lr": [...], "loss": [...]}`` (one entry per
    optimizer step of the sweep; the loss smoothed), ``suggestion()`` and ``plot()``."""

    def __init__(self, mode: str, min_lr: float, max_lr: float, num_training: int) -> None:
        self.mode = mode
        self.lr_min = min_lr
        self.lr_max = max_lr
        self.num_training = num_training
        self.results: dict[str, list[float]] = {"lr": [], "loss": []}
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate at the steepest descent of the smoothed loss: the most
        negative ``torch.gradient`` of loss over learning rate, among the finite points
        left after skipping ``skip_begin`` first and ``skip_end`` last ones. None when fewer
        than two points remain (train longer, or on more data)."""
        if skip_begin < 0 or skip_end < 0:
            raise ValueError(
                f"skip_begin and skip_end must be >= 0, got {skip_begin} and {skip_end}"
            )
        n = len(self.results["loss"])
        index = list(range(n))[skip_begin : n - skip_end]
        losses = torch.tensor([self.results["loss"][i] for i in index], dtype=torch.float64)
        lrs = torch.tensor([self.results["lr"][i] for i in index], dtype=torch.float64)
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        kept = [i for i, ok in zip(index, finite.tolist()) if ok]
        if len(kept) < 2:
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        self._optimal_idx = kept[int(torch.argmin(gradients))]
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """Loss against learning rate (a log axis in exponential mode) with matplotlib (the
        ``plot`` extra); ``suggest`` marks the suggestion in red. Returns the figure."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "LRFinder.plot() needs matplotlib: pip install 'purestep[plot]'"
            ) from None
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        lrs, losses = self.results["lr"], self.results["loss"]
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest:
            self.suggestion()
            if self._optimal_idx is not None:
                i = self._optimal_idx
                ax.plot(lrs[i], losses[i], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig


class LRSweepCallback(Callback):
    """Records each sweep step's learning rate and smoothed loss in its state (pure) and
    asks to stop when the loss diverges (Lightning's ``_LRCallback``)."""

    name = "lr_finder"

    def __init__(
        self,
        lrs: Sequence[float],
        start_step: int,
        early_stop_threshold: float | None,
        beta: float = 0.98,
        set_lr: bool = False,
    ) -> None:
        self.lrs = list(lrs)
        self.start_step = start_step
        self.early_stop_threshold = early_stop_threshold
        self.beta = beta
        self.set_lr = set_lr

    def init(self) -> dict[str, Any]:
        return {"lr": (), "loss": (), "avg_loss": 0.0, "best_loss": 0.0, "diverged": False}

    def _lr(self, ctx: Context) -> float:
        """The learning rate of the optimizer step this batch belongs to."""
        k = ctx.global_step - self.start_step
        return self.lrs[min(k, len(self.lrs) - 1)]

    def on_train_batch_start(self, state: dict[str, Any], ctx: Context) -> tuple[Any, Requests]:
        """With ``set_lr``: the injected learning rate becomes this step's, before it runs."""
        if not self.set_lr:
            return state, NOTHING
        return state, Requests(hyperparams={"lr": self._lr(ctx)})

    def on_train_batch_end(self, state: dict[str, Any], ctx: Context) -> tuple[Any, Requests]:
        out = ctx.outputs
        if out is None or not getattr(out, "stepped", True):
            return state, NOTHING  # inside an accumulation window: no optimizer step yet
        current_step = ctx.global_step - self.start_step  # 1 after the first step
        if self.set_lr:
            _check_used(ctx.state.opt_state, self.lrs[min(current_step, len(self.lrs)) - 1])
        loss = float(out.loss) if out.loss is not None else math.nan
        avg = self.beta * state["avg_loss"] + (1 - self.beta) * loss
        smoothed = avg / (1 - self.beta ** (current_step + 1))
        best = state["best_loss"]
        stop = (
            self.early_stop_threshold is not None
            and current_step > 1
            and smoothed > self.early_stop_threshold * best
        )
        if smoothed < best or current_step == 1:
            best = smoothed
        lr = self.lrs[min(current_step, len(self.lrs)) - 1]
        new = {
            "lr": (*state["lr"], lr),
            "loss": (*state["loss"], smoothed),
            "avg_loss": avg,
            "best_loss": best,
            "diverged": bool(stop),
        }
        return new, Requests(stop=True) if stop else NOTHING


def _check_used(opt_state: Any, lr: float) -> None:
    """Refuse an optimizer whose injected learning rate is not the one the sweep set (a
    schedule injected with it overrides what the state holds at every step)."""
    used = {
        float(h.hyperparams["lr"]) for h in find_hyperparams(opt_state) if "lr" in h.hyperparams
    }
    if used != {lr}:
        raise ValueError(
            f"lr_find set the learning rate {lr}, but the optimizer stepped with {sorted(used)}: "
            "its injected lr is a schedule, which overrides the state's value at every step; "
            "give the optimizer a float lr for the sweep"
        )


def _the_optimizer(task: Any) -> OptimizerConfig:
    """The task's one optimizer, from any of ``configure_optimizers``' shapes (a transform,
    Lightning's dict with a scheduler, ...). Several are refused, as in Lightning."""
    if getattr(task, "automatic_optimization", True) is False:
        raise ValueError(
            "lr_find sets the learning rate of automatic optimization: it does not run a "
            "task with automatic_optimization=False"
        )
    entries = parse_optimizers(task.configure_optimizers())
    if len(entries) != 1:
        raise ValueError(
            f"configure_optimizers() returned {len(entries)} optimizers, but the learning "
            "rate finder works with a single optimizer"
        )
    return entries[0]


def _sweep_optimizer(entry: OptimizerConfig, factor: Any = None) -> Any:
    """What the sweep's ``configure_optimizers`` returns: the task's optimizer (with its
    updates scaled by ``factor(count)`` when one is given), its own clipping kept and its
    scheduler left out (Lightning swaps the schedulers for the sweep's own)."""
    tx = entry.optimizer
    if factor is not None:
        tx = optim.chain(tx, optim.scale_by_schedule(factor))
    clip = {
        k: v
        for k, v in (
            ("gradient_clip_val", entry.gradient_clip_val),
            ("gradient_clip_algorithm", entry.gradient_clip_algorithm),
        )
        if v is not None
    }
    return {"optimizer": tx, **clip} if clip else tx


def _base_lr(task: Any, state: Any, attr_name: str, entry: OptimizerConfig) -> float:
    """The learning rate the task's optimizer runs at (see the module doc)."""
    opt_state = state.opt_state if state is not None else None
    if opt_state is None:
        try:
            opt_state = entry.optimizer.init({})
        except Exception:  # an optimizer that cannot start without parameters
            opt_state = None
    found = {
        float(h.hyperparams[k])
        for h in find_hyperparams(opt_state)
        for k in LR_ATTRS
        if k in h.hyperparams and not isinstance(h.hyperparams[k], tuple)
    }
    if len(found) == 1:
        return found.pop()
    name = attr_name or attrs.find_attr(LR_ATTRS, task)
    if name and attrs.has_attr(name, task):
        value = attrs.get_attr(name, task)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    raise ValueError(
        "lr_find cannot tell the optimizer's learning rate: build it with "
        "optim.inject_hyperparams(...) (one learning rate), or give the task an `lr` or "
        "`learning_rate` attribute (or hparams entry) holding it"
    )


def _injected_lr(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds an injected learning rate (``optim.inject_hyperparams``)."""
    return any(any(k in h.hyperparams for k in LR_ATTRS) for h in find_hyperparams(opt_state))


def _settable_lr(entry: OptimizerConfig, state: Any) -> bool:
    """Whether the sweep can set the optimizer's learning rate itself: its state (the given
    one, else a fresh one) holds an injected float ``lr`` (``Requests.hyperparams`` sets
    every one of them; a tuple of rates cannot take one value)."""
    if state is not None:
        opt_state = state.opt_state
    else:
        try:
            opt_state = entry.optimizer.init({})
        except Exception:  # an optimizer that cannot start without parameters
            return False
    found = [h.hyperparams["lr"] for h in find_hyperparams(opt_state) if "lr" in h.hyperparams]
    return bool(found) and not any(isinstance(v, tuple) for v in found)


def _scaling(lrs: Sequence[float], base: float) -> Any:
    """The factor of step ``count`` that makes an optimizer at ``base`` step at ``lrs``."""
    factors = [lr / base for lr in lrs]

    def factor(count: int) -> float:
        return factors[min(count, len(factors) - 1)]

    return factor


def _check(min_lr: float, max_lr: float, num_training: int, mode: str, threshold: Any) -> None:
    for name, value in (("min_lr", min_lr), ("max_lr", max_lr)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not min_lr < max_lr:
        raise ValueError(f"min_lr ({min_lr}) must be smaller than max_lr ({max_lr})")
    if not isinstance(num_training, int) or isinstance(num_training, bool) or num_training < 1:
        raise ValueError(f"num_training must be a positive int, got {num_training!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be 'exponential' or 'linear', got {mode!r}")
    if threshold is not None and (
        not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or threshold <= 0
    ):
        raise ValueError(
            f"early_stop_threshold must be a positive number or None, got {threshold!r}"
        )


def lr_find(
    trainer: Any,
    model: Any,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    *,
    datamodule: Any = None,
    loss_fn: Any = None,
    optimizer: Any = None,
    state: Any = None,
    seed: int | None = None,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: float | None = 4.0,
    update_attr: bool = True,
    attr_name: str = "",
) -> LRFinder | None:
    """Run the range test for ``trainer`` (see the module doc); ``Tuner.lr_find`` calls it.

    ``update_attr``: set the task's learning-rate attribute (``attr_name``, else ``lr`` or
    ``learning_rate``, on the task or in its hparams) to the suggestion. Returns None with
    ``fast_dev_run`` (as Lightning, the sweep is skipped).
    """
    from .. import lightning
    from ..trainer_fit import fit_task
    from ..trainer_run import printer

    _check(min_lr, max_lr, num_training, mode, early_stop_threshold)
    say = printer(trainer)
    if trainer.config.fast_dev_run:
        say("Skipping learning rate finder since `fast_dev_run` is enabled.")
        return None
    model = lightning.adapt(model, trainer)  # a Lightning-style module: its LightningTask
    task = fit_task(model, loss_fn, optimizer)
    if update_attr:
        if attr_name and not attrs.has_attr(attr_name, task):
            raise AttributeError(
                f"attr_name={attr_name!r} names the learning rate, but the "
                "task has no such attribute or hparams entry"
            )
        attr_name = attr_name or attrs.find_attr(LR_ATTRS, task) or ""
        if not attr_name:
            raise AttributeError(
                "lr_find(update_attr=True) sets the task's learning rate: the task (or its "
                f"hparams) needs one of {LR_ATTRS}, or name it with attr_name=...; pass "
                "update_attr=False to only look at the results"
            )
    entry = _the_optimizer(task)
    lrs = sweep_lrs(min_lr, max_lr, num_training, mode)
    settable = _settable_lr(entry, state)
    if settable:  # the learning rate itself, step by step, as Lightning's sweep sets it
        sweep_opt = _sweep_optimizer(entry)
    else:  # the updates scaled to it (see the module doc)
        sweep_opt = _sweep_optimizer(entry, _scaling(lrs, _base_lr(task, state, attr_name, entry)))
    sweep = copy.copy(task)
    sweep.configure_optimizers = lambda: sweep_opt
    start = state.progress.step if state is not None else 0
    callback = LRSweepCallback(lrs, start, early_stop_threshold, set_lr=settable)
    inner = trial_trainer(
        trainer,
        [callback],
        max_steps=start + num_training,
        min_steps=None,
        min_epochs=None,
        max_time=None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        val_check_interval=None,
    )
    start_state = state
    if state is not None and not settable:  # the optimizer state: the task's, the scaling's
        scaling = optim.ScaleByScheduleState(count=0)
        start_state = state.replace(opt_state=(state.opt_state, scaling))
    final = inner.fit(
        sweep,
        train_dataloaders=train_dataloaders,
        val_dataloaders=val_dataloaders,
        datamodule=datamodule,
        state=start_state,
        seed=seed,
    )
    found = final.callbacks[callback.key] if final is not None else callback.init()
    finder = LRFinder(mode, min_lr, max_lr, num_training)
    finder.results = {"lr": list(found["lr"]), "loss": list(found["loss"])}
    if trainer.world_size > 1:  # every rank goes on with rank 0's results
        finder.results = trainer.strategy.broadcast_object(finder.results, 0)
    done = len(finder.results["loss"])
    if found["diverged"]:
        say(f"LR finder stopped early after {done} steps due to diverging loss.")
    elif done < num_training:
        say(
            f"LR finder ran {done} of num_training={num_training} steps: the training data or "
            "the epoch limit (max_epochs) ran out first"
        )
    if update_attr:
        lr = finder.suggestion()
        if lr is not None:
            attrs.set_attr(attr_name, lr, task)
            say(f"Learning rate set to {lr}")
            if state is not None and _injected_lr(state.opt_state):
                say(
                    "The given state's optimizer state holds its own learning rate, which a "
                    "fit from that state keeps: start from state.replace(opt_state=optim."
                    f"set_hyperparams(state.opt_state, {{'lr': {lr}}})) to train at {lr}"
                )
        else:
            say(
                "Failed to compute a learning-rate suggestion: too few points (train longer "
                f"with num_training, or on more data); {attr_name} is left as it was"
            )
    return finder
