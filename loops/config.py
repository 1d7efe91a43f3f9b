"""The loop configuration: Lightning's Trainer loop flags, validated and normalised once.

``LoopConfig`` takes the flags a Lightning user knows (``max_epochs``, ``limit_val_batches``,
``val_check_interval``, ``fast_dev_run``, ...) with Lightning's defaults, and on construction
turns them into the values the loops work with, exactly as Lightning does: limits become an
int (a number of batches) or a float fraction (``2.0 -> 2``), ``fast_dev_run`` and
``overfit_batches`` override the limits and counters, ``max_epochs=None`` becomes 1000 (or
-1 when ``max_steps``/``max_time`` bound the run), ``num_sanity_val_steps=-1`` becomes
``math.inf``. Bad input is refused with a message naming the flag and what it accepts.

Where Lightning silently overrides a flag the user set explicitly to something else, this
class refuses instead: ``fast_dev_run`` together with a different ``limit_*_batches``, and
``overfit_batches`` together with a different ``limit_train_batches``/``limit_val_batches``.
``val_check_interval=0`` (an int, "every 0 batches") and ``check_val_every_n_epoch=0`` are
refused too (Lightning would divide by zero later).

The config is static and frozen (hashable, so it can be a static field of a pytree). Every
decision that reads it lives in ``loops.schedule``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import functools
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["FLAG_NAMES", "LoopConfig", "normalize_limit", "parse_duration"]

#: Number of epochs ``max_epochs=None`` means when nothing else bounds the run.
DEFAULT_MAX_EPOCHS = 1000
#: The stages a batch limit exists for, with the flag that holds it.
LIMIT_FLAGS = {
    "train": "limit_train_batches",
    "val": "limit_val_batches",
    "test": "limit_test_batches",
    "predict": "limit_predict_batches",
}
_GRAD_CLIP_ALGORITHMS = ("norm", "value")
_DURATION = re.compile(r"(\d+):(\d\d):(\d\d):(\d\d)")


# --------------------------------------------------------------------------- small checks


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _type_error(name: str, value: Any, accepted: str, owner: str = "LoopConfig") -> TypeError:
    return TypeError(f"{owner}: `{name}` must be {accepted}; got {type(value).__name__} {value!r}.")


def _value_error(
    name: str, value: Any, accepted: str, hint: str = "", owner: str = "LoopConfig"
) -> ValueError:
    tail = f" {hint}" if hint else ""
    return ValueError(f"{owner}: `{name}={value!r}` is not valid; expected {accepted}.{tail}")


def _int(name: str, value: Any, minimum: int, accepted: str, allow_none: bool = False) -> Any:
    """``value`` as an int ``>= minimum`` (or None when allowed), else a clear error."""
    if value is None and allow_none:
        return None
    if not _is_int(value):
        raise _type_error(name, value, accepted)
    value = int(value)
    if value < minimum:
        raise _value_error(name, value, accepted)
    return value


def normalize_limit(value: Any, name: str) -> int | float:
    """A batch-limit flag as the loops use it: an int count or a float fraction in [0, 1].

    Lightning's rule: ``None`` means ``1.0`` (everything); a value in ``[0, 1]`` keeps its
    type (int ``1`` = one batch, float ``1.0`` = all batches); a whole number above 1 becomes
    an int (``2.0 -> 2``); negative values and fractions above 1 (``1.5``) are refused.
    """
    accepted = "a fraction in [0.0, 1.0] or a whole number of batches (an int >= 0)"
    if value is None:
        return 1.0
    if not _is_real(value):
        raise _type_error(name, value, accepted)
    value = int(value) if _is_int(value) else float(value)
    if math.isnan(value) or value < 0:
        raise _value_error(name, value, accepted)
    if value <= 1:
        return value
    if value % 1 == 0:
        return int(value)
    raise _value_error(name, value, accepted)


def parse_duration(
    value: Any, name: str = "max_time", *, owner: str = "LoopConfig"
) -> float | None:
    """A duration in seconds from ``"DD:HH:MM:SS"``, a dict of timedelta kwargs, a timedelta
    or a number of seconds (``None`` stays ``None``: no time limit).

    The string form is Lightning's Timer format: any number of days, then exactly two digits
    each for hours, minutes and seconds (``"00:12:00:00"`` is twelve hours). Errors name
    ``owner`` and ``name`` (the Trainer's ``max_time``, the Timer's ``duration``).
    """
    accepted = (
        'None, a "DD:HH:MM:SS" string, a dict of timedelta arguments, a timedelta '
        "or a number of seconds >= 0"
    )
    if value is None:
        return None
    if isinstance(value, str):
        match = _DURATION.fullmatch(value.strip())
        if match is None:
            hint = 'For example "00:12:00:00" is 12 hours.'
            raise _value_error(name, value, accepted, hint, owner)
        days, hours, minutes, seconds = (int(g) for g in match.groups())
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    if isinstance(value, Mapping):
        try:
            value = datetime.timedelta(**value)
        except TypeError as err:
            raise _value_error(name, value, accepted, f"({err})", owner) from None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif _is_real(value):
        seconds = float(value)
    else:
        raise _type_error(name, value, accepted, owner)
    if not math.isfinite(seconds) or seconds < 0:
        raise _value_error(name, value, accepted, "", owner)
    return seconds


def _fast_dev_run(value: Any) -> int:
    accepted = "True/False or an int >= 0 (the number of batches to run per stage)"
    if isinstance(value, bool):
        return int(value)
    if not _is_int(value):
        raise _type_error("fast_dev_run", value, accepted)
    if value < 0:
        raise _value_error("fast_dev_run", value, accepted)
    return int(value)


def _num_sanity_val_steps(value: Any) -> int | float:
    accepted = "an int >= 0, or -1 (or math.inf) to check every validation batch"
    if isinstance(value, float) and value == math.inf:
        return math.inf
    value = _int("num_sanity_val_steps", value, -1, accepted)
    return math.inf if value == -1 else value


def _val_check_interval(value: Any) -> int | float:
    value = normalize_limit(value, "val_check_interval")
    if value == 0 and isinstance(value, int):
        raise _value_error(
            "val_check_interval",
            value,
            "a fraction of the epoch in [0.0, 1.0] or an int >= 1 (a number of batches)",
            "Use 0.0 to validate after every batch, or limit_val_batches=0 to turn validation off.",
        )
    return value


def _accumulation(value: Any) -> int | tuple[tuple[int, int], ...]:
    """An int factor, or a schedule normalised to sorted ``(first_epoch, factor)`` pairs.

    Lightning's GradientAccumulationScheduler semantics: ``{0: 1}`` is implied when the
    smallest epoch is above 0. A schedule that never changes collapses to its int factor.
    """
    name = "accumulate_grad_batches"
    accepted = "an int >= 1, or a non-empty dict {epoch (int >= 0): factor (int >= 1)}"
    if _is_int(value):
        return _int(name, value, 1, accepted)
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)) and all(
        isinstance(p, (tuple, list)) and len(p) == 2 for p in value
    ):
        pairs = [tuple(p) for p in value]
    else:
        raise _type_error(name, value, accepted)
    if not pairs:
        raise _value_error(name, value, accepted)
    schedule: dict[int, int] = {}
    for epoch, factor in pairs:
        if not _is_int(epoch) or epoch < 0:
            raise _value_error(name, value, accepted, f"Epoch key {epoch!r} is not an int >= 0.")
        if not _is_int(factor) or factor < 1:
            raise _value_error(
                name, value, accepted, f"Factor {factor!r} for epoch {epoch} is not an int >= 1."
            )
        schedule[int(epoch)] = int(factor)
    if min(schedule) > 0:
        schedule[0] = 1
    steps: list[tuple[int, int]] = []
    for epoch in sorted(schedule):
        if not steps or steps[-1][1] != schedule[epoch]:
            steps.append((epoch, schedule[epoch]))
    return steps[0][1] if len(steps) == 1 else tuple(steps)


def _gradient_clip_val(value: Any) -> float | None:
    accepted = "None or a number >= 0"
    if value is None:
        return None
    if not _is_real(value):
        raise _type_error("gradient_clip_val", value, accepted)
    if math.isnan(value) or value < 0:
        raise _value_error("gradient_clip_val", value, accepted)
    return float(value)


def _gradient_clip_algorithm(value: Any) -> str:
    accepted = " or ".join(repr(a) for a in _GRAD_CLIP_ALGORITHMS)
    if not isinstance(value, str):
        raise _type_error("gradient_clip_algorithm", value, accepted)
    if value.lower() not in _GRAD_CLIP_ALGORITHMS:
        raise _value_error("gradient_clip_algorithm", value, accepted)
    return value.lower()


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same type: int ``1`` (one batch) is not float ``1.0`` (all batches)."""
    return type(a) is type(b) and a == b


# --------------------------------------------------------------------------- the config


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Lightning's Trainer loop flags; after construction each field holds its normalised value.

    Build it with ``LoopConfig(**flags)`` or ``LoopConfig.create(**flags)`` (the latter also
    suggests the right name for a misspelt flag). Normalised fields: ``max_epochs`` and
    ``min_epochs`` are ints (-1 = no epoch limit); limits, ``overfit_batches`` and
    ``val_check_interval`` are an int (batches) or a float fraction; ``max_time`` is seconds
    or None; ``num_sanity_val_steps`` an int or ``math.inf``; ``fast_dev_run`` an int
    (0 = off); ``accumulate_grad_batches`` an int or a tuple of ``(first_epoch, factor)``
    pairs. ``flags`` keeps what the user passed (for checkpoint metadata and
    ``with_flags``); ``as_dict()`` gives the normalised values for logging.

    ``dataclasses.replace(config, x=...)`` edits the normalised values (defaults already
    resolved stay resolved); ``config.with_flags(x=...)`` re-applies Lightning's defaults
    and overrides to the original flags with ``x`` changed.
    """

    max_epochs: int | None = None
    min_epochs: int | None = None
    max_steps: int = -1
    min_steps: int | None = None
    max_time: float | str | Mapping[str, float] | datetime.timedelta | None = None
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int | float = 2
    fast_dev_run: int | bool = False
    overfit_batches: int | float = 0.0
    accumulate_grad_batches: int | tuple[tuple[int, int], ...] = 1
    log_every_n_steps: int = 50
    reload_dataloaders_every_n_epochs: int = 0
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    _flags: dict[str, Any] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        raw = {name: getattr(self, name) for name in FLAG_NAMES}
        for name, value in _normalise(raw).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_flags", _explicit_flags(raw))

    @classmethod
    def create(cls, flags: Mapping[str, Any] | None = None, /, **kwargs: Any) -> LoopConfig:
        """A config from Trainer-style flags (a mapping and/or keywords); unknown names are
        refused with a "did you mean" suggestion."""
        given = {**(flags or {}), **kwargs}
        unknown = [name for name in given if name not in FLAG_NAMES]
        if unknown:
            raise TypeError("LoopConfig: " + "; ".join(_unknown_flag(n) for n in unknown))
        return cls(**given)

    @property
    def flags(self) -> dict[str, Any]:
        """The flags as the user passed them (those that differ from Lightning's defaults).

        ``LoopConfig.create(**config.flags) == config`` always holds. A timedelta
        ``max_time`` is kept as its seconds so the flags stay plain data.
        """
        return copy.deepcopy(self._flags)

    def with_flags(self, **changes: Any) -> LoopConfig:
        """A new config from this one's original flags updated with ``changes``."""
        return LoopConfig.create({**self._flags, **changes})

    @property
    def accumulation_schedule(self) -> tuple[tuple[int, int], ...]:
        """``accumulate_grad_batches`` as sorted ``(first_epoch, factor)`` pairs."""
        if isinstance(self.accumulate_grad_batches, int):
            return ((0, self.accumulate_grad_batches),)
        return self.accumulate_grad_batches

    def as_dict(self) -> dict[str, Any]:
        """The normalised values by flag name, for logging as hyper-parameters (an
        accumulation schedule appears as a dict ``{epoch: factor}``)."""
        out = {name: getattr(self, name) for name in FLAG_NAMES}
        if not isinstance(self.accumulate_grad_batches, int):
            out["accumulate_grad_batches"] = dict(self.accumulate_grad_batches)
        return out


FLAG_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(LoopConfig) if not f.name.startswith("_")
)
_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(LoopConfig) if not f.name.startswith("_")
}


def _unknown_flag(name: str) -> str:
    close = difflib.get_close_matches(str(name), FLAG_NAMES, n=1)
    suggestion = f" Did you mean `{close[0]}`?" if close else ""
    return f"unknown flag `{name}`.{suggestion} Known flags: {', '.join(FLAG_NAMES)}."


def _explicit_flags(raw: Mapping[str, Any]) -> dict[str, Any]:
    flags = {}
    for name, value in raw.items():
        if _same(value, _DEFAULTS[name]):
            continue
        if isinstance(value, datetime.timedelta):
            value = value.total_seconds()
        flags[name] = copy.deepcopy(value)
    return flags


def _normalise(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's normalisation of the loop flags (see the module docstring)."""
    out: dict[str, Any] = {}
    fast_dev_run = _fast_dev_run(raw["fast_dev_run"])
    out["fast_dev_run"] = fast_dev_run
    out["max_epochs"] = _int(
        "max_epochs", raw["max_epochs"], -1, "None, -1 (no limit) or an int >= 0", True
    )
    out["min_epochs"] = _int("min_epochs", raw["min_epochs"], 0, "None or an int >= 0", True)
    out["max_steps"] = _int("max_steps", raw["max_steps"], -1, "-1 (no limit) or an int >= 0")
    out["min_steps"] = _int("min_steps", raw["min_steps"], 0, "None or an int >= 0", True)
    out["max_time"] = parse_duration(raw["max_time"])
    for flag in LIMIT_FLAGS.values():
        out[flag] = normalize_limit(raw[flag], flag)
    out["overfit_batches"] = normalize_limit(raw["overfit_batches"], "overfit_batches")
    check_every = _int(
        "check_val_every_n_epoch",
        raw["check_val_every_n_epoch"],
        1,
        "None (count batches across epochs) or an int >= 1",
        True,
    )
    out["check_val_every_n_epoch"] = check_every
    out["val_check_interval"] = _val_check_interval(raw["val_check_interval"])
    interval = raw["val_check_interval"]
    # The normalised default (float 1.0) is accepted so that re-validating a config works.
    if check_every is None and isinstance(interval, float) and interval != 1.0:
        raise _value_error(
            "val_check_interval",
            interval,
            "an int (a number of training batches) when check_val_every_n_epoch=None",
        )
    out["num_sanity_val_steps"] = _num_sanity_val_steps(raw["num_sanity_val_steps"])
    out["accumulate_grad_batches"] = _accumulation(raw["accumulate_grad_batches"])
    log_every = raw["log_every_n_steps"]
    out["log_every_n_steps"] = (
        50
        if log_every is None
        else _int("log_every_n_steps", log_every, 0, "an int >= 0 (0: never log step metrics)")
    )
    out["reload_dataloaders_every_n_epochs"] = _int(
        "reload_dataloaders_every_n_epochs",
        raw["reload_dataloaders_every_n_epochs"],
        0,
        "an int >= 0 (0: never reload)",
    )
    out["gradient_clip_val"] = _gradient_clip_val(raw["gradient_clip_val"])
    out["gradient_clip_algorithm"] = _gradient_clip_algorithm(raw["gradient_clip_algorithm"])

    overfit = out["overfit_batches"]
    if overfit > 0:
        for stage in ("train", "val"):
            flag = LIMIT_FLAGS[stage]
            if raw[flag] is not None and not _same(out[flag], overfit):
                raise ValueError(
                    f"LoopConfig: both overfit_batches={overfit!r} and {flag}={raw[flag]!r} "
                    f"were given; overfit_batches sets {flag} itself. Pass only one of them."
                )
            out[flag] = overfit
    if fast_dev_run:
        stages = ("test", "predict") if overfit > 0 else tuple(LIMIT_FLAGS)
        for stage in stages:
            flag = LIMIT_FLAGS[stage]
            if raw[flag] is not None and not _same(out[flag], fast_dev_run):
                raise ValueError(
                    f"LoopConfig: both fast_dev_run={raw['fast_dev_run']!r} and limits were "
                    f"given ({flag}={raw[flag]!r}); fast_dev_run runs {fast_dev_run} "
                    "batch(es) of every stage. Pass only one of them."
                )
            out[flag] = fast_dev_run
        out["max_steps"] = fast_dev_run
        out["max_epochs"] = 1
        out["num_sanity_val_steps"] = 0
        out["val_check_interval"] = 1.0
        out["check_val_every_n_epoch"] = 1
    if out["max_epochs"] is None:
        unbounded = out["max_steps"] != -1 or out["max_time"] is not None
        out["max_epochs"] = -1 if unbounded else DEFAULT_MAX_EPOCHS
    if out["min_epochs"] is None:
        out["min_epochs"] = 1 if out["min_steps"] is not None else 0
    return out


@functools.lru_cache(maxsize=1)
def default_config() -> LoopConfig:
    """Lightning's defaults, for code that runs without a config (built once)."""
    return LoopConfig()
