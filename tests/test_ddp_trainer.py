"""The Trainer under DDP on 2 CPU ranks: same user code, sharded data, agreed decisions.

One launch runs a Trainer.fit on each rank and reports what it saw. Checked: both ranks end
with the same state; the run equals a single-process run whose batch is the two ranks'
batches together (to 1e-6); a stop requested on one rank only stops both at the same step;
only rank 0 writes logs; epoch-level validation values cover both shards; ``ckpt_path="best"``
and ``best_model_path`` name rank 0's run folder on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep import hardware
from purestep.engine import optim, tree
from purestep.loops import Trainer
from purestep.loops.callbacks import LambdaCallback
from purestep.loops.events import Requests
from purestep.loops.loggers import MemoryLogger
from tests.helpers import mlp

pytestmark = pytest.mark.timeout(180)

B = 4  # samples per rank and batch


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def _fit(strategy, batch_size: int, stop_rank: int | None = None):
    logger = MemoryLogger()
    callbacks = []
    if stop_rank is not None:

        def maybe_stop(ctx):
            if ctx.rank == stop_rank and ctx.batch_idx == 2:
                return Requests(stop=True)
            return None

        callbacks.append(LambdaCallback(on_train_batch_end=maybe_stop))
    trainer = Trainer(
        max_epochs=2,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        strategy=strategy if strategy is not None else "auto",
    )
    train = DataLoader(_data(48, 0), batch_size=batch_size, shuffle=True)
    val = DataLoader(_data(16, 1), batch_size=batch_size)
    state = trainer.fit(mlp(seed=0), _loss, optim.sgd(0.1, momentum=0.9), train, val, seed=3)
    return state, logger, trainer


_NAN_SEEN: list[int] = []  # in each rank's process: the batches whose loss was not finite


def _loss_noting_nan(apply, batch):
    loss = _loss(apply, batch)
    if not bool(torch.isfinite(loss)):
        _NAN_SEEN.append(1)
    return loss


def _nan_on_one_rank(strategy) -> str | None:
    """A fit whose data holds one NaN sample: it reaches one rank's batch only."""
    from purestep.loops.fit import NonFiniteLossError

    data = _data(48, 0)
    data.tensors[0][21] = float("nan")
    trainer = Trainer(
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        terminate_on_nan=True,
        strategy=strategy,
    )
    try:
        trainer.fit(mlp(seed=0), _loss_noting_nan, optim.sgd(0.1), DataLoader(data, batch_size=B))
    except NonFiniteLossError as err:
        return str(err)
    return None


def _rank_main(rank: int) -> dict:
    strategy = hardware.ddp()
    state, logger, trainer = _fit(strategy, B)
    stopped, _, _ = _fit(strategy, B, stop_rank=1)
    nan_error = _nan_on_one_rank(strategy)
    return {
        "nan_error": nan_error,
        "nan_seen": len(_NAN_SEEN),
        "params": {k: v.clone() for k, v in state.params.items()},
        "step": state.progress.step,
        "rows": len(logger.metrics),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "stopped_step": stopped.progress.step,
    }


@pytest.fixture(scope="module")
def ranks():
    return hardware.launch(_rank_main, 2, max_seconds=150, timeout=30)


@pytest.mark.bitwise
def test_both_ranks_end_with_the_same_state(ranks):
    tree.assert_trees_equal(ranks[0]["params"], ranks[1]["params"])
    assert ranks[0]["step"] == ranks[1]["step"] == 2 * (48 // (2 * B))


def test_a_nan_loss_on_one_rank_stops_every_rank_with_the_same_error(ranks):
    """terminate_on_nan agreed across ranks: the healthy rank raises NonFiniteLossError
    too (not a collective error when its peer leaves), naming the rank and batch."""
    (nan_rank,) = [r for r in (0, 1) if ranks[r]["nan_seen"]]
    errors = [ranks[r]["nan_error"] for r in (0, 1)]
    assert all(e is not None for e in errors), errors
    assert errors[0] == errors[1]
    assert f"nan on rank {nan_rank} (epoch 0, batch " in errors[0]


def test_ddp_equals_one_process_with_the_combined_batch(ranks):
    single, _, trainer = _fit(None, 2 * B)
    tree.assert_trees_close(ranks[0]["params"], single.params, rtol=1e-6, atol=1e-6)
    # validation values are merged over both shards: they equal the single-process ones
    assert ranks[0]["val_loss"] == pytest.approx(
        float(trainer.callback_metrics["val_loss"]), rel=1e-6
    )
    assert ranks[0]["val_loss"] == ranks[1]["val_loss"]


def test_a_stop_on_one_rank_stops_both_at_the_same_step(ranks):
    assert ranks[0]["stopped_step"] == ranks[1]["stopped_step"] == 3


def test_only_rank_zero_writes_logs(ranks):
    assert ranks[0]["rows"] > 0
    assert ranks[1]["rows"] == 0


# --------------------------------------------------------------------------- kill and resume


def _resumable_fit(rank: int, folder: str, kill_at: int | None, resume: bool) -> str | None:
    """A 2-rank fit that checkpoints every step; ``kill_at``: every rank SIGKILLs itself at
    that train batch end. Returns the digest of the final state (rank 0)."""
    import os
    import signal

    from purestep.loops.callbacks import ModelCheckpoint
    from tests.helpers import digest

    os.chdir(folder)
    seen = {"n": 0}

    def killer(ctx):
        seen["n"] += 1
        if kill_at is not None and seen["n"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    trainer = Trainer(
        max_epochs=2,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            LambdaCallback(name="killer", on_train_batch_end=killer),
            ModelCheckpoint(dirpath="ckpts", every_n_train_steps=1, save_top_k=0, save_last=True),
        ],
        strategy=hardware.ddp(),
    )
    train = DataLoader(_data(48, 0), batch_size=B, shuffle=True)
    val = DataLoader(_data(16, 1), batch_size=B)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
    )
    state = trainer.fit(
        net, _loss, optim.adam(1e-2), train, val, seed=5, ckpt_path="last" if resume else None
    )
    return digest(state) if rank == 0 else None


@pytest.mark.bitwise
def test_a_killed_ddp_run_resumes_bitwise(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    whole.mkdir()
    broken.mkdir()
    reference = hardware.launch(_resumable_fit, 2, str(whole), None, False, max_seconds=120)[0]
    with pytest.raises(hardware.LaunchError):
        hardware.launch(_resumable_fit, 2, str(broken), 7, False, max_seconds=120)
    assert (broken / "ckpts" / "last.ckpt").exists()
    resumed = hardware.launch(_resumable_fit, 2, str(broken), None, True, max_seconds=120)[0]
    assert resumed == reference


# --------------------------------------------------------------------------- best checkpoint


def _fit_then_test_best(rank: int, root: str) -> dict:
    """``Trainer(strategy="ddp")``'s fit, then test(ckpt_path="best"). Each rank's logger
    names its own version folder (as a default logger may: rank 1 picks its version after
    rank 0 made version_0); files go to rank 0's."""
    from purestep.loops.loggers import CSVLogger

    trainer = Trainer(
        strategy="ddp",
        max_epochs=1,
        default_root_dir=root,
        logger=CSVLogger(root, version=rank),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train = DataLoader(_data(32, 0), batch_size=B)
    trainer.fit(mlp(seed=0), _loss, optim.sgd(0.1), train, seed=0)
    best = trainer.best_model_path
    test = DataLoader(_data(16, 1), batch_size=B)
    results = trainer.test(dataloaders=test, ckpt_path="best", fn=_loss)
    return {"best": best, "log_dir": trainer.log_dir, "test_loss": results[0]["test_loss"]}


def test_best_checkpoint_is_rank_zeros_on_every_rank(tmp_path):
    first, second = hardware.launch(_fit_then_test_best, 2, str(tmp_path), max_seconds=120)
    run = str(tmp_path / "lightning_logs" / "version_0")
    assert first["log_dir"] == second["log_dir"] == run
    assert first["best"] == second["best"] == run + "/checkpoints/epoch=0-step=4.ckpt"
    assert (
        tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt"
    ).exists()
    assert not (tmp_path / "lightning_logs" / "version_1").exists()  # rank 1 writes nothing
    assert first["test_loss"] == second["test_loss"]
