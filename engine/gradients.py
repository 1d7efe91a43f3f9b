"""Gradients the step owns: a fast scalar backward pass and separate, dense gradient tensors.

``scalar_gradients`` is ``torch.autograd.grad`` for a scalar loss, minus the public
wrapper's overhead; ``owned_gradients`` copies the gradients that share storage with
another or overlap themselves, so the optimizer, the loss scaler and donation may write
each one in place.
"""

from __future__ import annotations

import torch

__all__ = ["owned_gradients", "scalar_gradients"]

Tensor = torch.Tensor


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its memory exactly once (non-overlapping and dense)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)


def scalar_gradients(loss: Tensor, inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(loss, inputs, allow_unused=True)`` for a scalar loss.

    Calls torch's autograd engine entry point directly when this torch has it and ``loss`` is
    a plain tensor: the public wrapper's argument handling costs about 25 µs, a tenth of a
    small model's step. Same engine call, same results (the parity tests compare bitwise);
    the public API otherwise.
    """
    if _RUN_BACKWARD is None or type(loss) is not Tensor:
        return torch.autograd.grad(loss, inputs, allow_unused=True)
    one = torch.ones_like(loss, memory_format=torch.preserve_format)
    return _RUN_BACKWARD((loss,), (one,), False, False, inputs, True, accumulate_grad=False)


def owned_gradients(grads: dict[str, Tensor], *, contiguous: bool = False) -> dict[str, Tensor]:
    """``grads`` with every tensor safe to overwrite in place on its own.

    ``torch.autograd.grad`` and ``torch.func.grad`` do not promise separate tensors: ``a + b``
    hands both inputs the same tensor, a ``view`` hands out a view of another gradient's
    storage, and ``w.sum()`` an expanded tensor with stride 0. The optimizer, the loss
    scaler and donation write into the step's gradients in place, which would then mix
    parameters or fail. This copies every gradient that shares its storage with an earlier
    one or is not non-overlapping and dense (normally none: the check is a storage lookup
    per tensor). ``contiguous=True`` also makes every gradient row-major (the ensemble's
    per-member arithmetic wants that); the copies it makes count as owned.
    """
    owners = set()
    for g in grads.values():
        # The usual case, checked cheaply: each gradient is its own tensor or a view of a
        # tensor no other gradient owns (a Linear weight's gradient is a transposed view),
        # contiguous or a plain 2-d transpose.
        owner = id(g) if g._base is None else id(g._base)
        if owner in owners or id(g) in owners:
            break
        if not g.is_contiguous() and (contiguous or not (g.dim() == 2 and g.t().is_contiguous())):
            break
        owners.add(owner)
        owners.add(id(g))
    else:
        return grads
    seen: set[int] = set()
    out: dict[str, Tensor] | None = None
    for name, g in grads.items():
        if g.is_contiguous():
            storage = g.untyped_storage().data_ptr()
            if storage not in seen:
                seen.add(storage)
                continue
            fresh = g.clone()
        elif contiguous:
            fresh = g.contiguous()
        else:
            storage = g.untyped_storage().data_ptr()
            if storage not in seen and _dense(g):
                seen.add(storage)
                continue
            fresh = g.clone(memory_format=torch.contiguous_format)
        if out is None:
            out = dict(grads)
        out[name] = fresh
    return grads if out is None else out
