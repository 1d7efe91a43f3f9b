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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from purestep.engine import rng
from purestep.engine.bind import Binder
from purestep.engine.step import check_unchanged

from .logging import batch_size_of

__all__ = ["LightningOptimizer", "ManualRun"]

#: The fold-in purpose of a manual training step's random key.
MANUAL_PURPOSE = 102
#: Where gradients that no ``zero_grad`` cleared wait for the next batch, in
#: ``TrainState.extra`` (accumulating over batches is Lightning's manual way; a checkpoint
#: between them keeps them, so a resumed run accumulates the same).
GRADS_KEY = "lightning_manual_grads"


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
        return self.optimizer.param_groups if self.optimizer is not None else []

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
    ) -> None:
        self.module = module
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
        try:
            self._bind()
            with rng.scope(key):
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
        raise NotImplementedError(
            "self.lr_schedulers() in manual optimization is not supported under "
            "purestep.Trainer yet: a scheduler with interval='step' is applied before each "
            "opt.step() by the loop; give it in configure_optimizers and drop the .step() call"
        )

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
