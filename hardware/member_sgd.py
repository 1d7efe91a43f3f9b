"""SGD whose hyper-parameters are per-member tensors: one broadcasting call for an ensemble.

``hardware.ensemble(k, hparams=...)`` runs an ``optim.inject_hyperparams`` optimizer once per
distinct set of values, which for a K-trial sweep costs what K separate optimizers cost;
``member_sgd`` keeps ``lr``, ``momentum`` and ``weight_decay`` as ``[K]`` tensors in its state
and updates every member with its own values in one call (``loops.integrations.sweep``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from purestep.engine import optim
from purestep.engine.tree import struct

__all__ = ["MEMBER_SGD_HPARAMS", "MemberSGDState", "member_sgd"]


@struct
class MemberSGDState:
    """``member_sgd``'s state: the step count, the momentum buffers and the three
    hyper-parameters as tensors (one value per member in an ensemble state, shape ``[K]``)."""

    count: int
    momentum_buffer: dict[str, torch.Tensor]
    lr: torch.Tensor
    momentum: torch.Tensor
    weight_decay: torch.Tensor


#: the hyper-parameters ``member_sgd`` keeps, one value per member
MEMBER_SGD_HPARAMS = ("lr", "momentum", "weight_decay")


def member_sgd(
    lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0
) -> optim.GradientTransformation:
    """SGD with momentum and L2 weight decay whose hyper-parameters are tensors in its state,
    applied to all members of an ensemble in one broadcasting call.

    ``optim.inject_hyperparams(optim.sgd)`` works in a sweep too, but the ensemble runs it
    once per distinct set of hyper-parameters (once per trial); this one takes one call for
    all of them. Member ``i`` follows ``optim.sgd(lr_i, momentum=m_i, weight_decay=wd_i)``
    (torch's SGD: the first buffer is the gradient, no dampening, no Nesterov) to float
    rounding: the decay and the update multiply by a tensor and add, where ``optim.sgd``
    fuses them (``add(alpha=...)``). Momentum 0 is plain SGD, so trials with and without
    momentum share one ensemble. The values given here are the defaults ``sweep`` replaces.
    """
    defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    for name, value in defaults.items():
        if not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise ValueError(f"member_sgd({name}={value!r}) must be a finite number >= 0")

    def init(params: Mapping[str, torch.Tensor]) -> MemberSGDState:
        like = next(iter(params.values()), torch.zeros(()))
        scalar = {
            n: torch.tensor(float(v), dtype=like.dtype, device=like.device)
            for n, v in defaults.items()
        }
        zeros = {n: torch.zeros_like(p) for n, p in params.items()}
        return MemberSGDState(count=0, momentum_buffer=zeros, **scalar)

    def update(grads, state: MemberSGDState, params=None):
        names = list(grads)
        if params is None:
            raise ValueError("member_sgd needs params in update() (weight decay)")
        g = [grads[n] for n in names]
        p = [params[n] for n in names]

        def per_member(h: torch.Tensor) -> list[torch.Tensor]:
            # [K] (or 0-d) values against [K, ...] tensors: one value per leading row
            return [h.reshape(-1, *([1] * (t.dim() - 1))) if t.dim() else h for t in g]

        g = torch._foreach_addcmul(g, p, per_member(state.weight_decay))
        if state.count == 0:
            buf = [t.clone() for t in g]
        else:
            old = [state.momentum_buffer[n] for n in names]
            buf = torch._foreach_add(torch._foreach_mul(old, per_member(state.momentum)), g)
        updates = torch._foreach_mul(buf, per_member(torch.neg(state.lr)))
        new = state.replace(count=state.count + 1, momentum_buffer=dict(zip(names, buf)))
        return dict(zip(names, updates)), new

    return optim.GradientTransformation(init, update)
