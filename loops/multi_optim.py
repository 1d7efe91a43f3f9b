"""Several optimizers in one training step: Lightning's automatic and manual optimization.

``MultiStep`` trains one module template with several named optimizers, each over its own
parameters (``loops.optimizers``). Each optimizer has its own ``engine.TrainStep`` whose
gradients cover that optimizer's parameters only (the others are bound as constants), and
its own state inside the ``TrainState``'s ``MultiOptState`` (moments, schedule count, update
count ``steps[name]``).

- **automatic** (Lightning 1.5): for every batch the task's ``training_step(apply, batch,
  optimizer_idx)`` runs once per active optimizer, in order, each followed by that
  optimizer's update (with frequencies only one optimizer is active per batch). The
  accumulation window (``accumulate_grad_batches``) is the loop's, shared by all.
- **manual** (``Task.automatic_optimization = False``): ``training_step(opt, batch)`` gets
  an ``OptimizerHandle``; ``opt.step("disc", loss_fn, batch)`` runs one pure step of that
  optimizer — forward and backward of ``loss_fn(apply, batch)``, its own accumulation window
  (the entry's ``"accumulate"``: that many calls per update, counted across epochs; the
  open windows live in ``TrainState.grad_accum`` and ``extra["optimizer_micro"]``) and
  clipping, its update when the window closes — and
  returns its ``StepOutput``. The training step may call it any number of times, in any
  order (a GAN's discriminator twice per generator step).

The state the optimizers' steps see is threaded: the second one sees the first one's
update. Every sub-step's random key is derived from the run key, the optimizer's index, the
batch counter and (manual) the call's position in the batch, so a batch is a pure function
of the state. ``Progress.step`` — the loops' and loggers' ``global_step`` — counts batches
that stepped (Lightning 1.5's rule for several optimizers in automatic mode; Lightning 2.x
counts every optimizer's steps instead): max_steps, validation intervals and the logging
cadence then mean the same with one optimizer or several. Each optimizer's own count is
``state.opt_state.steps[name]``.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from purestep.engine import rng, user_errors
from purestep.engine.optim import MultiOptState
from purestep.engine.state import TrainState
from purestep.engine.step import (
    Gradients,
    StepOutput,
    TrainStep,
    advance_progress,
    batch_size,
    detached,
    split_output,
)

from .optimizers import OptimizerConfig, active_optimizers

__all__ = ["MultiOptimizer", "MultiStep", "OptimizerHandle"]

#: The fold-in purpose of the optimizers' sub-step keys (beyond ``rng.Purpose``'s values).
OPTIMIZER_PURPOSE = 101

#: ``before_update(state, grads, optimizer_idx, name) -> state``: what the loop does after
#: each optimizer's backward, before its update when ``grads.ready`` (events, gradient
#: norms, non-finite checks).
BeforeUpdate = Callable[[TrainState, Gradients, int, str], TrainState]

#: ``before_step(state, optimizer_idx, name) -> state``: what the loop does before a manual
#: ``opt.step`` (the step schedulers' learning rates for that optimizer's next update: one
#: optimizer may update several times in a batch).
BeforeStep = Callable[[TrainState, int, str], TrainState]


class MultiOptimizer:
    """``init(params) -> MultiOptState``: each optimizer's state over its own parameters.

    Stands for the optimizer in ``engine.init``; ``configs`` pairs each optimizer config
    with its transform (clipping included) and parameter names."""

    def __init__(self, configs: Sequence[tuple[OptimizerConfig, Any, list[str]]]) -> None:
        self.configs = list(configs)

    def init(self, params: dict[str, torch.Tensor]) -> MultiOptState:
        states = {}
        for cfg, tx, names in self.configs:
            missing = [n for n in names if n not in params]
            if missing:
                raise ValueError(
                    f"optimizer {cfg.name!r}: parameters {missing} are not trainable "
                    "(requires_grad=False on the template)"
                )
            states[cfg.name] = tx.init({n: params[n] for n in names})
        return MultiOptState(states=states, steps={cfg.name: 0 for cfg, _, _ in self.configs})

    def update(self, *args: Any) -> Any:  # pragma: no cover - the steps use each optimizer
        raise TypeError("MultiOptimizer is stepped by MultiStep, one optimizer at a time")


class MultiStep:
    """The train step of several optimizers (see the module doc).

    ``training_step``: the task's method; ``configs``: ``(config, transform, param names)``
    per optimizer, in order; ``manual``: Lightning's manual optimization; ``accumulate``: the
    loop's accumulation (automatic mode). ``run(state, batch, ...)`` processes one batch.
    """

    multi = True

    def __init__(
        self,
        model: nn.Module,
        training_step: Callable[..., Any],
        configs: Sequence[tuple[OptimizerConfig, Any, list[str]]],
        *,
        strategy: Any = None,
        manual: bool = False,
        accumulate: int | Callable[[Any], int] = 1,
    ) -> None:
        if strategy is not None and type(strategy).__name__ == "Ensemble":
            raise NotImplementedError(
                "several optimizers are not supported under an ensemble strategy: train "
                "each ensemble with one optimizer"
            )
        self.model = model
        self.training_step = training_step
        self.configs = list(configs)
        self.names = [cfg.name for cfg, _, _ in self.configs]
        self.manual = manual
        self.strategy = strategy
        self.accumulate = accumulate if not manual else 1
        freqs = [cfg.frequency for cfg, _, _ in self.configs]
        self.frequencies = freqs if all(f is not None for f in freqs) else None
        if self.frequencies and accumulate != 1:
            raise ValueError(
                "optimizer frequencies with accumulate_grad_batches > 1 are not supported: "
                "each batch trains a different optimizer, so no window could close"
            )
        if manual and (accumulate != 1):
            raise ValueError(
                "manual optimization accumulates per optimizer: give an optimizer "
                "{'optimizer': tx, 'accumulate': k} and leave accumulate_grad_batches at 1"
            )
        world = getattr(strategy, "world_size", 1)
        if manual and world > 1 and any(cfg.accumulate > 1 for cfg, _, _ in self.configs):
            raise ValueError(
                "per-optimizer accumulation in manual optimization runs on one process only "
                "(checkpoints inside an open window would hold rank 0's partial gradients)"
            )
        _check_arity(training_step, manual)
        self.steps = [
            self._build(i, cfg, tx, names) for i, (cfg, tx, names) in enumerate(self.configs)
        ]
        self._loss_fns: dict[tuple[int, Any], TrainStep] = {}

    def _build(self, index: int, cfg: OptimizerConfig, tx: Any, names: list[str]) -> TrainStep:
        if self.manual:
            loss_fn = _unset_loss
        else:
            fn = self.training_step

            def loss_fn(apply: nn.Module, batch: Any, _i: int = index) -> Any:
                return fn(apply, batch, _i)

            loss_fn.__name__ = getattr(fn, "__name__", "training_step")
            loss_fn.__qualname__ = getattr(fn, "__qualname__", loss_fn.__name__)
        accumulate = cfg.accumulate if self.manual else self.accumulate
        return _train_step(self.model, loss_fn, tx, self.strategy, accumulate, names)

    def __repr__(self) -> str:
        mode = "manual" if self.manual else "automatic"
        return f"MultiStep({mode}, optimizers={self.names})"

    # ------------------------------------------------------------------ pieces

    def _sub_state(self, state: TrainState, index: int, *extra_key: int) -> TrainState:
        cfg, _, names = self.configs[index]
        opt_state = state.opt_state
        acc = state.grad_accum
        own = None
        if acc is not None:
            own = {n: acc[n] for n in names if n in acc} or None
        progress = state.progress
        if self.manual:
            progress = progress.replace(micro_step=self._micro_of(state, index))
        key = rng.fold_in(
            state.rng, OPTIMIZER_PURPOSE, index, state.progress.total_batches, *extra_key
        )
        return state.replace(
            opt_state=opt_state.states[cfg.name], grad_accum=own, progress=progress, rng=key
        )

    def _merge(self, state: TrainState, sub: TrainState, index: int, stepped: bool) -> TrainState:
        cfg, _, names = self.configs[index]
        multi: MultiOptState = state.opt_state
        steps = multi.steps
        if stepped:
            steps = {**steps, cfg.name: steps[cfg.name] + 1}
        acc = state.grad_accum
        kept = {n: t for n, t in (acc or {}).items() if n not in set(names)}
        if sub.grad_accum:
            kept.update(sub.grad_accum)
        micro = dict(state.extra.get("optimizer_micro", {})) if self.manual else None
        extra = sub.extra
        if self.manual:
            micro[cfg.name] = sub.progress.micro_step
            extra = {**extra, "optimizer_micro": micro}
        return state.replace(
            params=sub.params,
            buffers=sub.buffers,
            precision=sub.precision,
            callbacks=sub.callbacks,
            loop=sub.loop,
            extra=extra,
            opt_state=multi.replace(states={**multi.states, cfg.name: sub.opt_state}, steps=steps),
            grad_accum=kept or None,
        )

    def _one(
        self,
        state: TrainState,
        index: int,
        step: TrainStep,
        batch: Any,
        end_window: bool | None,
        before_update: BeforeUpdate | None,
        extra_key: tuple[int, ...] = (),
        before_step: BeforeStep | None = None,
    ) -> tuple[TrainState, StepOutput]:
        """One optimizer's backward and (when its window closes) update on ``state``."""
        if before_step is not None:
            state = before_step(state, index, self.names[index])
        sub = self._sub_state(state, index, *extra_key)
        sub, grads = step.backward(sub, batch, end_window=end_window)
        if before_update is not None:  # every micro-batch (its loss), not only full windows
            view = self._merge(state, sub, index, False).replace(progress=state.progress)
            view = before_update(view, grads, index, self.names[index])
            sub = sub.replace(callbacks=view.callbacks, loop=view.loop, extra=view.extra)
        if grads.ready:
            sub, out = step.apply(sub, grads)
        else:
            out = grads.output
        return self._merge(state, sub, index, out.stepped), out

    def _micro_of(self, state: TrainState, index: int) -> int:
        return int(state.extra.get("optimizer_micro", {}).get(self.names[index], 0))

    # ------------------------------------------------------------------ a batch

    def run(
        self,
        state: TrainState,
        batch: Any,
        *,
        batch_idx: int,
        end_window: bool,
        before_update: BeforeUpdate | None = None,
        before_step: BeforeStep | None = None,
    ) -> tuple[TrainState, StepOutput]:
        """Process one batch; ``(new state, combined output)``. ``end_window``: whether the
        loop's accumulation window closes with this batch (automatic mode); ``before_step``:
        run before each manual ``opt.step`` (manual mode)."""
        progress = state.progress
        if self.manual:
            handle = OptimizerHandle(self, state, before_update, before_step)
            returned = self.training_step(handle, batch)
            state, outs = handle.state, handle.outputs
            stepped = any(o.stepped for o in outs)
            combined = _combine(outs, returned, self.names, handle.called)
        else:
            outs, called = [], []
            for i in active_optimizers(self.frequencies, len(self.steps), batch_idx):
                state, out = self._one(state, i, self.steps[i], batch, end_window, before_update)
                outs.append(out)
                called.append(i)
            stepped = end_window
            combined = _combine(outs, None, self.names, called)
        n = batch_size(batch)
        state = state.replace(progress=advance_progress(progress, n, stepped))
        return state, combined.replace(stepped=stepped)

    def __call__(self, state: TrainState, batch: Any, *, batch_idx: int = 0) -> Any:
        return self.run(state, batch, batch_idx=batch_idx, end_window=True)


def _check_arity(fn: Callable[..., Any], manual: bool) -> None:
    """Refuse a training step that cannot take what this mode passes, naming the shape."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None) if manual else signature.bind(None, None, 0)
    except TypeError:
        name = getattr(fn, "__qualname__", "training_step")
        shape = (
            "training_step(self, opt, batch) (manual optimization: opt runs the steps)"
            if manual
            else "training_step(self, apply, batch, optimizer_idx) (called once per optimizer)"
        )
        raise TypeError(
            f"{name}{signature} cannot be called with several optimizers; define {shape}"
        ) from None


def _unset_loss(apply: nn.Module, batch: Any) -> Any:  # replaced per call in manual mode
    raise RuntimeError("manual optimization: opt.step(name, loss_fn, batch) gives the loss")


def _train_step(model, loss_fn, tx, strategy, accumulate, names) -> TrainStep:
    kwargs = dict(accumulate=accumulate, grad_norm=False, trainable=names)
    if strategy is not None:
        built = strategy.build_train_step(model, loss_fn, tx, **kwargs)
        if built is not NotImplemented:
            return built
    return TrainStep(model, loss_fn, tx, strategy=strategy, **kwargs)


def _combine(
    outs: list[StepOutput], returned: Any, names: list[str], called: Sequence[int]
) -> StepOutput:
    """One output for the batch: the training step's returned loss and metrics (manual), or
    the last optimizer's loss with every optimizer's loss as ``loss/<name>`` and their
    metrics merged (automatic)."""
    metrics: dict[str, Any] = {}
    loss = None
    if returned is not None:
        if isinstance(returned, dict) and "loss" not in returned:
            metrics.update(detached(returned))
        else:
            loss, more = split_output(returned, "training_step")
            loss = loss.detach()
            metrics.update(detached(more))
    else:
        for i, out in zip(called, outs):
            metrics.update(out.metrics)
            metrics[f"loss/{names[i]}"] = out.loss
    if loss is None:
        loss = outs[-1].loss if outs else torch.tensor(math.nan)
    skipped = (
        bool(outs) and all(o.skipped for o in outs if o.stepped) and any(o.stepped for o in outs)
    )
    return StepOutput(loss, metrics, None, bool(outs) and any(o.stepped for o in outs), skipped)


class OptimizerHandle:
    """What a manual-optimization ``training_step(opt, batch)`` receives.

    ``opt.step(name, loss_fn, batch)`` runs one pure step of optimizer ``name`` (its index
    works too) and returns its ``StepOutput``; ``opt.names`` lists the optimizers;
    ``opt.state`` is the state so far (read only: the loop takes it after the training step
    returns). Do not keep the handle beyond the call.
    """

    def __init__(
        self,
        owner: MultiStep,
        state: TrainState,
        before_update: BeforeUpdate | None,
        before_step: BeforeStep | None = None,
    ):
        self._owner = owner
        self.state = state
        self.outputs: list[StepOutput] = []
        self.called: list[int] = []
        self._before = before_update
        self._before_step = before_step

    @property
    def names(self) -> list[str]:
        return list(self._owner.names)

    def _index(self, name: str | int) -> int:
        names = self._owner.names
        if isinstance(name, int) and not isinstance(name, bool) and 0 <= name < len(names):
            return name
        if name in names:
            return names.index(name)
        raise KeyError(f"opt.step({name!r}, ...): no such optimizer; they are {names}")

    def step(self, name: str | int, loss_fn: Callable[[nn.Module, Any], Any], batch: Any) -> Any:
        """One step of optimizer ``name`` on ``loss_fn(apply, batch)`` (see the class doc)."""
        owner = self._owner
        index = self._index(name)
        if not callable(loss_fn):
            raise TypeError(f"opt.step({name!r}, loss_fn, batch): loss_fn must be callable")
        # One step per (optimizer, loss code): a lambda made anew each batch reuses what its
        # first call learnt about the buffers (same code, same writes); only its closure is new.
        key = (index, getattr(loss_fn, "__code__", loss_fn))
        step = owner._loss_fns.get(key)
        if step is None:
            if len(owner._loss_fns) >= 64:  # bounded: loss functions of ever-new code
                owner._loss_fns.pop(next(iter(owner._loss_fns)))
            step = owner._loss_fns[key] = _rebind(owner.steps[index], loss_fn)
        elif step.loss_fn != loss_fn:  # (a bound method equals its re-access)
            step = copy.copy(step)
            step.loss_fn = loss_fn
        position = len(self.called)
        self.state, out = owner._one(
            self.state,
            index,
            step,
            batch,
            None,
            self._before,
            extra_key=(position,),
            before_step=self._before_step,
        )
        self.outputs.append(out)
        self.called.append(index)
        return out

    def apply_gradients(
        self,
        name: str | int,
        grads: dict[str, torch.Tensor],
        *,
        loss: torch.Tensor | None = None,
        batch_size: int = 0,
    ) -> StepOutput:
        """One update of optimizer ``name`` from gradients computed outside a pure step
        (Lightning's imperative ``manual_backward`` + ``opt.step()``): ``grads`` maps each of
        its parameter names to a gradient (a missing one counts as zero; the optimizer may
        reuse their storage). Under several processes they are averaged first, as DDP's
        backward does. The events before an update run as for ``step``."""
        owner = self._owner
        index = self._index(name)
        names = owner.configs[index][2]
        state = self.state
        if self._before_step is not None:
            state = self._before_step(state, index, owner.names[index])
        sub = owner._sub_state(state, index, len(self.called))
        values = {n: grads[n] if n in grads else torch.zeros_like(sub.params[n]) for n in names}
        strategy = owner.strategy
        if strategy is not None and getattr(strategy, "world_size", 1) > 1:
            values = strategy.all_reduce(values, "mean")
        lost = torch.tensor(math.nan) if loss is None else loss.detach()
        pending = Gradients(values, True, StepOutput(lost, {}, None, True, False), batch_size)
        if self._before is not None:
            view = owner._merge(state, sub, index, False).replace(progress=state.progress)
            view = self._before(view, pending, index, owner.names[index])
            sub = sub.replace(callbacks=view.callbacks, loop=view.loop, extra=view.extra)
        sub, out = owner.steps[index].apply(sub, pending)
        self.state = owner._merge(state, sub, index, out.stepped)
        self.outputs.append(out)
        self.called.append(index)
        return out


def _rebind(base: TrainStep, loss_fn: Callable[..., Any]) -> TrainStep:
    """A step like ``base`` (same model, optimizer, parameters) running ``loss_fn``."""

    user_errors.check_signature(loss_fn, "loss_fn")
    twin = copy.copy(base)
    twin.loss_fn = loss_fn
    # What the first call learnt about buffers is per loss function: learn it again.
    twin._mutated = None
    twin._spares = {}
    twin._checked = False
    return twin
