"""Any ``torch.optim.Optimizer`` subclass as a pure ``GradientTransformation``.

``from_torch(torch.optim.NAdam, lr=1e-3, weight_decay=0.01)`` takes the optimizer class and
the arguments one would pass after ``params``. Each step drives one scratch instance of
the class exactly as a hand-written loop drives it: the parameters are put into its param
groups (copies, or the state's own tensors under ``donating()``), the gradients become their
``.grad``, the per-parameter state is loaded from the pytree (copies, or the state's own
tensors under ``donating()``), ``step()`` runs with autograd off, and the state it leaves
is read back into a new pytree; then the instance is emptied (instances are kept for reuse,
one per call in flight). So ``optim.step`` on this transform is **bitwise** equal to
``opt.step()`` on the same gradients, and the input state, params and gradients are never
written (the gradients are copied first, since an optimizer may write into ``p.grad``:
torch's own SGD does with ``nesterov=True, foreach=True``; under ``owning_updates()``, as in
``engine.train_step``, they are the step's own and used as they are). Nothing in the new
state shares storage with the input state, except the 0-d hyper-parameter tensors a step
leaves unchanged (passed on, as ``inject_hyperparams`` does) and the entries of params that
had no gradient (torch does not touch them; the built-in transforms pass those on too).

Donation. Under ``donating()`` (the Trainer's fit loop; ``train_step(donate=True)``) the
params and state are updated in place, and with one of torch's own classes the instance
stays loaded between steps instead of being emptied: when the next step's state and params
are the previous step's objects (checked by identity), it only sets the gradients and
hyper-parameters and runs ``step()``, as a hand loop does; any other state (another run's,
a restored or reset one) empties it first. A loaded instance holds the latest state's
tensors (not the gradients) until the transform's next step or ``init``.

State. One group: an ``InjectHyperparamsState`` (``count``, ``hyperparams``, ``name`` =
the class name, so ``LearningRateMonitor`` logs ``lr-NAdam``) whose ``inner_state`` is a
``TorchOptimizerState``; several groups: a ``PartitionState`` of those, labelled ``pg1``,
``pg2``, ... (or a group's ``"name"``), as Lightning names param groups. The float
hyper-parameters of each group (floats, one-element tensors, tuples of floats such as
``betas``) live in ``hyperparams`` as 0-d float64 tensors, with ``inject_hyperparams``'s
semantics: a schedule (a callable of the step count) is evaluated at every step, any other
value is read from the state, so a callback or ``state.replace`` can change it, and the
state holds the values the latest step used. Values the optimizer itself writes into its
param group during a step (a learning rate it adapts, a group-level counter) are read back
too. Everything else torch's per-parameter state holds (``step`` tensors, moments, ints)
is kept as torch names it.

Torch creates most state lazily, in the first ``step``. A checkpoint is matched against a
fresh state's structure, so ``init`` learns the structure the first step creates (a probe
step on copies with zero gradients, torch's, Python's and NumPy's global RNGs restored
afterwards) and holds zero placeholders for the entries not created yet, flagged in
``TorchOptimizerState.created``; those are not loaded
into the optimizer, which then creates them itself, exactly as by hand. An optimizer that
later adds entries, or changes a tensor's shape or dtype, is refused with a clear error.

Not supported, with a clear error: optimizers whose ``step`` needs a closure (``LBFGS``,
or any whose ``step`` requires an argument or fails asking for one), sparse gradients
(``SparseAdam``, or a sparse gradient tensor), ``differentiable=True`` (the step runs on
detached copies: there is no graph to differentiate), and state values a checkpoint cannot
hold (anything but tensors, numbers, strings, ``None`` and lists / tuples / dicts of them),
and state kept on the instance itself (an attribute a step rebinds), which would be lost
between steps. Stacked ensemble members (``hardware.ensemble``) are not supported: a torch
optimizer steps one model's tensors (its ``step`` counters are per model).

``update`` (the unfused path) returns ``new_params - params``; adding that back rounds
differently, so only ``step`` / ``apply`` is bitwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from purestep.engine.tree import struct

from ._torch_setup import (
    _GROUP_RESERVED,
    _Config,
    _empty,
    _note,
    _rngs_kept,
    _run_step,
    torch_optimizer_class,
)
from ._torch_values import (
    _IMMUTABLE,
    _at,
    _check_plain,
    _compatible,
    _copy,
    _placeholder,
    _stored,
    _unalias,
)
from .base import GradientTransformation, Params, Updates, is_donating, owns_updates
from .hyperparams import InjectHyperparamsState
from .masking import PartitionState

__all__ = ["TorchOptimizerState", "from_torch", "torch_optimizer_class"]

Tensor = torch.Tensor


@struct
class TorchOptimizerState:
    """One param group's part of a ``from_torch`` optimizer's state.

    ``state``: param name -> torch's per-parameter state (its own keys: ``step``,
    ``exp_avg``, ...); an entry the optimizer has not created yet holds a zero placeholder
    of the shape and type the first step creates. ``created``: param name -> key -> whether
    the optimizer has created that entry (only created entries are loaded into it).
    ``group``: the group's other settings (ints, flags, strings, ``None``; torch's own
    ``load_state_dict`` restores these too) and any group-level state the optimizer keeps
    there, read back after every step; ``group_created``: which of those exist (an entry
    its first step adds to the group is a placeholder until then).
    """

    state: dict[str, dict[str, Any]]
    created: dict[str, dict[str, bool]]
    group: dict[str, Any]
    group_created: dict[str, bool]


# --------------------------------------------------------------------------- the transform


def from_torch(
    optimizer: type[Optimizer],
    /,
    *args: Any,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> GradientTransformation:
    """``optimizer`` (a ``torch.optim.Optimizer`` subclass) as a pure transform.

    ``args`` / ``kwargs`` are the class's arguments after ``params`` (``lr=1e-3``, ...);
    float ones may be schedules (functions of the step count). ``param_groups``, as torch's
    list of dicts, says which params (a list of names, or a function ``(name, tensor) ->
    bool``) get which overrides; params no group names form a last group with the class
    arguments. A group's ``"name"`` labels it for ``LearningRateMonitor``. ``step`` on the
    result is bitwise ``opt.step()`` (see the module doc).
    """
    cls = torch_optimizer_class(optimizer)
    cfg = _Config(cls, args, kwargs, param_groups)

    def init(params: Params) -> Any:
        cfg.release_warm()
        groups = cfg.membership(params)
        n = len(groups)
        states = _initial_states(cfg, params, groups)
        if n == 1:
            return states[0]
        labels = [cfg.label(i) for i in range(n)]
        if len(set(labels)) != n:
            raise ValueError(
                f"from_torch({cfg.name}): the param groups' labels {labels} repeat; a group "
                "without a 'name' is labelled pg<its position>, so name the groups apart"
            )
        return PartitionState(dict(zip(labels, states)))

    def update(updates: Updates, state: Any, params: Params | None = None) -> tuple:
        if params is None:
            raise ValueError(f"from_torch({cfg.name}) needs the params in update()")
        groups = _group_states(state, cfg)
        new_params, groups = _step(cfg, updates, groups, params, donate_params=False)
        names = list(updates)
        if not names:
            return {}, _rebuild(state, groups)
        deltas = torch._foreach_sub([new_params[n] for n in names], [params[n] for n in names])
        return dict(zip(names, deltas)), _rebuild(state, groups)

    def apply(grads: Updates, state: Any, params: Params) -> tuple:
        groups = _group_states(state, cfg)
        new_params, groups = _step(cfg, grads, groups, params, donate_params=is_donating())
        out = dict(params)
        out.update(new_params)
        return out, _rebuild(state, groups)

    return GradientTransformation(init, update, apply)


def _group_states(state: Any, cfg: _Config) -> list[InjectHyperparamsState]:
    if isinstance(state, InjectHyperparamsState) and isinstance(
        state.inner_state, TorchOptimizerState
    ):
        return [state]
    if isinstance(state, PartitionState) and state.inner_states:
        groups = list(state.inner_states.values())
        if all(
            isinstance(g, InjectHyperparamsState) and isinstance(g.inner_state, TorchOptimizerState)
            for g in groups
        ):
            if len(groups) > len(cfg.specs) + 1:
                raise ValueError(
                    f"from_torch({cfg.name}): the state has {len(groups)} param groups, the "
                    f"optimizer at most {len(cfg.specs) + 1}"
                )
            return groups
    raise TypeError(
        f"from_torch({cfg.name}) got a state of type {type(state).__name__}; it needs the "
        "state its init() made"
    )


def _rebuild(old: Any, groups: list[InjectHyperparamsState]) -> Any:
    if isinstance(old, InjectHyperparamsState):
        return groups[0]
    return PartitionState(dict(zip(old.inner_states, groups)))


def _initial_states(
    cfg: _Config, params: Mapping[str, Tensor], groups: list[list[str]]
) -> list[InjectHyperparamsState]:
    """The state before the first step: the settings the class gives each group, the
    per-parameter state its constructor creates, and zero placeholders (not created) for
    what its first step creates, learned from a probe step on copies."""
    n = len(groups)
    copies = {name: params[name].detach().clone() for names in groups for name in names}
    created: dict[str, dict[str, Any]] = {}
    after: dict[str, dict[str, Any]] = {}
    settings: list[dict[str, Any]] = []
    later: list[dict[str, Any]] = [{} for _ in groups]  # group entries the first step adds
    if copies:
        opt = cfg.construct([[copies[name] for name in names] for names in groups], n)
        settings = [dict(g) for g in opt.param_groups]
        for name, p in copies.items():
            if p in opt.state:
                made = dict(opt.state[p])
                _check_plain(made, f"{cfg.name}'s state for param {name!r}")
                created[name] = _copy(made)
        for p in copies.values():
            p.grad = torch.zeros_like(p)
        with _rngs_kept(copies.values()):
            try:
                _run_step(opt, cfg.name)
            except Exception as e:
                _note(
                    e,
                    f"(while from_torch ran a probe step of {cfg.name} on copies with zero "
                    "gradients, to learn the structure of its state)",
                )
                raise
        for name, p in copies.items():
            got = opt.state.get(p, {})
            _check_plain(got, f"{cfg.name}'s state for param {name!r}")
            after[name] = got
        for i, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key not in settings[i] and key not in _GROUP_RESERVED:
                    _check_plain(value, f"{cfg.name}'s param group entry {key!r}")
                    later[i][key] = _placeholder(value)
        _empty(opt)
    else:
        opt = cfg.construct([[torch.zeros((1, 1))] for _ in range(n)], n)
        settings = [dict(g) for g in opt.param_groups]
    states = []
    for i, names in enumerate(groups):
        hypers = {
            h.key: _stored(_at(h.spec, 0) if h.scheduled else settings[i][h.key])
            for h in cfg.hypers[i]
        }
        injected = {h.key for h in cfg.hypers[i]}
        static = {
            k: _copy(v)
            for k, v in settings[i].items()
            if k not in injected and k not in _GROUP_RESERVED
        }
        static_made = dict.fromkeys(static, True)
        for key, value in later[i].items():
            static[key], static_made[key] = value, False
        per_param: dict[str, dict[str, Any]] = {}
        flags: dict[str, dict[str, bool]] = {}
        for name in names:
            made = created.get(name, {})
            values: dict[str, Any] = {}
            marks: dict[str, bool] = {}
            for key, value in after.get(name, {}).items():
                if key in made:
                    values[key], marks[key] = made[key], True
                else:
                    values[key], marks[key] = _placeholder(value), False
            for key, value in made.items():
                if key not in values:
                    values[key], marks[key] = value, True
            per_param[name], flags[name] = values, marks
        inner = TorchOptimizerState(per_param, flags, static, static_made)
        states.append(InjectHyperparamsState(0, hypers, inner, cfg.class_name))
    return states


def _step(
    cfg: _Config,
    grads: Mapping[str, Tensor],
    groups: list[InjectHyperparamsState],
    params: Mapping[str, Tensor],
    *,
    donate_params: bool,
) -> tuple[dict[str, Tensor], list[InjectHyperparamsState]]:
    """One ``opt.step()`` over every group: ``(stepped params by name, new group states)``."""
    count = groups[0].count
    donate_state = is_donating()
    owned = owns_updates()
    donating_all = donate_params and donate_state and owned
    warm = cfg.take_warm()
    if warm is not None:
        if donating_all:
            stepped = _warm_step(cfg, warm, grads, groups, params, count)
            if stepped is not None:
                cfg.park(warm)
                return stepped
        cfg.release(warm.opt)  # another state: drop the parked instance's references
    seen = 0
    for g in groups:
        state = g.inner_state.state
        for name in grads:
            if name in state:
                seen += 1
    if seen != len(grads):
        known = {n for g in groups for n in g.inner_state.state}
        unknown = [n for n in grads if n not in known]
        raise KeyError(
            f"from_torch({cfg.name}): gradients for params its state does not cover: "
            f"{unknown[:5]} (was the state initialised from params with other names?)"
        )
    if not grads:
        return {}, [g.replace(count=count + 1) for g in groups]
    opt = cfg.borrow(len(groups))
    parked = False
    try:
        stepped = _drive(cfg, opt, grads, groups, params, count, donate_params, donate_state, owned)
        if donating_all and cfg.trusted:
            warm = _parkable(opt, grads, stepped[1])
            if warm is not None:
                cfg.park(warm)
                parked = True
        return stepped
    finally:
        if not parked:
            cfg.give_back(opt)


class _Warm:
    """A scratch instance left loaded after a donating step (``_park``): its param groups
    hold the state's own params (``pairs``, name by name) and its ``state`` the very dicts
    of ``inners``, the groups' ``TorchOptimizerState`` objects that step returned."""

    __slots__ = ("inners", "opt", "pairs")

    def __init__(self, opt: Optimizer, inners: tuple, pairs: tuple) -> None:
        self.opt, self.inners, self.pairs = opt, inners, pairs


def _parkable(opt: Optimizer, grads: Mapping[str, Tensor], groups: list) -> _Warm | None:
    """``opt`` as a ``_Warm`` to keep loaded for the next step, if that step can reuse it as
    it is (else None): every param stepped, every entry created, and every per-param dict
    the new state holds the instance's own (the caller checks for a torch class and
    donation). The next donating step's state is then this one's objects, which
    ``_warm_step`` checks by identity, so it skips loading and reading back."""
    pairs = []
    for g, group in zip(groups, opt.param_groups):
        inner = g.inner_state
        if False in inner.group_created.values():
            return None
        for (name, per_param), p in zip(inner.state.items(), group["params"]):
            if name not in grads or opt.state.get(p) is not per_param:
                return None
            if False in inner.created[name].values():
                return None
            pairs.append((name, p))
    for _, p in pairs:
        p.grad = None  # the gradients are the step's temporaries: do not keep them alive
    return _Warm(opt, tuple(g.inner_state for g in groups), tuple(pairs))


def _warm_step(
    cfg: _Config,
    warm: _Warm,
    grads: Mapping[str, Tensor],
    groups: list[InjectHyperparamsState],
    params: Mapping[str, Tensor],
    count: int,
) -> tuple[dict[str, Tensor], list[InjectHyperparamsState]] | None:
    """The step on the parked instance when ``groups`` and ``params`` are the objects it
    holds and every param has a gradient (else None: the caller takes the full path).
    Torch's own classes keep their state dicts' entries and update them in place, so the
    new state is the old one's objects with the count and hyper-parameters advanced."""
    pairs = warm.pairs
    if len(groups) != len(warm.inners) or len(grads) != len(pairs):
        return None
    for g, inner in zip(groups, warm.inners):
        if g.inner_state is not inner:
            return None
    for name, p in pairs:
        if params.get(name) is not p or name not in grads:
            return None
    opt = warm.opt
    torch_groups = opt.param_groups
    try:
        settings = [
            _set_hypers(cfg, i, g, group, count)
            for i, (g, group) in enumerate(zip(groups, torch_groups))
        ]
        for name, p in pairs:
            _set_grad(cfg, name, p, grads[name], False)
        try:
            _run_step(opt, cfg.name)
        except Exception as e:
            _note(e, f"(while from_torch ran {cfg.name}.step() for step {count + 1})")
            raise
    except BaseException:
        cfg.give_back(opt)  # the caller took it: nothing else holds it
        raise
    for _, p in pairs:
        p.grad = None
    new_groups = []
    for g, group, (values, keep) in zip(groups, torch_groups, settings):
        _read_hypers(group, values, keep)
        new_groups.append(InjectHyperparamsState(count + 1, keep, g.inner_state, cfg.class_name))
    return dict(pairs), new_groups


def _set_hypers(
    cfg: _Config, i: int, g: InjectHyperparamsState, group: dict[str, Any], count: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Put group ``i``'s hyper-parameters for step ``count + 1`` into its torch param group:
    ``(the values set, the values to store)``."""
    values, keep = {}, {}
    hp = g.hyperparams
    for h in cfg.hypers[i]:
        try:
            current = hp[h.key]
        except KeyError:
            raise KeyError(
                f"from_torch({cfg.name}): the state has no hyper-parameter {h.key!r}"
            ) from None
        value, keep[h.key] = h.value(count, current)
        values[h.key] = group[h.key] = value
    return values, keep


def _read_hypers(group: dict[str, Any], values: dict[str, Any], keep: dict[str, Any]) -> None:
    """Store in ``keep`` the hyper-parameters the optimizer changed itself during the step."""
    for key, value in values.items():
        now = group[key]
        if now is not value:
            keep[key] = _stored(now)


def _set_grad(cfg: _Config, name: str, p: Tensor, grad: Tensor, copy: bool) -> None:
    if grad.layout is not torch.strided:
        raise ValueError(
            f"from_torch({cfg.name}): the gradient of {name!r} is {grad.layout}; "
            "sparse gradients are not supported"
        )
    try:
        p.grad = grad.clone() if copy else grad
    except RuntimeError as e:
        raise TypeError(
            f"from_torch({cfg.name}): the gradient of {name!r} does not fit its param ({e})"
        ) from None


def _drive(
    cfg: _Config,
    opt: Optimizer,
    grads: Mapping[str, Tensor],
    groups: list[InjectHyperparamsState],
    params: Mapping[str, Tensor],
    count: int,
    donate_params: bool,
    donate_state: bool,
    owned: bool,
) -> tuple[dict[str, Tensor], list[InjectHyperparamsState]]:
    torch_groups = opt.param_groups
    set_values: list[dict[str, Any]] = []
    stored: list[dict[str, Any]] = []
    scratch: list[list[Tensor]] = []
    for i, (g, group) in enumerate(zip(groups, torch_groups)):
        inner = g.inner_state
        made = inner.group_created
        if cfg.trusted and False not in made.values():
            group.update(inner.group)  # torch's own settings: immutable values
        else:
            for key, value in inner.group.items():
                if made[key]:
                    group[key] = value if type(value) in _IMMUTABLE else _copy(value)
                else:
                    group.pop(key, None)
        values, keep = _set_hypers(cfg, i, g, group, count)
        set_values.append(values)
        stored.append(keep)
        # Even torch's own classes may write into ``p.grad`` (SGD with ``nesterov=True`` and
        # ``foreach=True`` adds the momentum to it in place), so a gradient the step does not
        # own is always copied.
        copy_grads = not owned
        ps = []
        state, created = inner.state, inner.created
        for name, per_param in state.items():
            p = params[name]
            if not donate_params:
                p = p.detach().clone() if p.requires_grad else p.clone()
            grad = grads.get(name)
            if grad is not None:
                _set_grad(cfg, name, p, grad, copy_grads)
            marks = created[name]
            if False not in marks.values():
                loaded = (
                    dict(per_param) if donate_state else {k: _copy(v) for k, v in per_param.items()}
                )
            elif donate_state:
                loaded = {k: v for k, v in per_param.items() if marks[k]}
            else:
                loaded = {k: _copy(v) for k, v in per_param.items() if marks[k]}
            if loaded:
                opt.state[p] = loaded
            ps.append(p)
        group["params"] = ps
        scratch.append(ps)
    try:
        _run_step(opt, cfg.name)
    except Exception as e:
        _note(e, f"(while from_torch ran {cfg.name}.step() for step {count + 1}; {_ENSEMBLE})")
        raise
    if not cfg.trusted:
        cfg.check_attributes(opt, count)
    new_params: dict[str, Tensor] = {}
    new_groups = []
    for i, (g, group, ps) in enumerate(zip(groups, torch_groups, scratch)):
        inner = g.inner_state
        trusted = cfg.trusted
        storages = None if trusted else {p.untyped_storage().data_ptr() for p in ps}
        new_state: dict[str, dict[str, Any]] = {}
        new_created: dict[str, dict[str, bool]] = {}
        for (name, old), p in zip(inner.state.items(), ps):
            got = opt.state.get(p)
            marks = inner.created[name]
            if name in grads:
                new_params[name] = p
            if got is None:  # never touched (a param without a gradient)
                new_state[name], new_created[name] = old, marks
                continue
            if trusted and got.keys() == old.keys() and False not in marks.values():
                # The usual case: every entry there before and after (torch's own classes
                # keep their entries' shapes and dtypes). ``got`` is the dict loaded above.
                new_state[name], new_created[name] = got, marks
                continue
            values: dict[str, Any] = {}
            for key, was in old.items():
                if key in got:
                    value = got[key]
                    if not _compatible(was, value):
                        raise TypeError(_changed(cfg, name, key, was, value, count))
                    values[key] = value
                else:
                    values[key] = was
            if len(values) != len(got):
                extra = [k for k in got if k not in old]
                raise TypeError(
                    f"{cfg.name} created the state entry {extra[0]!r} for param {name!r} at "
                    f"step {count + 1}, which its first step did not create. from_torch needs "
                    "the state's structure fixed after one step (checkpoints are matched "
                    "against it)."
                )
            if not cfg.trusted:
                _check_plain(values, f"{cfg.name}'s state for param {name!r}")
                values = _unalias(values, storages)
            new_state[name] = values
            if all(marks[k] == (k in got) for k in old):
                new_created[name] = marks
            else:
                new_created[name] = {k: k in got for k in old}
        if trusted:  # torch's own classes never write into their param groups
            group_values, group_made = inner.group, inner.group_created
        else:
            group_values, group_made = _read_group(cfg, i, group, inner, count)
        keep = stored[i]
        _read_hypers(group, set_values[i], keep)
        new_groups.append(
            InjectHyperparamsState(
                count + 1,
                keep,
                TorchOptimizerState(new_state, new_created, group_values, group_made),
                cfg.class_name,
            )
        )
    return new_params, new_groups


def _read_group(
    cfg: _Config, i: int, group: dict[str, Any], inner: TorchOptimizerState, count: int
) -> tuple[dict[str, Any], dict[str, bool]]:
    """The group's entries after a step (the state's own dicts when nothing changed)."""
    old, made = inner.group, inner.group_created
    if len(group) != len(old) + len(cfg.hypers[i]) + 1 or any(
        not made[k] or group.get(k, old) is not v for k, v in old.items()
    ):
        injected = {h.key for h in cfg.hypers[i]}
        extra = [k for k in group if k not in old and k not in injected and k != "params"]
        if extra:
            raise TypeError(
                f"{cfg.name} added the entry {extra[0]!r} to its param group at step "
                f"{count + 1}, which its first step did not add. from_torch needs the "
                "state's structure fixed after one step (checkpoints are matched against it)."
            )
        values = {k: group.get(k, v) for k, v in old.items()}
        for k, v in values.items():
            if k in group and not _compatible(old[k], v):
                raise TypeError(_changed(cfg, "(its param group)", k, old[k], v, count))
        _check_plain(values, f"{cfg.name}'s param group entries")
        flags = {k: k in group for k in old}
        return values, flags if flags != made else made
    return old, made


_ENSEMBLE = (
    "from_torch does not support ensembles, a state stacked by hardware.ensemble (with a "
    "leading member axis): a torch optimizer steps one model's tensors; use an engine.optim "
    "transform there (e.g. optim.adam)"
)


def _changed(cfg: _Config, name: str, key: str, was: Any, now: Any, count: int) -> str:
    def show(v: Any) -> str:
        if isinstance(v, Tensor):
            return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
        return f"a {type(v).__name__}"

    stacked = (
        isinstance(was, Tensor)
        and isinstance(now, Tensor)
        and was.dim() == now.dim() + 1
        and was.shape[1:] == now.shape
    )
    hint = f". The state looks stacked: {_ENSEMBLE}" if stacked else ""
    return (
        f"{cfg.name} changed its state entry {key!r} for param {name!r} at step {count + 1} "
        f"from {show(was)} to {show(now)}; from_torch needs the state's structure, shapes "
        f"and dtypes fixed after one step (checkpoints are matched against it){hint}"
    )
