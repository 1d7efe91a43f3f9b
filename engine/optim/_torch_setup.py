"""How ``from_torch`` sets up a torch optimizer class: the checks that refuse what it cannot
run, the binding of the class's arguments, ``param_groups``, and the scratch instances
(built on placeholder params, kept in a pool) that the steps drive.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from ._torch_values import _at, _check_plain, _has_schedule, _Hyper, _injectable

Tensor = torch.Tensor

# Optimizers refused by class (and their subclasses), with the reason.
_NEEDS_CLOSURE: tuple[type, ...] = (torch.optim.LBFGS,)
_SPARSE_ONLY: tuple[type, ...] = (torch.optim.SparseAdam,)
# torch's own classes: their ``step`` never keeps a reference to a parameter in its state,
# never writes into its param groups and keeps its entries' shapes and dtypes (so reading
# their state back needs no checks). Their gradients are still copied when not owned: some
# write into ``p.grad`` (SGD with ``nesterov=True, foreach=True``).
_TORCH_OWN = frozenset(
    v
    for v in vars(torch.optim).values()
    if isinstance(v, type) and issubclass(v, Optimizer) and v is not Optimizer
)
_GROUP_RESERVED = ("params", "param_names")
_MISSING = object()


# --------------------------------------------------------------------------- the class


def torch_optimizer_class(optimizer: Any) -> type[Optimizer]:
    """``optimizer`` checked to be a ``torch.optim.Optimizer`` subclass ``from_torch`` can run.

    Raises ``TypeError`` for anything else (an instance gets the accepted form) and
    ``ValueError`` for optimizers that need a closure or sparse gradients.
    """
    if isinstance(optimizer, Optimizer):
        raise TypeError(_instance_message(optimizer))
    if not (isinstance(optimizer, type) and issubclass(optimizer, Optimizer)):
        raise TypeError(
            "from_torch() needs a torch.optim.Optimizer subclass (e.g. torch.optim.NAdam), "
            f"got {_describe(optimizer)}"
        )
    if optimizer is Optimizer:
        raise TypeError("from_torch() needs a subclass of torch.optim.Optimizer, not the base")
    name = _qualname(optimizer)
    if issubclass(optimizer, _NEEDS_CLOSURE) or _step_requires_argument(optimizer):
        raise ValueError(
            f"{name} needs a closure (its step re-evaluates the loss several times), which a "
            "pure step cannot give it: from_torch supports optimizers whose step() runs "
            "without one. Use a first-order optimizer (e.g. torch.optim.Adam)."
        )
    if issubclass(optimizer, _SPARSE_ONLY):
        raise ValueError(
            f"{name} works on sparse gradients only; purestep's gradients are dense tensors. "
            "Use torch.optim.Adam (or optim.adam) instead."
        )
    return optimizer


def _step_requires_argument(cls: type) -> bool:
    """Whether ``cls.step`` has a parameter (other than ``self``) without a default."""
    try:
        sig = inspect.signature(cls.step)
    except (TypeError, ValueError):
        return False
    params = list(sig.parameters.values())[1:]
    return any(
        p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        for p in params
    )


def _qualname(cls: type) -> str:
    module = cls.__module__
    if cls in _TORCH_OWN:
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__name__} ({obj!r:.80})"


#: What torch's LR schedulers write into a param group beside ``lr`` (and ``momentum`` /
#: ``betas``): their own bookkeeping, no argument of any optimizer.
SCHEDULER_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum")


def _signature_parameters(cls: type) -> tuple[dict[str, Any], bool] | None:
    """``cls``'s constructor arguments after ``params`` (name -> default, ``empty`` when it
    has none) and whether it takes ``**kwargs``; None if it has no signature."""
    try:
        params = list(inspect.signature(cls).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    named = {
        p.name: p.default
        for p in params
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def group_arguments(opt: Optimizer, group: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The constructor arguments a built optimizer's param group holds, by name, and the
    group's other entries (``[]`` when every one is accounted for). Left out: ``params``,
    ``param_names``, ``name``, what LR schedulers add (``SCHEDULER_GROUP_KEYS``) and what the
    class sets itself (its ``defaults`` entries that are no arguments, such as AdamW's
    ``decoupled_weight_decay``, while they hold the class's value)."""
    sig = _signature_parameters(type(opt))
    named, var_kw = sig if sig is not None else ({}, True)
    args: dict[str, Any] = {}
    other: list[str] = []
    for key, value in group.items():
        if key in _GROUP_RESERVED or key == "name" or key in SCHEDULER_GROUP_KEYS:
            continue
        if key in named or var_kw:
            args[key] = value
        elif key in opt.defaults and _same(opt.defaults[key], value):
            continue
        else:
            other.append(key)
    return args, other


def _instance_message(opt: Optimizer, what: str = "from_torch()'s argument") -> str:
    """The error for an already-built optimizer: the ``from_torch`` call that replaces it
    (its constructor arguments that differ from the defaults; never what an LR scheduler
    wrote into its param groups, and ``lr`` as given before a scheduler changed it)."""
    cls = type(opt)
    name = _qualname(cls)
    sig = _signature_parameters(cls)
    sig_defaults = sig[0] if sig is not None else {}
    groups = opt.param_groups
    first, _ = group_arguments(opt, groups[0]) if groups else ({}, [])
    touched = bool(groups) and "initial_lr" in groups[0]
    if touched and "lr" in first:
        first["lr"] = groups[0]["initial_lr"]
    args = "".join(
        f", {k}={v!r}"
        for k, v in first.items()
        if not (k in sig_defaults and _same(sig_defaults[k], v))
    )
    more = (
        f" It has {len(groups)} param groups: give from_torch param_groups=[{{'params': "
        "<names or a function (name, tensor) -> bool>, ...overrides}, ...]."
        if len(groups) > 1
        else ""
    )
    scheduled = (
        " A torch LR scheduler was built on it: in configure_optimizers return the two "
        "together, ([optimizer], [scheduler]) or {'optimizer': optimizer, 'lr_scheduler': "
        "scheduler}, and purestep translates the pair (the optimizer's parameters must be "
        "the module's)."
        if touched
        else ""
    )
    return (
        f"{what} is a {name} instance, already bound to some module's parameters. purestep "
        "needs an engine.optim transform, which keeps the optimizer state in the TrainState "
        f"and steps it purely: pass the class and its arguments instead, "
        f"optim.from_torch({name}{args}) or functools.partial({name}{args}).{more}{scheduled}"
    )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


# --------------------------------------------------------------------------- configuration


class _GroupSpec:
    """One entry of ``param_groups``: which params, the overrides, the label."""

    __slots__ = ("label", "overrides", "select")

    def __init__(self, select: Any, overrides: dict[str, Any], label: str | None) -> None:
        self.select, self.overrides, self.label = select, overrides, label


def _group_specs(param_groups: Any, name: str) -> list[_GroupSpec]:
    if param_groups is None:
        return []
    if isinstance(param_groups, Mapping) or not isinstance(param_groups, Sequence):
        raise TypeError(
            "param_groups must be a list of dicts {'params': <names or a function (name, "
            f"tensor) -> bool>, ...overrides}}, got {type(param_groups).__name__}"
        )
    specs = []
    labels: set[str] = set()
    for i, group in enumerate(param_groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise TypeError(
                f"param_groups[{i}] must be a dict with a 'params' entry (the names of its "
                "params, or a function (name, tensor) -> bool), and the hyper-parameters it "
                f"overrides; got {group!r:.80}"
            )
        select = group["params"]
        if isinstance(select, str):
            select = (select,)
        elif not callable(select):
            if isinstance(select, Tensor) or not isinstance(select, Iterable):
                raise TypeError(
                    f"param_groups[{i}]['params'] must name the params (a list of str) or be "
                    f"a function (name, tensor) -> bool, got {type(select).__name__}"
                )
            select = tuple(select)
            bad = [s for s in select if not isinstance(s, str)]
            if bad:
                raise TypeError(
                    f"param_groups[{i}]['params'] must hold param names (str), got "
                    f"{type(bad[0]).__name__}: the pure optimizer names params as the "
                    "TrainState does ('0.weight', ...), not by tensor"
                )
        label = group.get("name")
        if label is not None:
            if not isinstance(label, str) or not label:
                raise TypeError(f"param_groups[{i}]['name'] must be a non-empty str")
            if label in labels:
                raise ValueError(f"param_groups: two groups are named {label!r}")
            labels.add(label)
        overrides = {k: v for k, v in group.items() if k != "params"}
        _check_differentiable(overrides, name)
        specs.append(_GroupSpec(select, overrides, label))
    return specs


def _check_differentiable(kwargs: Mapping[str, Any], name: str) -> None:
    if kwargs.get("differentiable"):
        raise ValueError(
            f"{name}(differentiable=True) is not supported by from_torch: the step runs on "
            "detached copies of the params, so there is no autograd graph through it to "
            "differentiate; leave differentiable=False"
        )


def _bind(cls: type, name: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments after ``params``, by name (positional ones bound)."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        if args:
            raise TypeError(
                f"from_torch({name}, ...): pass the hyper-parameters by keyword"
            ) from None
        return dict(kwargs)
    params = list(sig.parameters.values())
    if not params:
        raise TypeError(f"{name}() takes no params argument: not a torch-style optimizer")
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError as e:
        hint = ""
        stray = [k for k in kwargs if k in SCHEDULER_GROUP_KEYS]
        if stray:
            hint = (
                f" ({stray[0]} is what a torch LR scheduler writes into a param group, not an "
                "argument of the optimizer: leave it out, and give the scheduler to the "
                "Trainer with the optimizer it was built on)"
            )
        raise TypeError(f"from_torch({name}, ...): {e}{hint}") from None
    out: dict[str, Any] = {}
    for key, value in bound.arguments.items():
        kind = sig.parameters[key].kind
        if key == params[0].name:
            continue
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"from_torch({name}, ...): pass extra arguments by keyword")
        else:
            out[key] = value
    return out


class _Config:
    """Everything ``from_torch`` knows before it sees params: the class, its arguments, the
    groups and, per group (``param_groups`` entries, then the rest), the injected entries
    and the initial settings, learned from an instance built on a placeholder param."""

    def __init__(self, cls: type, args: tuple, kwargs: dict[str, Any], param_groups: Any):
        self.cls = cls
        self.name = _qualname(cls)
        self.class_name = cls.__name__
        self.kwargs = _bind(cls, self.name, args, kwargs)
        _check_differentiable(self.kwargs, self.name)
        self.specs = _group_specs(param_groups, self.name)
        self.kwargs0 = {k: _at(v, 0) for k, v in self.kwargs.items()}
        self.pool: dict[int, list[Optimizer]] = {}
        self.warm: Any = None  # from_torch's _Warm: an instance parked loaded between steps
        self._warm_lock = threading.Lock()
        self.attributes: dict[int, dict[str, Any]] = {}  # id(scratch instance) -> its vars
        n = len(self.specs) + 1  # the groups given, then the rest
        opt = self.construct([[torch.zeros((1, 1))] for _ in range(n)], n)
        self.hypers: list[tuple[_Hyper, ...]] = []
        for i, group in enumerate(opt.param_groups):
            given = {**self.kwargs, **(self.specs[i].overrides if i < len(self.specs) else {})}
            hypers = []
            for key, value in group.items():
                if key in _GROUP_RESERVED:
                    continue
                spec = given[key] if key in given and _has_schedule(given[key]) else value
                if _injectable(key, spec):
                    hypers.append(_Hyper(key, spec))
                else:
                    _check_plain(value, f"{self.name}'s param group setting {key!r}")
            self.hypers.append(tuple(hypers))
        self.trusted = cls in _TORCH_OWN

    def construct(self, params: list[list[Tensor]], n: int) -> Optimizer:
        """An instance with ``n`` groups (``param_groups`` entries first, then the rest)."""
        groups = []
        for i in range(n):
            over = self.specs[i].overrides if i < len(self.specs) else {}
            groups.append({"params": params[i], **{k: _at(v, 0) for k, v in over.items()}})
        try:
            return self.cls(groups, **self.kwargs0)
        except Exception as e:
            _note(e, f"(while from_torch built {self.name} with {self._shown_args()})")
            raise

    def _shown_args(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.kwargs0.items())
        return shown or "its defaults"

    def label(self, i: int) -> str:
        """Group ``i``'s label in the state (and the LR monitor's log name)."""
        if i < len(self.specs) and self.specs[i].label:
            return self.specs[i].label
        return f"pg{i + 1}"

    def membership(self, params: Mapping[str, Tensor]) -> list[list[str]]:
        """The names of each group's params (a group's own order for lists of names, the
        params' order for functions); the params no group names form the last group."""
        owner: dict[str, int] = {}
        groups: list[list[str]] = []
        for i, spec in enumerate(self.specs):
            select = spec.select
            if callable(select):
                names = [n for n, t in params.items() if select(n, t)]
            else:
                missing = [n for n in select if n not in params]
                if missing:
                    raise KeyError(
                        f"param_groups[{i}] names params that are not trained: {missing[:5]} "
                        f"(the trainable params are {list(params)[:8]}...)"
                    )
                names = list(dict.fromkeys(select))
            for n in names:
                if n in owner:
                    raise ValueError(
                        f"param {n!r} is in param_groups[{owner[n]}] and param_groups[{i}]; "
                        "each param belongs to one group (as in torch)"
                    )
                owner[n] = i
            groups.append(names)
        rest = [n for n in params if n not in owner]
        if rest or not self.specs:
            groups.append(rest)
        return groups

    def borrow(self, n: int) -> Optimizer:
        """A scratch instance with ``n`` groups, emptied (``give_back`` returns it)."""
        free = self.pool.setdefault(n, [])
        try:
            return free.pop()
        except IndexError:
            pass
        opt = self.construct([[torch.zeros((1, 1))] for _ in range(n)], n)
        _empty(opt)
        return opt

    def give_back(self, opt: Optimizer) -> None:
        _empty(opt)
        self.pool.setdefault(len(opt.param_groups), []).append(opt)

    def take_warm(self) -> Any:
        """The instance parked by the latest donating step (None if none), now the caller's:
        steps on several threads never share one."""
        if self.warm is None:
            return None
        with self._warm_lock:
            warm, self.warm = self.warm, None
        return warm

    def park(self, warm: Any) -> None:
        """Park ``warm`` (a loaded instance) for the next step; one displaced goes back."""
        with self._warm_lock:
            old, self.warm = self.warm, warm
        if old is not None:
            self.release(old.opt)

    def release(self, opt: Optimizer) -> None:
        """Return a parked instance to the pool, dropping its references without touching
        the ``.grad`` of its params: they are another run's tensors, whose step may be
        setting them on another instance right now (parked params hold no gradient)."""
        for group in opt.param_groups:
            group["params"] = []
        opt.state = defaultdict(dict)
        self.pool.setdefault(len(opt.param_groups), []).append(opt)

    def release_warm(self) -> None:
        """Drop the parked instance, if any (a new run's ``init``: do not keep the last
        run's tensors alive through it)."""
        warm = self.take_warm()
        if warm is not None:
            self.release(warm.opt)

    def check_attributes(self, opt: Optimizer, count: int) -> None:
        """Refuse state kept on the instance: an attribute a step (after an instance's
        first, which may set up caches) rebinds would be lost to the pytree state."""
        now = {k: v for k, v in vars(opt).items() if k not in ("state", "param_groups")}
        before = self.attributes.get(id(opt))
        self.attributes[id(opt)] = now
        if before is None:
            return
        for key, value in now.items():
            if before.get(key, _MISSING) is not value:
                raise TypeError(
                    f"{self.name} changed its attribute {key!r} in step {count + 1}: "
                    "from_torch keeps an optimizer's state where torch's own optimizers keep "
                    "it, in self.state[p] and the param groups, so state on the instance "
                    "would be lost between steps (and to checkpoints); keep it in "
                    "self.state[p] or the param group instead"
                )


def _note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11+; on 3.10 into ``__notes__`` directly)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]


def _empty(opt: Optimizer) -> None:
    """Drop every reference an instance holds to params, gradients and state."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None
        group["params"] = []
    opt.state = defaultdict(dict)


@contextlib.contextmanager
def _rngs_kept(params: Iterable[Tensor]) -> Iterator[None]:
    """Every global RNG a step might draw from restored afterwards: torch's (CPU, and the
    CUDA devices of ``params``), Python's ``random`` and, if loaded, NumPy's. The probe
    step in ``init`` runs under it, so building a state draws nothing from the caller's
    random streams."""
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        if np_state is not None:
            np.random.set_state(np_state)


def _run_step(opt: Optimizer, name: str) -> None:
    """``opt.step()`` with autograd off (``torch.no_grad()``'s effect, set directly: the
    context manager object costs several microseconds a step)."""
    enabled = torch.is_grad_enabled()
    try:
        if enabled:
            torch._C._set_grad_enabled(False)
        opt.step()
    except Exception as e:
        if "closure" in str(e).lower():
            raise ValueError(
                f"{name}.step() failed without a closure ({type(e).__name__}: {e}); from_torch "
                "supports optimizers whose step() runs without one"
            ) from e
        raise
    finally:
        if enabled:
            torch._C._set_grad_enabled(True)
