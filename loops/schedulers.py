"""Learning-rate schedulers in the fit loop: Lightning's scheduler configs, carried out as
hyper-parameter requests.

A scheduler never writes the optimizer state itself: at its points in the loop it returns
``Requests(hyperparams={"lr": value})`` (``"<optimizer>/lr"`` with several optimizers),
which the driver carries out like any other request (``engine.optim.set_hyperparams``).
A callback can request changes the same way, so users write their own metric-driven rules.

- ``interval="epoch"``: before each training epoch (before ``on_train_epoch_start``) the
  learning rate becomes ``schedule(epoch // frequency)``: a pure function of the epoch, so a
  resumed run sets what the uninterrupted one had;
- ``interval="step"``: before each training batch, ``schedule(steps // frequency)`` where
  ``steps`` counts the optimizer's updates (``Progress.step`` with one optimizer); in
  manual optimization also before each ``opt.step`` (``step_start``), since an optimizer
  may update several times in a batch;
- ``ReduceLROnPlateau``: stepped with the ``monitor`` metric at the end of every
  ``frequency``-th epoch (after validation and ``on_train_epoch_end``), or for
  ``interval="step"`` after a batch in which its optimizer's update count reached a
  multiple of ``frequency`` (not after batches its optimizer sat out); its counters live in
  ``TrainState.extra["lr_schedulers"]``. A missing metric is an error with ``strict=True``
  (Lightning's default) and a message, skipping the step, with ``strict=False``.

Setting the value before the batch's events means a ``LearningRateMonitor`` sees the rate
the step uses.

A translated torch scheduler (``engine.optim.TorchSchedule``) sets one rate per param group
(``{"lr": [lr_0, lr_1, ...]}``), and where its class cycles momentum (``CyclicLR``,
``OneCycleLR``, or a ``SequentialLR`` / ``ChainedScheduler`` holding one) also the momentum,
under the injected name ``MOMENTUM_NAMES`` gives for the group entry torch writes:
``"momentum"`` for SGD-like optimizers' ``momentum`` and for Adam-like ones' ``betas[0]``
(the optimizer converted with it carries ``momentum`` as beta1:
``engine.optim.torch_instances.beta1_as_momentum``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from purestep.engine.optim import MultiOptState, find_injected, injected_values
from purestep.engine.optim.torch_schedules import MOMENTUM_NAMES, TorchSchedule
from purestep.engine.state import TrainState

from .events import NOTHING, Requests
from .optimizers import SchedulerConfig

__all__ = ["STATE_KEY", "LRSchedulers", "scheduled_values"]

#: Where the plateau schedulers' counters live in ``TrainState.extra``.
STATE_KEY = "lr_schedulers"


def scheduled_values(schedule: Any, k: int) -> dict[str, Any]:
    """What ``schedule`` (not a plateau) sets at its step ``k``: injected hyper-parameter
    name -> a float, or one float per param group (a torch scheduler's translation, which
    also sets the momentum it cycles, under ``MOMENTUM_NAMES``)."""
    if not isinstance(schedule, TorchSchedule):
        return {"lr": float(schedule(k))}
    lrs = list(schedule.lrs(k))
    out: dict[str, Any] = {"lr": lrs[0] if len(lrs) == 1 else lrs}
    if schedule.momentum_key is not None:
        moms = list(schedule.momentums(k))
        out[MOMENTUM_NAMES[schedule.momentum_key]] = moms[0] if len(moms) == 1 else moms
    return out


def _check_torch(optimizer: str, schedule: TorchSchedule, opt_state: Any) -> None:
    """A torch scheduler's optimizer state holds a rate (and the cycled momentum) for each
    of its param groups."""
    names = ["lr"]
    if schedule.momentum_key is not None:
        names.append(MOMENTUM_NAMES[schedule.momentum_key])
    for name in names:
        have = len(injected_values(opt_state, name))
        if have != schedule.num_groups:
            raise ValueError(
                f"optimizer {optimizer!r}: its torch scheduler ({schedule.name}) schedules "
                f"{name!r} for {schedule.num_groups} param group(s), but the optimizer state "
                f"holds {have} injected {name!r} value(s); give the scheduler with the torch "
                "optimizer it was built on"
            )


class LRSchedulers:
    """The fit loop's schedulers (see the module doc); ``multi``: the optimizer state is a
    ``MultiOptState`` (keys get the optimizer's name)."""

    def __init__(self, configs: Sequence[SchedulerConfig], *, multi: bool) -> None:
        self.configs = list(configs)
        self.multi = multi
        self._told: set[str] = set()
        # each step plateau's optimizer's update count when the batch started
        self._before: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.configs)

    def _key(self, cfg: SchedulerConfig, name: str = "lr") -> str:
        return f"{cfg.optimizer}/{name}" if self.multi else name

    def _opt_state(self, state: TrainState, cfg: SchedulerConfig) -> Any:
        opt = state.opt_state
        return opt.states[cfg.optimizer] if isinstance(opt, MultiOptState) else opt

    def check(self, state: TrainState) -> None:
        """Every scheduled optimizer must have an injected learning rate (one per param
        group a torch scheduler schedules, and the momentum it cycles)."""
        for cfg in self.configs:
            opt_state = self._opt_state(state, cfg)
            if not any("lr" in s.hyperparams for s in find_injected(opt_state)):
                raise ValueError(
                    f"optimizer {cfg.optimizer!r} has a learning-rate scheduler, but its "
                    "learning rate is not in the optimizer state: build it with "
                    "optim.inject_hyperparams, e.g. optim.inject_hyperparams(optim.adam)(lr=1e-3)"
                )
            if isinstance(cfg.scheduler, TorchSchedule):
                _check_torch(cfg.optimizer, cfg.scheduler, opt_state)

    def init(self, state: TrainState) -> TrainState:
        """``state`` with counters for every plateau scheduler (kept if already there)."""
        plateaus = {cfg.optimizer: cfg for cfg in self.configs if cfg.plateau}
        if not plateaus:
            return state
        self.check(state)
        have = state.extra.get(STATE_KEY) or {}
        counters = {name: have.get(name) or cfg.scheduler.init() for name, cfg in plateaus.items()}
        if counters == have:
            return state
        return state.replace(extra={**state.extra, STATE_KEY: counters})

    def _set(self, state: TrainState, cfg: SchedulerConfig, k: int) -> dict[str, Any]:
        """The requests that bring ``cfg``'s optimizer to its schedule's values at ``k``
        (none for values it holds already)."""
        opt_state = self._opt_state(state, cfg)
        changes: dict[str, Any] = {}
        for name, value in scheduled_values(cfg.scheduler, k).items():
            current = injected_values(opt_state, name)
            if isinstance(value, list):
                if current == value:
                    continue
            elif all(v == value for v in current):
                continue
            changes[self._key(cfg, name)] = value
        return changes

    def epoch_start(self, state: TrainState) -> Requests:
        """The epoch schedules' learning rates for the epoch about to run."""
        changes: dict[str, Any] = {}
        epoch = state.progress.epoch
        for cfg in self.configs:
            if cfg.interval == "epoch" and not cfg.plateau:
                changes.update(self._set(state, cfg, epoch // cfg.frequency))
        return Requests(hyperparams=changes) if changes else NOTHING

    def _steps(self, state: TrainState, cfg: SchedulerConfig) -> int:
        opt = state.opt_state
        if isinstance(opt, MultiOptState):
            return opt.steps[cfg.optimizer]
        return state.progress.step

    def batch_start(self, state: TrainState) -> Requests:
        """The step schedules' learning rates for the batch about to run."""
        changes: dict[str, Any] = {}
        self._before = {
            cfg.optimizer: self._steps(state, cfg)
            for cfg in self.configs
            if cfg.plateau and cfg.interval == "step"
        }
        for cfg in self.configs:
            if cfg.interval == "step" and not cfg.plateau:
                k = self._steps(state, cfg) // cfg.frequency
                changes.update(self._set(state, cfg, k))
        return Requests(hyperparams=changes) if changes else NOTHING

    def step_start(self, state: TrainState, optimizer: str) -> Requests:
        """The step schedules' learning rates for optimizer ``optimizer``'s next update
        (before each manual ``opt.step``: an optimizer stepped twice in a batch runs its
        second update at the next value of its schedule)."""
        changes: dict[str, Any] = {}
        for cfg in self.configs:
            if cfg.optimizer == optimizer and cfg.interval == "step" and not cfg.plateau:
                k = self._steps(state, cfg) // cfg.frequency
                changes.update(self._set(state, cfg, k))
        return Requests(hyperparams=changes) if changes else NOTHING

    def has_step_schedules(self) -> bool:
        """Whether a scheduler is stepped by optimizer updates (not by epochs or a metric)."""
        return any(cfg.interval == "step" and not cfg.plateau for cfg in self.configs)

    def _plateau(
        self, state: TrainState, cfg: SchedulerConfig, metrics: Mapping[str, Any]
    ) -> tuple[TrainState, Requests]:
        value = metrics.get(cfg.monitor)
        if value is None:
            available = sorted(metrics)
            text = (
                f"ReduceLROnPlateau conditioned on metric {cfg.monitor!r} which is not "
                f"available. Available metrics are: {available}. Condition can be set using "
                "`monitor` key in lr scheduler dict"
            )
            if cfg.strict:
                raise RuntimeError(text)
            if cfg.optimizer in self._told:
                return state, NOTHING
            self._told.add(cfg.optimizer)
            return state, Requests(messages=(text + "; skipping (strict=False)",))
        counters = state.extra[STATE_KEY]
        lrs = injected_values(self._opt_state(state, cfg), "lr")
        new_lrs, counter = cfg.scheduler.update(counters[cfg.optimizer], float(value), lrs)
        state = state.replace(
            extra={**state.extra, STATE_KEY: {**counters, cfg.optimizer: counter}}
        )
        if new_lrs == lrs:
            return state, NOTHING
        return state, Requests(hyperparams={self._key(cfg): new_lrs})

    def epoch_end(
        self, state: TrainState, metrics: Mapping[str, Any]
    ) -> tuple[TrainState, Requests]:
        """The epoch plateau schedulers' steps at the end of epoch ``state.progress.epoch``."""
        merged = NOTHING
        epoch = state.progress.epoch
        for cfg in self.configs:
            if cfg.plateau and cfg.interval == "epoch" and (epoch + 1) % cfg.frequency == 0:
                state, requests = self._plateau(state, cfg, metrics)
                merged = merged | requests
        return state, merged

    def batch_end(
        self, state: TrainState, metrics: Mapping[str, Any], stepped: bool
    ) -> tuple[TrainState, Requests]:
        """The step plateau schedulers' steps after a batch that stepped: one for each whose
        optimizer's update count reached a multiple of ``frequency`` in the batch (an
        optimizer that did not update, with frequencies, is not stepped)."""
        merged = NOTHING
        if not stepped:
            return state, merged
        for cfg in self.configs:
            if cfg.plateau and cfg.interval == "step":
                steps = self._steps(state, cfg)
                before = self._before.get(cfg.optimizer, steps - 1)
                if steps // cfg.frequency > before // cfg.frequency:
                    state, requests = self._plateau(state, cfg, metrics)
                    merged = merged | requests
        return state, merged
