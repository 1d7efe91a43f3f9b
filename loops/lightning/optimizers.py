"""A Lightning-style ``configure_optimizers``: torch optimizers bound to ``self.parameters()``.

Lightning users build ``torch.optim.Adam(self.parameters(), lr=...)``. Such an instance is
bound to the module's parameter objects; the engine needs a pure transform over named
tensors. ``convert_optimizers`` walks every shape Lightning accepts (one optimizer, a list,
``([optimizers], [schedulers])``, dicts with ``"optimizer"``) and replaces each instance by
``optim.from_torch`` of its class with the instance's parameter groups, named through the
module (``engine.optim.torch_instances.from_instance``: the constructor arguments as they
are after any scheduler was built on it). An optimizer over a part of the
module's trainable parameters gets the entry's ``"params"``. Schedulers are left in place
(``loops.optimizers`` reads them). What cannot be represented is refused, naming why.

Manual optimization (Lightning 2): the loop steps no scheduler; the module calls
``self.lr_schedulers()`` and ``sch.step()`` itself. ``split_schedulers`` takes the
schedulers out of the output (the loop then gets the optimizers alone) and gives each, in
configure_optimizers order, with the position of its optimizer; ``translate_scheduler``
turns one into its pure form (``loops.lightning.manual`` steps it). An optimizer whose
torch scheduler cycles ``betas[0]`` is converted with its ``momentum`` alias (``beta1``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

from purestep.engine.optim import GradientTransformation, ReduceLROnPlateau
from purestep.engine.optim.torch_instances import from_instance
from purestep.engine.optim.torch_schedules import from_torch_scheduler, is_torch_scheduler

from ..optimizers import _is_entry_dict

__all__ = ["convert_optimizers", "split_schedulers", "translate_scheduler"]


def convert_optimizers(
    output: Any,
    module: nn.Module,
    where: str = "configure_optimizers()",
    beta1: Collection[Optimizer] = (),
) -> Any:
    """``output`` with every torch optimizer instance replaced (see the module doc);
    ``beta1``: the instances converted with their ``momentum`` alias of ``betas[0]``."""
    named = list(module.named_parameters())
    trainable = [n for n, p in named if p.requires_grad]

    def convert(opt: Optimizer, at: str) -> Any:
        if any(opt.state.values()):
            raise ValueError(
                f"{at}: the {type(opt).__name__} has already stepped (it holds optimizer "
                "state); configure_optimizers must return a fresh optimizer"
            )
        alias = any(opt is o for o in beta1)
        tx, covered = from_instance(opt, named, momentum_alias=alias, what=at)
        if covered is None or sorted(covered) == sorted(trainable):
            return tx, None
        return tx, covered

    def entry(value: Any, at: str) -> Any:
        if isinstance(value, Optimizer):
            tx, params = convert(value, at)
            return tx if params is None else {"optimizer": tx, "params": params}
        if isinstance(value, Mapping) and isinstance(value.get("optimizer"), Optimizer):
            tx, params = convert(value["optimizer"], f"{at}['optimizer']")
            out = {**value, "optimizer": tx}
            if params is not None and "params" not in value:
                out["params"] = params
            return out
        return value

    if isinstance(output, GradientTransformation):  # a NamedTuple, not a list of optimizers
        return output
    if (
        isinstance(output, (list, tuple))
        and len(output) == 2
        and isinstance(output[0], (list, tuple))
    ):
        optimizers, schedulers = output
        return [entry(o, f"{where}[0][{i}]") for i, o in enumerate(optimizers)], schedulers
    if isinstance(output, (list, tuple)):
        return [entry(o, f"{where}[{i}]") for i, o in enumerate(output)]
    return entry(output, where)


#: The keys of Lightning's scheduler dict (``LRSchedulerConfig``'s fields).
_SCHEDULER_KEYS = frozenset(
    {"scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau"}
)


def _optimizer_of(entry: Any) -> Any:
    return entry.get("optimizer") if isinstance(entry, Mapping) else entry


def _scheduler_of(spec: Any, at: str) -> Any:
    """The scheduler object of a bare scheduler or of Lightning's scheduler dict (its other
    keys mean nothing in manual optimization: the module steps the scheduler)."""
    if not isinstance(spec, Mapping):
        return spec
    unknown = sorted(set(spec) - _SCHEDULER_KEYS)
    if unknown:
        raise ValueError(
            f"{at}: unknown scheduler keys {unknown} (Lightning's are {sorted(_SCHEDULER_KEYS)})"
        )
    if "scheduler" not in spec:
        raise ValueError(f"{at}: a scheduler dict needs a 'scheduler' entry")
    return spec["scheduler"]


def _check_bound(scheduler: Any, optimizer: Any, at: str) -> None:
    bound = getattr(scheduler, "optimizer", None) if is_torch_scheduler(scheduler) else None
    if bound is not None and isinstance(optimizer, Optimizer) and bound is not optimizer:
        raise ValueError(
            f"{at}: this torch LR scheduler was built on another {type(bound).__name__} "
            "instance than its entry's optimizer; a torch scheduler drives the torch optimizer "
            "it was built on: give that one"
        )


def split_schedulers(
    output: Any, where: str = "configure_optimizers()"
) -> tuple[Any, list[tuple[str, Any]], list[tuple[int, Any, str]]]:
    """``(the optimizers alone, (name, optimizer) of each, the schedulers)`` of a
    ``configure_optimizers`` output (see the module doc): the first in a shape the loop
    reads as the same optimizers with the same names; the names as the loop gives them (an
    entry's ``"name"``, a dict's key, else the position) with the optimizer objects; each
    scheduler as ``(its optimizer's position, the scheduler object, where it was)``, in
    Lightning's ``lr_schedulers()`` order."""
    found: list[tuple[int, Any, str]] = []

    def entry(value: Any, position: int, at: str) -> Any:
        if not isinstance(value, Mapping) or value.get("lr_scheduler") is None:
            if isinstance(value, Mapping):  # Lightning ignores "monitor" here too
                return {k: v for k, v in value.items() if k not in ("lr_scheduler", "monitor")}
            return value
        sched = _scheduler_of(value["lr_scheduler"], f"{at}['lr_scheduler']")
        _check_bound(sched, value.get("optimizer"), at)
        found.append((position, sched, f"{at}['lr_scheduler']"))
        return {k: v for k, v in value.items() if k not in ("lr_scheduler", "monitor")}

    def name(value: Any, position: int) -> tuple[str, Any]:
        given = value.get("name") if isinstance(value, Mapping) else None
        return (given if isinstance(given, str) else str(position)), _optimizer_of(value)

    if isinstance(output, (GradientTransformation, Optimizer)):
        return output, [("0", output)], []
    if isinstance(output, Mapping):
        if _is_entry_dict(output):
            return entry(output, 0, where), [name(output, 0)], found
        stripped = {k: entry(v, i, f"{where}[{k!r}]") for i, (k, v) in enumerate(output.items())}
        return stripped, [(str(k), _optimizer_of(v)) for k, v in output.items()], found
    if (
        isinstance(output, (list, tuple))
        and len(output) == 2
        and isinstance(output[0], (list, tuple))
    ):
        opts, scheds = output
        scheds = list(scheds) if isinstance(scheds, (list, tuple)) else [scheds]
        optimizers = [entry(o, i, f"{where}[0][{i}]") for i, o in enumerate(opts)]
        for j, spec in enumerate(scheds):
            at = f"{where}[1][{j}]"
            sched = _scheduler_of(spec, at)
            bound = getattr(sched, "optimizer", None) if is_torch_scheduler(sched) else None
            owners = [
                i for i, o in enumerate(opts) if bound is not None and _optimizer_of(o) is bound
            ]
            if owners:
                position = owners[0]
            elif bound is None and j < len(opts):
                position = j  # a schedule of engine.optim: the optimizer at its position
            else:
                raise ValueError(
                    f"{at}: this LR scheduler's optimizer is not among the optimizers "
                    "configure_optimizers returned with it"
                )
            found.append((position, sched, at))
        return optimizers, [name(o, i) for i, o in enumerate(opts)], found
    if isinstance(output, (list, tuple)):
        optimizers = [entry(o, i, f"{where}[{i}]") for i, o in enumerate(output)]
        return optimizers, [name(o, i) for i, o in enumerate(output)], found
    return output, [("0", output)], []


def translate_scheduler(scheduler: Any, where: str) -> Any:
    """A scheduler as the pure rule ``loops.lightning.manual`` steps: a torch scheduler's
    exact translation (``engine.optim.from_torch_scheduler``: a ``TorchSchedule``, or the
    engine's ``ReduceLROnPlateau``), or an ``engine.optim`` schedule / ``ReduceLROnPlateau``
    as it is."""
    if is_torch_scheduler(scheduler):
        try:
            return from_torch_scheduler(scheduler)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
    if isinstance(scheduler, ReduceLROnPlateau) or callable(scheduler):
        return scheduler
    raise TypeError(
        f"{where}: the scheduler must be a torch.optim.lr_scheduler object built on its torch "
        "optimizer, a schedule (a function step -> learning rate, e.g. "
        "optim.schedules.step(0.1, 30)) or optim.ReduceLROnPlateau(...), got "
        f"{type(scheduler).__name__}"
    )
