"""Several optimizers in the Trainer under DDP on 2 gloo ranks (automatic and manual mode).

One launch runs every fit on each rank and reports what it saw. Checked: both ranks end with
bitwise the same state (all but the step's logged training losses, which are each rank's own,
as with one optimizer); the 2-rank run equals a 1-process run whose batch is the two ranks'
batches together (to 1e-5 * max|ref| + 1e-6 per tensor: an all-reduced mean is not the same
arithmetic as one big batch's mean); a two-optimizer DDP checkpoint resumes to bitwise the
uninterrupted 2-rank run; manual per-optimizer accumulation under DDP is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Task, Trainer, hardware
from purestep.engine import optim, tree
from purestep.loops.callbacks import LambdaCallback
from tests.helpers import digest

pytestmark = pytest.mark.timeout(180)

B = 4  # samples per rank and batch
N = 48  # samples: 6 global batches an epoch
EPOCHS = 2


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(4, 6), "b": nn.Linear(6, 1)})


def _forward(apply, x):
    return apply["b"](torch.tanh(apply["a"](x))).squeeze(-1)


def _loader(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=g)
    return DataLoader(TensorDataset(x, x[:, 0] - 2 * x[:, 1]), batch_size=batch_size, shuffle=True)


def _loss(apply, batch, idx):
    # the two optimizers see different objectives (both means), so a mix-up shows
    x, y = batch
    out = _forward(apply, x)
    return F.mse_loss(out, y) if idx == 0 else F.l1_loss(out, y)


def _opts(**d_extra):
    return {
        "d": {"optimizer": optim.adam(1e-2), "params": "a", **d_extra},
        "g": {
            "optimizer": optim.inject_hyperparams(optim.sgd)(lr=0.05, momentum=0.9),
            "params": "b",
            "lr_scheduler": optim.schedules.step(0.05, 3, 0.5),
        },
    }


class Auto(Task):
    def __init__(self):
        super().__init__(_net())

    def training_step(self, apply, batch, optimizer_idx):
        return _loss(apply, batch, optimizer_idx)

    def configure_optimizers(self):
        return _opts()


class Manual(Task):
    """A GAN-like pattern: "d" twice per batch, then "g"."""

    automatic_optimization = False

    def __init__(self, accumulate: int = 1):
        super().__init__(_net())
        self.accumulate = accumulate

    def d_loss(self, apply, batch):
        return _loss(apply, batch, 0)

    def g_loss(self, apply, batch):
        return _loss(apply, batch, 1)

    def training_step(self, opt, batch):
        opt.step("d", self.d_loss, batch)
        opt.step("d", self.d_loss, batch)
        out = opt.step("g", self.g_loss, batch)
        return {"loss": out.loss}

    def configure_optimizers(self):
        return _opts(accumulate=self.accumulate)


def _fit(task, strategy, batch_size: int, ckpt_path: str | None = None, **kw):
    trainer = Trainer(
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        num_sanity_val_steps=0,
        strategy=strategy if strategy is not None else "auto",
        **kw,
    )
    state = trainer.fit(task, train_dataloaders=_loader(batch_size), ckpt_path=ckpt_path)
    return state, trainer


def _fit_resumed(task_cls, strategy, folder: str):
    """``max_steps=5`` with a checkpoint every step, then a fresh Trainer resumes from it;
    the resumed state and how many batches the resumed fit ran."""
    from purestep.loops.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=0, save_last=True)
    trainer = Trainer(
        max_epochs=EPOCHS,
        max_steps=5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt],
        num_sanity_val_steps=0,
        strategy=strategy,
    )
    trainer.fit(task_cls(), train_dataloaders=_loader(B))
    strategy.barrier()  # rank 0's last.ckpt is written before rank 1 reads it
    ran = []
    count = LambdaCallback(name="count", on_train_batch_end=lambda ctx: ran.append(1))
    resumed, _ = _fit(task_cls(), strategy, B, ckpt_path=folder + "/last.ckpt", callbacks=[count])
    return resumed, len(ran)


def _digest_without(state, *skip: str) -> str:
    """A digest of every leaf of ``state`` whose path contains none of ``skip``."""
    import hashlib

    h = hashlib.sha256()
    for path, leaf in tree.flatten_with_paths(state):
        if not any(part in path for part in skip):
            h.update(path.encode() + digest(leaf).encode())
    return h.hexdigest()


# Each rank's own: the step's logged training losses (as Lightning's
# ``self.log(..., sync_dist=False)``, and as with one optimizer under DDP).
RANK_LOCAL = "callback_metrics['train_loss"
# Only the checkpointed run has a ModelCheckpoint, whose state the resumed run carries on.
CALLBACKS = ".callbacks["


def _state(state) -> dict:
    return {"params": dict(state.params), "opt": state.opt_state, "step": state.progress.step}


def _rank_main(rank: int, root: str) -> dict:
    strategy = hardware.ddp()
    out = {}
    for mode, cls in (("auto", Auto), ("manual", Manual)):
        state, trainer = _fit(cls(), strategy, B)
        out[mode] = _state(state)
        out[mode]["global_step"] = trainer.global_step
        out[mode + "_shared"] = _digest_without(state, RANK_LOCAL)
        out[mode + "_training"] = _digest_without(state, CALLBACKS)
        resumed, out[mode + "_resumed_batches"] = _fit_resumed(cls, strategy, f"{root}/{mode}")
        out[mode + "_resumed"] = _digest_without(resumed, CALLBACKS)
    try:
        _fit(Manual(accumulate=2), strategy, B)
        out["refusal"] = None
    except ValueError as err:
        out["refusal"] = str(err)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_optim_ddp")
    return hardware.launch(_rank_main, 2, str(root), max_seconds=150, timeout=30)


MODES = [("auto", Auto), ("manual", Manual)]


@pytest.mark.bitwise
@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_both_ranks_end_with_the_same_state(ranks, mode):
    assert ranks[0][mode + "_shared"] == ranks[1][mode + "_shared"]
    tree.assert_trees_equal(ranks[0][mode]["params"], ranks[1][mode]["params"])
    steps = EPOCHS * N // (2 * B)
    assert ranks[0][mode]["step"] == ranks[0][mode]["global_step"] == steps
    per_batch = {"auto": {"d": 1, "g": 1}, "manual": {"d": 2, "g": 1}}[mode]
    assert ranks[0][mode]["opt"].steps == {k: v * steps for k, v in per_batch.items()}


@pytest.mark.parametrize("mode, cls", MODES)
def test_two_ranks_equal_one_process_with_the_combined_batch(ranks, mode, cls):
    single, _ = _fit(cls(), None, 2 * B)
    ref = {"params": dict(single.params), "opt": single.opt_state}
    got = {"params": ranks[0][mode]["params"], "opt": ranks[0][mode]["opt"]}
    assert got["opt"].steps == single.opt_state.steps
    ref_leaves, got_leaves = tree.flatten_with_paths(ref), tree.flatten_with_paths(got)
    assert [p for p, _ in ref_leaves] == [p for p, _ in got_leaves]
    compared = 0
    for (path, r), (_, g) in zip(ref_leaves, got_leaves):
        if not isinstance(r, torch.Tensor) or not r.is_floating_point():
            assert torch.equal(r, g) if isinstance(r, torch.Tensor) else r == g, path
            continue
        tol = 1e-5 * float(r.abs().max()) + 1e-6
        assert float((r - g).abs().max()) <= tol, (path, float((r - g).abs().max()), tol)
        compared += 1
    assert compared >= 4 + 4  # the four parameters and (at least) their optimizer state


@pytest.mark.bitwise
@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_a_two_optimizer_ddp_checkpoint_resumes_bitwise(ranks, mode):
    for r in ranks:
        assert r[mode + "_resumed_batches"] == EPOCHS * N // (2 * B) - 5  # it did resume
        assert r[mode + "_resumed"] == r[mode + "_training"]


def test_manual_accumulation_under_ddp_is_refused(ranks):
    for r in ranks:
        assert r["refusal"] is not None
        assert "per-optimizer accumulation in manual optimization" in r["refusal"]
        assert "one process only" in r["refusal"]
