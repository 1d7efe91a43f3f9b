"""Activation checkpointing inside a train step: the recomputed forward pass sees the state.

``torch.utils.checkpoint`` (and ``gradient_checkpointing_enable()`` of a Hugging Face
model) drops activations in the forward pass and recomputes them during the backward pass.
The step takes its gradients while the template is still bound to the state's tensors and
under the step's key, so the recomputation runs on the state's weights (not the template's
own) and draws the same dropout masks: training with checkpointing is the same arithmetic as
without, step after step, and the results are asserted equal with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from purestep import engine
from purestep.engine import optim


class Blocks(nn.Module):
    """Two residual blocks with dropout, each optionally checkpointed."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 8))
            for _ in range(2)
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed:
                x = x + checkpoint(block, x, use_reentrant=False)
            else:
                x = x + block(x)
        return self.head(x)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def run(checkpointed: bool, grad: str, steps: int = 4):
    torch.manual_seed(0)
    model = Blocks(checkpointed)
    state = engine.init(model, optim.adam(1e-2), seed=3)
    step = engine.train_step(model, loss_fn, optim.adam(1e-2), grad=grad)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = (torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
        state, out = step(state, batch)
        losses.append(out.loss)
    return state, losses


@pytest.mark.bitwise
def test_checkpointed_blocks_train_exactly_as_unchecked_ones():
    plain, plain_losses = run(False, "autograd")
    checked, checked_losses = run(True, "autograd")
    for a, b in zip(plain_losses, checked_losses):
        assert torch.equal(a, b)
    for name, p in plain.params.items():
        assert torch.equal(p, checked.params[name]), name


def test_grad_func_refuses_checkpointing_with_torchs_own_reason():
    """``torch.func.grad`` cannot run saved-tensor hooks (what non-reentrant checkpointing
    is made of); the error reaches the user with the loss function named."""
    with pytest.raises(RuntimeError, match="saved tensor hooks") as err:
        run(True, "func", steps=1)
    assert any("loss_fn" in note for note in getattr(err.value, "__notes__", []))


def test_the_template_keeps_its_own_weights():
    """The recomputation reads the state's weights through the bound template; the
    template's own tensors are never trained (the first step alone would not show a
    recomputation on the template's weights: they equal the state's at step 0)."""
    torch.manual_seed(0)
    model = Blocks(True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = engine.init(model, optim.sgd(0.5), seed=0)
    step = engine.train_step(model, loss_fn, optim.sgd(0.5))
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    for _ in range(2):
        state, _ = step(state, batch)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not torch.equal(state.params["head.weight"], before["head.weight"])
