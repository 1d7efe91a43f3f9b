"""A hyper-parameter sweep as one vmapped run: K Optuna trials trained as K ensemble members.

``sweep(study, k, suggest, model, loss_fn, optimizer, train, val)`` asks the study for ``k``
trials, lets ``suggest(trial)`` pick each one's hyper-parameters (``{"lr": ...,
"weight_decay": ..., "momentum": ...}``), and trains all of them at once with
``Trainer(strategy=hardware.ensemble(k, ...))``. The optimizer: ``hardware.member_sgd()`` (SGD whose
three hyper-parameters are per-member tensors, one broadcasting call for all members) or
any optimizer built with ``optim.inject_hyperparams`` (``hardware.ensemble(k, hparams=...)``,
which runs it once per distinct set of values, so K calls a step for K trials). Every member
starts from the state a single ``Trainer.fit(model, ..., seed=seed)`` would start from (the
template's weights, the run key of ``seed``, so the same data order), which makes member
``i`` the run a single Trainer would make with trial ``i``'s hyper-parameters, to the
ensemble's stated tolerance (``|a - b| <= 1e-5 * max|b| + 1e-6`` per tensor: vmapped kernels
do not promise the accumulation order of separate ones; without dropout, whose masks an
ensemble draws differently).

At each validation end of the fit (not the sanity check) every member still running
reports its ``<monitor>/<i>`` to its trial at ``step = epoch``, as ``OptunaPruning`` does
for one run; a member whose trial ``should_prune()`` is told ``PRUNED`` at once. A pruned
member is **ignored**, not frozen: the vmapped step costs the same with or without it, so
it keeps training, but nothing of it is reported or told again and its result is not used.
When every member is pruned the fit stops. At the end each remaining trial is told its
member's last validation value. An error during the run tells every open trial ``FAIL``
and is raised again.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
import torch
from optuna.trial import TrialState
from torch import nn

from purestep import hardware
from purestep.engine import optim
from purestep.engine import state as engine_state
from purestep.engine.state import TrainState
from purestep.hardware import member_optim
from purestep.hardware.member_sgd import MEMBER_SGD_HPARAMS, MemberSGDState

from ..callbacks.base import Callback
from ..events import NOTHING, Context, Requests, Stage

__all__ = ["MemberPruning", "SweepResult", "prune_members", "sweep"]

Suggest = Callable[[optuna.trial.Trial], Mapping[str, float]]


def prune_members(
    pruned: Sequence[bool], decisions: Sequence[bool]
) -> tuple[tuple[bool, ...], tuple[int, ...], bool]:
    """One validation's bookkeeping: ``(pruned after it, members pruned now, stop?)``.

    ``decisions[i]``: whether member ``i``'s trial says to prune (read for running members
    only; a pruned member stays pruned whatever it says). The fit stops when every member
    is pruned.
    """
    if len(pruned) != len(decisions):
        raise ValueError(f"{len(decisions)} decisions for {len(pruned)} members")
    now = tuple(i for i, (p, d) in enumerate(zip(pruned, decisions)) if not p and d)
    after = tuple(bool(p) or i in now for i, p in enumerate(pruned))
    return after, now, bool(after) and all(after)


class MemberPruning(Callback):
    """Per-member Optuna reporting and pruning for an ensemble fit (see the module doc).

    State: ``pruned`` (one bool per member), ``values`` (each member's last reported value,
    NaN before the first), ``pruned_epoch`` (-1 while running) and ``validations`` (how
    many validations reported).
    """

    monitoring = True

    def __init__(self, study: optuna.Study, trials: Sequence[optuna.trial.Trial], monitor: str):
        self.study = study
        self.trials = list(trials)
        self.monitor = monitor

    def init(self) -> dict[str, Any]:
        k = len(self.trials)
        return {
            "pruned": (False,) * k,
            "values": (math.nan,) * k,
            "pruned_epoch": (-1,) * k,
            "validations": 0,
        }

    def names(self) -> list[str]:
        """The logged name of each member's value (``<monitor>/<i>``, before a
        ``/dataloader_idx_<j>`` suffix when the monitor has one; a 1-member ensemble logs
        its value under ``monitor`` itself)."""
        k = len(self.trials)
        if k == 1:
            return [self.monitor]
        base, sep, loader = self.monitor.rpartition("/dataloader_idx_")
        if sep:
            return [f"{base}/{i}{sep}{loader}" for i in range(k)]
        return [f"{self.monitor}/{i}" for i in range(k)]

    def on_validation_end(self, state: dict[str, Any], ctx: Context) -> tuple[Any, Requests]:
        if ctx.fn != "fit" or ctx.stage == Stage.SANITY_CHECK:
            return state, NOTHING
        names = self.names()
        missing = [n for n in names if n not in ctx.metrics]
        if missing:
            raise RuntimeError(
                f"sweep(monitor={self.monitor!r}): the validation logged no {missing[0]!r}; "
                f"it logged {sorted(ctx.metrics) or 'nothing'}. Monitor a value the "
                "validation step returns (e.g. 'val_loss')"
            )
        epoch = ctx.epoch
        values = list(state["values"])
        decisions = []
        for i, (trial, name) in enumerate(zip(self.trials, names)):
            if state["pruned"][i]:
                decisions.append(False)
                continue
            values[i] = float(ctx.metrics[name])
            trial.report(values[i], step=epoch)
            decisions.append(trial.should_prune())
        pruned, now, stop = prune_members(state["pruned"], decisions)
        epochs = tuple(epoch if i in now else e for i, e in enumerate(state["pruned_epoch"]))
        for i in now:
            self.study.tell(self.trials[i], state=TrialState.PRUNED)
        new = {
            "pruned": pruned,
            "values": tuple(values),
            "pruned_epoch": epochs,
            "validations": state["validations"] + 1,
        }
        return new, Requests(stop=True) if stop else NOTHING


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """What a sweep did: its ``trials`` (in member order), each trial's final ``states``
    and ``values`` (None for a pruned trial), the member each trial was (``hparams[name]
    [i]`` its values), the ensemble's final training ``state`` and the ``trainer``."""

    trials: tuple[optuna.trial.Trial, ...]
    states: tuple[TrialState, ...]
    values: tuple[float | None, ...]
    hparams: dict[str, tuple[float, ...]]
    state: TrainState
    trainer: Any

    def member(self, i: int) -> TrainState:
        """Trial ``i``'s trained state as an ordinary ``TrainState``."""
        return hardware.member(self.state, i)


def _suggested(trials: Sequence[optuna.trial.Trial], suggest: Suggest) -> dict[str, list[float]]:
    """``{name: one value per trial}`` from ``suggest``, checked."""
    rows = []
    for trial in trials:
        row = suggest(trial)
        if not isinstance(row, Mapping) or not row:
            raise TypeError(
                "suggest(trial) must return a non-empty dict of hyper-parameters, e.g. "
                f"{{'lr': trial.suggest_float('lr', 1e-3, 1e-1, log=True)}}; got {row!r}"
            )
        for name, value in row.items():
            if (
                not isinstance(value, numbers.Real)
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                raise ValueError(
                    f"suggest(trial) gave {name}={value!r}; it must be a finite number"
                )
        if rows and set(row) != set(rows[0]):
            raise ValueError(
                f"suggest(trial) gave {sorted(row)} for trial {trial.number} but "
                f"{sorted(rows[0])} for trial {trials[0].number}: every member of one "
                "ensemble needs the same hyper-parameters"
            )
        rows.append(row)
    return {name: [float(r[name]) for r in rows] for name in rows[0]}


def _check_optimizer(
    model: nn.Module, optimizer: optim.GradientTransformation, hparams: Mapping[str, list[float]]
) -> bool:
    """The optimizer must keep every swept hyper-parameter in its state. Returns whether it
    is a ``member_sgd`` (which applies them itself) rather than an injected optimizer."""
    trainable = set(engine_state.trainable_names(model))
    params = {n: p.detach() for n, p in model.named_parameters() if n in trainable}
    initial = optimizer.init(params)
    fused = isinstance(initial, MemberSGDState)
    kept = (
        set(MEMBER_SGD_HPARAMS)
        if fused
        else {name for name, _ in member_optim.hyperparameters(initial)}
    )
    missing = sorted(set(hparams) - kept)
    if missing:
        raise ValueError(
            f"the optimizer does not keep {missing} in its state, so members cannot differ in "
            f"them (it keeps {sorted(kept) or 'none'}); use member_sgd() (lr, momentum, "
            "weight_decay) or build it with optim.inject_hyperparams(factory)(...), e.g. "
            "optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9, weight_decay=1e-4)"
        )
    momentum = hparams.get("momentum")
    built = None if fused else dict(member_optim.hyperparameters(initial)).get("momentum")
    if built is not None and float(built) == 0 and any(m != 0 for m in momentum or ()):
        raise ValueError(
            "the optimizer was built with momentum=0, so it keeps no momentum buffer, but "
            "suggest(trial) gives trials a momentum > 0: build it with momentum > 0, e.g. "
            "optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9), or use member_sgd()"
        )
    if not fused and momentum is not None and 0 < sum(m == 0 for m in momentum) < len(momentum):
        raise ValueError(
            "suggest(trial) gave momentum 0 to some trials and not to others: SGD keeps a "
            "momentum buffer only when momentum != 0, so one ensemble cannot mix them; "
            "suggest a momentum > 0 (or 0 for all), or use member_sgd()"
        )
    return fused


def _initial_state(
    model: nn.Module,
    optimizer: optim.GradientTransformation,
    k: int,
    seed: int,
    hparams: Mapping[str, list[float]],
    fused: bool,
    base: Any,
) -> TrainState:
    """K copies of the state a single run of ``seed`` starts from on ``base`` (its device
    and precision), with each member's hyper-parameters."""
    single = engine_state.init(model, optimizer, seed=seed, strategy=base)
    stacked = hardware.stack([single] * k, key=single.rng)
    if not fused:
        opt_state = member_optim.set_hyperparameters(stacked.opt_state, dict(hparams))
    else:
        opt_state = stacked.opt_state.replace(
            **{
                name: torch.tensor(values, dtype=old.dtype, device=old.device)
                for name, values in hparams.items()
                for old in [getattr(stacked.opt_state, name)]
            }
        )
    return stacked.replace(opt_state=opt_state)


def sweep(
    study: optuna.Study,
    k: int,
    suggest: Suggest,
    model: nn.Module,
    loss_fn: Callable[[Any, Any], Any],
    optimizer: optim.GradientTransformation,
    train_dataloaders: Any,
    val_dataloaders: Any,
    *,
    monitor: str = "val_loss",
    seed: int = 0,
    trials: Sequence[optuna.trial.Trial] | None = None,
    callbacks: Sequence[Any] = (),
    base: Any = None,
    **trainer_flags: Any,
) -> SweepResult:
    """Train ``k`` trials of ``study`` as one ensemble run; tell Optuna their results.

    ``suggest(trial) -> {name: value}`` picks a trial's hyper-parameters (``trial.
    suggest_float(...)``); ``optimizer`` must keep those names in its state: ``member_sgd()``
    (lr, momentum, weight_decay; one optimizer call for all members) or any
    ``optim.inject_hyperparams`` optimizer (one call per distinct set of values); the
    values it was built with are replaced per member.
    ``trials``: ``k`` trials already asked for (default: ``study.ask()`` ``k`` times).
    ``monitor``: the validation value reported, pruned on and told (lower or higher is
    better as the study's direction says). ``base``: the ensemble's base strategy (device,
    precision). ``trainer_flags`` go to the ``Trainer`` (``max_epochs=...``), ``callbacks``
    too. Returns a ``SweepResult``.
    """
    from ..trainer import Trainer

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (the number of trials trained at once) must be an int >= 1, got {k!r}")
    if not isinstance(study, optuna.Study):
        raise TypeError(f"study must be an optuna.Study, got {type(study).__name__}")
    if study._is_multi_objective():
        raise ValueError("sweep tells one value per trial: the study must have one objective")
    if not isinstance(monitor, str) or not monitor:
        raise TypeError(f"monitor must be a metric name, got {monitor!r}")
    if "strategy" in trainer_flags:
        raise TypeError("sweep builds the ensemble strategy itself: pass base=... instead")
    if trials is not None and len(trials) != k:
        raise ValueError(f"trials holds {len(trials)} trials for a sweep of k={k}")
    asked = list(trials) if trials is not None else [study.ask() for _ in range(k)]
    pruning = MemberPruning(study, asked, monitor)
    open_trials = set(range(k))
    try:
        hparams = _suggested(asked, suggest)
        fused = _check_optimizer(model, optimizer, hparams)
        strategy = hardware.ensemble(k, base, hparams=None if fused else hparams)
        start = _initial_state(model, optimizer, k, seed, hparams, fused, strategy.base)
        trainer = Trainer(strategy=strategy, callbacks=[*callbacks, pruning], **trainer_flags)
        final = trainer.fit(
            model, loss_fn, optimizer, train_dataloaders, val_dataloaders, state=start
        )
        if trainer.interrupted:  # the fit returned on Ctrl-C: its trials did not finish
            raise KeyboardInterrupt("the sweep was interrupted: its open trials are FAIL")
        own = final.callbacks[pruning.key]
        values: list[float | None] = []
        states: list[TrialState] = []
        for i, trial in enumerate(asked):
            if own["pruned"][i]:
                open_trials.discard(i)
                values.append(None)
                states.append(TrialState.PRUNED)
                continue
            value = own["values"][i]
            if own["validations"] == 0:
                raise RuntimeError(
                    f"trial {trial.number} has no {monitor!r}: no validation ran during the fit "
                    "(give val_dataloaders and let at least one epoch end)"
                )
            told = study.tell(trial, value)  # a NaN value makes Optuna store FAIL
            open_trials.discard(i)
            values.append(told.value)
            states.append(told.state)
    except BaseException:
        for i in sorted(open_trials):  # a trial pruned during the run stays PRUNED
            study.tell(asked[i], state=TrialState.FAIL, skip_if_finished=True)
        raise
    return SweepResult(
        trials=tuple(asked),
        states=tuple(states),
        values=tuple(values),
        hparams={n: tuple(v) for n, v in hparams.items()},
        state=final,
        trainer=trainer,
    )
