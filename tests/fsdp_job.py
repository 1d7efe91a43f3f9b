"""Worker functions for the FSDP and sharded-checkpoint tests (run by ``hardware.launch``).

Each is a top-level function ``fn(rank, ...)`` returning plain, picklable results: full
(gathered) tensors, so the tests compare them with a single process.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import shutil
import tempfile
import time

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from purestep import engine, hardware
from purestep.engine import checkpoint, optim, tree
from tests.helpers import batches, loss_fn, mlp

fsdp_module = importlib.import_module("purestep.hardware.fsdp")

G = 8  # samples per global batch
STEPS = 4


def optimizers() -> dict[str, optim.GradientTransformation]:
    return {
        "adam": optim.adam(1e-2),
        "clip_sgd": optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(0.1, momentum=0.9)),
    }


def train(strategy, opt, *, steps=STEPS, accumulate=1, state=None, start=0, data_seed=0):
    """``steps`` global batches of ``G`` samples from batch ``start``; rank ``r`` of ``W``
    takes its contiguous slice, a single process (``strategy=None``) all of them."""
    net = mlp(seed=0)
    if state is None:
        state = engine.init(net, opt, seed=0, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy, accumulate=accumulate)
    out = None
    for x, y in batches(start + steps, seed=data_seed, size=G)[start:]:
        if strategy is not None and strategy.world_size > 1:
            b = G // strategy.world_size
            r = strategy.rank
            x, y = x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]
        before = _snapshot(state)
        state_in = state
        state, out = step(state, (x, y))
        after = _snapshot(state_in)
        if len(before) != len(after) or not all(map(torch.equal, before, after)):
            IMPURE.append(f"{strategy!r} accumulate={accumulate}: the input state changed")
    return state, out


#: Steps (in this process) that changed their input state: a pure step never does.
IMPURE: list[str] = []


def _snapshot(state) -> list[torch.Tensor]:
    """Copies of every tensor of ``state`` (a DTensor's local shard)."""
    out = []
    for t in tree.leaves(state):
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            out.append(t.detach().clone())
    return out


def _full(state, strategy):
    if strategy is not None and hasattr(strategy, "full_state"):
        state = strategy.full_state(state)
    return {"params": dict(state.params), "opt_state": state.opt_state, "step": state.progress.step}


def parity(rank: int) -> dict:
    """Every training configuration the parity tests compare with one process."""
    out: dict = {}
    for policy_name, policy in (("none", None), ("linear", {nn.Linear})):
        strategy = hardware.fsdp(auto_wrap_policy=policy)
        for name, opt in optimizers().items():
            state, last = train(strategy, opt)
            out[(policy_name, name)] = {**_full(state, strategy), "grad_norm": last.grad_norm}
    zero2 = hardware.fsdp(sharding="grad_op")
    for name, opt in optimizers().items():
        state, last = train(zero2, opt)
        out[("grad_op", name)] = {**_full(state, zero2), "grad_norm": last.grad_norm}
    tensors = [t for t in tree.leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    out["grad_op_layout"] = (
        not any(isinstance(p, DTensor) for p in state.params.values()),
        bool(tensors) and all(isinstance(t, DTensor) for t in tensors),
    )
    state, _ = train(zero2, optim.adam(1e-2), accumulate=2)
    out["grad_op_accumulate"] = _full(state, zero2)
    strategy = hardware.fsdp(auto_wrap_policy={nn.Linear})
    state, _ = train(strategy, optim.adam(1e-2), accumulate=2)
    out["accumulate"] = _full(state, strategy)
    out["local_numel"] = sum(p.to_local().numel() for p in state.params.values())
    out["opt_sharded"] = all(isinstance(t, DTensor) for t in state.opt_state.exp_avg.values())
    # reshard after forward: gathered parameters are dropped and gathered again in backward
    counted = {"again": 0}
    unpack = fsdp_module._Gathering.unpack

    def counting(self, x):
        if isinstance(x, fsdp_module._Token):
            counted["again"] += 1
        return unpack(self, x)

    fsdp_module._Gathering.unpack = counting
    try:
        state_r, _ = train(strategy, optim.adam(1e-2), steps=2)
    finally:
        fsdp_module._Gathering.unpack = unpack
    kept = hardware.fsdp(auto_wrap_policy={nn.Linear}, reshard_after_forward=False)
    state_k, _ = train(kept, optim.adam(1e-2), steps=2)
    out["regathered"] = counted["again"]
    out["reshard_same"] = all(
        torch.equal(a, b)
        for a, b in zip(
            _full(state_r, strategy)["params"].values(), _full(state_k, kept)["params"].values()
        )
    )
    # bf16 compute, fp32 reductions and master weights
    mp = hardware.fsdp(
        auto_wrap_policy={nn.Linear},
        mixed_precision=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        ),
    )
    state_mp, _ = train(mp, optim.adam(1e-2))
    out["bf16"] = _full(state_mp, mp)
    # eval and predict gather too
    x, y = batches(1, seed=5, size=G)[0]
    b = G // strategy.world_size
    mine = (x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b])
    out["eval"] = engine.eval_step(mlp(0), loss_fn, strategy=strategy)(state, mine)
    out["predict"] = engine.predict_step(mlp(0), strategy=strategy)(state, mine[0])
    out["errors"] = _errors(strategy, state)
    out["repeat"] = repeat(rank)  # the ("linear", "clip_sgd") run again, with a new strategy
    out["impure"] = list(IMPURE)
    return out


def _errors(strategy, state) -> dict:
    found = {}
    plain = engine.init(mlp(0), optim.adam(1e-2), seed=0)
    step = engine.train_step(mlp(0), loss_fn, optim.adam(1e-2), strategy=strategy)
    for name, fn in {
        "unsharded": lambda: step(plain, batches(1, size=4)[0]),
        "policy": lambda: hardware.fsdp(auto_wrap_policy=[3]),
        "fp16": lambda: hardware.fsdp(precision="16-mixed"),
        "func": lambda: engine.train_step(
            mlp(0), loss_fn, optim.sgd(0.1), strategy=strategy, grad="func"
        ),
        "mp_type": lambda: hardware.fsdp(mixed_precision="bf16"),
        "sharding": lambda: hardware.fsdp(sharding="zero3"),
    }.items():
        try:
            fn()
            found[name] = None
        except Exception as err:  # the tests check type and message
            found[name] = f"{type(err).__name__}: {err}"
    return found


def repeat(rank: int) -> dict:
    strategy = hardware.fsdp(auto_wrap_policy={nn.Linear})
    state, _ = train(strategy, optimizers()["clip_sgd"])
    return _full(state, strategy)


# ---------------------------------------------------------------------- sharded checkpoints


def save_two(rank: int, folder: str) -> dict:
    """Train 2 steps on 2 ranks, save sharded; train 2 more (the uninterrupted reference);
    also load a plain checkpoint into the 2 ranks."""
    strategy = hardware.fsdp(auto_wrap_policy={nn.Linear})
    opt = optim.adam(1e-2)
    state, _ = train(strategy, opt, steps=2)
    checkpoint.sharded.save(state, f"{folder}/two.ckpt", metadata={"note": "two ranks"})
    files = sorted(os.listdir(f"{folder}/two.ckpt"))
    full = _full(state, strategy)
    after, _ = train(strategy, opt, steps=2, state=state, start=2)
    # a sharded checkpoint loads back at the same world size, bitwise
    fresh = engine.init(mlp(0), opt, seed=1, strategy=strategy)
    loaded, meta = checkpoint.sharded.load(f"{folder}/two.ckpt", fresh)
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(loaded.params.values(), state.params.values())
    )
    cont, _ = train(strategy, opt, steps=2, state=loaded, start=2)
    # a plain (single-process) checkpoint into 2 ranks
    plain, _ = checkpoint.load(f"{folder}/plain.ckpt")
    sharded_plain = strategy.shard_state(plain)
    return {
        "files": files,
        "saved": full,
        "after": _full(after, strategy),
        "resumed": _full(cont, strategy),
        "same": same,
        "meta": meta.get("note"),
        "progress": loaded.progress,
        "from_plain": _full(sharded_plain, strategy),
    }


def load_n(rank: int, folder: str) -> dict:
    """Load the 2-rank checkpoint at this launch's world size and train 2 more steps."""
    strategy = hardware.fsdp(auto_wrap_policy={nn.Linear})
    opt = optim.adam(1e-2)
    fresh = engine.init(mlp(0), opt, seed=1, strategy=strategy)
    loaded, _ = checkpoint.sharded.load(f"{folder}/two.ckpt", fresh)
    local = sum(p.to_local().numel() for p in loaded.params.values())
    cont, _ = train(strategy, opt, steps=2, state=loaded, start=2)
    return {"loaded": _full(loaded, strategy), "resumed": _full(cont, strategy), "local": local}


# ---------------------------------------------------------------------- the Trainer


def _points(n: int, seed: int):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def _plain_loss(apply, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(apply(x), y)


def trainer_fit(
    rank: int, folder: str, kill_at: int | None, ckpt: str | None, batch: int, extra: bool = False
) -> dict:
    """``Trainer(strategy="fsdp")`` for 8 steps, one epoch (shuffled data, a checkpoint at
    every step, validation at the epoch's end); ``kill_at``: rank 1 SIGKILLs itself in that
    step's sharded save (its shard written, not committed); ``ckpt``: resume from that.
    ``extra``: also a ``save_top_k=1`` checkpoint in ``<folder>/top`` (each save evicts the
    one before; what else is there is not the Trainer's: rank 0 puts a foreign DCP folder
    and a file there first), and after the fit ``validate(ckpt_path="best")``."""
    import signal

    from torch.utils.data import DataLoader

    from purestep.loops import Trainer
    from purestep.loops.callbacks import LambdaCallback, ModelCheckpoint

    if kill_at is not None and rank == 1:
        # rank 1 dies in the middle of step ``kill_at``'s save: its shard written, DCP's
        # index and the commit not yet
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def write_and_die(self, *args, **kwargs):
            done = write_data(self, *args, **kwargs)
            if f"step={kill_at}.ckpt" in os.fspath(self.path):
                done.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return done

        FileSystemWriter.write_data = write_and_die

    first: list[int] = []  # the step the fit's first batch starts from

    def note_start(ctx):
        if not first:
            first.append(ctx.state.progress.step)

    callbacks = [
        ModelCheckpoint(
            dirpath=f"{folder}/ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1
        ),
        LambdaCallback(
            on_train_batch_start=note_start,
        ),
    ]
    if extra:
        top = f"{folder}/top"
        if rank == 0:
            os.makedirs(f"{top}/foreign.ckpt")
            for name in (".metadata", "COMMITTED", "__0_0.distcp"):
                open(f"{top}/foreign.ckpt/{name}", "wb").close()
            open(f"{top}/notes.txt", "w").close()
        callbacks.insert(
            1,
            ModelCheckpoint(
                dirpath=top, filename="{step}", every_n_train_steps=1, save_top_k=1, name="top"
            ),
        )
    trainer = Trainer(
        max_steps=8,
        strategy="fsdp",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=folder,
        callbacks=callbacks,
    )
    loader = DataLoader(_points(64, 0), batch_size=batch, shuffle=True)
    val = DataLoader(_points(16, 1), batch_size=batch)
    opt = optim.adam(1e-2)
    state = trainer.fit(mlp(0), _plain_loss, opt, loader, val, seed=3, ckpt_path=ckpt)
    full = trainer.strategy.full_state(state)
    out = {}
    if extra:
        out["top"] = sorted(os.listdir(f"{folder}/top"))
        best = trainer.validate(dataloaders=val, ckpt_path="best", verbose=False)
        out["best_val_loss"] = best[0]["val_loss"]
    return {
        **out,
        "first": first[0],
        "params": dict(full.params),
        "opt_state": full.opt_state,
        "step": state.progress.step,
        "sharded": isinstance(next(iter(state.params.values())), DTensor),
        "files": sorted(n for n in os.listdir(f"{folder}/ckpt") if not n.startswith(".")),
        "hidden": sorted(n for n in os.listdir(f"{folder}/ckpt") if n.startswith(".")),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }


# ---------------------------------------------------------------------- shared launches
# A launch costs seconds (every rank imports torch): the tests of test_fsdp,
# test_fsdp_trainer and test_sharded_checkpoint share four, each bounded, cached per process.

TRAINER_BATCH = 4  # samples per rank and batch in the Trainer runs
LAUNCH = {"timeout": 30, "grace": 3.0}
KILL_AT = 5


@functools.cache
def killed_run() -> dict:
    """A 2-rank ``trainer_fit`` whose rank 1 is SIGKILLed in step 5's save: the launch's
    error, how long it took, and what its checkpoint folder held right after."""
    folder = tempfile.mkdtemp(prefix="purestep-fsdp-killed-")
    atexit.register(shutil.rmtree, folder, True)
    start = time.monotonic()
    try:
        hardware.launch(
            trainer_fit, 2, folder, KILL_AT, None, TRAINER_BATCH, max_seconds=120, **LAUNCH
        )
    except hardware.LaunchError as err:
        error = str(err)
    else:
        error = None
    ckpt = f"{folder}/ckpt"
    names = sorted(os.listdir(ckpt))
    return {
        "folder": folder,
        "error": error,
        "seconds": time.monotonic() - start,
        "names": names,
        "committed": [n for n in names if os.path.exists(f"{ckpt}/{n}/COMMITTED")],
        "inside": {n: sorted(os.listdir(f"{ckpt}/{n}")) for n in names},
    }


def _both(rank: int, folder: str, killed: str) -> dict:
    resumed = trainer_fit(rank, killed, None, "last", TRAINER_BATCH)
    return {
        "parity": parity(rank),
        "ckpt": save_two(rank, folder),
        "trainer": {
            "full": trainer_fit(rank, f"{folder}/trainer", None, None, TRAINER_BATCH, extra=True),
            "resumed": resumed,
        },
    }


@functools.cache
def two_rank_run() -> tuple[list[dict], str]:
    """One 2-rank launch: the parity checks, the sharded-checkpoint run, an uninterrupted
    ``Trainer`` fit and one resumed with ``ckpt_path="last"`` from ``killed_run``'s folder
    (where a copy of step 4 without its commit marker, named and recorded as step 9, must be
    passed over); and the folder holding its checkpoints (``plain.ckpt`` from one process,
    ``two.ckpt``)."""
    killed = killed_run()["folder"]
    fake = f"{killed}/ckpt/step=9.ckpt"
    shutil.copytree(f"{killed}/ckpt/step=4.ckpt", fake)
    os.remove(f"{fake}/COMMITTED")
    manifest = f"{fake}/purestep.json"
    with open(manifest) as f:
        data = json.load(f)
    data["record"]["progress"]["step"] = 9
    with open(manifest, "w") as f:
        json.dump(data, f)
    folder = tempfile.mkdtemp(prefix="purestep-fsdp-")
    atexit.register(shutil.rmtree, folder, True)
    plain, _ = train(None, optim.adam(1e-2), steps=2)
    checkpoint.save(plain, f"{folder}/plain.ckpt")
    try:
        results = hardware.launch(_both, 2, folder, killed, max_seconds=300, **LAUNCH)
    finally:
        shutil.rmtree(fake)
    return results, folder


def _one(rank: int, folder: str, killed: str, plain: str) -> dict:
    ckpt = f"{killed}/ckpt/step=4.ckpt"
    return {
        "load": load_n(rank, folder),
        "trainer": trainer_fit(rank, f"{killed}/one", None, ckpt, 2 * TRAINER_BATCH),
        "from_plain": trainer_fit(rank, f"{killed}/from_plain", None, plain, 2 * TRAINER_BATCH),
    }


def plain_fit(folder: str, steps: int) -> None:
    """``trainer_fit``'s run in this process without a strategy (the global batch), for
    ``steps`` steps, checkpointing each: plain checkpoint files."""
    from torch.utils.data import DataLoader

    from purestep.loops import Trainer
    from purestep.loops.callbacks import ModelCheckpoint

    trainer = Trainer(
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=folder,
        callbacks=[
            ModelCheckpoint(
                dirpath=f"{folder}/ckpt", filename="{step}", save_top_k=-1, every_n_train_steps=1
            )
        ],
    )
    loader = DataLoader(_points(64, 0), batch_size=2 * TRAINER_BATCH, shuffle=True)
    trainer.fit(mlp(0), _plain_loss, optim.adam(1e-2), loader, seed=3)


@functools.cache
def one_rank_run() -> dict:
    """One 1-rank launch: ``load_n`` of ``two.ckpt``, and ``Trainer`` fits with the same
    global batch resumed from the killed run's step 4 and from a plain (one process, no
    strategy) checkpoint file of step 4."""
    folder = two_rank_run()[1]
    killed = killed_run()["folder"]
    plain_fit(f"{folder}/plain_fit", 4)
    plain = f"{folder}/plain_fit/ckpt/step=4.ckpt"
    return hardware.launch(_one, 1, folder, killed, plain, max_seconds=120, **LAUNCH)[0]
