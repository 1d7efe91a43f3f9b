"""Train K copies of a model at once: ``torch.func.vmap`` over a leading member axis.

``hardware.ensemble(k)`` is a strategy that reshapes the computation, so it builds the state
and the steps itself (``engine.init`` / ``train_step`` / ``eval_step`` / ``predict_step``
ask it first)::

    ens = hardware.ensemble(8, hparams={"lr": [1e-4, 3e-4, 1e-3, ...]})
    opt = optim.inject_hyperparams(optim.adam)(lr=1e-3)
    state = engine.init(net, opt, seed=0, strategy=ens)       # tensors stacked: [8, ...]
    step = engine.train_step(net, loss_fn, opt, strategy=ens)
    state, out = step(state, batch)                           # out.loss: shape [8]
    best = hardware.member(state, int(out.loss.argmin()))      # an ordinary TrainState

**State** (see ``hardware.members``): K independent initialisations stacked along axis 0;
member ``i`` is initialised by every submodule's ``reset_parameters()`` (or ``init_fn``)
under ``fold_in(run_key, Purpose.INIT, i)``, and its own key is
``fold_in(run_key, "ensemble-member", i)``. Counters are shared. ``state.rng`` is the run key.

**Randomness.** The step runs under ``rng.scope(fold_in(state.rng, TRAIN, step, micro,
rank))`` like a plain step, and vmap draws with ``randomness="different"``: one draw covers
all members, so dropout masks differ between members and are a pure function of the state.
They are not the masks member ``i`` would draw alone (with dropout, a member's trajectory is
statistically, not numerically, that of a separate run).

**Batches.** Every member sees the same batch; with ``per_member_batch=True`` every tensor
of the batch has a leading axis of size K and member ``i`` sees slice ``i`` (bagging, or K
data orders). **BatchNorm** works in train mode: buffers are stacked, each member keeps its
own running statistics. **Gradients**: ``grad="autograd"`` (the default of
``engine.train_step``) vmaps the forward pass and runs one ``torch.autograd.grad`` of the
summed member losses (each member's loss depends only on its own slice, so this is each
member's gradient; it is the faster path); ``grad="func"`` runs
``vmap(torch.func.grad(...))``. **Optimizer**: applied to the stacked tensors (elementwise,
so members stay independent; see ``hardware.member_optim``); per-member hyper-parameters
through ``optim.inject_hyperparams``; per-member global-norm clipping with
``clip_grad_norm``; the first step checks that the optimizer does not mix members.
**Outputs** have a leading K axis: ``out.loss``, every metric and ``out.grad_norm`` are
``[K]``; eval metrics and predictions likewise.

**Parity** (tested): member ``i`` after any number of steps is the state a separate
``engine.train_step`` run from ``member(initial, i)`` reaches, to a stated tolerance (each
tensor within ``1e-5 * max|b| + 1e-6``; counters exactly). It is not bitwise: the batched
(vmapped) forward and backward kernels do not promise the accumulation order of K separate
ones, so whether they agree to the bit depends on the CPU's kernels. The optimizer update
is elementwise, so given the same gradients it is the same arithmetic stacked or not.

Limits: a precision with a loss scaler ("16-mixed") is refused when the strategy is built
(one scaler would make every member skip when one overflows). ``optim.skip_nonfinite``
inside the optimizer decides for all members at once (one non-finite member skips the step
for all). Parameters of a submodule without ``reset_parameters`` are not re-initialised per
member (pass ``init_fn``); on a meta template they are an error (``engine.state.materialize``).

**Collectives.** Every ``Strategy`` method that is not about the state's shape (placement,
collectives, metric and buffer sync, object broadcast, model conversion, data sharding, RNG
devices) is the base strategy's; ``build_state`` asks the base first (DDP checks the seeds).
With a DDP base, the stacked buffers follow DDP's ``buffers=`` policy after every call.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from purestep.engine import optim, rng, user_errors
from purestep.engine.bind import Binder
from purestep.engine.state import Progress, TrainState, materialize, trainable_names
from purestep.engine.step import (
    NoGradStep,
    StepOutput,
    TrainStep,
    batch_size,
    detached,
    loss_for_grad,
    scalar_gradients,
    split_output,
)
from purestep.engine.strategy import Local, Strategy
from purestep.engine.tree import NAMESPACE, leaves, struct

from . import member_optim
from .members import is_ensemble, size, stack

__all__ = [
    "Ensemble",
    "EnsembleEvalStep",
    "EnsemblePredictStep",
    "EnsembleStepOutput",
    "EnsembleTrainStep",
    "ensemble",
]

Tensor = torch.Tensor


@struct
class EnsembleStepOutput(StepOutput):
    """A ``StepOutput`` whose values carry the member axis: ``loss``, the metrics and
    ``grad_norm`` are ``[K]`` (``grad_norms``: one ``[K]`` tensor per gradient tensor)."""

    @property
    def grad_norm(self) -> Tensor | None:
        """Each member's global gradient norm, shape ``[K]``."""
        norms = self.grad_norms
        return None if norms is None else member_optim.combine_norms(norms)


class _Aux:
    """Splits an output pytree into its tensor leaves (what vmap returns) and the rest."""

    __slots__ = ("mask", "others", "spec")

    def flatten(self, value: Any) -> list[Tensor]:
        if isinstance(value, dict) and not value:  # no metrics (also: dynamo traces this)
            self.spec, self.mask, self.others = None, [], []
            return []
        flat, self.spec = optree.tree_flatten(value, namespace=NAMESPACE)
        self.mask = [isinstance(x, Tensor) for x in flat]
        self.others = [x for x in flat if not isinstance(x, Tensor)]
        return [x for x in flat if isinstance(x, Tensor)]

    def unflatten(self, tensors: Sequence[Tensor]) -> Any:
        if self.spec is None:
            return {}
        ts, others = iter(tensors), iter(self.others)
        return optree.tree_unflatten(
            self.spec, [next(ts) if m else next(others) for m in self.mask]
        )


# --------------------------------------------------------------------------- the strategy


class Ensemble(Strategy):
    """K members trained at once on ``base``'s device and precision (see the module doc)."""

    def __init__(
        self,
        k: int,
        base: Strategy,
        hparams: dict[str, tuple[Any, ...]],
        per_member_batch: bool,
        clip_grad_norm: float | None,
        check_optimizer: bool,
    ) -> None:
        self.k = k
        self.base = base
        self.hparams = hparams
        self.per_member_batch = per_member_batch
        self.clip_grad_norm = clip_grad_norm
        self.check_optimizer = check_optimizer
        self.rank = base.rank
        self.world_size = base.world_size
        self.device = base.device
        self.precision = base.precision

    def __repr__(self) -> str:
        extras = "".join(
            f", {name}={value!r}"
            for name, value in (
                ("hparams", sorted(self.hparams) or None),
                ("per_member_batch", self.per_member_batch or None),
                ("clip_grad_norm", self.clip_grad_norm),
            )
            if value is not None
        )
        return f"Ensemble(k={self.k}, base={self.base!r}{extras})"

    # the base strategy does placement, precision and collectives (every Strategy method
    # that does not concern the state's shape; tests check that none is left out)

    @property
    def is_primary(self) -> bool:
        return self.base.is_primary

    def place(self, tree: Any) -> Any:
        return self.base.place(tree)

    def prepare_state(self, params: dict[str, Tensor], buffers: dict[str, Tensor]) -> tuple:
        return self.base.prepare_state(params, buffers)

    def all_reduce(self, tree: Any, op: str = "mean") -> Any:
        return self.base.all_reduce(tree, op)

    def broadcast(self, tree: Any, src: int = 0) -> Any:
        return self.base.broadcast(tree, src)

    def barrier(self) -> None:
        self.base.barrier()

    def reduce_flag(self, flag: bool, op: str = "any") -> bool:
        return self.base.reduce_flag(flag, op)

    def sync_metrics(self, tree: Any) -> Any:
        return self.base.sync_metrics(tree)

    def sync_buffers(self, buffers: Any, op: str = "mean") -> Any:
        return self.base.sync_buffers(buffers, op)

    def sync_step_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.base.sync_step_buffers(buffers)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.base.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.base.broadcast_object(obj, src)

    def data_options(self) -> dict[str, int]:
        return self.base.data_options()

    def convert_model(self, model: Any) -> Any:
        return self.base.convert_model(model)

    def rng_devices(self, tensors: Any = ()) -> tuple[torch.device, ...]:
        return self.base.rng_devices(tensors)

    # the state and the steps

    def build_state(
        self,
        model: nn.Module,
        optimizer: optim.GradientTransformation,
        *,
        seed: int = 0,
        init_fn: Callable[[nn.Module], None] | None = None,
        **_: Any,
    ) -> TrainState:
        """K independently initialised members, stacked (see the module doc)."""
        if (
            self.base.build_state(model, optimizer, seed=seed, init_fn=init_fn)
            is not NotImplemented
        ):
            raise TypeError(
                f"the base strategy {self.base!r} builds its own state; an ensemble cannot stack it"
            )
        run_key = rng.key(seed)
        trainable = set(trainable_names(model))
        members = []
        for i in range(self.k):
            source = materialize(model, rng.fold_in(run_key, rng.Purpose.INIT, i), init_fn)
            params = {n: p.detach() for n, p in source.named_parameters()}
            buffers = {n: b.detach() for n, b in source.named_buffers() if b is not None}
            params, buffers = self.base.prepare_state(params, buffers)
            members.append(
                TrainState(
                    params=params,
                    buffers=buffers,
                    opt_state=optimizer.init({n: p for n, p in params.items() if n in trainable}),
                    progress=Progress(),
                    rng=rng.fold_in(run_key, "ensemble-member", i),
                    precision=self.base.precision.init(),
                )
            )
        state = stack(members, key=run_key)
        if self.hparams:
            state = state.replace(
                opt_state=member_optim.set_hyperparameters(state.opt_state, self.hparams)
            )
        return state

    def build_train_step(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Any],
        optimizer: optim.GradientTransformation,
        **kwargs: Any,
    ) -> EnsembleTrainStep:
        return EnsembleTrainStep(self, model, loss_fn, optimizer, **kwargs)

    def build_eval_step(self, model: nn.Module, fn: Callable[[nn.Module, Any], Any]) -> Any:
        return EnsembleEvalStep(self, model, fn)

    def build_predict_step(self, model: nn.Module, fn: Callable[[nn.Module, Any], Any]) -> Any:
        return EnsemblePredictStep(self, model, fn)

    # helpers of the steps

    @property
    def batch_dim(self) -> int | None:
        """vmap's ``in_dims`` for the batch."""
        return 0 if self.per_member_batch else None

    def batch_size(self, batch: Any) -> int:
        """Samples per member in ``batch`` (checking the member axis of a per-member batch)."""
        if not self.per_member_batch:
            return batch_size(batch)
        tensors = [x for x in leaves(batch) if isinstance(x, Tensor)]
        bad = [tuple(t.shape) for t in tensors if t.dim() == 0 or t.shape[0] != self.k]
        if not tensors or bad:
            raise ValueError(
                f"per_member_batch=True: every tensor of the batch needs a leading axis of "
                f"size {self.k} (one slice per member); got shapes "
                f"{bad or [tuple(t.shape) for t in tensors]}"
            )
        first = tensors[0]
        return first.shape[1] if first.dim() > 1 else 1

    def check_state(self, state: Any, binder: Binder) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a TrainState, got {type(state).__name__}")
        if not is_ensemble(state):
            raise TypeError(
                "this step trains an ensemble: build its state with "
                "engine.init(model, optimizer, strategy=ensemble) or hardware.stack(states)"
            )
        if size(state) != self.k:
            raise ValueError(f"the state has {size(state)} members, this ensemble {self.k}")
        binder.check(state.params, state.buffers)
        for name, t in [*state.params.items(), *state.buffers.items()]:
            if t.dim() == 0 or t.shape[0] != self.k:
                raise ValueError(
                    f"{name!r} has shape {tuple(t.shape)}: an ensemble state's tensors have a "
                    f"leading member axis of size {self.k}"
                )


# --------------------------------------------------------------------------- training


class EnsembleTrainStep(TrainStep):
    """``step(state, batch) -> (state, out)`` for all members; out's values are ``[K]``.

    ``engine.TrainStep`` (accumulation, ``donate``, ``backward`` / ``apply`` halves, the
    buffer and purity checks) with the forward and backward passes vmapped over the member
    axis, per-member norms and clipping, and the optimizer applied per hyper-parameter group.
    """

    _output_type = EnsembleStepOutput
    _stage = "train_step (ensemble, vmapped over members)"
    # Batched matmuls hand back weight gradients as transposed views; one copy makes the
    # per-member norms (which need each member's elements in order, as a separate run has
    # them) and every elementwise optimizer op run on contiguous memory: measured on the
    # benchmark's MLP, it saves about a third of the optimizer's time.
    _contiguous_grads = True

    def __init__(
        self,
        ensemble: Ensemble,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Any],
        optimizer: optim.GradientTransformation,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, loss_fn, optimizer, strategy=ensemble, **kwargs)
        self.ensemble = ensemble
        self._optimizer_checked = not ensemble.check_optimizer
        # Whether the optimizer keeps injected hyper-parameters in its state (learnt from
        # the first state; one optimizer always builds states of one structure). Without
        # them the grouped step has nothing to group and the walk that looks for them is
        # skipped (about 25 us a step).
        self._injected: bool | None = None

    def __repr__(self) -> str:
        return f"EnsembleTrainStep(model={type(self.model).__name__}, strategy={self.ensemble!r})"

    def _check(self, state: TrainState) -> None:
        self.ensemble.check_state(state, self.binder)

    def _samples(self, batch: Any) -> int:
        return self.ensemble.batch_size(batch)

    def _tensor_norms(self, grads: dict[str, Tensor]) -> tuple[Tensor, ...] | None:
        if self.compute_grad_norm or self.ensemble.clip_grad_norm is not None:
            return member_optim.tensor_norms(grads)
        return None

    def _check_update(self, state: TrainState) -> None:
        """Once: check that the optimizer updates members independently, and learn whether
        it keeps injected hyper-parameters (a compiled step calls this before tracing)."""
        if not self._optimizer_checked:
            trainable = self._trainable(state.params)
            if trainable:
                member_optim.check_separable(self.optimizer, trainable)
            self._optimizer_checked = True
        if self._injected is None:
            self._injected = bool(member_optim.hyperparameters(state.opt_state))

    def _traced_update(self, params, grads, opt_state, norms):
        """``_update`` without its donation context (``engine.compile`` sets it)."""
        max_norm = self.ensemble.clip_grad_norm
        if max_norm is not None:
            grads = member_optim.clip(grads, member_optim.combine_norms(norms), max_norm)
        run = member_optim.step if self._injected else optim.step
        return run(self.optimizer, grads, opt_state, self._trainable(params))

    def _update(self, state: TrainState, grads: dict[str, Tensor], norms: Any) -> tuple:
        """The optimizer update of every member (per-member clipping and hparams)."""
        params = state.params
        trainable = self._trainable(params)
        self._check_update(state)
        max_norm = self.ensemble.clip_grad_norm
        if max_norm is not None:
            grads = member_optim.clip(grads, member_optim.combine_norms(norms), max_norm)
        run = member_optim.step if self._injected else optim.step
        # The gradients are this step's own temporaries: the optimizer may reuse them.
        with optim.donating() if self.donate else optim.owning_updates():
            new_trainable, opt_state = run(self.optimizer, grads, state.opt_state, trainable)
        return self._merged(params, new_trainable), opt_state

    # gradients

    def _member_forward(self, aux: _Aux) -> Callable[..., tuple]:
        binder, loss_fn, precision = self.binder, self.loss_fn, self.ensemble.precision
        stage = self._stage

        def forward(params: dict, buffers: dict, batch: Any) -> tuple:
            with binder.bind(params, buffers, True) as apply:
                with precision.autocast():
                    try:
                        out = loss_fn(apply, batch)
                    except Exception as exc:
                        user_errors.annotate(exc, loss_fn, stage, batch)
                        raise
                    loss, metrics = split_output(out, "loss_fn")
                new_buffers = binder.collect_buffers() if buffers else buffers
            return loss, aux.flatten(metrics), new_buffers

        return forward

    def _member_losses(self, loss: Tensor) -> Tensor:
        if loss.shape[1:].numel() != 1:
            raise ValueError(
                "the loss must be a scalar per member, got a tensor of shape "
                f"{tuple(loss.shape[1:])}"
            )
        return loss.reshape(self.ensemble.k)

    def _grad_autograd(self, params, buffers, batch, key, loss_scale, divisor):
        wrt = {n: params[n].detach().requires_grad_() for n in self.trainable}
        bound = wrt if self._all_trainable else {**params, **wrt}
        aux = _Aux()
        forward = self._member_forward(aux)
        # vmap takes flat positional tensors: its per-call pytree handling of nested inputs
        # and outputs is a measurable part of a small model's step.
        p_names, b_names = list(bound), list(buffers)
        n_p, n_b = len(p_names), len(b_names)
        leaves, spec = torch_pytree.tree_flatten(batch)
        bdim = self.ensemble.batch_dim
        in_dims = (0,) * (n_p + n_b) + tuple(
            bdim if isinstance(x, Tensor) else None for x in leaves
        )

        def flat_forward(*args: Any) -> tuple:
            loss, tensors, new_buffers = forward(
                dict(zip(p_names, args[:n_p])),
                dict(zip(b_names, args[n_p : n_p + n_b])),
                torch_pytree.tree_unflatten(list(args[n_p + n_b :]), spec),
            )
            return (loss, *tensors, *(new_buffers[n] for n in b_names))

        vmapped = torch.func.vmap(flat_forward, in_dims=in_dims, randomness="different")
        with rng.scope(key, generators=self._rng_generators), torch.enable_grad():
            outs = vmapped(*bound.values(), *buffers.values(), *leaves)
        loss = self._member_losses(outs[0])
        tensors = outs[1 : len(outs) - n_b]
        new_buffers = dict(zip(b_names, outs[len(outs) - n_b :])) if n_b else buffers
        target = loss_for_grad(loss.sum() if divisor == 1 else (loss / divisor).sum(), 1.0, 1)
        grads = scalar_gradients(target, tuple(wrt.values()))
        metrics = detached(aux.unflatten(tensors))
        return self._named_grads(wrt, grads), loss.detach(), metrics, new_buffers

    def _grad_func(self, params, buffers, batch, key, loss_scale, divisor):
        frozen = {n: params[n] for n in self._frozen}
        wrt = self._trainable(params)
        aux = _Aux()
        forward = self._member_forward(aux)

        def objective(wrt: dict, frozen: dict, buffers: dict, batch: Any) -> tuple:
            loss, tensors, new_buffers = forward({**frozen, **wrt}, buffers, batch)
            return loss_for_grad(loss, 1.0, divisor), (loss, tensors, new_buffers)

        fn = torch.func.vmap(
            torch.func.grad(objective, has_aux=True),
            in_dims=(0, 0, 0, self.ensemble.batch_dim),
            randomness="different",
        )
        with rng.scope(key, generators=self._rng_generators):
            grads, (loss, tensors, new_buffers) = fn(wrt, frozen, buffers, batch)
        loss = self._member_losses(loss).detach()
        return dict(grads), loss, detached(aux.unflatten(tensors)), new_buffers


# --------------------------------------------------------------------------- eval and predict


class _EnsembleNoGrad(NoGradStep):
    """Eval mode, no gradients, vmapped over members, under a key of the state."""

    purpose = rng.Purpose.EVAL

    def __init__(self, ensemble: Ensemble, model: nn.Module, fn: Callable[[nn.Module, Any], Any]):
        super().__init__(model, fn, ensemble)
        self.ensemble = ensemble

    def _check(self, state: TrainState) -> None:
        self.ensemble.check_state(state, self.binder)

    def _finish(self, out: Any) -> Any:
        return out

    def _forward(self, params: dict, buffers: dict, batch: Any) -> Any:
        ens = self.ensemble
        if ens.per_member_batch:
            ens.batch_size(batch)
        binder, fn, finish, precision = self.binder, self.fn, self._finish, ens.precision
        stage = self._stage
        aux = _Aux()

        def run(params: dict, buffers: dict, batch: Any) -> list[Tensor]:
            with binder.bind(params, buffers, False) as apply, precision.autocast():
                try:
                    out = fn(apply, batch)
                except Exception as exc:
                    user_errors.annotate(exc, fn, stage, batch)
                    raise
                return aux.flatten(finish(out))

        tensors = torch.func.vmap(run, in_dims=(0, 0, ens.batch_dim), randomness="different")(
            params, buffers, batch
        )
        return aux.unflatten([t.detach() for t in tensors])


class EnsembleEvalStep(_EnsembleNoGrad):
    """``step(state, batch, index=0) -> dict`` of per-member metrics (``"loss"``: ``[K]``)."""

    purpose = rng.Purpose.EVAL
    _stage = "eval_step (ensemble, vmapped over members)"

    def _finish(self, out: Any) -> Any:
        if isinstance(out, dict) and "loss" not in out:
            return out
        loss, metrics = split_output(out, "eval fn")
        return {"loss": loss, **metrics}

    def __call__(self, state: TrainState, batch: Any, *, index: int = 0) -> dict[str, Any]:
        return self._run(state, batch, index)


class EnsemblePredictStep(_EnsembleNoGrad):
    """``step(state, batch, index=0) -> fn's output`` with a leading member axis."""

    purpose = rng.Purpose.PREDICT
    _stage = "predict_step (ensemble, vmapped over members)"

    def __call__(self, state: TrainState, batch: Any, *, index: int = 0) -> Any:
        return self._run(state, batch, index)


# --------------------------------------------------------------------------- the factory


def _check_hparams(hparams: Any, k: int) -> dict[str, tuple[Any, ...]]:
    if hparams is None:
        return {}
    if not isinstance(hparams, Mapping):
        raise TypeError(
            "hparams must be a dict name -> one value per member, e.g. "
            f"{{'lr': [1e-3, 3e-3]}}; got {type(hparams).__name__}"
        )
    out = {}
    for name, values in hparams.items():
        if not isinstance(name, str):
            raise TypeError(f"hparams names must be strings, got {name!r}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(
                f"hparams[{name!r}] must be a list of {k} values (one per member), got "
                f"{type(values).__name__}"
            )
        if len(values) != k:
            raise ValueError(
                f"hparams[{name!r}] has {len(values)} values for an ensemble of {k} members"
            )
        for v in values:
            items = v if isinstance(v, (tuple, list)) else (v,)
            if not items or not all(
                isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
                for x in items
            ):
                raise ValueError(
                    f"hparams[{name!r}] values must be finite numbers (or tuples of them), "
                    f"got {v!r}"
                )
        out[name] = tuple(tuple(v) if isinstance(v, list) else v for v in values)
    return out


def ensemble(
    k: int,
    base: Strategy | None = None,
    *,
    hparams: Mapping[str, Sequence[Any]] | None = None,
    per_member_batch: bool = False,
    clip_grad_norm: float | None = None,
    check_optimizer: bool = True,
) -> Ensemble:
    """A strategy that trains ``k`` members at once with ``torch.func.vmap``.

    ``base``: the strategy for placement, precision and collectives (default ``Local()``:
    tensors stay where they are). ``hparams``: per-member values of hyper-parameters the
    optimizer keeps in its state (``optim.inject_hyperparams``), ``{"lr": [k values]}``;
    a tuple hyper-parameter takes a tuple per member. ``per_member_batch``: the batch carries
    a leading axis of size ``k``, one slice per member. ``clip_grad_norm``: clip each
    member's gradients to this global L2 norm (what ``optim.clip_by_global_norm`` does in a
    separate run). ``check_optimizer``: verify on a small probe at the first step that the
    optimizer updates members independently.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (the number of ensemble members) must be an int >= 1, got {k!r}")
    if base is None:
        base = Local()
    if not isinstance(base, Strategy):
        raise TypeError(f"base must be a Strategy, got {type(base).__name__}")
    if isinstance(base, Ensemble):
        raise TypeError("base is already an ensemble; ensembles do not nest")
    if base.precision.scaler is not None:
        raise ValueError(
            f"precision {base.precision.name!r} scales the loss with one dynamic scaler; an "
            "ensemble would make every member skip a step when one overflows. Use "
            "'bf16-mixed', '32-true' or a '-true' precision with ensembles"
        )
    if not isinstance(per_member_batch, bool):
        raise TypeError(f"per_member_batch must be a bool, got {per_member_batch!r}")
    if clip_grad_norm is not None and (
        isinstance(clip_grad_norm, bool)
        or not isinstance(clip_grad_norm, numbers.Real)
        or not math.isfinite(clip_grad_norm)
        or clip_grad_norm < 0
    ):
        raise ValueError(f"clip_grad_norm must be None or a number >= 0, got {clip_grad_norm!r}")
    return Ensemble(
        k,
        base,
        _check_hparams(hparams, k),
        per_member_batch,
        None if clip_grad_norm is None else float(clip_grad_norm),
        bool(check_optimizer),
    )
