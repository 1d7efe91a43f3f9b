"""Lightning's manual optimization, imperative as Lightning spells it, over pure updates.

A module with ``automatic_optimization = False`` writes::

    d_opt, g_opt = self.optimizers()
    self.toggle_optimizer(d_opt)
    d_opt.zero_grad(); self.manual_backward(d_loss); d_opt.step()
    self.untoggle_optimizer(d_opt)

``ManualRun`` runs such a ``training_step`` once per batch over the state the loop's
``OptimizerHandle`` threads. The module is bound to fresh leaf tensors made from the
state's parameters (and copies of its buffers, which a forward pass may write);
``manual_backward(loss)`` differentiates the loss with respect to the leaves that require
gradients and adds the result to this run's gradients (torch's ``.grad`` accumulation);
``opt.step()`` hands the gradients of that optimizer's parameters to
``OptimizerHandle.apply_gradients`` — one pure update, whose new parameters the module is
bound to from then on, so the rest of the step sees them as in Lightning; ``zero_grad``
drops them. Randomness in the step is scoped to a key of the state, and the state passed
in is never written, so a manual run resumes bit-exactly like an automatic one.

Schedulers (Lightning 2's rule: with manual optimization the loop steps none; the module
does)::

    sch = self.lr_schedulers()
    ...; opt.step()
    if (batch_idx + 1) == self.trainer.num_training_batches:
        sch.step()                      # or in on_train_epoch_end; sch.step(metric) for
                                        # ReduceLROnPlateau

``self.lr_schedulers()`` returns one ``LightningScheduler`` per scheduler of
``configure_optimizers`` (the single one, a list, or None), standing for the torch scheduler
object: each is stepped as its pure translation (``engine.optim.from_torch_scheduler``), so
``sch.step()`` is a pure change of the state: its count (or a plateau's counters) in the
task's own state (``TrainState.callbacks["task"]["lr_schedulers"]``) and the learning rates
(and a cycled momentum) it gives in the optimizer state. In ``training_step`` the change is
made to the state the step threads, so the next ``opt.step()`` uses the new rate; in a hook
(``on_train_epoch_end``, ``on_validation_epoch_end``, ``on_train_batch_end``, ...) it is
the hook's own new state and a hyper-parameter request (``loops.events.Requests``), which
the driver carries out at once. Checkpoints hold both, so a resumed run continues
bit-exactly. ``sch.get_last_lr()``, ``sch.last_epoch`` (a plateau's ``best``,
``num_bad_epochs``, ``cooldown_counter``), ``sch.optimizer.param_groups`` and
``opt.param_groups`` read the state's current values; other attributes are the torch
object's settings, and ``isinstance(sch, ReduceLROnPlateau)`` holds as for the torch object.
Refused, with the way out: ``sch.step(epoch)``, ``state_dict`` / ``load_state_dict`` (the
checkpoint holds the scheduler), writing a param group's values, and a step during the
sanity check, in ``on_before_optimizer_step`` or outside a fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from purestep.engine import rng
from purestep.engine.bind import Binder
from purestep.engine.optim import MultiOptState, ReduceLROnPlateau, injected_values
from purestep.engine.optim.multi import set_hyperparams
from purestep.engine.optim.torch_schedules import is_torch_scheduler
from purestep.engine.state import TrainState
from purestep.engine.step import check_unchanged

from ..events import Requests, Stage
from ..schedulers import scheduled_values
from .logging import batch_size_of
from .optimizers import split_schedulers, translate_scheduler

__all__ = ["LightningOptimizer", "LightningScheduler", "ManualRun", "ManualSchedulers"]

#: The fold-in purpose of a manual training step's random key.
MANUAL_PURPOSE = 102
#: Where gradients that no ``zero_grad`` cleared wait for the next batch, in
#: ``TrainState.extra`` (accumulating over batches is Lightning's manual way; a checkpoint
#: between them keeps them, so a resumed run accumulates the same).
GRADS_KEY = "lightning_manual_grads"
#: The task's key in ``TrainState.callbacks`` (``loops.task.task_callback``) and where its
#: state keeps the schedulers' counters (scheduler position -> steps taken, or a plateau's
#: ``PlateauState``).
TASK_KEY = "task"
SCHEDULERS_KEY = "lr_schedulers"


class LightningOptimizer:
    """What ``self.optimizers()`` returns: one of the module's optimizers, by name."""

    def __init__(self, run: ManualRun, name: str, index: int, optimizer: Any) -> None:
        self._run = run
        self.name = name
        self.index = index
        #: the torch optimizer configure_optimizers returned (its settings; the optimizer
        #: state itself is in the TrainState)
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's param groups with the state's current learning rates (and
        momentum): a read-only copy."""
        state = self._run.handle.state
        return current_groups(_optimizer_state(state, self.name), self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._run.zero_grad(self.index)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run ``closure`` (it computes a loss and calls ``manual_backward``) if given, then
        update this optimizer's parameters with their gradients."""
        result = closure() if closure is not None else None
        self._run.step(self.index)
        return result

    def __repr__(self) -> str:
        return f"LightningOptimizer({self.name!r}, {type(self.optimizer).__name__})"


class ManualRun:
    """One manual-optimization ``training_step`` call (see the module doc)."""

    def __init__(
        self,
        module: nn.Module,
        binder: Binder,
        handle: Any,
        batch: Any,
        optimizers: list[Any],
        schedulers: ManualSchedulers | None = None,
    ) -> None:
        self.module = module
        self.schedulers = schedulers
        self.binder = binder
        self.handle = handle
        self.batch = batch
        owner = handle._owner
        self.names = list(owner.names)
        self.param_names = [list(names) for _, _, names in owner.configs]
        self.proxies = [
            LightningOptimizer(self, name, i, optimizers[i] if i < len(optimizers) else None)
            for i, name in enumerate(self.names)
        ]
        self.grads: dict[str, torch.Tensor] = dict(handle.state.extra.get(GRADS_KEY, {}))
        self.frozen: set[str] = set()  # toggle_optimizer: names that do not require grad
        self._toggled: set[str] | None = None
        self._bound: Any = None
        self.leaves: dict[str, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []

    # ------------------------------------------------------------------ binding

    def _trainable(self) -> set[str]:
        return {n for names in self.param_names for n in names}

    def _leaf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        leaf = tensor.detach()
        if name in self._trainable() and name not in self.frozen:
            leaf.requires_grad_(True)
        return leaf

    def _bind(self, changed: set[str] | None = None) -> None:
        """Bind the module to the handle's current state (new leaves for ``changed``)."""
        state = self.handle.state
        leaves = dict(self.leaves)
        for name, tensor in state.params.items():
            if changed is None or name in changed or name not in leaves:
                leaves[name] = self._leaf(name, tensor)
        buffers = self.binder.collect_buffers() if self._bound is not None else None
        self._unbind()
        self.leaves = leaves
        if buffers is None:  # a forward pass may write them: the state's stay untouched
            buffers = {n: b.clone() for n, b in state.buffers.items()}
        self._bound = self.binder.bind(leaves, buffers, training=True)
        self._bound.__enter__()

    def _unbind(self) -> None:
        if self._bound is not None:
            bound, self._bound = self._bound, None
            bound.__exit__(None, None, None)

    def run(self, training_step: Callable[[], Any]) -> Any:
        """Call ``training_step()`` with the module bound and the methods Lightning's manual
        optimization uses attached; returns what it returned. The buffers the forward
        passes wrote end up in the handle's state."""
        state = self.handle.state
        key = rng.fold_in(state.rng, MANUAL_PURPOSE, state.progress.total_batches)
        attached = {
            "optimizers": self.optimizers,
            "manual_backward": self.manual_backward,
            "toggle_optimizer": self.toggle_optimizer,
            "untoggle_optimizer": self.untoggle_optimizer,
            "clip_gradients": self.clip_gradients,
            "lr_schedulers": self.lr_schedulers,
        }
        saved = {k: self.module.__dict__.get(k) for k in attached}
        self.module.__dict__.update(attached)
        given = state.params
        versions = [p._version for p in given.values()]
        scope = contextlib.nullcontext()
        if self.schedulers is not None:  # sch.step() changes the state the step threads
            scope = self.schedulers.scope(lambda: self.handle.state, self._put_state)
        try:
            self._bind()
            with rng.scope(key), scope:
                out = training_step()
            buffers = self.binder.collect_buffers()
            # the first leaves share the given state's storage: it must be as it was
            check_unchanged(given, versions, {}, [], where="training_step")
        finally:
            self._unbind()
            for k, v in saved.items():
                if v is None:
                    self.module.__dict__.pop(k, None)
                else:
                    self.module.__dict__[k] = v
        extra = {k: v for k, v in self.handle.state.extra.items() if k != GRADS_KEY}
        if self.grads:
            extra[GRADS_KEY] = {n: g.detach() for n, g in self.grads.items()}
        changes: dict[str, Any] = {"extra": extra}
        if buffers:
            changes["buffers"] = {n: b.detach() for n, b in buffers.items()}
        self.handle.state = self.handle.state.replace(**changes)
        return out

    # ------------------------------------------------------------------ Lightning's API

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        proxies = self.proxies if use_pl_optimizer else [p.optimizer for p in self.proxies]
        return proxies[0] if len(proxies) == 1 else list(proxies)

    def lr_schedulers(self) -> Any:
        """Lightning's ``self.lr_schedulers()``: the scheduler, a list, or None."""
        return self.schedulers.lr_schedulers() if self.schedulers is not None else None

    def _put_state(self, state: TrainState) -> None:
        self.handle.state = state

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Add the gradients of ``loss`` to every leaf that requires them (``.grad``)."""
        targets = [(n, t) for n, t in self.leaves.items() if t.requires_grad]
        if not targets:
            raise RuntimeError("manual_backward: no parameter requires a gradient")
        found = torch.autograd.grad(
            loss,
            [t for _, t in targets],
            allow_unused=True,
            retain_graph=kwargs.get("retain_graph"),
            create_graph=bool(kwargs.get("create_graph", False)),
        )
        for (name, _), grad in zip(targets, found):
            if grad is None:
                continue
            old = self.grads.get(name)
            self.grads[name] = grad if old is None else old + grad
        self.losses.append(loss.detach())

    def zero_grad(self, index: int) -> None:
        for name in self.param_names[index]:
            self.grads.pop(name, None)

    def step(self, index: int) -> None:
        names = self.param_names[index]
        grads = {n: self.grads[n].clone() for n in names if n in self.grads}
        if not grads:  # torch's step skips parameters without a gradient: all of them here
            return
        loss = self.losses[-1] if self.losses else None
        self._unbind_keep_buffers()
        self.handle.apply_gradients(index, grads, loss=loss, batch_size=batch_size_of(self.batch))
        self._bind(set(names))

    def _unbind_keep_buffers(self) -> None:
        """Before an update: the buffers written so far go into the handle's state, so the
        update and the rebinding carry them on."""
        if self._bound is None:
            return
        buffers = self.binder.collect_buffers()
        self._unbind()
        self.handle.state = self.handle.state.replace(buffers=dict(buffers))

    def toggle_optimizer(self, optimizer: LightningOptimizer) -> None:
        """Only ``optimizer``'s parameters require gradients until ``untoggle_optimizer``
        (Lightning flips ``requires_grad`` on the parameters; here on the bound leaves)."""
        self._toggled = set(self.frozen)
        self.frozen = self._trainable() - set(self.param_names[optimizer.index])
        self._flags()

    def untoggle_optimizer(self, optimizer: LightningOptimizer) -> None:
        self.frozen = self._toggled or set()
        self._toggled = None
        self._flags()

    def _flags(self) -> None:
        trainable = self._trainable()
        for name, leaf in self.leaves.items():
            if name in trainable:
                leaf.requires_grad_(name not in self.frozen)

    def clip_gradients(
        self,
        optimizer: LightningOptimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's ``clip_gradients``: torch's ``clip_grad_norm_`` / ``clip_grad_value_``
        on the optimizer's gradients."""
        if not gradient_clip_val:
            return
        names = [n for n in self.param_names[optimizer.index] if n in self.grads]
        holders = []
        for name in names:  # clip_grad_* read .grad: lend the gradients to stand-ins
            holder = torch.empty_like(self.grads[name])
            holder.grad = self.grads[name]
            holders.append(holder)
        if (gradient_clip_algorithm or "norm") == "norm":
            torch.nn.utils.clip_grad_norm_(holders, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_value_(holders, gradient_clip_val)
        for name, holder in zip(names, holders):
            self.grads[name] = holder.grad


# ---------------------------------------------------------------------- schedulers


def _optimizer_state(state: TrainState, name: str) -> Any:
    opt = state.opt_state
    return opt.states[name] if isinstance(opt, MultiOptState) else opt


class _Group(dict):
    """A param group as ``param_groups`` shows it: the state's values, read only."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "param_groups is a read-only copy under purestep.Trainer: the learning rate and "
            "the other hyper-parameters live in the optimizer state of the TrainState. Change "
            "a learning rate with a scheduler from configure_optimizers (a torch LambdaLR for "
            "a warm-up) stepped through self.lr_schedulers(), or from a callback "
            "(Requests(hyperparams=...))"
        )

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = _refuse


def current_groups(opt_state: Any, optimizer: Any) -> list[dict[str, Any]]:
    """``optimizer``'s param groups (the torch instance configure_optimizers returned)
    with the learning rate, and a ``momentum`` / ``betas[0]`` the state carries, as
    ``opt_state`` holds them now (copies)."""
    groups = list(optimizer.param_groups) if optimizer is not None else []
    lrs = injected_values(opt_state, "lr")
    moms = injected_values(opt_state, "momentum")
    out = []
    for i, group in enumerate(groups):
        view = dict(group)
        if len(lrs) == len(groups):
            view["lr"] = lrs[i]
        if len(moms) == len(groups):
            if isinstance(group.get("betas"), tuple):
                view["betas"] = (moms[i], *group["betas"][1:])
            elif "momentum" in group:
                view["momentum"] = moms[i]
        out.append(_Group(view))
    return out


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One scheduler: its position, its optimizer's name and torch instance (or None), the
    object configure_optimizers gave and its pure translation."""

    index: int
    optimizer: str
    torch_optimizer: Any
    source: Any
    rule: Any

    @property
    def plateau(self) -> bool:
        return isinstance(self.rule, ReduceLROnPlateau)


class _Scope:
    """Where ``sch.step()`` calls read the state and write its new value (``get`` /
    ``put``); ``refusal``: why steps are refused here; ``hyperparams``: what they set."""

    def __init__(
        self,
        get: Callable[[], TrainState],
        put: Callable[[TrainState], None],
        refusal: str | None = None,
    ) -> None:
        self.get, self.put, self.refusal = get, put, refusal
        self.hyperparams: dict[str, Any] = {}
        self.stepped = False


def _counters(state: TrainState) -> dict[str, Any]:
    own = state.callbacks.get(TASK_KEY)
    found = own.get(SCHEDULERS_KEY) if isinstance(own, Mapping) else None
    return dict(found or {})


def _with_counters(state: TrainState, counters: dict[str, Any]) -> TrainState:
    own = state.callbacks.get(TASK_KEY)
    own = (
        {**own, SCHEDULERS_KEY: counters}
        if isinstance(own, Mapping)
        else {SCHEDULERS_KEY: counters}
    )
    return state.replace(callbacks={**state.callbacks, TASK_KEY: own})


class ManualSchedulers:
    """The schedulers of a manual-optimization module, in configure_optimizers order, and
    the scopes their steps write into (see the module doc)."""

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries
        self.proxies = [LightningScheduler(self, e) for e in entries]
        self._scopes: list[_Scope] = []

    @classmethod
    def split(cls, output: Any) -> tuple[Any, ManualSchedulers, list[Any]]:
        """``(output without its schedulers, the schedulers, the torch optimizers to convert
        with a momentum alias of betas[0])`` for a configure_optimizers ``output``."""
        optimizers, named, found = split_schedulers(output)
        entries, beta1 = [], []
        for index, (position, scheduler, where) in enumerate(found):
            rule = translate_scheduler(scheduler, where)
            name, optimizer = named[position]
            bound = optimizer if isinstance(optimizer, Optimizer) else None
            if getattr(rule, "momentum_key", None) == "betas" and bound is not None:
                beta1.append(bound)
            entries.append(_Entry(index, name, bound, scheduler, rule))
        return optimizers, cls(entries), beta1

    def lr_schedulers(self) -> Any:
        """What Lightning's ``self.lr_schedulers()`` returns: the single scheduler, a list
        of them, or None."""
        if not self.proxies:
            return None
        return self.proxies[0] if len(self.proxies) == 1 else list(self.proxies)

    @contextlib.contextmanager
    def scope(
        self,
        get: Callable[[], TrainState],
        put: Callable[[TrainState], None],
        refusal: str | None = None,
    ) -> Iterator[_Scope]:
        """Steps made inside the block read ``get()`` and write through ``put``."""
        scope = _Scope(get, put, refusal)
        self._scopes.append(scope)
        try:
            yield scope
        finally:
            self._scopes.remove(scope)

    def current(self, what: str) -> _Scope:
        if not self._scopes:
            raise RuntimeError(
                f"{what}: the scheduler is stepped and read while purestep.Trainer runs the "
                "module's training_step or one of its hooks in a fit"
            )
        return self._scopes[-1]

    def run_hook(
        self, module: nn.Module, event: str, handler: Callable[..., Any], own: Any, ctx: Any
    ) -> tuple[Any, Requests]:
        """Run the task's ``handler`` of ``event`` with ``self.lr_schedulers()`` on the
        module: what the hook's ``sch.step()`` calls change joins the task's new state and
        its hyper-parameter requests (the driver sets them at once)."""
        refusal = None
        if ctx.fn != "fit":
            refusal = f"sch.step() in {event} of a {ctx.fn} run: schedulers step in a fit"
        elif ctx.stage == Stage.SANITY_CHECK:
            refusal = (
                "sch.step() during the sanity check is not supported under purestep.Trainer: "
                "guard it with `if not self.trainer.sanity_checking`, or run with "
                "num_sanity_val_steps=0"
            )
        elif event == "on_before_optimizer_step":
            refusal = (
                "sch.step() in on_before_optimizer_step is not supported under "
                "purestep.Trainer: step the scheduler in training_step (before or after "
                "opt.step()) or in on_train_batch_end"
            )
        held = [ctx.state]
        saved = module.__dict__.get("lr_schedulers")
        module.__dict__["lr_schedulers"] = self.lr_schedulers
        try:
            with self.scope(lambda: held[0], lambda s: held.__setitem__(0, s), refusal) as scope:
                own, requests = handler(own, ctx)
        finally:
            if saved is None:
                module.__dict__.pop("lr_schedulers", None)
            else:
                module.__dict__["lr_schedulers"] = saved
        if not scope.stepped:
            return own, requests
        own = {**(own if isinstance(own, Mapping) else {}), SCHEDULERS_KEY: _counters(held[0])}
        return own, requests | Requests(hyperparams=dict(scope.hyperparams))


class LightningScheduler:
    """What ``self.lr_schedulers()`` returns: one scheduler of configure_optimizers, stepped
    as its pure translation in the training state (see the module doc)."""

    def __init__(self, owner: ManualSchedulers, entry: _Entry) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_entry", entry)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(sch, torch's class) holds, as in Lightning
        source = self._entry.source
        if is_torch_scheduler(source) or isinstance(source, ReduceLROnPlateau):
            return type(source)
        return LightningScheduler

    def _counter(self, state: TrainState) -> Any:
        entry = self._entry
        found = _counters(state).get(str(entry.index))
        if found is None:
            return entry.rule.init() if entry.plateau else 0
        return found

    def step(self, *args: Any, **kwargs: Any) -> None:
        """``scheduler.step()`` (``step(metrics)`` for ``ReduceLROnPlateau``)."""
        entry = self._entry
        scope = self._owner.current("sch.step()")
        if scope.refusal is not None:
            raise RuntimeError(scope.refusal)
        accepted = {"metrics", "epoch"} if entry.plateau else {"epoch"}
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(f"sch.step() got unexpected keyword arguments {unknown}")
        if entry.plateau:
            metrics = kwargs.get("metrics", args[0] if args else None)
            if kwargs.get("epoch") is not None or len(args) > 1:
                raise NotImplementedError(_NO_EPOCH)
            if metrics is None:
                raise TypeError(
                    "ReduceLROnPlateau.step() needs the metric: sch.step(value), e.g. "
                    'sch.step(self.trainer.callback_metrics["val_loss"])'
                )
        elif args or kwargs.get("epoch") is not None:
            raise NotImplementedError(_NO_EPOCH)
        state = scope.get()
        counters = _counters(state)
        opt_state = _optimizer_state(state, entry.optimizer)
        if entry.plateau:
            lrs = injected_values(opt_state, "lr")
            new_lrs, counter = entry.rule.update(self._counter(state), float(metrics), lrs)
            values: dict[str, Any] = {"lr": new_lrs}
        else:
            counter = self._counter(state) + 1
            values = scheduled_values(entry.rule, counter)
        multi = isinstance(state.opt_state, MultiOptState)
        changes = {(f"{entry.optimizer}/{k}" if multi else k): v for k, v in values.items()}
        try:
            new_opt = set_hyperparams(state.opt_state, changes)
        except (KeyError, ValueError) as err:
            raise type(err)(
                f"sch.step() of {self._name()}: {err} (a torch scheduler steps the optimizer "
                "configure_optimizers built it on)"
            ) from None
        counters[str(entry.index)] = counter
        scope.put(_with_counters(state.replace(opt_state=new_opt), counters))
        scope.hyperparams.update(changes)
        scope.stepped = True

    def _state(self, what: str) -> TrainState:
        return self._owner.current(what).get()

    def get_last_lr(self) -> list[float]:
        """The learning rate of each param group as the state holds it now."""
        state = self._state("sch.get_last_lr()")
        return injected_values(_optimizer_state(state, self._entry.optimizer), "lr")

    @property
    def last_epoch(self) -> int:
        """The steps taken (torch's ``last_epoch``)."""
        counter = self._counter(self._state("sch.last_epoch"))
        return int(counter.last_epoch) if self._entry.plateau else int(counter)

    @property
    def optimizer(self) -> _OptimizerView:
        return _OptimizerView(self)

    def _name(self) -> str:
        return f"{type(self._entry.source).__name__} #{self._entry.index}"

    def state_dict(self) -> Any:
        raise NotImplementedError(_NO_STATE_DICT)

    def load_state_dict(self, state_dict: Any) -> None:
        raise NotImplementedError(_NO_STATE_DICT)

    def __getattr__(self, name: str) -> Any:
        entry = self._entry
        if name.startswith("__"):
            raise AttributeError(name)
        if entry.plateau and name in ("best", "num_bad_epochs", "cooldown_counter"):
            return getattr(self._counter(self._state(f"sch.{name}")), name)
        if name in _STALE:
            raise AttributeError(
                f"sch.{name} is not offered under purestep.Trainer: the torch scheduler object "
                "is never stepped (its pure translation is, in the TrainState); read "
                "sch.get_last_lr() and sch.last_epoch"
            )
        return getattr(entry.source, name)  # its settings (step_size, gamma, base_lrs, ...)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"sch.{name} = ... is not supported under purestep.Trainer: the scheduler's "
            "settings are fixed when fit starts (configure_optimizers) and its counters live "
            "in the TrainState"
        )

    def __repr__(self) -> str:
        return f"LightningScheduler({self._name()}, optimizer={self._entry.optimizer!r})"


class _OptimizerView:
    """``sch.optimizer``: the torch optimizer's settings, its param groups as the state
    holds them now."""

    def __init__(self, scheduler: LightningScheduler) -> None:
        self._scheduler = scheduler

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        entry = self._scheduler._entry
        state = self._scheduler._state("sch.optimizer.param_groups")
        return current_groups(_optimizer_state(state, entry.optimizer), entry.torch_optimizer)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._scheduler._entry.torch_optimizer, name)


_NO_EPOCH = (
    "sch.step(epoch) is not supported under purestep.Trainer (torch deprecates the epoch "
    "argument): call sch.step() once per step you want the schedule to take"
)
_NO_STATE_DICT = (
    "a scheduler's state_dict is not offered under purestep.Trainer: the scheduler's counters "
    "are in the TrainState (callbacks['task']['lr_schedulers']), which checkpoints hold and "
    "ckpt_path= restores"
)
#: torch scheduler attributes that the (never stepped) torch object would show stale.
_STALE = frozenset({"_last_lr", "_step_count", "get_lr", "_get_closed_form_lr", "print_lr"})
