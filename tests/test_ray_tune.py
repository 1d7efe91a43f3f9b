"""purestep inside Ray Tune, on a real local Ray cluster (2 CPUs, loopback only).

One cluster serves the whole file. Checked: ``TuneReportCheckpoint`` reports each epoch
(``training_iteration``) with a purestep checkpoint; ``ASHAScheduler`` stops the trials
whose validation loss is behind at a rung, after fewer iterations than the full run; a
trial that crashes mid-epoch and is retried by Tune (``FailureConfig(max_failures=1)``)
resumes from its last reported checkpoint and ends bitwise equal, parameters and metrics,
to the same trial never interrupted, and so does one that ended in error and was resumed by
``Tuner.restore(..., resume_errored=True)``; outside a Tune trial the callback and
``tune_ckpt_path`` fail saying so.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# Ray resolves a loopback node address to the machine's outward one unless it runs as a
# single-machine cluster; set before ray is imported (its processes read it at import).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ray = pytest.importorskip("ray")
pytest.importorskip("ray.tune")

from ray import tune  # noqa: E402
from ray.tune.schedulers import ASHAScheduler  # noqa: E402

from purestep.engine import checkpoint, optim  # noqa: E402
from purestep.loops import Trainer  # noqa: E402
from purestep.loops.integrations.ray_train import CHECKPOINT_FILE  # noqa: E402
from purestep.loops.integrations.ray_tune import (  # noqa: E402
    TuneReportCheckpoint,
    tune_ckpt_path,
    tune_report,
)
from purestep.loops.profiling import Monitor  # noqa: E402
from tests.ray_cluster import local_cluster  # noqa: E402

#: What every process of the cluster (and the trials it starts) runs with: no usage
#: reports, a single-machine cluster on 127.0.0.1.
CLUSTER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# The trials get this module's functions by value (they cannot import a test module).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster(cores_to_ourselves):
    """A local Ray cluster for this file (torn down at its end, its processes with it)."""
    with local_cluster(ray, CLUSTER_ENV) as info:
        yield info


# ---------------------------------------------------------------------- the trial

_W = torch.tensor([[1.0, -2.0, 0.5], [0.3, 1.0, -1.0], [-1.0, 0.2, 2.0], [0.5, 0.5, 0.5]])


def _data(n: int, seed: int) -> TensorDataset:
    """A learnable problem: the label is the argmax of a fixed linear map of the input."""
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ _W).argmax(-1))


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


class CrashOnce(Monitor):
    """Kills the trial's process (SIGKILL) at a global step, the first time only (a marker
    file remembers it)."""

    events = frozenset({"on_train_batch_start"})

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_event(self, event, ctx):
        if ctx.progress.step == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def trainable(config: dict) -> None:
    """One trial: a purestep fit reporting each epoch's validation loss to Tune."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    callbacks = tune_report("val_loss")
    if config.get("reporter_alone"):  # the mistake: the reporter without its SaveForReport
        callbacks = [TuneReportCheckpoint("val_loss")]
    if config.get("crash_at") is not None:
        callbacks.append(CrashOnce(config["crash_at"], config["marker"]))
    trainer = Trainer(
        max_epochs=config["epochs"],
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        logger=False,
    )
    train = DataLoader(_data(32, 0), batch_size=8, shuffle=True)  # 4 batches an epoch
    val = DataLoader(_data(16, 1), batch_size=16)
    trainer.fit(
        model,
        _loss,
        optim.sgd(config["lr"], momentum=0.9),
        train,
        val,
        seed=5,
        ckpt_path=tune_ckpt_path(),
    )


def _params(result) -> dict[str, torch.Tensor]:
    state, _ = checkpoint.load(os.path.join(result.checkpoint.path, CHECKPOINT_FILE))
    return state.params


pytestmark = [pytest.mark.xdist_group("processes")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_asha_stops_the_trials_that_fall_behind(cluster, tmp_path):
    epochs = 4
    tuner = tune.Tuner(
        trainable,
        # run one at a time, the good learning rate first: it sets each rung's bar
        param_space={"lr": tune.grid_search([0.5, 0.0, 0.0001]), "epochs": epochs},
        tune_config=tune.TuneConfig(
            scheduler=ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=2),
            metric="val_loss",
            mode="min",
            max_concurrent_trials=1,
        ),
        run_config=tune.RunConfig(name="asha", storage_path=str(tmp_path / "ray")),
    )
    results = tuner.fit()
    assert not results.errors
    iterations = {r.config["lr"]: r.metrics["training_iteration"] for r in results}
    assert iterations[0.5] == epochs  # the best trial ran to the end
    assert iterations[0.0] < epochs and iterations[0.0001] < epochs  # stopped early
    best = results.get_best_result()
    assert best.config["lr"] == 0.5 and best.metrics["epoch"] == epochs - 1
    # what each report carried: the epoch's purestep checkpoint
    state, _ = checkpoint.load(os.path.join(best.checkpoint.path, CHECKPOINT_FILE))
    assert state.progress.epoch == epochs and state.progress.step == 4 * epochs


def _crash_space(marker) -> dict:
    """Two trials, one of which crashes at step 6 (epoch 1's third batch; its last report
    was at the end of epoch 0), the first time only."""
    return {"crash_at": tune.grid_search([None, 6]), "marker": str(marker), "lr": 0.1, "epochs": 3}


def _assert_the_crashed_trial_equals_the_clean_one(results) -> None:
    """Resumed, not restarted (3 iterations in all), and bitwise the uninterrupted trial."""
    assert not results.errors
    by = {r.config["crash_at"]: r for r in results}
    clean, resumed = by[None], by[6]
    assert resumed.metrics["training_iteration"] == clean.metrics["training_iteration"] == 3
    assert resumed.metrics["val_loss"] == clean.metrics["val_loss"]
    expected, got = _params(clean), _params(resumed)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.slow
@pytest.mark.bitwise
@pytest.mark.timeout(240)
def test_a_trial_that_crashed_and_was_retried_ends_bitwise_equal(cluster, tmp_path):
    marker = tmp_path / "crashed"
    tuner = tune.Tuner(
        trainable,
        param_space=_crash_space(marker),
        run_config=tune.RunConfig(
            name="retried",
            storage_path=str(tmp_path / "ray"),
            failure_config=tune.FailureConfig(max_failures=1),
        ),
    )
    results = tuner.fit()
    assert marker.exists()  # it did crash once, and was retried
    _assert_the_crashed_trial_equals_the_clean_one(results)


@pytest.mark.slow
@pytest.mark.bitwise
@pytest.mark.timeout(240)
def test_an_errored_trial_resumed_by_tuner_restore_ends_bitwise_equal(cluster, tmp_path):
    """No retries: the crashed trial ends the experiment in error; ``Tuner.restore(...,
    resume_errored=True)`` resumes it from its last reported checkpoint, not from scratch."""
    marker = tmp_path / "crashed"
    storage = tmp_path / "ray"
    tuner = tune.Tuner(
        trainable,
        param_space=_crash_space(marker),
        run_config=tune.RunConfig(name="restored", storage_path=str(storage)),
    )
    first = tuner.fit()
    assert len(first.errors) == 1 and marker.exists()
    restored = tune.Tuner.restore(str(storage / "restored"), trainable, resume_errored=True)
    _assert_the_crashed_trial_equals_the_clean_one(restored.fit())


# ---------------------------------------------------------------------- misuse (no cluster)


def _quick_fit(callbacks) -> None:
    Trainer(
        max_epochs=1,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    ).fit(nn.Linear(4, 3), _loss, optim.sgd(0.1), DataLoader(_data(8, 0), batch_size=4))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_reporter_without_its_save_callback_fails_saying_what_to_pass(cluster, tmp_path):
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": 0.1, "epochs": 1, "reporter_alone": True},
        run_config=tune.RunConfig(name="alone", storage_path=str(tmp_path / "ray")),
    )
    (result,) = tuner.fit()
    assert "report.callbacks()" in str(result.error)


def test_outside_a_tune_trial_the_report_fails_saying_so():
    with pytest.raises(RuntimeError, match="does not run in a Tune trial"):
        _quick_fit(tune_report())
    with pytest.raises(RuntimeError, match="call it inside the function given to ray.tune"):
        tune_ckpt_path()


def test_a_report_event_must_be_known():
    with pytest.raises(ValueError, match="on must be one of"):
        TuneReportCheckpoint(on="step")


def test_a_metric_the_run_has_not_logged_is_named():
    from purestep import engine
    from purestep.loops.events import Context, Stage

    state = engine.init(nn.Linear(4, 3), optim.sgd(0.1), seed=0)
    ctx = Context(stage=Stage.TRAIN, fn="fit", state=state, metrics={"train_loss": 1.5})
    reporter = TuneReportCheckpoint({"loss": "val_loss"})
    with pytest.raises(KeyError, match=r"reports \['val_loss'\] but the run has not logged"):
        reporter.on_event("on_train_epoch_end", ctx)
    picked = TuneReportCheckpoint({"loss": "train_loss"})
    picked.on_event("on_train_epoch_end", ctx)  # noted, reported after the commit point
    assert picked._pending[0].metrics == {"loss": 1.5, "epoch": 0, "step": 0}
