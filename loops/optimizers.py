"""What ``configure_optimizers`` may return, read into optimizer and scheduler configs.

Lightning's shapes, with ``engine.optim`` transforms in place of torch optimizers (a
transform is not bound to parameters, so an entry names the parameters it updates):

- a transform: one optimizer over every trainable parameter (the usual case);
- ``{"optimizer": tx, "lr_scheduler": ..., "params": ..., "frequency": n, "name": ...}``;
- a list / tuple of transforms or such dicts: several optimizers, named ``"0"``, ``"1"``, ...
  unless an entry has a ``"name"``; or a dict ``name -> transform or dict``;
- ``([tx, ...], [scheduler, ...])`` (or a list of the two; one scheduler may come bare):
  optimizers and the schedulers of the first ones.

With several optimizers every entry says which parameters it updates (``"params"``: a
submodule's name such as ``"generator"``, meaning the parameters under it, a parameter's
name, a list of those, or a function ``name -> bool``). The subsets must not overlap; each
optimizer's step computes gradients for its own subset only, with every other parameter
held constant (Lightning's ``toggle_optimizer``). Per entry, ``"gradient_clip_val"`` /
``"gradient_clip_algorithm"`` override the Trainer's clipping, and in manual optimization
``"accumulate"`` gives that optimizer's own accumulation window (micro-steps per update).

Schedulers (``"lr_scheduler"``) are Lightning's dict — ``{"scheduler": s, "interval":
"epoch" | "step", "frequency": 1, "monitor": None, "strict": True, "name": None}`` — or a
bare scheduler (interval "epoch"). ``s`` is a schedule (a function ``k -> learning rate``
from ``engine.optim.schedules``: ``k`` counts the scheduler's steps, epochs or optimizer
steps divided by ``frequency``, so an epoch schedule is a pure function of the epoch) or an
``engine.optim.ReduceLROnPlateau`` (which needs ``monitor``). A scheduler changes the
optimizer's injected learning rate: build the optimizer with ``optim.inject_hyperparams``.

Torch's own scheduler objects are taken too, with the torch optimizer they were built on
(Lightning's ``opt = torch.optim.AdamW(self.model.parameters()); return [opt],
[OneCycleLR(opt, ...)]``, in any of the shapes above): the scheduler becomes its exact pure
translation (``engine.optim.from_torch_scheduler``: the learning rates, and the momentum
where the class cycles it, after ``k`` steps) and the optimizer ``from_torch`` of its class
with its param groups' current settings, the groups' params named by the module's names
(``params`` of ``parse_optimizers``; with several optimizers an entry's ``"params"``
defaults to them). A torch scheduler is matched with its optimizer by identity, in
``([optimizers], [schedulers])`` too; an optimizer that is a transform already (an instance
converted before, as ``loops.lightning`` does) takes it by position. Where the scheduler
cycles ``betas[0]``, the optimizer's state carries it as ``momentum``
(``torch_instances.beta1_as_momentum``). A torch optimizer without its scheduler is
refused (use ``optim.from_torch``), and so is a scheduler class that cannot be translated.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from purestep.engine import optim
from purestep.engine.optim import GradientTransformation, ReduceLROnPlateau
from purestep.engine.optim.torch_instances import beta1_as_momentum, from_instance
from purestep.engine.optim.torch_schedules import (
    TorchSchedule,
    from_torch_scheduler,
    is_torch_scheduler,
)

__all__ = [
    "OptimizerConfig",
    "SchedulerConfig",
    "active_optimizers",
    "param_subset",
    "parse_optimizers",
    "resolve_params",
    "with_clipping",
]

_ENTRY_KEYS = frozenset(
    {
        "optimizer",
        "lr_scheduler",
        "params",
        "frequency",
        "name",
        "gradient_clip_val",
        "gradient_clip_algorithm",
        "accumulate",
        "monitor",
    }
)
_SCHEDULER_KEYS = frozenset(
    {"scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau"}
)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """One learning-rate scheduler of an optimizer (Lightning's scheduler dict)."""

    scheduler: Any
    optimizer: str
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None

    @property
    def plateau(self) -> bool:
        return isinstance(self.scheduler, ReduceLROnPlateau)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """One optimizer: its name, transform, parameters (None: every trainable one), and
    Lightning's per-optimizer options."""

    name: str
    optimizer: GradientTransformation
    params: Any = None
    frequency: int | None = None
    accumulate: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    scheduler: SchedulerConfig | None = None


def _transform(obj: Any, where: str) -> GradientTransformation:
    """``obj`` as a transform (through ``optim.as_transformation`` where the package has
    it, which also takes torch optimizer classes), or a ``TypeError`` naming ``where``."""
    convert = getattr(optim, "as_transformation", None)
    if convert is not None and not isinstance(obj, GradientTransformation):
        obj = convert(obj, where)
    if not (hasattr(obj, "init") and hasattr(obj, "update")):
        raise TypeError(
            f"{where} must be an engine.optim transform (e.g. optim.adamw(1e-3)), "
            f"got {type(obj).__name__}"
        )
    return obj


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    return value


def _scheduler(obj: Any, optimizer: str, where: str) -> SchedulerConfig:
    if isinstance(obj, Mapping):
        unknown = sorted(set(obj) - _SCHEDULER_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown scheduler keys {unknown} (Lightning's are "
                f"{sorted(_SCHEDULER_KEYS - {'reduce_on_plateau'})})"
            )
        if "scheduler" not in obj:
            raise ValueError(f"{where}: a scheduler dict needs a 'scheduler' entry")
        fields = dict(obj)
        fields.pop("reduce_on_plateau", None)
        sched = fields.pop("scheduler")
    else:
        sched, fields = obj, {}
    if is_torch_scheduler(sched):
        try:
            sched = from_torch_scheduler(sched)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
    if not (isinstance(sched, ReduceLROnPlateau) or callable(sched)):
        raise TypeError(
            f"{where}: the scheduler must be a schedule (a function step -> learning rate, "
            "e.g. optim.schedules.step(0.1, 30)), optim.ReduceLROnPlateau(...) or a "
            "torch.optim.lr_scheduler object built on the entry's torch optimizer, got "
            f"{type(sched).__name__}"
        )
    interval = fields.get("interval", "epoch")
    if interval not in ("epoch", "step"):
        raise ValueError(f"{where}: interval must be 'epoch' or 'step', got {interval!r}")
    frequency = _positive_int(fields.get("frequency", 1), f"{where}: frequency")
    monitor = fields.get("monitor")
    if monitor is not None and not isinstance(monitor, str):
        raise TypeError(f"{where}: monitor must be a metric name, got {monitor!r}")
    if isinstance(sched, ReduceLROnPlateau) and monitor is None:
        raise ValueError(
            f"{where}: ReduceLROnPlateau needs the metric to watch: "
            '{"scheduler": plateau, "monitor": "val_loss"} (Lightning requires it too)'
        )
    strict = fields.get("strict", True)
    if not isinstance(strict, bool):
        raise TypeError(f"{where}: strict must be a bool, got {strict!r}")
    name = fields.get("name")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{where}: name must be a str, got {name!r}")
    return SchedulerConfig(sched, optimizer, interval, frequency, monitor, strict, name)


def _bound_optimizer(spec: Any) -> Any:
    """The torch optimizer a torch scheduler (bare or in Lightning's dict) was built on, or
    None for any other scheduler."""
    sched = spec.get("scheduler") if isinstance(spec, Mapping) else spec
    return sched.optimizer if is_torch_scheduler(sched) else None


def _paired(
    opt: Any,
    bound: Any,
    sched: SchedulerConfig,
    params: Any,
    where: str,
) -> tuple[GradientTransformation, list[str] | None]:
    """The optimizer of an entry whose scheduler is a torch scheduler built on the torch
    optimizer ``bound``, and the names of its params (None when unknown). The instance
    itself becomes a ``from_torch`` transform; an entry whose optimizer is already a
    transform (an instance someone converted before, as ``loops.lightning`` does) keeps
    it. Where the scheduler cycles ``betas[0]``, the state gets its ``momentum`` alias."""
    translated = sched.scheduler
    beta1 = isinstance(translated, TorchSchedule) and translated.momentum_key == "betas"
    if not isinstance(opt, Optimizer):
        tx = _transform(opt, f"{where}['optimizer']")
        return (beta1_as_momentum(tx) if beta1 else tx), None
    if opt is not bound:
        raise ValueError(
            f"{where}: its torch LR scheduler was built on a {type(bound).__name__} instance, "
            f"but the entry's 'optimizer' is another {type(opt).__name__} instance; a torch "
            "scheduler drives the torch optimizer it was built on: give that one"
        )
    return from_instance(opt, params, momentum_alias=beta1, what=f"{where}['optimizer']")


def _entry(
    obj: Any,
    default_name: str,
    where: str,
    params: Any = None,
    sched_where: str | None = None,
) -> OptimizerConfig:
    if not isinstance(obj, Mapping):
        return OptimizerConfig(default_name, _transform(obj, where))
    unknown = sorted(set(obj) - _ENTRY_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (accepted: {sorted(_ENTRY_KEYS)})")
    if "optimizer" not in obj:
        raise ValueError(f"{where}: an optimizer dict needs an 'optimizer' entry")
    name = obj.get("name", default_name)
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{where}: name must be a non-empty str without '/', got {name!r}")
    frequency = obj.get("frequency")
    if frequency is not None:
        frequency = _positive_int(frequency, f"{where}: frequency")
    accumulate = _positive_int(obj.get("accumulate", 1), f"{where}: accumulate")
    clip = obj.get("gradient_clip_val")
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, numbers.Real) or clip < 0
    ):
        raise ValueError(f"{where}: gradient_clip_val must be a number >= 0, got {clip!r}")
    algorithm = obj.get("gradient_clip_algorithm")
    if algorithm not in (None, "norm", "value"):
        raise ValueError(
            f"{where}: gradient_clip_algorithm must be 'norm' or 'value', got {algorithm!r}"
        )
    raw = obj.get("lr_scheduler")
    sched = None
    if raw is not None:
        at = sched_where or f"{where}['lr_scheduler']"
        if isinstance(raw, Mapping) or "monitor" not in obj:
            sched = _scheduler(raw, name, at)
        else:  # Lightning also reads "monitor" next to the optimizer
            sched = _scheduler({"scheduler": raw, "monitor": obj["monitor"]}, name, at)
    bound = None if raw is None else _bound_optimizer(raw)
    chosen = obj.get("params")
    if bound is not None:
        tx, names = _paired(obj["optimizer"], bound, sched, params, where)
        if chosen is None:
            chosen = names
    else:
        tx = _transform(obj["optimizer"], f"{where}['optimizer']")
    return OptimizerConfig(
        name,
        tx,
        chosen,
        frequency,
        accumulate,
        None if clip is None else float(clip),
        algorithm,
        sched,
    )


def _is_entry_dict(obj: Mapping) -> bool:
    """Whether ``obj`` is one optimizer's dict (not a dict ``name -> optimizer``): it has an
    ``"optimizer"`` and either only Lightning's keys or values that are no optimizers (a
    misspelt key such as ``"lr_schedular"``, which ``_entry`` then names)."""
    if "optimizer" not in obj:
        return False
    return set(obj) <= _ENTRY_KEYS or not all(_optimizer_like(v) for v in obj.values())


def _optimizer_like(value: Any) -> bool:
    if isinstance(value, Mapping):
        return "optimizer" in value
    return isinstance(value, type) or (hasattr(value, "init") and hasattr(value, "update"))


def _is_sequence(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and not isinstance(x, GradientTransformation)


def _is_two_lists(output: Any) -> bool:
    """Lightning's ``([optimizers], [schedulers])`` (a list or tuple of two; the second may
    be one scheduler): the first item is itself a list of optimizers."""
    return _is_sequence(output) and len(output) == 2 and _is_sequence(output[0])


def parse_optimizers(
    output: Any,
    where: str = "configure_optimizers()",
    params: Mapping[str, Tensor] | Sequence[tuple[str, Tensor]] | None = None,
) -> list[OptimizerConfig]:
    """The optimizers ``configure_optimizers()`` returned (see the module doc); ``where``
    names the value in errors; ``params`` (the module's ``named_parameters()``, a dict or
    its pairs) names the parameters of torch optimizers that come with their torch
    schedulers."""
    if isinstance(output, GradientTransformation) or (
        hasattr(output, "init") and hasattr(output, "update")
    ):
        return [OptimizerConfig("0", output)]
    if isinstance(output, Mapping):
        if _is_entry_dict(output):
            return [_entry(output, "0", where, params)]
        entries = [
            _entry(v, str(k), f"{where}[{k!r}]", params)
            if not isinstance(v, Mapping) or "name" not in v
            else None
            for k, v in output.items()
        ]
        if any(e is None for e in entries):
            raise ValueError(f"{where}: a dict of optimizers names them by its keys; drop 'name'")
        if not entries:
            raise ValueError(f"{where} returned an empty dict")
        return _checked(entries)
    if _is_two_lists(output):
        return _two_lists(output, where, params)
    if isinstance(output, (list, tuple)):
        if not output:
            raise ValueError(f"{where} returned no optimizer")
        entries = [_entry(o, str(i), f"{where}[{i}]", params) for i, o in enumerate(output)]
        return _checked(entries)
    # let the transform check say what is accepted
    return [OptimizerConfig("0", _transform(output, where))]


def _optimizer_of(entry: Any) -> Any:
    return entry.get("optimizer") if isinstance(entry, Mapping) else entry


def _owner(opts: Sequence[Any], bound: Any) -> int | None:
    """The position of the optimizer (bare or an entry dict's) that ``bound`` is."""
    for i, o in enumerate(opts):
        if _optimizer_of(o) is bound:
            return i
    return None


def _two_lists(output: Any, where: str, params: Any) -> list[OptimizerConfig]:
    """Lightning's ``([optimizers], [schedulers])``: the i-th scheduler belongs to the i-th
    optimizer; a torch scheduler to the torch optimizer it was built on."""
    opts, scheds = output
    if not isinstance(scheds, (list, tuple)):  # Lightning takes one scheduler bare too
        scheds = [scheds]
    if not opts:
        raise ValueError(f"{where} returned no optimizer")
    if len(scheds) > len(opts):
        raise ValueError(
            f"{where}: {len(scheds)} schedulers for {len(opts)} optimizers; the i-th "
            "scheduler belongs to the i-th optimizer"
        )
    owners: dict[int, int] = {}  # optimizer position -> scheduler position
    for j, s in enumerate(scheds):
        bound = _bound_optimizer(s)
        i = j if bound is None else _owner(opts, bound)
        if i is None and not isinstance(_optimizer_of(opts[j]), Optimizer):
            i = j  # its instance was converted before (loops.lightning): by position
        if i is None:
            raise ValueError(
                f"{where}[1][{j}]: this torch LR scheduler was built on a "
                f"{type(bound).__name__} that is not among the optimizers returned with it"
            )
        o = opts[i]
        if i in owners or (isinstance(o, Mapping) and o.get("lr_scheduler") is not None):
            name = o.get("name", str(i)) if isinstance(o, Mapping) else str(i)
            raise ValueError(
                f"{where}: optimizer {name!r} has two schedulers (one torch scheduler can "
                "step several: torch.optim.lr_scheduler.ChainedScheduler)"
            )
        owners[i] = j
    entries = []
    for i, o in enumerate(opts):
        at = f"{where}[0][{i}]"
        if i not in owners:
            entries.append(_entry(o, str(i), at, params))
            continue
        j = owners[i]
        spec = {**o} if isinstance(o, Mapping) else {"optimizer": o}
        spec["lr_scheduler"] = scheds[j]
        entries.append(_entry(spec, str(i), at, params, sched_where=f"{where}[1][{j}]"))
    return _checked(entries)


def _checked(entries: list[OptimizerConfig]) -> list[OptimizerConfig]:
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"configure_optimizers(): optimizer names repeat: {names}")
    with_freq = [e.frequency is not None for e in entries]
    if any(with_freq) and not all(with_freq):
        raise ValueError(
            "configure_optimizers(): give every optimizer a 'frequency', or none (Lightning "
            "cycles through them by their frequencies)"
        )
    return entries


def param_subset(spec: Any, names: Sequence[str], where: str) -> list[str]:
    """The parameter names (of ``names``, in order) an entry's ``"params"`` selects."""
    if callable(spec) and not isinstance(spec, str):
        chosen = [n for n in names if spec(n)]
    else:
        items = [spec] if isinstance(spec, str) else list(spec)
        if not all(isinstance(i, str) for i in items):
            raise TypeError(
                f"{where}: params must be a submodule or parameter name, a list of them, or a "
                f"function name -> bool, got {spec!r}"
            )
        chosen = []
        for item in items:
            found = [n for n in names if n == item or n.startswith(item + ".")]
            if not found:
                raise ValueError(
                    f"{where}: params {item!r} matches no trainable parameter (they are "
                    f"{list(names)[:8]}{' ...' if len(names) > 8 else ''})"
                )
            chosen += [n for n in found if n not in chosen]
        chosen = [n for n in names if n in chosen]
    if not chosen:
        raise ValueError(f"{where}: params {spec!r} selects no trainable parameter")
    return chosen


def resolve_params(
    entries: list[OptimizerConfig], trainable: Sequence[str]
) -> list[tuple[OptimizerConfig, list[str]]]:
    """Each optimizer with the parameter names it updates; overlaps are an error."""
    if len(entries) == 1 and entries[0].params is None:
        return [(entries[0], list(trainable))]
    out = []
    owner: dict[str, str] = {}
    for e in entries:
        if e.params is None:
            raise ValueError(
                f"optimizer {e.name!r} does not say which parameters it updates: with several "
                "optimizers give each one {'optimizer': tx, 'params': 'submodule_name'}"
            )
        names = param_subset(e.params, trainable, f"optimizer {e.name!r}")
        for n in names:
            if n in owner:
                raise ValueError(
                    f"parameter {n!r} is in optimizers {owner[n]!r} and {e.name!r}; each "
                    "parameter may belong to one optimizer"
                )
            owner[n] = e.name
        out.append((e, names))
    return out


def with_clipping(
    tx: GradientTransformation, clip: float | None, algorithm: str
) -> GradientTransformation:
    """``tx`` behind the clipping Lightning's flags ask for (0 and None: none)."""
    if not clip:
        return tx
    if algorithm == "norm":
        return optim.chain(optim.clip_by_global_norm(clip), tx)
    return optim.chain(optim.clip_by_value(clip), tx)


def active_optimizers(frequencies: Sequence[int] | None, count: int, batch_idx: int) -> list[int]:
    """Lightning 1.5's rule: every optimizer each batch, or with frequencies ``(n_0, n_1,
    ...)`` optimizer ``i`` alone for ``n_i`` consecutive batches, in a cycle over the
    epoch's batch index."""
    if not frequencies:
        return list(range(count))
    place = batch_idx % sum(frequencies)
    total = 0
    for i, f in enumerate(frequencies):
        total += f
        if place < total:
            return [i]
    raise AssertionError("unreachable")
