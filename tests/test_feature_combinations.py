"""Features of #11-#15 used together, as a Lightning user combines them: each combination
either works (checked against the features alone or a single process) or is refused before
the first step with an error that names it.

The FSDP cases share one 2-rank gloo launch (``_fsdp_work``, bounded in time): an EMA run
resumed from a sharded checkpoint, ``track_grad_norm`` against one process, and
``terminate_on_nan`` with a NaN in one rank's gradient shard only.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Task, Trainer
from purestep.engine import optim
from purestep.loops.callbacks import EMA, ModelCheckpoint, StochasticWeightAveraging

AOT = {"backend": "aot_eager"}  # traces the whole step as inductor does, without codegen


def _data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, 0] - 2 * x[:, 1])


def _loader(n: int = 24, batch_size: int = 4) -> DataLoader:
    return DataLoader(_data(n), batch_size=batch_size)


def _trainer(**kw) -> Trainer:
    kw.setdefault("max_epochs", 2)
    return Trainer(
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        logger=kw.pop("logger", False),
        **kw,
    )


def _pair(batchnorm: bool = False) -> nn.ModuleDict:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)) if batchnorm else nn.Linear(4, 6)
    return nn.ModuleDict({"a": a, "b": nn.Linear(6, 1)})


def _forward(apply, x):
    return apply["b"](torch.tanh(apply["a"](x))).squeeze(-1)


def _two():
    inject = optim.inject_hyperparams
    return [
        {"optimizer": inject(optim.adam)(lr=1e-2), "params": "a"},
        {"optimizer": inject(optim.sgd)(lr=0.05), "params": "b"},
    ]


class TwoAuto(Task):
    def __init__(self, batchnorm: bool = False):
        super().__init__(_pair(batchnorm))

    def training_step(self, apply, batch, optimizer_idx):
        x, y = batch
        out = _forward(apply, x)
        return F.mse_loss(out, y) if optimizer_idx == 0 else F.l1_loss(out, y)

    def configure_optimizers(self):
        return _two()


class TwoManual(Task):
    automatic_optimization = False

    def __init__(self, batchnorm: bool = False):
        super().__init__(_pair(batchnorm))

    def _loss(self, apply, batch):
        x, y = batch
        return F.mse_loss(_forward(apply, x), y)

    def training_step(self, opt, batch):
        opt.step("d", self._loss, batch)
        return {"loss": opt.step("g", self._loss, batch).loss}

    def configure_optimizers(self):
        a, b = _two()
        return {"d": a, "g": b}


# ---------------------------------------------------------------- compile


@pytest.mark.parametrize("task", [TwoAuto, TwoManual])
def test_compile_with_several_optimizers_is_refused_before_the_first_step(task):
    trainer = _trainer(compile=AOT)
    with pytest.raises(ValueError, match="compile=.*several optimizers or manual") as err:
        trainer.fit(task(), train_dataloaders=_loader())
    assert task.__name__ in str(err.value)
    assert trainer.train_state is None  # refused before a state was built


class Single(Task):
    def __init__(self, opt):
        torch.manual_seed(0)
        super().__init__(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)))
        self.opt = opt

    def training_step(self, apply, batch):
        x, y = batch
        return F.mse_loss(apply(x).squeeze(-1), y)

    def configure_optimizers(self):
        return self.opt()


@pytest.mark.bitwise
def test_compiled_from_torch_with_ema_resumes_bitwise_from_last(tmp_path):
    def opt():
        return optim.from_torch(torch.optim.NAdam, lr=1e-2)

    def ema():
        return EMA(decay=0.9, apply_at_end=False)

    def fit(epochs, **kw):
        trainer = _trainer(
            max_epochs=epochs,
            compile=AOT,
            default_root_dir=str(tmp_path),
            enable_checkpointing=True,
            callbacks=[ema(), ModelCheckpoint(dirpath=str(tmp_path), save_last=True)],
        )
        state = trainer.fit(Single(opt), train_dataloaders=_loader(), **kw)
        return trainer, state

    averaging = ema()
    full = _trainer(max_epochs=3, compile=AOT, callbacks=[averaging]).fit(
        Single(opt), train_dataloaders=_loader()
    )
    fit(2)
    trainer, resumed = fit(3, ckpt_path="last")
    assert trainer._loop._stepper.compilations >= 1  # it did run compiled
    for k in full.params:
        assert torch.equal(resumed.params[k], full.params[k]), k
    name = averaging.key
    assert full.callbacks[name]["n_averaged"] == resumed.callbacks[name]["n_averaged"] == 18
    for k, v in full.callbacks[name]["average"].items():
        assert torch.equal(resumed.callbacks[name]["average"][k], v), k


def _logged_grad_norms(**kw) -> list[dict[str, float]]:
    from purestep.loops.loggers import MemoryLogger

    logger = MemoryLogger()
    trainer = _trainer(max_epochs=1, track_grad_norm=2, logger=logger, log_every_n_steps=1, **kw)
    trainer.fit(Single(lambda: optim.adam(1e-2)), train_dataloaders=_loader())
    return [
        {k: float(v) for k, v in row.items() if k.startswith("grad_")}
        for _, row in logger.metrics
        if "grad_2.0_norm_total" in row
    ]


@pytest.mark.parametrize("donate", [False, True])
def test_compiled_track_grad_norm_logs_the_gradients_not_the_optimizer_moments(donate):
    # the whole-step graph runs the update in ``backward``; the gradients it hands the
    # loop must be those from before Adam wrote its moments into them
    eager = _logged_grad_norms(donate_state=donate)
    compiled = _logged_grad_norms(compile=AOT, donate_state=donate)
    assert len(eager) == len(compiled) == 6
    for step, (e, c) in enumerate(zip(eager, compiled)):
        assert set(e) == set(c)
        for k in e:  # compiled vs eager: different kernels, stated tolerance
            assert c[k] == pytest.approx(e[k], rel=1e-5, abs=1e-7), (step, k)


# ---------------------------------------------------------------- SWA with several optimizers


def test_swa_with_two_optimizers_recomputes_batchnorm_with_the_training_step():
    state = _trainer(callbacks=[StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)]).fit(
        TwoAuto(batchnorm=True), train_dataloaders=_loader()
    )
    # update_bn by hand: the averaged weights, fresh statistics, a cumulative average over
    # the training forward of every batch
    net = _pair(batchnorm=True)
    net.load_state_dict({**state.params, **state.buffers})
    bn = net["a"][1]
    bn.reset_running_stats()
    bn.momentum = None
    net.train()
    with torch.no_grad():
        for x, _ in _loader():
            _forward(net, x)
    tol = dict(rtol=1e-5, atol=1e-6)  # different code paths over the same batches
    torch.testing.assert_close(state.buffers["a.1.running_mean"], bn.running_mean, **tol)
    torch.testing.assert_close(state.buffers["a.1.running_var"], bn.running_var, **tol)


def test_swa_with_manual_optimization_and_batchnorm_without_forward_is_refused():
    with pytest.raises(ValueError, match="BatchNorm.*no forward.*manual optimization"):
        _trainer(callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)]).fit(
            TwoManual(batchnorm=True), train_dataloaders=_loader()
        )


def test_ema_with_two_optimizers_averages_every_parameter():
    decay = 0.5
    ema = EMA(decay=decay, apply_at_end=False)
    seen = []

    from purestep.loops.callbacks import LambdaCallback

    def note(ctx):
        seen.append({k: v.clone() for k, v in ctx.state.params.items()})

    state = _trainer(max_epochs=1, callbacks=[ema, LambdaCallback(on_train_batch_end=note)]).fit(
        TwoAuto(), train_dataloaders=_loader()
    )
    expected = copy.deepcopy(seen[0])
    for params in seen[1:]:
        for k in expected:
            expected[k] = expected[k].lerp(params[k], 1 - decay)
    average = state.callbacks[ema.key]["average"]
    assert set(average) == set(state.params)
    for k, v in expected.items():
        torch.testing.assert_close(average[k], v, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- FSDP (2 gloo ranks)


class _NaNGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class _HalfNaN(nn.Module):
    """A finite loss whose gradient is NaN in rows 3-5 of ``l.weight``: under FSDP on 2
    ranks (rows sharded 3 and 3) only rank 1's shard holds the NaN."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l, self.o = nn.Linear(4, 6), nn.Linear(6, 1)

    def forward(self, x):
        w = torch.cat([self.l.weight[:3], _NaNGrad.apply(self.l.weight[3:])])
        return self.o(F.linear(x, w, self.l.bias)).squeeze(-1)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1), nn.Flatten(0))


def _mse(apply, batch):
    x, y = batch
    return F.mse_loss(apply(x), y)


def _grad_norm_rows(strategy, batch_size: int) -> dict[str, float]:
    from purestep.loops.loggers import MemoryLogger

    logger = MemoryLogger()
    trainer = _trainer(
        max_epochs=1, strategy=strategy, track_grad_norm=2, logger=logger, log_every_n_steps=1
    )
    trainer.fit(_mlp(), _mse, optim.adam(1e-2), _loader(32, batch_size))
    rows = [r for _, r in logger.metrics if any(k.startswith("grad_") for k in r)]
    return {k: float(v) for k, v in rows[0].items() if k.startswith("grad_")} if rows else {}


def _fsdp_work(rank: int, folder: str) -> dict:
    from purestep.engine.optim import inject_hyperparams
    from purestep.loops.fit import NonFiniteLossError

    out: dict = {"grad_norms": _grad_norm_rows("fsdp", 4)}  # global batch 8

    def fit(epochs, cbs, **kw):
        trainer = _trainer(
            max_epochs=epochs,
            strategy="fsdp",
            default_root_dir=folder,
            enable_checkpointing=True,
            callbacks=cbs,
        )
        state = trainer.fit(
            _mlp(), _mse, inject_hyperparams(optim.adam)(lr=1e-2), _loader(16), **kw
        )
        return trainer.strategy.full_state(state)

    def callbacks(ckpt: bool):
        cbs = [EMA(decay=0.9), StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)]
        return [*cbs, ModelCheckpoint(dirpath=f"{folder}/ckpt", save_last=True)] if ckpt else cbs

    full = fit(3, callbacks(False))
    fit(2, callbacks(True))
    resumed = fit(3, callbacks(True), ckpt_path="last")
    out["resumed_equal"] = [
        bool(torch.equal(full.params[k], resumed.params[k])) for k in full.params
    ]
    try:
        _trainer(max_epochs=1, strategy="fsdp", terminate_on_nan=True).fit(
            _HalfNaN(), _mse, optim.adam(1e-2), _loader(16)
        )
        out["nan"] = None
    except NonFiniteLossError as exc:
        out["nan"] = str(exc)
    return out


@pytest.fixture(scope="module")
def fsdp_runs() -> list[dict]:
    from purestep import hardware

    with tempfile.TemporaryDirectory() as folder:
        return hardware.launch(
            _fsdp_work, 2, folder, max_seconds=240, timeout=30, grace=3.0, threads=1
        )


@pytest.mark.timeout(300)
def test_fsdp_track_grad_norm_logs_the_norms_of_the_whole_gradients(fsdp_runs):
    single = _grad_norm_rows("auto", 8)  # one process, the same global batch
    sharded = fsdp_runs[0]["grad_norms"]
    assert set(sharded) == set(single) and "grad_2.0_norm_total" in single
    for k, v in single.items():
        assert sharded[k] == pytest.approx(v, rel=1e-5), k


@pytest.mark.timeout(300)
def test_fsdp_ema_and_swa_resume_from_a_sharded_checkpoint_bitwise(fsdp_runs):
    for r in fsdp_runs:
        assert r["resumed_equal"] and all(r["resumed_equal"])


@pytest.mark.timeout(300)
def test_fsdp_terminate_on_nan_stops_every_rank_when_one_shard_is_nan(fsdp_runs):
    messages = [r["nan"] for r in fsdp_runs]
    assert all(m is not None and "terminate_on_nan" in m for m in messages), messages
    assert "l.weight" in messages[1] and "another rank" in messages[0]
