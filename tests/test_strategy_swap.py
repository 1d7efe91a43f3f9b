"""The same user code on one device, on 2 DDP ranks and as a vmapped ensemble.

``user_code`` is written once against the engine (init, train step, eval step, data
sources sharded as the strategy says) and only the ``strategy`` argument changes. Checked:
every strategy learns; DDP equals one device on the same global batches (to 1e-6); each
ensemble member equals a one-device run from that member's initial state (to 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from purestep import engine, hardware
from purestep.engine import optim, tree
from purestep.loops import data
from tests.helpers import loss_fn, mlp

pytestmark = pytest.mark.timeout(180)

STEPS = 12


def _dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def user_code(strategy, state=None):
    """Train for ``STEPS`` steps and evaluate; nothing here depends on the strategy."""
    net = mlp(seed=0)
    opt = optim.adam(1e-2)
    if state is None:
        state = engine.init(net, opt, seed=0, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy)
    evaluate = engine.eval_step(net, loss_fn, strategy=strategy)
    shard = strategy.data_options() if strategy is not None else {}
    batches = data.source(_dataset(), batch_size=8, shuffle=True, seed=1, **shard)
    before = evaluate(state, _dataset())["loss"]
    epoch = 0
    while state.progress.step < STEPS:
        for batch in batches.iterate(epoch):
            state, _ = step(state, batch)
            if state.progress.step == STEPS:
                break
        epoch += 1
    after = evaluate(state, _dataset())["loss"]
    return state, before, after


def _ddp_rank(rank: int):
    state, before, after = user_code(hardware.ddp())
    return state.params, float(before), float(after)


def test_single_device_learns():
    _, before, after = user_code(hardware.single_device("cpu"))
    assert after < before


@pytest.mark.bitwise
def test_ddp_on_two_ranks_equals_one_device_on_the_same_global_batches():
    ranks = hardware.launch(_ddp_rank, 2, max_seconds=120, timeout=30)
    tree.assert_trees_equal(ranks[0][0], ranks[1][0])
    # one device with batch 16 sees the union of the two ranks' batches of 8
    net, opt = mlp(seed=0), optim.adam(1e-2)
    state = engine.init(net, opt, seed=0)
    step = engine.train_step(net, loss_fn, opt)
    batches = data.source(_dataset(), batch_size=8, shuffle=True, seed=1, world_size=2)
    shards = [batches.with_options(rank=r) for r in range(2)]
    epoch = 0
    while state.progress.step < STEPS:
        for a, b in zip(shards[0].iterate(epoch), shards[1].iterate(epoch)):
            state, _ = step(state, (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])))
            if state.progress.step == STEPS:
                break
        epoch += 1
    tree.assert_trees_close(ranks[0][0], state.params, rtol=1e-6, atol=1e-6)
    assert ranks[0][2] < ranks[0][1]


def test_an_ensemble_runs_the_same_code_and_each_member_matches_a_single_run():
    strategy = hardware.ensemble(3)
    state, before, after = user_code(strategy)
    assert before.shape == after.shape == (3,)
    assert bool((after < before).all())
    initial = engine.init(mlp(seed=0), optim.adam(1e-2), seed=0, strategy=strategy)
    for i in range(3):
        alone, _, _ = user_code(None, state=hardware.member(initial, i))
        # vmapped kernels may round a few ulps differently from the unbatched ones
        tree.assert_trees_close(
            hardware.member(state, i).params, alone.params, rtol=1e-5, atol=1e-6
        )


def test_the_trainer_runs_an_ensemble_and_logs_every_member():
    from torch.utils.data import DataLoader, TensorDataset

    from purestep.loops import Trainer
    from purestep.loops.loggers import MemoryLogger

    logger = MemoryLogger()
    trainer = Trainer(
        max_epochs=2,
        strategy=hardware.ensemble(3),
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    x, y = _dataset()
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    state = trainer.fit(mlp(seed=0), loss_fn, optim.adam(1e-2), loader, loader)
    (result,) = trainer.test(state, loader, verbose=False)
    members = [result[f"test_loss/{i}"] for i in range(3)]
    assert result["test_loss"] == pytest.approx(sum(members) / 3, rel=1e-6)
    assert len(set(members)) == 3  # independent members
    step_rows = [row for _, row in logger.metrics if "train_loss/2" in row]
    assert len(step_rows) == state.progress.step
