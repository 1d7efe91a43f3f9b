"""``torch.optim.lr_scheduler`` objects as pure schedules, bitwise equal to torch's own.

``from_torch_scheduler(scheduler)`` reads a torch scheduler's settings (and its optimizer's
param groups: the learning rates and momenta it starts from, the entries ``OneCycleLR``
keeps there) and returns a ``TorchSchedule``: ``lrs(k)`` is the learning rate of each param
group after ``k`` calls of ``scheduler.step()``, and ``momentums(k)`` the momentum (or
``betas[0]``) where the class cycles it. ``ReduceLROnPlateau`` becomes the engine's
``ReduceLROnPlateau`` with the same settings (``update`` is torch's ``step(metric)``).

Exact, not approximate: most torch schedulers update *recursively* (step ``k``'s rate is
step ``k - 1``'s times a factor), so the rate after ``k`` steps carries ``k`` roundings and
differs from the closed form in the last bits. A ``TorchSchedule`` replays torch's Python
float arithmetic, in torch's order, on a private model of the scheduler (the user's object
is never stepped), from the values at translation time: a fresh scheduler's step 0.
Replays are memoised (the replay state every ``_MARK`` steps, and where it stands), so
``lrs(k)`` is a pure function of ``k`` and a run resumed at step ``k`` gets exactly the
values an uninterrupted one had; ``LambdaLR`` / ``MultiplicativeLR`` call the user's
lambdas, which must be pure functions of the step for that to hold.

Translated (torch 2.x semantics, tested against torch's own classes): ``LambdaLR``,
``MultiplicativeLR``, ``StepLR``, ``MultiStepLR``, ``ConstantLR``, ``LinearLR``,
``ExponentialLR``, ``PolynomialLR``, ``CosineAnnealingLR`` (which rises again past
``T_max``, as torch's does), ``CosineAnnealingWarmRestarts``, ``CyclicLR`` and
``OneCycleLR`` (with their momentum cycling), ``SequentialLR``, ``ChainedScheduler`` and
``ReduceLROnPlateau``. Subclasses and other classes are refused, naming the way out: a pure
``engine.optim.schedules`` function or a ``LambdaLR``.

``MOMENTUM_NAMES`` maps the param-group entry a class cycles to the injected
hyper-parameter that carries it in a purestep optimizer state: ``"momentum"`` for both
(SGD-like optimizers hold ``momentum``; for Adam-like ones, whose group holds ``betas``,
``torch_instances.from_instance`` adds ``momentum`` as ``betas[0]``).
"""

from __future__ import annotations

import bisect
import copy
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import lr_scheduler as S

from .plateau import ReduceLROnPlateau

__all__ = ["MOMENTUM_NAMES", "TorchSchedule", "from_torch_scheduler", "is_torch_scheduler"]

#: The param-group entry a cycling scheduler writes -> the injected hyper-parameter name.
MOMENTUM_NAMES: dict[str, str] = {"momentum": "momentum", "betas": "momentum"}

#: Replay states are kept every this many steps (a jump back replays at most this many).
_MARK = 1024

_WAY_OUT = (
    "write the schedule as a pure function of the step count instead (engine.optim.schedules, "
    "e.g. optim.schedules.join / step / cosine, or your own def schedule(k) -> lr), or as a "
    "torch.optim.lr_scheduler.LambdaLR(opt, lambda k: factor(k)), which purestep translates"
)


def is_torch_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is a torch LR scheduler object (any ``LRScheduler`` or plateau)."""
    return isinstance(obj, (S.LRScheduler, S.ReduceLROnPlateau))


# --------------------------------------------------------------------------- replay model


class _Groups:
    """The param-group values torch's schedulers read and write, one entry per group:
    ``lr`` and, where a class cycles it, ``mom`` (``momentum`` or ``betas[0]``)."""

    __slots__ = ("lr", "mom")

    def __init__(self, lr: list[Any], mom: list[Any] | None) -> None:
        self.lr, self.mom = lr, mom

    def copy(self) -> _Groups:
        return _Groups(list(self.lr), None if self.mom is None else list(self.mom))


class _Rule:
    """One scheduler's replay: ``step`` is torch's ``step()``, ``restart`` what
    ``SequentialLR`` does to it at its milestone (torch's ``_update_lr(0)``: the closed form
    at step 0 where the class has one, else its ``get_lr``)."""

    momentum: str | None = None  # the group entry it cycles ("momentum" / "betas")

    def step(self, g: _Groups) -> None:
        raise NotImplementedError

    def restart(self, g: _Groups) -> None:
        raise NotImplementedError

    def clone(self) -> _Rule:
        return copy.copy(self)


class _Base(_Rule):
    """A scheduler with torch's base ``step``: count the step, advance ``last_epoch``, set
    each group's rate to ``get`` (torch's ``get_lr``, at the new ``last_epoch``)."""

    closed: Callable[[_Groups], list[Any]] | None = None

    def __init__(self, sched: Any) -> None:
        self.epoch = sched.last_epoch
        self.count = getattr(sched, "_step_count", 1)
        self.base = tuple(sched.base_lrs)

    def get(self, g: _Groups) -> list[Any]:
        raise NotImplementedError

    def step(self, g: _Groups) -> None:
        self.count += 1
        self.epoch += 1
        g.lr = self.get(g)

    def restart(self, g: _Groups) -> None:
        self.epoch = 0
        g.lr = self.closed(g) if self.closed is not None else self.get(g)


class _Lambda(_Base):
    def __init__(self, sched: S.LambdaLR) -> None:
        super().__init__(sched)
        self.fns = tuple(sched.lr_lambdas)

    def get(self, g: _Groups) -> list[Any]:
        return [b * f(self.epoch) for f, b in zip(self.fns, self.base)]


class _Multiplicative(_Base):
    def __init__(self, sched: S.MultiplicativeLR) -> None:
        super().__init__(sched)
        self.fns = tuple(sched.lr_lambdas)

    def get(self, g: _Groups) -> list[Any]:
        return [lr * f(self.epoch) for f, lr in zip(self.fns, g.lr)]


class _Step(_Base):
    def __init__(self, sched: S.StepLR) -> None:
        super().__init__(sched)
        self.size, self.gamma = sched.step_size, sched.gamma

    def get(self, g: _Groups) -> list[Any]:
        if self.epoch == 0 or self.epoch % self.size != 0:
            return list(g.lr)
        return [lr * self.gamma for lr in g.lr]

    def closed(self, g: _Groups) -> list[Any]:
        return [b * self.gamma ** (self.epoch // self.size) for b in self.base]


class _MultiStep(_Base):
    def __init__(self, sched: S.MultiStepLR) -> None:
        super().__init__(sched)
        self.marks = dict(sched.milestones)  # milestone -> how often it was given
        self.sorted = sorted(sched.milestones.elements())
        self.gamma = sched.gamma

    def get(self, g: _Groups) -> list[Any]:
        times = self.marks.get(self.epoch)
        if times is None:
            return list(g.lr)
        return [lr * self.gamma**times for lr in g.lr]

    def closed(self, g: _Groups) -> list[Any]:
        n = bisect.bisect_right(self.sorted, self.epoch)
        return [b * self.gamma**n for b in self.base]


class _Constant(_Base):
    def __init__(self, sched: S.ConstantLR) -> None:
        super().__init__(sched)
        self.factor, self.total = sched.factor, sched.total_iters

    def get(self, g: _Groups) -> list[Any]:
        if self.epoch == 0:
            return [lr * self.factor for lr in g.lr]
        if self.epoch != self.total:
            return list(g.lr)
        return [lr * (1.0 / self.factor) for lr in g.lr]

    def closed(self, g: _Groups) -> list[Any]:
        after = self.epoch >= self.total
        return [b * (self.factor + after * (1 - self.factor)) for b in self.base]


class _Linear(_Base):
    def __init__(self, sched: S.LinearLR) -> None:
        super().__init__(sched)
        self.start, self.end = sched.start_factor, sched.end_factor
        self.total = sched.total_iters

    def get(self, g: _Groups) -> list[Any]:
        k, s, e = self.epoch, self.start, self.end
        if k == 0:
            return [lr * s for lr in g.lr]
        if k > self.total:
            return list(g.lr)
        factor = 1.0 + (e - s) / (self.total * s + (k - 1) * (e - s))
        return [lr * factor for lr in g.lr]

    def closed(self, g: _Groups) -> list[Any]:
        s, e = self.start, self.end
        frac = (e - s) * min(self.total, self.epoch) / self.total
        return [b * (s + frac) for b in self.base]


class _Exponential(_Base):
    def __init__(self, sched: S.ExponentialLR) -> None:
        super().__init__(sched)
        self.gamma = sched.gamma

    def get(self, g: _Groups) -> list[Any]:
        return [lr * self.gamma for lr in g.lr]

    def closed(self, g: _Groups) -> list[Any]:
        return [b * self.gamma**self.epoch for b in self.base]


class _Polynomial(_Base):
    def __init__(self, sched: S.PolynomialLR) -> None:
        super().__init__(sched)
        self.total, self.power = sched.total_iters, sched.power

    def get(self, g: _Groups) -> list[Any]:
        k, n = self.epoch, self.total
        if k > n:
            return list(g.lr)
        factor = ((1.0 - k / n) / (1.0 - (k - 1) / n)) ** self.power
        return [lr * factor for lr in g.lr]

    def closed(self, g: _Groups) -> list[Any]:
        left = 1.0 - min(self.total, self.epoch) / self.total
        return [b * left**self.power for b in self.base]


class _Cosine(_Base):
    """``CosineAnnealingLR``'s recursive form: past ``T_max`` the rate rises again (the
    cosine continues), where ``schedules.cosine`` holds at its end value."""

    def __init__(self, sched: S.CosineAnnealingLR) -> None:
        super().__init__(sched)
        self.t_max, self.eta = sched.T_max, sched.eta_min

    def get(self, g: _Groups) -> list[Any]:
        k, t, eta = self.epoch, self.t_max, self.eta
        if self.count == 1 and k > 0:  # torch's first step of a scheduler built mid-way
            return [eta + (b - eta) * (1 + math.cos(k * math.pi / t)) / 2 for b in self.base]
        if (k - 1 - t) % (2 * t) == 0:  # leaving a trough: the recursion's ratio is 0 / 0
            c = 1 - math.cos(math.pi / t)
            return [lr + (b - eta) * c / 2 for b, lr in zip(self.base, g.lr)]
        ratio = (1 + math.cos(math.pi * k / t)) / (1 + math.cos(math.pi * (k - 1) / t))
        return [ratio * (lr - eta) + eta for lr in g.lr]

    def closed(self, g: _Groups) -> list[Any]:
        c = 1 + math.cos(math.pi * self.epoch / self.t_max)
        return [self.eta + (b - self.eta) * c / 2 for b in self.base]


class _WarmRestarts(_Base):
    """``CosineAnnealingWarmRestarts``: a closed form of its own counters ``T_cur`` (steps
    since the restart) and ``T_i`` (the current period, times ``T_mult`` at each restart)."""

    def __init__(self, sched: S.CosineAnnealingWarmRestarts) -> None:
        super().__init__(sched)
        self.t_0, self.t_mult, self.eta = sched.T_0, sched.T_mult, sched.eta_min
        self.t_cur, self.t_i = sched.T_cur, sched.T_i

    def get(self, g: _Groups) -> list[Any]:
        c = 1 + math.cos(math.pi * self.t_cur / self.t_i)
        return [self.eta + (b - self.eta) * c / 2 for b in self.base]

    def step(self, g: _Groups) -> None:
        if self.epoch < 0:  # torch takes epoch 0 explicitly here (0 < T_0)
            self.t_i, self.t_cur, self.epoch = self.t_0, 0, 0
        else:
            self.epoch += 1
            self.t_cur = self.t_cur + 1
            if self.t_cur >= self.t_i:
                self.t_cur = self.t_cur % self.t_i
                self.t_i = self.t_i * self.t_mult
        g.lr = self.get(g)


def _scale(mode: str, gamma: float) -> Callable[[Any], Any]:
    """``CyclicLR``'s built-in amplitude policies."""
    if mode == "triangular":
        return lambda x: 1.0
    if mode == "triangular2":
        return lambda x: 1 / (2.0 ** (x - 1))
    return lambda x: gamma**x


class _Cyclic(_Base):
    """``CyclicLR``: a closed form of ``last_epoch`` between each group's ``base_lr`` and
    ``max_lr``; with ``cycle_momentum`` it writes the momentum inversely."""

    def __init__(self, sched: S.CyclicLR) -> None:
        super().__init__(sched)
        self.maxes = tuple(sched.max_lrs)
        self.size, self.ratio = sched.total_size, sched.step_ratio
        self.by_cycle = sched.scale_mode == "cycle"
        custom = getattr(sched, "_scale_fn_custom", _MISSING)
        if custom is _MISSING:
            raise TypeError(_unreadable(sched, "_scale_fn_custom"))
        self.fn = custom if custom is not None else _scale(sched.mode, sched.gamma)
        self.cycles = bool(sched.cycle_momentum)
        if self.cycles:
            self.momentum = "betas" if sched.use_beta1 else "momentum"
            self.m_base = tuple(sched.base_momentums)
            self.m_max = tuple(sched.max_momentums)

    def get(self, g: _Groups) -> list[Any]:
        k = self.epoch
        cycle = math.floor(1 + k / self.size)
        x = 1.0 + k / self.size - cycle
        scale = x / self.ratio if x <= self.ratio else (x - 1) / (self.ratio - 1)
        at = cycle if self.by_cycle else k
        lrs = [b + (m - b) * scale * self.fn(at) for b, m in zip(self.base, self.maxes)]
        if self.cycles:
            g.mom = [
                hi - (hi - lo) * scale * self.fn(at) for lo, hi in zip(self.m_base, self.m_max)
            ]
        return lrs


class _OneCycle(_Base):
    """``OneCycleLR``: annealing between the phase values it keeps in each param group
    (``initial_lr``, ``max_lr``, ``min_lr`` and the two momenta), read from the groups as
    torch reads them; torch raises past ``total_steps`` steps and so does this."""

    _KEYS = ("initial_lr", "max_lr", "min_lr")
    _MOMENTA = ("max_momentum", "base_momentum")

    def __init__(self, sched: S.OneCycleLR) -> None:
        super().__init__(sched)
        phases = getattr(sched, "_schedule_phases", None)
        kind = getattr(sched, "_anneal_func_type", None)
        if phases is None or kind not in ("cos", "linear"):
            raise TypeError(_unreadable(sched, "_schedule_phases / _anneal_func_type"))
        self.total = sched.total_steps
        self.phases = tuple(
            (p["end_step"], p["start_lr"], p["end_lr"], p["start_momentum"], p["end_momentum"])
            for p in phases
        )
        self.cos = kind == "cos"
        self.cycles = bool(sched.cycle_momentum)
        keys = self._KEYS + (self._MOMENTA if self.cycles else ())
        self.values = tuple({k: group[k] for k in keys} for group in sched.optimizer.param_groups)
        if self.cycles:
            self.momentum = "betas" if sched.use_beta1 else "momentum"

    def _anneal(self, start: Any, end: Any, pct: float) -> Any:
        if self.cos:
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get(self, g: _Groups) -> list[Any]:
        k = self.epoch
        if k > self.total:
            raise ValueError(
                f"OneCycleLR(total_steps={self.total}) was stepped {k} times; torch raises "
                "here too. Give it more total_steps (or epochs * steps_per_epoch), or stop "
                "training sooner (max_steps / max_epochs)"
            )
        lrs, moms = [], []
        last = len(self.phases) - 1
        for values in self.values:
            begin = 0.0
            for i, (end, lr0, lr1, m0, m1) in enumerate(self.phases):
                if k <= end or i == last:
                    pct = (k - begin) / (end - begin)
                    lrs.append(self._anneal(values[lr0], values[lr1], pct))
                    if self.cycles:
                        moms.append(self._anneal(values[m0], values[m1], pct))
                    break
                begin = end
        if self.cycles:
            g.mom = moms
        return lrs


class _Sequential(_Rule):
    """``SequentialLR``: its own step count picks the scheduler; at a milestone that one
    restarts (see ``_Rule``), otherwise it steps."""

    def __init__(self, sched: S.SequentialLR, subs: list[_Rule]) -> None:
        self.epoch = sched.last_epoch
        self.marks = list(sched._milestones)
        self.subs = subs
        self.momentum = _momentum_of(subs)

    def step(self, g: _Groups) -> None:
        self.epoch += 1
        i = bisect.bisect_right(self.marks, self.epoch)
        if i > 0 and self.marks[i - 1] == self.epoch:
            self.subs[i].restart(g)
        else:
            self.subs[i].step(g)

    def clone(self) -> _Rule:
        new = copy.copy(self)
        new.subs = [s.clone() for s in self.subs]
        return new


class _Chained(_Rule):
    """``ChainedScheduler``: every scheduler steps, in order, on the same groups."""

    def __init__(self, subs: list[_Rule]) -> None:
        self.subs = subs
        self.momentum = _momentum_of(subs)

    def step(self, g: _Groups) -> None:
        for s in self.subs:
            s.step(g)

    def clone(self) -> _Rule:
        new = copy.copy(self)
        new.subs = [s.clone() for s in self.subs]
        return new


def _momentum_of(subs: Sequence[_Rule]) -> str | None:
    found = {s.momentum for s in subs} - {None}
    return found.pop() if found else None


_MISSING = object()

_SIMPLE: dict[type, type[_Base]] = {
    S.LambdaLR: _Lambda,
    S.MultiplicativeLR: _Multiplicative,
    S.StepLR: _Step,
    S.MultiStepLR: _MultiStep,
    S.ConstantLR: _Constant,
    S.LinearLR: _Linear,
    S.ExponentialLR: _Exponential,
    S.PolynomialLR: _Polynomial,
    S.CosineAnnealingLR: _Cosine,
    S.CosineAnnealingWarmRestarts: _WarmRestarts,
    S.CyclicLR: _Cyclic,
    S.OneCycleLR: _OneCycle,
}
_TRANSLATED = (*_SIMPLE, S.SequentialLR, S.ChainedScheduler, S.ReduceLROnPlateau)


def _unreadable(sched: Any, attr: str) -> str:
    return (
        f"{type(sched).__name__} of this torch version ({torch.__version__}) does not keep "
        f"{attr}, which purestep reads to translate it; {_WAY_OUT}"
    )


def _refusal(sched: Any) -> str:
    cls = type(sched)
    names = ", ".join(c.__name__ for c in _TRANSLATED)
    kind = (
        f"a subclass of torch's {next(c.__name__ for c in cls.__mro__[1:] if c in _TRANSLATED)}"
        if any(c in _TRANSLATED for c in cls.__mro__[1:])
        else "not one of torch's own LR scheduler classes"
    )
    return (
        f"{cls.__module__}.{cls.__qualname__} is {kind}: purestep translates torch's own "
        f"classes ({names}) into pure schedules, exactly, but cannot know what another "
        f"class's step() does. To use it, {_WAY_OUT}"
    )


def _rule(sched: Any, optimizer: Any) -> _Rule:
    """The replay model of ``sched`` (refusing what cannot be translated)."""
    cls = type(sched)
    if getattr(sched, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            f"{cls.__name__}: its schedulers must all belong to the same optimizer (torch "
            "checks this too)"
        )
    if cls in _SIMPLE:
        return _SIMPLE[cls](sched)
    if cls is S.SequentialLR:
        subs = [_rule(s, optimizer) for s in sched._schedulers]
        for i, s in enumerate(subs[1:], 1):
            if isinstance(s, (_Sequential, _Chained)):
                raise ValueError(
                    f"SequentialLR: scheduler {i} is a {type(sched._schedulers[i]).__name__}, "
                    "which torch cannot restart at a milestone (it raises there); nest it at "
                    "position 0 or flatten the schedule"
                )
        return _Sequential(sched, subs)
    if cls is S.ChainedScheduler:
        return _Chained([_rule(s, optimizer) for s in sched._schedulers])
    if cls is S.ReduceLROnPlateau:
        raise ValueError(
            f"ReduceLROnPlateau inside a {type(sched).__name__} cannot be translated (torch "
            "refuses it there too); give it as the optimizer's own scheduler"
        )
    raise TypeError(_refusal(sched))


# --------------------------------------------------------------------------- the schedule


class TorchSchedule:
    """A translated torch scheduler (see the module doc): ``lrs(k)`` per param group after
    ``k`` steps; ``momentums(k)`` where ``momentum_key`` (the group entry torch cycles:
    ``"momentum"`` or ``"betas"``) is set; ``schedule(k)`` the rate of a one-group
    optimizer; ``group(i)`` group ``i``'s rate as a plain ``Schedule``."""

    def __init__(self, name: str, rule: _Rule, groups: _Groups) -> None:
        self.name = name
        self.num_groups = len(groups.lr)
        self.momentum_key = rule.momentum
        self._marks: list[tuple[_Rule, _Groups]] = [(rule.clone(), groups.copy())]
        self._at: tuple[int, _Rule, _Groups] = (0, rule, groups)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TorchSchedule({self.name}, groups={self.num_groups})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _values(self, k: int) -> _Groups:
        """The groups' values after ``k`` steps (a copy)."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"{self.name}: the step count must be an int >= 0, got {k!r}")
        k = int(k)
        with self._lock:
            at, rule, g = self._at
            if k < at:  # back: replay from the nearest kept state
                mark = min(k // _MARK, len(self._marks) - 1)
                rule, g = self._marks[mark][0].clone(), self._marks[mark][1].copy()
                at = mark * _MARK
            try:
                while at < k:
                    rule.step(g)
                    at += 1
                    if at % _MARK == 0 and at // _MARK == len(self._marks):
                        self._marks.append((rule.clone(), g.copy()))
            except BaseException:
                self._at = (0, self._marks[0][0].clone(), self._marks[0][1].copy())
                raise
            self._at = (at, rule, g)
            return g.copy()

    def lrs(self, k: int) -> tuple[float, ...]:
        """Each param group's learning rate after ``k`` steps."""
        return tuple(float(v) for v in self._values(k).lr)

    def momentums(self, k: int) -> tuple[float, ...]:
        """Each group's cycled momentum (``momentum`` or ``betas[0]``) after ``k`` steps."""
        if self.momentum_key is None:
            raise ValueError(f"{self.name} does not cycle momentum")
        return tuple(float(v) for v in self._values(k).mom)

    def __call__(self, k: int) -> float:
        if self.num_groups != 1:
            raise TypeError(
                f"{self.name} schedules {self.num_groups} param groups: use .lrs(k) (one rate "
                "per group) or .group(i)(k)"
            )
        return self.lrs(k)[0]

    def group(self, i: int) -> Callable[[int], float]:
        """Group ``i``'s learning rate as a schedule ``k -> float``."""
        if not 0 <= i < self.num_groups:
            raise IndexError(f"{self.name} has {self.num_groups} param groups, not {i + 1}")
        return lambda k: self.lrs(k)[i]


def _start(optimizer: Any, momentum: str | None, name: str) -> _Groups:
    """The groups' current values: what torch's next step() starts from."""
    lrs, moms = [], []
    for i, group in enumerate(optimizer.param_groups):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            raise TypeError(
                f"{name}: param group {i} holds its lr as a Tensor; purestep's schedules are "
                "Python floats: build the optimizer with a float lr"
            )
        lrs.append(lr)
        if momentum == "betas":
            moms.append(group["betas"][0])
        elif momentum == "momentum":
            moms.append(group["momentum"])
    return _Groups(lrs, moms if momentum else None)


def _plateau(sched: S.ReduceLROnPlateau) -> ReduceLROnPlateau:
    """torch's plateau as the engine's (its settings; the counters start fresh)."""
    if type(sched) is not S.ReduceLROnPlateau:
        raise TypeError(_refusal(sched))
    if sched.last_epoch != 0 or sched.num_bad_epochs or sched.cooldown_counter:
        raise ValueError(
            "ReduceLROnPlateau was stepped already; its counters would be lost: return a "
            "fresh one from configure_optimizers"
        )
    min_lr = sched.default_min_lr if sched.default_min_lr is not None else sched.min_lrs
    return ReduceLROnPlateau(
        mode=sched.mode,
        factor=sched.factor,
        patience=sched.patience,
        threshold=sched.threshold,
        threshold_mode=sched.threshold_mode,
        cooldown=sched.cooldown,
        min_lr=min_lr,
        eps=sched.eps,
    )


def from_torch_scheduler(scheduler: Any) -> TorchSchedule | ReduceLROnPlateau:
    """``scheduler`` (a torch LR scheduler object) as a ``TorchSchedule``, or, for
    ``ReduceLROnPlateau``, as ``engine.optim.ReduceLROnPlateau`` (see the module doc).
    Raises ``TypeError`` for classes it cannot translate, naming the way out."""
    if not is_torch_scheduler(scheduler):
        raise TypeError(
            f"from_torch_scheduler() needs a torch.optim.lr_scheduler object, got "
            f"{type(scheduler).__name__}"
        )
    if isinstance(scheduler, S.ReduceLROnPlateau):
        return _plateau(scheduler)
    name = type(scheduler).__name__
    optimizer = scheduler.optimizer
    rule = _rule(scheduler, optimizer)
    return TorchSchedule(name, rule, _start(optimizer, rule.momentum, name))
