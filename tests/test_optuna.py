"""Optuna pruning and restartable studies, against real Optuna studies and storages.

``OptunaPruning`` is compared with ``optuna_integration``'s ``PyTorchLightningPruningCallback``
on Lightning's own Trainer (same module, same data): the trials end the same way with the
same intermediate values at the same epochs. A study over a ``Task`` with an sqlite
``RDBStorage`` is SIGKILLed in the middle of a trial; the restarted process retries that
trial, which resumes from its predecessor's last checkpoint and ends bitwise equal to a
trial never interrupted.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
import warnings

import optuna
import pytest
import torch
from torch.utils.data import DataLoader

import purestep
from purestep.engine import optim
from purestep.loops import Task, Trainer
from purestep.loops.callbacks import Callback
from purestep.loops.events import NOTHING, Context, Stage
from purestep.loops.integrations.optuna_pruning import (
    OptunaPruning,
    original_trial_number,
    resume_path,
    trial_run_dir,
)
from tests.helpers import mlp, sign_data, sign_loss
from tests.lightning_models import QUIET, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
optuna.logging.set_verbosity(optuna.logging.WARNING)


class PruneFrom(optuna.pruners.BasePruner):
    """Prunes a trial once it has reported at step ``step`` or later."""

    def __init__(self, step: int) -> None:
        self.step = step

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.last_step is not None and trial.last_step >= self.step


def _study(pruner: optuna.pruners.BasePruner | None = None, **kwargs) -> optuna.Study:
    return optuna.create_study(pruner=pruner or optuna.pruners.NopPruner(), **kwargs)


def _loaders():
    return DataLoader(sign_data(48, 0), batch_size=16), DataLoader(sign_data(32, 1), batch_size=16)


# --------------------------------------------------------------------------- the callback


@pytest.mark.slow
@pytest.mark.bitwise
@pytest.mark.timeout(120)
@pytest.mark.xdist_group("processes")
@pytest.mark.parametrize("prune_from", [2, 99])
def test_reports_and_prunes_as_the_lightning_callback_does(tmp_path, prune_from):
    """The same module under both Trainers (with a sanity check, which neither reports):
    the same trial states and the same intermediate values at the same epochs."""
    pl = pytest.importorskip("lightning.pytorch")
    integration = pytest.importorskip("optuna_integration")

    purestep.seed_everything(0)
    model, data = build("autoencoder", "lightning")
    reference = copy.deepcopy(model)

    def theirs(trial):
        callback = integration.PyTorchLightningPruningCallback(trial, monitor="val_loss")
        trainer = pl.Trainer(
            max_epochs=4,
            accelerator="cpu",
            devices=1,
            default_root_dir=tmp_path / "lightning",
            num_sanity_val_steps=2,
            callbacks=[callback],
            **QUIET,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its tips and data-loader worker advice
            trainer.fit(reference, **data)
        return float(trainer.callback_metrics["val_loss"])

    def ours(trial):
        trainer = Trainer(
            max_epochs=4,
            default_root_dir=tmp_path / "purestep",
            num_sanity_val_steps=2,
            callbacks=[OptunaPruning(trial, monitor="val_loss")],
            **QUIET,
        )
        trainer.fit(model, **data)
        return float(trainer.callback_metrics["val_loss"])

    studies = []
    for objective in (theirs, ours):
        study = _study(PruneFrom(prune_from))
        study.optimize(objective, n_trials=1)
        studies.append(study.trials[0])
    lightning, purestep_trial = studies
    want = optuna.trial.TrialState.PRUNED if prune_from < 4 else optuna.trial.TrialState.COMPLETE
    assert lightning.state == purestep_trial.state == want
    assert list(purestep_trial.intermediate_values) == list(range(min(prune_from + 1, 4)))
    assert purestep_trial.intermediate_values == lightning.intermediate_values
    assert purestep_trial.value == lightning.value


def test_reported_values_are_the_logged_validation_values():
    logged = []

    class Record(Callback):
        def on_validation_end(self, state, ctx):
            if ctx.stage != Stage.SANITY_CHECK:
                logged.append((ctx.epoch, float(ctx.metrics["val_loss"])))
            return state, NOTHING

    def objective(trial):
        train, val = _loaders()
        trainer = Trainer(max_epochs=3, callbacks=[OptunaPruning(trial), Record()], **QUIET)
        trainer.fit(mlp(), sign_loss, optim.sgd(0.1), train, val)
        return 0.0

    study = _study()
    study.optimize(objective, n_trials=1)
    assert list(study.trials[0].intermediate_values.items()) == logged
    assert [e for e, _ in logged] == [0, 1, 2]


def test_a_missing_monitor_is_an_error_or_with_strict_false_a_warning():
    train, val = _loaders()

    def objective(strict):
        def run(trial):
            trainer = Trainer(
                max_epochs=2,
                callbacks=[OptunaPruning(trial, "val_acc", strict=strict)],
                **QUIET,
            )
            trainer.fit(mlp(), sign_loss, optim.sgd(0.1), train, val)
            return 1.0

        return run

    study = _study()
    with pytest.raises(RuntimeError, match=r"'val_acc' is not in the evaluation logs.*val_loss"):
        study.optimize(objective(True), n_trials=1, catch=())
    assert study.trials[-1].state == optuna.trial.TrialState.FAIL
    with pytest.warns(UserWarning, match="'val_acc' is not in the evaluation logs"):
        study.optimize(objective(False), n_trials=1)
    assert study.trials[-1].state == optuna.trial.TrialState.COMPLETE
    assert study.trials[-1].intermediate_values == {}


def test_bad_arguments_are_clear_errors():
    study = _study()
    trial = study.ask()
    with pytest.raises(TypeError, match="needs the optuna.trial.Trial"):
        OptunaPruning(study.trials[0])  # a FrozenTrial
    with pytest.raises(TypeError, match="must be a metric name"):
        OptunaPruning(trial, monitor="")
    cb = OptunaPruning(trial)
    state = {"steps": (), "values": (), "pruned_epoch": -1}
    ctx = _ctx(0, 1, {"val_loss": torch.ones(3)})
    with pytest.raises(ValueError, match="tensor of shape \\(3,\\).*sweep"):
        cb.on_validation_end(state, ctx)


def _ctx(rank: int, world_size: int, metrics: dict, epoch: int = 0) -> Context:
    state = engine_state(epoch)
    return Context(
        stage=Stage.VALIDATE,
        fn="fit",
        state=state,
        metrics=metrics,
        world_size=world_size,
        rank=rank,
    )


def engine_state(epoch: int):
    from purestep.engine import init

    state = init(mlp(), optim.sgd(0.1))
    return state.replace(progress=state.progress.replace(epoch=epoch))


def test_under_ddp_rank_zero_reports_every_rank_stops_and_check_pruned_raises():
    """The handlers of two ranks (real trial, real pruner; no processes needed: the
    callback's DDP rule is what each rank's handler returns)."""
    study = _study(PruneFrom(1))
    trial = study.ask()
    ranks = [OptunaPruning(trial) for _ in range(2)]
    states = [cb.init() for cb in ranks]
    for epoch, value in enumerate([0.5, 0.25]):
        for rank, cb in enumerate(ranks):
            states[rank], requests = cb.on_validation_end(
                states[rank], _ctx(rank, 2, {"val_loss": torch.tensor(value)}, epoch)
            )
            assert requests.stop == (rank == 0 and epoch == 1)
    assert study.trials[0].intermediate_values == {0: 0.5, 1: 0.25}  # rank 0's, once each
    assert states[0]["pruned_epoch"] == 1 and states[1]["pruned_epoch"] == -1
    ranks[1].check_pruned(states[1])
    with pytest.raises(optuna.TrialPruned, match="pruned at epoch 1"):
        ranks[0].check_pruned(states[0])


def test_the_sanity_check_and_other_entry_points_report_nothing():
    study = _study(PruneFrom(0))
    trial = study.ask()
    cb = OptunaPruning(trial)
    metrics = {"val_loss": torch.tensor(1.0)}
    for ctx in (
        _ctx(0, 1, metrics).replace(stage=Stage.SANITY_CHECK),
        _ctx(0, 1, metrics).replace(fn="validate"),
    ):
        assert cb.on_validation_end(cb.init(), ctx) == (cb.init(), NOTHING)
    assert study.trials[0].intermediate_values == {}


# --------------------------------------------------------------------------- run folders


def test_a_retried_trial_gets_its_original_trials_folder(tmp_path):
    study = _study()
    first = study.ask({"lr": optuna.distributions.FloatDistribution(0.01, 0.1)})
    assert trial_run_dir(first, tmp_path) == os.path.join(tmp_path, "trial_0")
    assert resume_path(first, tmp_path) is None
    os.makedirs(tmp_path / "trial_0" / "checkpoints")
    (tmp_path / "trial_0" / "checkpoints" / "epoch=0-step=3.ckpt").write_bytes(b"")
    study.tell(first, state=optuna.trial.TrialState.FAIL)
    frozen = study.trials[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry_callback = optuna.storages.RetryHeartbeatStaleTrialCallback()
    retry_callback(study, frozen)  # what a restarted study does with a stale trial
    retry = study.ask()
    assert retry.number == 1 and retry.params == first.params
    assert original_trial_number(retry) == 0
    assert trial_run_dir(retry, tmp_path) == os.path.join(tmp_path, "trial_0")
    assert resume_path(retry, tmp_path) == "last"


# --------------------------------------------------------------------------- kill and restart


class SignTask(Task):
    """The sign task: an MLP, SGD with momentum at the trial's learning rate."""

    def __init__(self, lr: float):
        super().__init__(mlp(0))
        self.lr = lr

    def configure_optimizers(self):
        return optim.sgd(self.lr, momentum=0.9)

    def training_step(self, apply, batch):
        return sign_loss(apply, batch)

    def validation_step(self, apply, batch):
        return sign_loss(apply, batch)


class HangInSecondEpoch(Callback):
    """Writes ``marker`` and sleeps at the second batch of epoch 1 (after epoch 0's
    checkpoint is written), so the parent can kill the process in the middle of a trial."""

    def __init__(self, marker: str):
        self.marker = marker

    def on_train_batch_start(self, state, ctx):
        if ctx.epoch == 1 and ctx.batch_idx == 1:
            with open(self.marker, "w") as f:
                f.write("hanging")
            time.sleep(300)
        return state, NOTHING


class RecordStart(Callback):
    """Sets the trial's user attribute ``start_epoch``: the epoch its fit started at."""

    def __init__(self, trial):
        self.trial = trial

    def on_train_start(self, state, ctx):
        self.trial.set_user_attr("start_epoch", ctx.epoch)
        return state, NOTHING


EPOCHS = 3


def objective(root: str, hang_marker: str | None = None):
    """The study's objective: one Task per trial, its run folder keyed by the original
    trial, resumed from its last checkpoint when there is one."""

    def run(trial: optuna.trial.Trial) -> float:
        lr = trial.suggest_float("lr", 0.02, 0.2, log=True)
        folder = trial_run_dir(trial, root)
        callbacks = [OptunaPruning(trial), RecordStart(trial)]
        if hang_marker is not None and original_trial_number(trial) == 0:
            callbacks.append(HangInSecondEpoch(hang_marker))
        trainer = Trainer(
            max_epochs=EPOCHS,
            default_root_dir=folder,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        train, val = _loaders()
        state = trainer.fit(SignTask(lr), train, val, ckpt_path=resume_path(trial, root))
        torch.save(dict(state.params), os.path.join(folder, f"final_params_{trial.number}.pt"))
        return float(trainer.callback_metrics["val_loss"])

    return run


def storage(url: str) -> optuna.storages.RDBStorage:
    return optuna.storages.RDBStorage(
        url,
        heartbeat_interval=1,
        grace_period=2,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
            max_retry=2
        ),
    )


def run_study(url: str, root: str, n_trials: int, hang_marker: str | None) -> None:
    """What the study's process does (``python -m tests.test_optuna URL ROOT N [MARKER]``)."""
    torch.set_num_threads(1)
    study = optuna.create_study(study_name="restartable", storage=storage(url), load_if_exists=True)
    # a sampler seeded by how far the study is, so a restart draws new parameters
    study.sampler = optuna.samplers.RandomSampler(seed=len(study.trials))
    study.optimize(objective(root, hang_marker), n_trials=n_trials)


def _start(url: str, root, n_trials: int, marker=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, "-m", "tests.test_optuna", url, str(root), str(n_trials)]
    return subprocess.Popen(
        [*args, *([str(marker)] if marker else [])],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out


@pytest.mark.slow
@pytest.mark.bitwise
@pytest.mark.timeout(180)
@pytest.mark.xdist_group("processes")
def test_a_killed_study_continues_and_its_running_trial_resumes(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    root = tmp_path / "runs"
    marker = tmp_path / "hanging"
    proc = _start(url, root, 1, marker)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert proc.poll() is None, _stop(proc)
            assert time.monotonic() < deadline, "the study never reached its second epoch"
            time.sleep(0.1)
        assert resume_path(_Numbered(0), root) == "last"  # epoch 0's checkpoint is there
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _stop(proc)
    assert proc.returncode == -signal.SIGKILL
    time.sleep(3)  # past the storage's grace period: the trial's heartbeat is stale

    restarted = _start(url, root, 2)
    try:
        out, _ = restarted.communicate(timeout=120)
    finally:
        _stop(restarted)
    assert restarted.returncode == 0, out

    study = optuna.load_study(study_name="restartable", storage=url)
    states = [t.state for t in study.trials]
    done = optuna.trial.TrialState
    assert states == [done.FAIL, done.COMPLETE, done.COMPLETE]
    killed, resumed, fresh = study.trials
    assert original_trial_number(resumed) == 0 and resumed.params == killed.params
    assert resumed.user_attrs["start_epoch"] == 1  # resumed, not started over
    assert fresh.user_attrs["start_epoch"] == 0 and fresh.params != killed.params

    # an uninterrupted trial with the same parameters, in this process
    reference = _study()
    reference.enqueue_trial(killed.params)
    reference.optimize(objective(str(tmp_path / "reference")), n_trials=1)
    (uninterrupted,) = reference.trials
    assert resumed.value == uninterrupted.value
    assert resumed.intermediate_values == uninterrupted.intermediate_values
    assert list(resumed.intermediate_values) == list(range(EPOCHS))
    got = torch.load(root / "trial_0" / "final_params_1.pt")
    want = torch.load(tmp_path / "reference" / "trial_0" / "final_params_0.pt")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


class _Numbered:
    """Stands for a trial with a number and no retry (what ``trial_run_dir`` reads)."""

    def __init__(self, number: int):
        self.number = number
        self.system_attrs: dict = {}


if __name__ == "__main__":
    url_arg, root_arg, n_arg, *marker_arg = sys.argv[1:]
    run_study(url_arg, root_arg, int(n_arg), marker_arg[0] if marker_arg else None)
