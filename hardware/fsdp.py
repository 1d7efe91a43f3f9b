"""Fully sharded data parallel training: parameters, gradients and optimizer state in shards.

``hardware.fsdp()`` is called in every worker process (``torchrun`` or ``hardware.launch``),
like ``hardware.ddp()``, whose process group, collectives, metric sync, buffer policy, data
sharding and rank-0 effects it shares (``FSDP`` is a ``DDP``). What differs is the state and
the step:

**State.** ``engine.init(model, opt, strategy=fsdp)`` builds the state as DDP does (rank 0's
values on every rank), then keeps each parameter as a ``DTensor`` shard on a 1-D mesh over
all ranks (``Shard(0)``; 0-d parameters ``Replicate()``; see ``hardware.sharding``); the
optimizer's ``init`` runs on those DTensors, so its moments are shards too. Buffers stay
plain (the same on every rank, kept so by the ``buffers=`` policy). A rank holds about 1/W of
the parameters, gradients and optimizer state; the state is still the one thing to save
(``engine.checkpoint.sharded`` writes one file per rank and reloads at any world size).

**Step.** The step's module template is a private copy of the model on the meta device,
split into *units* by ``auto_wrap_policy`` (a set of module classes, or
``policy(module) -> bool``; default: none, the whole model is one unit). The collectives
are per unit, as torch's FSDP2's (``hardware.fsdp_units``): a unit's parameters are
all-gathered with one ``all_gather_single`` per dtype (its shards packed into one flat
buffer) when its ``forward`` starts, and dropped from the template when it returns; the
root unit (parameters of no wrapped module, and tied parameters) is gathered for the whole
pass. The next unit's all-gather (in the order recorded on the step's first call) is issued
before the current unit computes, so at most two units are gathered at a time. With
``reshard_after_forward=True`` (default) the gathered tensors autograd saves for the
backward pass are not kept either (except the root's and the last unit's, which the
backward pass starts with): they are gathered again per unit when the backward pass comes
to the unit (a hook on its outputs, which also prefetches the unit before it; the saved
tensors through ``torch.autograd.graph.saved_tensors_hooks``). Each unit's gradients reach
their shards with one ``reduce_scatter_single`` in ``reduce_dtype``, averaged over ranks,
launched (asynchronously; waited on when the next unit's is launched) as soon as the
unit's last gradient is produced (so W ranks with b samples each train like one process
with W * b samples). Not overlapped: the first gather of a pass, the last reduce-scatter,
and the update. The optimizer (any
``engine.optim`` transform: fused tensor math) runs on the local shards, with the per-tensor
norms it takes (global-norm clipping, ``skip_nonfinite``) and the reported gradient norm
taken over all ranks (``hardware.sharding.sharded_norms``). Accumulation adds the
micro-batches' reduced gradient shards (each micro-batch reduce-scatters: no full
gradients are kept). Everything else (purity, keys, buffers, donation) is ``TrainStep``'s.

**Gradients and optimizer state only.** ``fsdp(sharding="grad_op")`` keeps the parameters
whole (plain tensors, the same on every rank) and shards the rest: the forward and backward
passes run as under DDP (micro-batches accumulate whole gradients locally), the closing
window reduce-scatters the gradients into shards, the optimizer updates this rank's chunk of
each parameter and its sharded state, and an all-gather rebuilds the whole parameters (these
two are still one collective per parameter, DTensor redistributions). Eval and predict
steps are the ordinary ones.

**Mixed precision.** ``mixed_precision=torch.distributed.fsdp.MixedPrecisionPolicy(
param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: parameters are gathered and the
forward/backward pass computes in ``param_dtype``; gradients are reduced in
``reduce_dtype`` (default: ``param_dtype``) and the shards, the master weights, stay float32;
``cast_forward_inputs`` casts the floating inputs of the root module's forward;
``output_dtype`` casts its output. A loss-scaling precision ("16-mixed") is refused (its
overflow check would be per rank); bfloat16 needs no scaler.

Every rank must run the same units in the same order (data-dependent control flow that
skips a unit on one rank only would leave a collective unmatched: the group's timeout then
raises ``CollectiveError``). Code outside a wrapped unit's ``forward`` must not read that
unit's parameters (they are only bound while it runs); tie such parameters or leave the
module unwrapped. ``grad="func"`` (vmap) is not supported.
"""

from __future__ import annotations

import copy
import datetime
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from purestep.engine import optim, user_errors
from purestep.engine.loss_scale import DynamicLossScale
from purestep.engine.step import (
    EvalStep,
    PredictStep,
    TrainStep,
    loss_for_grad,
    modified_in_place,
    scalar_gradients,
)
from purestep.engine.strategy import Precision

from . import fsdp_units, sharding
from .ddp import DDP, ddp, ddp_from_flags

if TYPE_CHECKING:  # torch.distributed.fsdp / .tensor are imported when a strategy is built
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "FSDP",
    "FSDPEvalStep",
    "FSDPPredictStep",
    "FSDPTrainStep",
    "fsdp",
    "SHARDING_MODES",
    "fsdp_from_flags",
    "wrap_units",
]

Policy = Callable[[nn.Module], bool] | Iterable[type] | None

#: ``"full"``: parameters, gradients and optimizer state sharded; ``"grad_op"``: gradients
#: and optimizer state only (parameters whole on every rank, no gathering: ZeRO-2).
SHARDING_MODES = ("full", "grad_op")


class FSDP(DDP):
    """One rank of a fully sharded run; build it with ``hardware.fsdp()`` in each worker."""

    def __init__(
        self,
        base: DDP,
        *,
        auto_wrap_policy: Policy = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool = True,
        sharding: str = "full",
    ) -> None:
        if sharding not in SHARDING_MODES:
            raise ValueError(f"sharding must be one of {SHARDING_MODES}, got {sharding!r}")
        super().__init__(**base._settings())
        if base.precision.scaler is not None:
            raise ValueError(
                f"precision {base.precision.name!r} scales the loss, which fsdp does not "
                "support (each rank would decide on overflow alone); use 'bf16-mixed' or "
                "mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
            )
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                "mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                f"{type(mixed_precision).__name__}"
            )
        _check_policy(auto_wrap_policy)
        self.auto_wrap_policy = auto_wrap_policy
        self.mixed_precision = mixed_precision or MixedPrecisionPolicy()
        self.reshard_after_forward = bool(reshard_after_forward)
        self.sharding = sharding
        self._mesh = None
        self._building = False

    def __repr__(self) -> str:
        mp = self.mixed_precision
        return (
            f"FSDP(rank={self.rank}/{self.world_size}, device={self.device}, "
            f"backend={self.backend!r}, precision={self.precision.name!r}, "
            f"sharding={self.sharding!r}, param_dtype={mp.param_dtype}, "
            f"reduce_dtype={mp.reduce_dtype})"
        )

    @property
    def mesh(self) -> Any:
        """The 1-D device mesh over all ranks the shards live on."""
        self._ready()
        if self._mesh is None:
            self._mesh = sharding.world_mesh(self.device.type)
        return self._mesh

    # ------------------------------------------------------------------ state

    def build_state(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        """As DDP's; under ``sharding="grad_op"`` the optimizer state is initialised on the
        parameters' shards (the parameters themselves stay whole on every rank)."""
        if self.sharding == "full" or self._building:
            return super().build_state(model, optimizer, **kwargs)
        from purestep.engine.state import init, trainable_names

        self._building = True
        try:
            state = init(model, optimizer, strategy=self, **kwargs)
        finally:
            self._building = False
        trainable = set(trainable_names(model))
        shards = self.shard({n: p for n, p in state.params.items() if n in trainable})
        return state.replace(opt_state=optimizer.init(shards))

    def prepare_state(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Rank 0's parameters, sharded (DTensors; whole under ``sharding="grad_op"``), and
        its buffers (plain) on every rank."""
        params, buffers = super().prepare_state(params, buffers)
        return (self.shard(params) if self.sharding == "full" else params), buffers

    def shard(self, tree: Any) -> Any:
        """Every plain tensor of ``tree`` (the same full value on every rank) as this rank's
        shard, without communication; e.g. a plain state's ``params`` and ``opt_state``."""
        return sharding.shard_tree(tree, self.mesh)

    def shard_state(self, state: Any) -> Any:
        """A plain ``TrainState`` (full tensors, the same on every rank: say one loaded from an
        ordinary checkpoint) as this strategy's sharded state."""
        params = self.shard(state.params) if self.sharding == "full" else state.params
        return state.replace(params=params, opt_state=self.shard(state.opt_state))

    @staticmethod
    def full_state(state: Any) -> Any:
        """The plain ``TrainState`` a sharded one stands for (all-gathers; every rank calls)."""
        return state.replace(
            params=sharding.full_tree(state.params), opt_state=sharding.full_tree(state.opt_state)
        )

    # ------------------------------------------------------------------ steps

    def gradient_norms(self, tensors: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
        """The ``ord``-norms of the full gradients whose shards are ``tensors`` (the train
        step hands out this rank's shards): the loop's ``track_grad_norm`` logs these, the
        same on every rank (one all-reduce)."""
        return sharding.global_norms(list(tensors), ord)

    def build_train_step(self, model: Any, loss_fn: Any, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs.get("grad", "autograd") != "autograd":
            raise ValueError("fsdp supports grad='autograd' only (not torch.func / vmap)")
        return FSDPTrainStep(model, loss_fn, optimizer, strategy=self, **kwargs)

    def build_eval_step(self, model: Any, fn: Any) -> Any:
        if self.sharding == "grad_op":
            return NotImplemented  # whole parameters: the ordinary step
        return FSDPEvalStep(model, fn, self)

    def build_predict_step(self, model: Any, fn: Any) -> Any:
        if self.sharding == "grad_op":
            return NotImplemented
        return FSDPPredictStep(model, fn, self)


def _check_policy(policy: Policy) -> None:
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return
    try:
        classes = list(policy)  # type: ignore[arg-type]
    except TypeError:
        classes = None
    if classes is None or not all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in classes
    ):
        raise TypeError(
            "auto_wrap_policy must be None, a set of nn.Module classes or a function "
            f"module -> bool, got {policy!r}"
        )


def _wrapped(policy: Policy, module: nn.Module) -> bool:
    if policy is None:
        return False
    if callable(policy) and not isinstance(policy, type):
        return bool(policy(module))
    return isinstance(module, tuple(policy))  # type: ignore[arg-type]


def wrap_units(model: nn.Module, policy: Policy) -> dict[str, list[str]]:
    """``unit path -> canonical parameter names`` ("" is the root unit): each parameter
    belongs to the innermost wrapped module holding it, tied parameters used by several
    units to the root."""
    _check_policy(policy)
    units = [name for name, m in model.named_modules() if name and _wrapped(policy, m)]
    owner: dict[str, set[str]] = {}
    first: dict[int, str] = {}
    for slot, p in model.named_parameters(remove_duplicate=False):
        canon = first.setdefault(id(p), slot)
        path = slot.rpartition(".")[0]
        inner = max(
            (u for u in units if path == u or path.startswith(u + ".")), key=len, default=""
        )
        owner.setdefault(canon, set()).add(inner)
    out: dict[str, list[str]] = {"": []}
    for u in units:
        out[u] = []
    for canon, where in owner.items():
        out[next(iter(where)) if len(where) == 1 else ""].append(canon)
    return {u: names for u, names in out.items() if names or u == ""}


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory); buffers are
    copied as they are (the state's are bound in their place)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    return copy.deepcopy(model, memo)


# The per-unit collectives live in ``hardware.fsdp_units``; these names are kept here.
_Token = fsdp_units.Token
_Gathering = fsdp_units.UnitPass


def _units(template: nn.Module, strategy: FSDP) -> fsdp_units.Units:
    """The gathering hooks of ``template``, split into units by the strategy's policy."""
    return fsdp_units.Units(
        template,
        wrap_units(template, strategy.auto_wrap_policy),
        strategy.mixed_precision,
        strategy.reshard_after_forward,
    )


def _check_sharded(state: Any) -> None:
    from torch.distributed.tensor import DTensor

    bad = [n for n, p in state.params.items() if not isinstance(p, DTensor)]
    if bad:
        raise ValueError(
            f"the state's parameters {bad[:3]} are not sharded: build the state with "
            "engine.init(model, optimizer, strategy=fsdp) (or fsdp.shard_state(state))"
        )


class _ReducedGradients:
    """The strategy as the train step sees it: the gradients it gets are already reduced
    (reduce-scattered in the backward pass), so its ``all_reduce`` of them is the identity;
    under ``sharding="grad_op"`` it reduce-scatters the whole gradients into shards."""

    def __init__(self, strategy: FSDP, step: FSDPTrainStep) -> None:
        self._strategy = strategy
        self._step = weakref.ref(step)

    def all_reduce(self, tree: Any, op: str = "mean") -> Any:
        step = self._step()
        if step is None or step.units is not None:
            return tree
        return step._scatter(tree)  # sharding="grad_op": whole gradients to shards

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)

    def __repr__(self) -> str:
        return repr(self._strategy)


class FSDPTrainStep(TrainStep):
    """``engine.TrainStep`` over sharded parameters (see the module docstring)."""

    def __init__(
        self, model: nn.Module, loss_fn: Any, optimizer: Any, *, strategy: FSDP, **kw: Any
    ):
        full = strategy.sharding == "full"
        template = _meta_copy(model) if full else model
        view = _ReducedGradients(strategy, self)
        super().__init__(template, loss_fn, optimizer, strategy=view, **kw)  # type: ignore[arg-type]
        self.fsdp = strategy
        self.units = _units(template, strategy) if full else None
        self._placeholders = dict(template.named_parameters()) if full else {}
        self._likes: dict[str, Any] = {}

    def _check(self, state: Any) -> None:
        super()._check(state)
        if self.units is not None:
            _check_sharded(state)
        elif not sharding.is_sharded(state.opt_state) or sharding.is_sharded(state.params):
            raise ValueError(
                'under sharding="grad_op" the state holds whole parameters and a sharded '
                "optimizer state: build it with engine.init(model, optimizer, strategy=fsdp)"
            )

    def _like(self, name: str, p: torch.Tensor) -> Any:
        """A DTensor laid out as parameter ``name``'s shards (on the meta device: no data)."""
        like = self._likes.get(name)
        if like is None:
            like = self._likes[name] = self.fsdp.shard(torch.empty_like(p, device="meta"))
        return like

    def _scatter(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole gradients reduce-scattered (averaged over ranks) to this rank's shards."""
        rd = self.fsdp.mixed_precision.reduce_dtype
        return {
            n: sharding.reduce_scatter_mean(g, self._like(n, g), rd).to(g.dtype)
            for n, g in grads.items()
        }

    def _grad_autograd(self, params, buffers, batch, key, loss_scale, divisor):
        if self.units is None:
            return super()._grad_autograd(params, buffers, batch, key, loss_scale, divisor)
        local = {n: p.to_local() for n, p in params.items()}
        versions = [t._version for t in local.values()]
        trainable = self.trainable if not self._all_trainable else list(local)
        wrt = {n: local[n] for n in trainable}
        sources = {n: t.detach() for n, t in local.items()}
        gathering = self.units.gathering(params, sources, trainable)
        run = gathering.run
        with self._forward_scope(self._placeholders, buffers, key, gathering) as apply:
            loss, metrics, new_buffers = self._call_loss(apply, batch, buffers)
            target = loss_for_grad(loss, loss_scale, divisor)
            # every unit's backward is on the path to the pass's anchor: it reduce-scatters
            # the unit's gradients, collected (averaged shards) once the backward pass is done
            scalar_gradients(target, (run.anchor,))
            reduced = run.gradients()
        changed = modified_in_place(local, versions)
        if changed:
            raise RuntimeError(f"the forward pass modified parameters {changed} in place")
        grads = [reduced.get(n) for n in trainable]
        return self._named_grads(wrt, grads), loss.detach(), metrics, new_buffers

    def _grad_func(self, *args: Any) -> Any:
        raise ValueError("fsdp supports grad='autograd' only")

    def _tensor_norms(self, grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        if not self.compute_grad_norm:
            return None
        return tuple(sharding.global_norms(list(grads.values()), 2.0))

    def _update(self, state: Any, grads: dict[str, torch.Tensor], norms: Any) -> tuple[dict, Any]:
        if self.units is None:
            return self._update_whole(state, grads)
        params = self._trainable(state.params)
        local_params = sharding.local_tree(params)
        local_opt = sharding.local_tree(state.opt_state)
        with (
            optim.donating() if self.donate else optim.owning_updates(),
            sharding.sharded_norms(),
        ):
            new_local, new_opt = optim.step(self.optimizer, grads, local_opt, local_params)
        new_params = sharding.rewrap(new_local, params)
        opt_state = sharding.rewrap(new_opt, state.opt_state)
        return self._merged(state.params, new_params), opt_state

    def _update_whole(self, state: Any, grads: dict[str, torch.Tensor]) -> tuple[dict, Any]:
        """``sharding="grad_op"``: the optimizer updates this rank's chunk of each whole
        parameter, then the chunks are all-gathered into the new whole parameters."""
        params = self._trainable(state.params)
        likes = {n: self._like(n, p) for n, p in params.items()}
        local_params = {n: sharding.local_chunk(p, likes[n]) for n, p in params.items()}
        local_opt = sharding.local_tree(state.opt_state)
        with (
            optim.donating() if self.donate else optim.owning_updates(),
            sharding.sharded_norms(),
        ):
            new_local, new_opt = optim.step(self.optimizer, grads, local_opt, local_params)
        with torch.no_grad():
            new_params = {n: sharding.gather(t, likes[n]) for n, t in new_local.items()}
        opt_state = sharding.rewrap(new_opt, state.opt_state)
        return self._merged(state.params, new_params), opt_state


class _NoGradMixin:
    """The eval/predict forward pass over sharded parameters, gathering unit by unit."""

    def _setup(self, model: nn.Module, strategy: FSDP) -> nn.Module:
        template = _meta_copy(model)
        self.units = _units(template, strategy)
        self._placeholders = dict(template.named_parameters())
        return template

    def _check(self, state: Any) -> None:
        super()._check(state)  # type: ignore[misc]
        _check_sharded(state)

    def _forward(self, params: dict, buffers: dict, batch: Any) -> Any:
        local = {n: p.to_local() for n, p in params.items()}
        with (
            self.binder.bind(self._placeholders, buffers, False) as apply,  # type: ignore[attr-defined]
            self.units.gathering(params, local, None),
            self.strategy.precision.autocast(),  # type: ignore[attr-defined]
        ):
            try:
                return self.fn(apply, batch)  # type: ignore[attr-defined]
            except Exception as exc:
                user_errors.annotate(exc, self.fn, self._stage, batch)  # type: ignore[attr-defined]
                raise


class FSDPEvalStep(_NoGradMixin, EvalStep):
    """``engine.EvalStep`` over sharded parameters."""

    def __init__(self, model: nn.Module, fn: Any, strategy: FSDP) -> None:
        template = self._setup(model, strategy)
        EvalStep.__init__(self, template, fn, strategy)


class FSDPPredictStep(_NoGradMixin, PredictStep):
    """``engine.PredictStep`` over sharded parameters."""

    def __init__(self, model: nn.Module, fn: Any, strategy: FSDP) -> None:
        template = self._setup(model, strategy)
        PredictStep.__init__(self, template, fn, strategy)


# ---------------------------------------------------------------------- construction


def fsdp(
    auto_wrap_policy: Policy = None,
    mixed_precision: MixedPrecisionPolicy | None = None,
    *,
    sharding: str = "full",
    reshard_after_forward: bool = True,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    precision: str | int | Precision = "32-true",
    device: torch.device | str | None = None,
    buffers: str = "broadcast",
    loss_scale: DynamicLossScale | None = None,
    per_run: bool = False,
    cluster: Any = None,
) -> FSDP:
    """This process's rank of a fully sharded run, with the process group initialised.

    ``auto_wrap_policy``: which submodules gather their parameters on their own (a set of
    module classes, e.g. ``{nn.TransformerEncoderLayer}``, or ``fn(module) -> bool``;
    default: the whole model at once). ``mixed_precision``: a
    ``torch.distributed.fsdp.MixedPrecisionPolicy``. ``reshard_after_forward``: free the
    gathered parameters after the forward pass and gather again for the backward pass
    (less memory, one more all-gather). ``sharding``: ``"full"`` (parameters, gradients and
    optimizer state) or ``"grad_op"`` (gradients and optimizer state only: the parameters
    stay whole, the forward pass gathers nothing, each optimizer step all-gathers the
    updated parameters). The other arguments are ``hardware.ddp``'s.
    """
    base = ddp(
        backend=backend,
        timeout=timeout,
        precision=precision,
        device=device,
        buffers=buffers,
        loss_scale=loss_scale,
        per_run=per_run,
        cluster=cluster,
    )
    value = FSDP(
        base,
        auto_wrap_policy=auto_wrap_policy,
        mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward,
        sharding=sharding,
    )
    value.cluster = base.cluster  # who started the processes (SLURM auto-requeue reads it)
    return value


def fsdp_from_flags(
    use_cuda: bool, devices: Any, count: int | None, precision: Any, cluster: Any = None
) -> FSDP:
    """``fsdp()`` for ``Trainer(strategy="fsdp")``: the process checks of ``ddp_from_flags``
    (``devices`` against the processes started), default wrapping (the whole model as one
    unit; pass ``strategy=hardware.fsdp(auto_wrap_policy=...)`` to choose). Unlike
    ``strategy="ddp"`` the group is not released after each run: the state's DTensors live
    on it, so it lives until the process exits (or ``close()``)."""
    base = ddp_from_flags(use_cuda, devices, count, precision, cluster)
    value = FSDP(base)
    value.per_run = False
    value.cluster = base.cluster
    return value
