"""Stochastic weight averaging: the average equals torch's ``AveragedModel`` fed the same
parameters, the learning rate follows ``SWALR``, BatchNorm statistics are recomputed with
``update_bn`` over the training data, and a SIGKILLed run (SWA and EMA together, in a
model with BatchNorm and dropout) resumes bitwise.

Run as a script (``python tests/test_swa.py [--kill N] [--resume]``) this file is the job
the kill-and-resume test launches.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import swa_utils
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.engine.optim.multi import find_injected
from purestep.loops import Task, Trainer
from purestep.loops.callbacks import EMA, LambdaCallback, ModelCheckpoint, StochasticWeightAveraging

ROOT = Path(__file__).resolve().parent.parent


def data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def net(batchnorm=False, dropout=0.0):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    layers.append(nn.ReLU())
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(8, 2))


def loss_fn(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def sgd(lr=0.1):
    return optim.inject_hyperparams(optim.sgd)(lr=lr, momentum=0.9)


def trainer(**flags):
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("logger", False)
    flags.setdefault("enable_checkpointing", False)
    return Trainer(**flags)


class Recorder:
    """Copies of the parameters at every epoch start and the lr of every epoch."""

    def __init__(self):
        self.params, self.lrs = {}, {}

        def start(ctx):
            self.params[ctx.epoch] = {k: v.clone() for k, v in ctx.state.params.items()}

        def end(ctx):
            self.lrs[ctx.epoch] = float(find_injected(ctx.state.opt_state)[0].hyperparams["lr"])

        # listed first: it sees the state before SWA's own epoch-start work
        self.callback = LambdaCallback(
            name="recorder", on_train_epoch_start=start, on_train_epoch_end=end
        )


def _module_with(template, params):
    m = copy.deepcopy(template)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(params[name])
    return m


@pytest.mark.bitwise
@pytest.mark.parametrize("avg_fn", [None, "custom"])
def test_swa_average_equals_averaged_model(avg_fn):
    fn = (lambda avg, cur, n: avg + (cur - avg) / (n + 1)) if avg_fn else None
    template, rec = net(), Recorder()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=2, avg_fn=fn)
    tr = trainer(max_epochs=5, callbacks=[rec.callback, swa])
    state = tr.fit(template, loss_fn, sgd(), DataLoader(data(), batch_size=4))
    reference = swa_utils.AveragedModel(template, avg_fn=fn)
    for epoch in range(1, 5):  # swa_epoch_start=2 (1-based): epochs 1..4 (0-based)
        reference.update_parameters(_module_with(template, rec.params[epoch]))
    assert state.callbacks[swa.key]["n_averaged"] == 4
    for name, p in reference.module.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name
        assert torch.equal(state.callbacks[swa.key]["average"][name], p.detach())


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_swa_learning_rate_follows_swalr():
    for strategy, anneal in (("cos", 3), ("linear", 2), ("cos", 0)):
        rec = Recorder()
        swa = StochasticWeightAveraging(
            swa_lrs=0.01,
            swa_epoch_start=0.4,
            annealing_epochs=anneal,
            annealing_strategy=strategy,
        )
        tr = trainer(max_epochs=6, callbacks=[rec.callback, swa])
        tr.fit(net(), loss_fn, sgd(0.1), DataLoader(data(8), batch_size=4))
        # torch: SGD at 0.1, SWALR created at the first SWA epoch, stepped every epoch end
        p = nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=0.1)
        start = max(int(6 * 0.4) - 1, 0)
        scheduler, want = None, {}
        for epoch in range(6):
            if epoch == start:
                scheduler = swa_utils.SWALR(
                    opt, swa_lr=0.01, anneal_epochs=anneal, anneal_strategy=strategy
                )
            want[epoch] = opt.param_groups[0]["lr"]
            if scheduler is not None:
                scheduler.step()
        for epoch in range(6):
            assert math.isclose(rec.lrs[epoch], want[epoch], rel_tol=1e-12, abs_tol=1e-15), (
                strategy,
                anneal,
                epoch,
                rec.lrs,
                want,
            )


class ScheduledTask(Task):
    """SGD at 0.1 with a ``0.1 * 0.9 ** k`` scheduler of the given interval."""

    def __init__(self, interval):
        super().__init__(net())
        self.interval = interval

    def configure_optimizers(self):
        return {
            "optimizer": sgd(0.1),
            "lr_scheduler": {"scheduler": lambda k: 0.1 * 0.9**k, "interval": self.interval},
        }

    def training_step(self, apply, batch):
        return loss_fn(apply, batch)


@pytest.mark.bitwise
@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_swa_holds_its_learning_rate_over_the_tasks_scheduler(tmp_path, interval):
    """In the SWA epochs every batch runs at SWALR's rate, whatever the task's scheduler
    sets (a step scheduler before every batch; an epoch one again on a mid-epoch resume),
    and a run resumed mid-SWA-epoch ends bitwise like the uninterrupted one."""
    loader = DataLoader(data(), batch_size=4)  # 6 batches an epoch

    def run(ckpt_path=None, callbacks=()):
        rec = Recorder()
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2)
        tr = trainer(
            max_epochs=4,
            callbacks=[rec.callback, swa, *callbacks],
            enable_checkpointing=bool(callbacks),
        )
        state = tr.fit(ScheduledTask(interval), train_dataloaders=loader, ckpt_path=ckpt_path)
        return state, rec.lrs

    saver = ModelCheckpoint(
        dirpath=str(tmp_path), every_n_train_steps=15, save_top_k=-1, filename="{step}"
    )
    full, lrs = run(callbacks=[saver])
    # SWA starts at epoch 1 from the rate the scheduler last set: before step 1 (the epoch
    # scheduler's epoch 1) or before the last batch of epoch 0 (the step scheduler's step 5)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1 * 0.9 ** (1 if interval == "epoch" else 5))
    swalr = swa_utils.SWALR(opt, swa_lr=0.01, anneal_epochs=2)
    for epoch in (1, 2, 3):
        assert math.isclose(lrs[epoch], opt.param_groups[0]["lr"], rel_tol=1e-12), (epoch, lrs)
        swalr.step()
    resumed, _ = run(ckpt_path=str(tmp_path / "step=15.ckpt"))  # epoch 2, batch 3 of 6
    for name in full.params:
        assert torch.equal(resumed.params[name], full.params[name]), name


@pytest.mark.bitwise
def test_swa_recomputes_batchnorm_statistics_over_the_training_data():
    template, rec = net(batchnorm=True), Recorder()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3, annealing_epochs=1)
    tr = trainer(max_epochs=4, callbacks=[rec.callback, swa])
    loader = DataLoader(data(), batch_size=4)
    state = tr.fit(template, loss_fn, sgd(), loader)
    reference = swa_utils.AveragedModel(template)
    for epoch in (2, 3):
        reference.update_parameters(_module_with(template, rec.params[epoch]))
    model = copy.deepcopy(reference.module)
    swa_utils.update_bn(loader, model)  # the same batches: unshuffled data, in order
    for name, b in model.named_buffers():
        assert torch.equal(state.buffers[name], b), name
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name
    # the BatchNorm pass started from reset statistics, not the trained ones
    assert not torch.equal(state.buffers["1.running_mean"], torch.zeros(8))


class DictPoints(torch.utils.data.Dataset):
    """Samples as dicts: a batch is ``{"x": ..., "y": ...}``."""

    def __init__(self):
        self.x, self.y = data().tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class DictTask(Task):
    def __init__(self):
        super().__init__(net(batchnorm=True))

    def configure_optimizers(self):
        return sgd()

    def training_step(self, apply, batch):
        return F.cross_entropy(apply(batch["x"] * 2.0), batch["y"])  # preprocessing in the step


@pytest.mark.bitwise
def test_swa_batchnorm_pass_runs_the_training_step_on_dict_batches():
    """The BatchNorm pass feeds the model what the training step feeds it (a dict batch,
    scaled inputs), as Lightning's extra epoch runs the training step."""
    rec = Recorder()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3, annealing_epochs=1)
    loader = DataLoader(DictPoints(), batch_size=4)
    state = trainer(max_epochs=4, callbacks=[rec.callback, swa]).fit(
        DictTask(), train_dataloaders=loader
    )
    template = net(batchnorm=True)
    reference = swa_utils.AveragedModel(template)
    for epoch in (2, 3):
        reference.update_parameters(_module_with(template, rec.params[epoch]))
    model = copy.deepcopy(reference.module)
    swa_utils.update_bn((b["x"] * 2.0 for b in loader), model)
    for name, b in model.named_buffers():
        assert torch.equal(state.buffers[name], b), name


@pytest.mark.bitwise
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_average_update_runs_averaged_models_arithmetic_on_each_device(device):
    """Tensor by tensor on the CPU, foreach kernels on CUDA: as AveragedModel chooses."""
    from purestep.loops.callbacks.swa import average_update

    template = net().to(device)
    reference = swa_utils.AveragedModel(template)
    g = torch.Generator().manual_seed(1)
    avg = None
    for n in range(5):
        params = {
            k: torch.randn(v.shape, generator=g).to(device) for k, v in template.named_parameters()
        }
        reference.update_parameters(_module_with(template, params))
        avg = average_update(avg, params, n)
    for name, p in reference.module.named_parameters():
        assert torch.equal(avg[name], p.detach()), name


def test_swa_keeps_the_weights_when_training_stops_before_the_last_epoch():
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    tr = trainer(max_epochs=4, max_steps=14, callbacks=[swa])
    state = tr.fit(net(), loss_fn, sgd(), DataLoader(data(), batch_size=4))
    avg = state.callbacks[swa.key]["average"]
    assert avg is not None and state.progress.epoch < 4
    assert any(not torch.equal(avg[k], state.params[k]) for k in avg)


def test_swa_bad_input():
    for kwargs, match in (
        ({"swa_lrs": -1.0}, "swa_lrs"),
        ({"swa_lrs": [0.1, "x"]}, "swa_lrs"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 0}, "swa_epoch_start"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 1.5}, "swa_epoch_start"),
        ({"swa_lrs": 0.1, "annealing_epochs": -1}, "annealing_epochs"),
        ({"swa_lrs": 0.1, "annealing_strategy": "step"}, "annealing_strategy"),
    ):
        with pytest.raises(ValueError, match=match):
            StochasticWeightAveraging(**kwargs)
    with pytest.raises(TypeError, match="avg_fn"):
        StochasticWeightAveraging(0.1, avg_fn=3)
    loader = DataLoader(data(8), batch_size=4)
    with pytest.raises(ValueError, match="inject_hyperparams"):
        trainer(max_epochs=2, callbacks=[StochasticWeightAveraging(0.1)]).fit(
            net(), loss_fn, optim.sgd(0.1), loader
        )
    with pytest.raises(ValueError, match="max_epochs"):
        trainer(max_steps=3, callbacks=[StochasticWeightAveraging(0.1)]).fit(
            net(), loss_fn, sgd(), loader
        )
    with pytest.raises(ValueError, match="swa_lrs has 2"):
        trainer(max_epochs=2, callbacks=[StochasticWeightAveraging([0.1, 0.2])]).fit(
            net(), loss_fn, sgd(), loader
        )


# --------------------------------------------------------------------------- kill and resume


def job(argv: list[str]) -> None:
    """SWA and EMA on a BatchNorm + dropout model with shuffled data and a checkpoint at
    every step; ``--kill N`` SIGKILLs itself at the N-th train batch end."""
    import argparse

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.helpers import digest

    parser = argparse.ArgumentParser()
    parser.add_argument("--kill", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels in every process (restored below)
    try:
        _job(args, digest)
    finally:
        torch.set_num_threads(threads)


def _job(args, digest) -> None:
    seen = [0]

    def maybe_die(ctx):
        seen[0] += 1
        if seen[0] == args.kill:
            os.kill(os.getpid(), signal.SIGKILL)

    tr = Trainer(
        max_epochs=4,
        default_root_dir="runs",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            LambdaCallback(name="killer", on_train_batch_end=maybe_die),
            StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=1),
            EMA(decay=0.9, every_n_steps=2, warmup=True),
            ModelCheckpoint(every_n_train_steps=1, save_top_k=0, save_last=True),
        ],
    )
    loader = DataLoader(data(40, 3), batch_size=4, shuffle=True)
    val = DataLoader(data(8, 4), batch_size=4)
    state = tr.fit(
        net(batchnorm=True, dropout=0.2),
        loss_fn,
        sgd(),
        loader,
        val,
        seed=5,
        ckpt_path="last" if args.resume else None,
    )
    print(f"ran={seen[0]}")
    print(f"digest={digest(state)}")


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, str(Path(__file__)), *args],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _digest(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.bitwise
@pytest.mark.timeout(300)
def test_killed_run_with_swa_and_ema_resumes_bitwise(tmp_path, monkeypatch, capsys):
    (tmp_path / "full").mkdir()
    monkeypatch.chdir(tmp_path / "full")
    job([])  # the uninterrupted run, in this process
    reference = capsys.readouterr().out.strip().splitlines()[-1]
    assert reference.startswith("digest=")
    killed = _run(tmp_path / "killed", "--kill", "27")  # epoch 2 (SWA running), mid-epoch
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _run(tmp_path / "killed", "--resume")
    assert "Restored the training state from" in resumed.stderr
    ran = int(resumed.stdout.split("ran=")[1].split()[0])
    assert 0 < ran < 40  # it continued
    assert _digest(resumed) == reference


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    job(sys.argv[1:])
