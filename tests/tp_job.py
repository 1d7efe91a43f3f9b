"""Worker functions for the tensor-parallel tests (run by ``hardware.launch``).

Each is a top-level function ``fn(rank, ...)`` returning plain, picklable results: full
(gathered) tensors, so the tests compare them with one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from purestep import engine
from purestep.engine import checkpoint, optim, tree
from purestep.hardware.tensor_parallel import tensor_parallel

G = 8  # samples per global batch
STEPS = 3


def mlp(seed: int = 0) -> nn.Module:
    """Two column-wise / row-wise blocks (8 -> 16 -> 8 -> 16 -> 3)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3),
    )  # fmt: skip


def mlp_plan() -> dict:
    return {
        "0": ColwiseParallel(),
        "2": RowwiseParallel(),
        "4": ColwiseParallel(),
        "6": RowwiseParallel(),
    }


class SeqBlock(nn.Module):
    """An attention-free residual block over sequences ``(batch, seq, 8)``, with LayerNorms."""

    def __init__(self) -> None:
        super().__init__()
        self.split = nn.Identity()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.out_norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.split(x)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(self.out_norm(h))


def seq_block(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SeqBlock()


def seq_plan() -> dict:
    """Sequence parallel norms between a column-wise / row-wise pair: activations sharded
    along the sequence outside the pair, the input split and the head gathered."""
    return {
        "split": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            use_local_output=False,
        ),
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "out_norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


MODELS = {"mlp": (mlp, mlp_plan), "seq": (seq_block, seq_plan)}


def data(kind: str, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (G, 8) if kind == "mlp" else (G, 4, 8)
    return [
        (torch.randn(*shape, generator=g), torch.randint(0, 3, shape[:-1], generator=g))
        for _ in range(n)
    ]


def loss_fn(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits.reshape(-1, 3), y.reshape(-1))


def optimizers() -> dict[str, optim.GradientTransformation]:
    return {
        "adam": optim.adam(1e-2),
        "clip_sgd": optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(0.1, momentum=0.9)),
    }


def train(kind, strategy, opt, *, steps=STEPS, state=None, start=0, accumulate=1):
    """``steps`` global batches from batch ``start``; replica ``d`` of ``dp`` takes its
    contiguous slice of each, one process (``strategy=None``) all of it."""
    build, _ = MODELS[kind]
    net = build(0)
    if state is None:
        state = engine.init(net, opt, seed=0, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy, accumulate=accumulate)
    out = None
    for x, y in data(kind, start + steps)[start:]:
        if strategy is not None:
            opts = strategy.data_options()
            b = G // opts["world_size"]
            r = opts["rank"]
            x, y = x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]
        state, out = step(state, (x, y))
    return state, out


def full(state, strategy) -> dict:
    if strategy is not None:
        state = strategy.full_state(state)
    return {"params": dict(state.params), "opt_state": state.opt_state, "step": state.progress.step}


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # the tests check type and message
        return f"{type(err).__name__}: {err}"
    return None


def _same(a, b) -> bool:
    """Bitwise equality of two trees (DTensors by their local tensors)."""
    la, lb = tree.leaves(a), tree.leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, DTensor):
            x, y = x.to_local(), y.to_local()
        if isinstance(x, torch.Tensor):
            if not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _snapshot(state) -> list[torch.Tensor]:
    out = []
    for t in tree.leaves(state):
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            out.append(t.detach().clone())
    return out


def _mine(strategy, batch):
    opts = strategy.data_options()
    b = G // opts["world_size"]
    r = opts["rank"]
    return tuple(t[r * b : (r + 1) * b] for t in batch)


def _parity(strategy, runs) -> dict:
    out = {}
    for kind, name in runs:
        state, last = train(kind, strategy, optimizers()[name])
        out[(kind, name)] = {**full(state, strategy), "grad_norm": last.grad_norm}
    return out


def _checkpointed(tp, path: str) -> dict:
    """Train 2 steps, save sharded at ``path``, load into a fresh state and train 2 more,
    against the uninterrupted 4 steps."""
    opt = optim.adam(1e-2)
    state, _ = train("mlp", tp, opt, steps=2)
    checkpoint.sharded.save(state, path, metadata={"mesh": [2, 2]})
    after, _ = train("mlp", tp, opt, steps=2, state=state, start=2)
    fresh = engine.init(mlp(1), opt, seed=1, strategy=tp)
    loaded, meta = checkpoint.sharded.load(path, fresh)
    resumed, _ = train("mlp", tp, opt, steps=2, state=loaded, start=2)
    return {
        "saved": full(state, tp),
        "after": full(after, tp),
        "loaded_same": _same(loaded.params, state.params)
        and _same(loaded.opt_state, state.opt_state),
        "resumed_same": _same(resumed.params, after.params)
        and _same(resumed.opt_state, after.opt_state),
        "meta": meta.get("mesh"),
    }


def _eval_predict(tp, state) -> dict:
    x, y = data("mlp", 1, seed=5)[0]
    mine = _mine(tp, (x, y))
    return {
        "eval": engine.eval_step(mlp(0), loss_fn, strategy=tp)(state, mine),
        "predict": engine.predict_step(mlp(0), strategy=tp)(state, mine[0]),
    }


def two_by_two(rank: int, folder: str) -> dict:
    """On a 2 x 2 mesh, with the replicas whole ("ddp") and sharded ("fsdp"): parity runs,
    one repeated (bitwise), accumulation, eval and predict, purity, and a sharded
    checkpoint written after 2 steps and resumed."""
    tp = tensor_parallel(mlp_plan(), mesh_shape=(2, 2))
    out = _parity(tp, [("mlp", "adam"), ("mlp", "clip_sgd")])
    sp = tensor_parallel(seq_plan(), mesh_shape=(2, 2))
    out.update(_parity(sp, [("seq", "adam")]))
    fs = tensor_parallel(mlp_plan(), mesh_shape=(2, 2), data_parallel="fsdp")
    sfs = tensor_parallel(seq_plan(), mesh_shape=(2, 2), data_parallel="fsdp")
    out["fsdp"] = {**_parity(fs, [("mlp", "clip_sgd")]), **_parity(sfs, [("seq", "adam")])}
    state, _ = train("mlp", fs, optim.adam(1e-2), steps=4, accumulate=2)
    out["fsdp"]["accumulate"] = full(state, fs)
    out["fsdp"]["local_numel"] = sum(p.to_local().numel() for p in state.params.values())
    out["fsdp"]["placements"] = {n: tuple(p.placements) for n, p in state.params.items()}
    out["fsdp"].update(_eval_predict(fs, state))
    out["fsdp"]["ckpt"] = _checkpointed(fs, f"{folder}/fsdp.ckpt")
    again = tensor_parallel(mlp_plan(), mesh_shape=(2, 2))
    out["repeat"] = full(train("mlp", again, optimizers()["clip_sgd"])[0], again)
    state, _ = train("mlp", tp, optim.adam(1e-2), steps=4, accumulate=2)
    out["accumulate"] = full(state, tp)
    out["local_numel"] = sum(p.to_local().numel() for p in state.params.values())
    out["placements"] = {n: tuple(p.placements) for n, p in state.params.items()}
    out["opt_laid_out"] = all(
        isinstance(m, DTensor) and m.placements == state.params[n].placements
        for n, m in state.opt_state.exp_avg.items()
    )
    # eval and predict on the trained state, each replica on its slice
    out.update(_eval_predict(tp, state))
    # a step leaves its input state as it was (replicas whole, and sharded)
    pure = []
    for strategy in (tp, fs):
        state = engine.init(mlp(0), optim.adam(1e-2), strategy=strategy)
        step = engine.train_step(mlp(0), loss_fn, optim.adam(1e-2), strategy=strategy)
        before = _snapshot(state)
        step(state, _mine(strategy, data("mlp", 1)[0]))
        pure.append(all(map(torch.equal, before, _snapshot(state))))
    out["pure"] = all(pure)
    out["ckpt"] = _checkpointed(tp, f"{folder}/tp.ckpt")
    return out


def four_by_one(rank: int, folder: str) -> dict:
    """Each 2 x 2 checkpoint loaded on a 4 x 1 mesh the other way (the one of whole replicas
    sharded over 4 replicas, the sharded one whole), then 2 more steps."""
    out = {}
    for name, mode in (("tp", "fsdp"), ("fsdp", "ddp")):
        tp = tensor_parallel(mlp_plan(), mesh_shape=(4, 1), data_parallel=mode)
        opt = optim.adam(1e-2)
        fresh = engine.init(mlp(1), opt, seed=1, strategy=tp)
        loaded, _ = checkpoint.sharded.load(f"{folder}/{name}.ckpt", fresh)
        resumed, _ = train("mlp", tp, opt, steps=2, state=loaded, start=2)
        out[name] = {"loaded": full(loaded, tp), "resumed": full(resumed, tp)}
    return out


def one_by_two(rank: int) -> dict:
    """Tensor parallelism only (1 x 2): parity, the layout, and the errors."""
    tp = tensor_parallel(mlp_plan())
    out = _parity(tp, [("mlp", "adam")])
    sp = tensor_parallel(seq_plan(), (1, 2))
    out.update(_parity(sp, [("seq", "clip_sgd")]))
    state = engine.init(mlp(0), optim.sgd(0.1), strategy=tp)
    out["local_numel"] = sum(p.to_local().numel() for p in state.params.values())
    out["mesh"] = (tp.dp_size, tp.tp_size, tp.dp_rank, tp.tp_rank, tp.data_options())
    # a plain state laid out by hand (after one step, so the moments are not zeros)
    adam = optim.adam(1e-2)
    trained, _ = train("mlp", None, adam, steps=1)
    laid_out = tp.shard_state(trained, mlp(0))
    ours, _ = train("mlp", tp, adam, steps=1)
    back = full(laid_out, tp)
    out["shard_state"] = (
        all(laid_out.params[n].placements == p.placements for n, p in ours.params.items())
        and all(
            m.placements == ours.opt_state.exp_avg[n].placements
            for n, m in laid_out.opt_state.exp_avg.items()
        )
        and _same(back["params"], dict(trained.params))
        and _same(back["opt_state"], trained.opt_state)
    )
    plain = engine.init(mlp(0), optim.sgd(0.1))
    step = engine.train_step(mlp(0), loss_fn, optim.sgd(0.1), strategy=tp)
    batch = data("mlp", 1)[0]
    out["errors"] = {
        "missing": _error(
            lambda: engine.init(
                mlp(0), optim.sgd(0.1), strategy=tensor_parallel({"9": ColwiseParallel()})
            )
        ),
        "shape": _error(lambda: tensor_parallel(mlp_plan(), mesh_shape=(2, 2))),
        "style": _error(lambda: tensor_parallel({"0": "colwise"})),
        "unlaid": _error(lambda: step(plain, batch)),
        "func": _error(
            lambda: engine.train_step(mlp(0), loss_fn, optim.sgd(0.1), strategy=tp, grad="func")
        ),
        "fp16": _error(lambda: tensor_parallel(mlp_plan(), precision="16-mixed")),
        "mode": _error(lambda: tensor_parallel(mlp_plan(), data_parallel="zero")),
    }
    return out


def _trainer_fit(tp, folder: str, ckpt: str | None) -> dict:
    """``Trainer(strategy=tp)``: 4 steps over shuffled data, a sharded checkpoint every 2."""
    from torch.utils.data import DataLoader, TensorDataset

    from purestep.loops import Trainer
    from purestep.loops.callbacks import ModelCheckpoint

    g = torch.Generator().manual_seed(0)
    points = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
    trainer = Trainer(
        max_steps=4,
        strategy=tp,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=folder,
        callbacks=[
            ModelCheckpoint(
                dirpath=f"{folder}/ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1
            )
        ],
    )
    loader = DataLoader(points, batch_size=8, shuffle=True)
    state = trainer.fit(
        mlp(0), loss_fn, optim.adam(1e-2), loader, DataLoader(points, batch_size=8), seed=3,
        ckpt_path=ckpt,
    )  # fmt: skip
    return {"params": dict(tp.full_state(state).params), "step": state.progress.step}


def trainer_runs(rank: int, folder: str) -> dict:
    """A Trainer run on 1 x 2, and the same run resumed from its step-2 checkpoint."""
    tp = tensor_parallel(mlp_plan())
    whole = _trainer_fit(tp, f"{folder}/whole", None)
    resumed = _trainer_fit(tp, f"{folder}/resumed", f"{folder}/whole/ckpt/step=2.ckpt")
    return {"whole": whole, "resumed": resumed}
