"""purestep inside Ray Train, on a real local Ray cluster (2 CPUs, 2 workers, gloo, loopback).

One cluster serves the whole file. Checked: ``Trainer(strategy="ddp")`` and
``hardware.ddp()`` adopt the process group Ray formed (no second rendezvous; rank, local
rank and world size are Ray's; the rendezvous address is the loopback one); every rank
reports at each validation and Ray keeps rank 0's purestep checkpoints; with
``FailureConfig(max_failures=1)``, a worker killed mid-epoch makes Ray restart the group,
the run resumes from the last reported checkpoint and ends bitwise equal to an
uninterrupted run; the example runs against the cluster; used outside a Ray Train worker,
or with a Trainer that is not data-parallel, the report fails saying what is wrong.
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
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
pytest.importorskip("ray.train.torch")

from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402

from purestep.engine import checkpoint, optim  # noqa: E402
from purestep.loops import Trainer  # noqa: E402
from purestep.loops.integrations.ray_train import (  # noqa: E402
    CHECKPOINT_FILE,
    RayTrainReport,
    ray_ckpt_path,
    ray_train_report,
)
from purestep.loops.profiling import Monitor  # noqa: E402
from tests.ray_cluster import local_cluster  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ray_train.py")

#: What every process of the cluster (and the workers it starts) runs with: no usage
#: reports, gloo on the loopback interface, a single-machine cluster on 127.0.0.1.
CLUSTER_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # how often Ray Train looks at its workers (default 2 s): a dead one is seen sooner
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}

# The workers get this module's functions by value (they cannot import a test module).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster(cores_to_ourselves):
    """A local Ray cluster for this file (torn down at its end, its processes with it)."""
    with local_cluster(ray, CLUSTER_ENV) as info:
        yield info


# ---------------------------------------------------------------------- the run


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


class KillOnce(Monitor):
    """Kills this worker (SIGKILL: no clean-up, no goodbye) at a global step, on rank
    ``rank`` and only the first time (a marker file remembers it)."""

    events = frozenset({"on_train_batch_start"})

    def __init__(self, step: int, rank: int, marker: str) -> None:
        self.step, self.rank, self.marker = step, rank, marker

    def on_event(self, event, ctx):
        here = ctx.rank == self.rank and ctx.progress.step == self.step
        if here and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def _facts(folder: str) -> None:
    """What this worker sees of the process group Ray formed, written for the test."""
    import torch.distributed as dist

    from purestep import hardware

    context = ray.train.get_context()
    before = dist.group.WORLD
    strategy = hardware.ddp()
    facts = {
        "ray": [context.get_world_rank(), context.get_local_rank(), context.get_world_size()],
        "ddp": [strategy.rank, strategy.local_rank, strategy.world_size],
        "same_group": dist.group.WORLD is before and dist.is_initialized(),
        "purestep_owns_it": strategy._owns_group,
        "master_addr": os.environ.get("MASTER_ADDR"),
        "backend": strategy.backend,
    }
    strategy.close()
    made = Trainer(strategy="ddp", logger=False).strategy  # the Trainer's own ddp()
    facts["trainer"] = [made.rank, made.local_rank, made.world_size, made._owns_group]
    facts["still_formed"] = dist.is_initialized()  # closing an adopted group leaves it be
    try:  # a Trainer that is not data-parallel, reporting to Ray's 2 workers
        _fit(strategy="auto", root=os.path.join(folder, "not_ddp"), max_epochs=1)
    except RuntimeError as err:
        facts["not_ddp"] = str(err)
    with open(os.path.join(folder, f"facts{context.get_world_rank()}.json"), "w") as f:
        json.dump(facts, f)


def train_fn(config: dict) -> None:
    """One worker's run: a data-parallel purestep fit reporting each validation to Ray."""
    if config.get("facts"):
        _facts(config["facts"])
    callbacks = []
    if config.get("kill_at") is not None:
        callbacks.append(KillOnce(config["kill_at"], 1, config["marker"]))
    _fit(strategy="ddp", root=config["root"], max_epochs=2, callbacks=callbacks)


def _fit(strategy: str, root: str, max_epochs: int, callbacks=()) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    trainer = Trainer(
        strategy=strategy,
        max_epochs=max_epochs,
        val_check_interval=2,
        default_root_dir=root,
        callbacks=[*ray_train_report(on="validation"), *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        logger=False,
    )
    train = DataLoader(_data(32, 0), batch_size=4, shuffle=True)  # 4 batches per rank
    val = DataLoader(_data(8, 1), batch_size=4)
    trainer.fit(
        model,
        _loss,
        optim.sgd(0.1, momentum=0.9),
        train,
        val,
        seed=3,
        ckpt_path=ray_ckpt_path(),
    )


def _run(tmp_path, name: str, max_failures: int = 0, **config):
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"root": str(tmp_path / name), **config},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo", timeout_s=60),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path / "ray_storage"),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def _final_params(result) -> dict[str, torch.Tensor]:
    state, _ = checkpoint.load(os.path.join(result.checkpoint.path, CHECKPOINT_FILE))
    return state.params


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return _run(tmp, "uninterrupted", facts=str(tmp)), tmp


pytestmark = [pytest.mark.xdist_group("processes")]


def on_the_cluster(test):
    """The marks of a test that runs on the cluster: slow, and bounded in time."""
    return pytest.mark.slow(pytest.mark.timeout(240)(test))


@on_the_cluster
def test_trainer_adopts_the_process_group_ray_formed(uninterrupted):
    result, folder = uninterrupted
    for rank in (0, 1):
        facts = json.loads((folder / f"facts{rank}.json").read_text())
        assert facts["ddp"] == facts["ray"] == [rank, rank, 2]
        assert facts["same_group"] and not facts["purestep_owns_it"]
        assert facts["trainer"] == [rank, rank, 2, False]
        assert facts["master_addr"] == "127.0.0.1" and facts["backend"] == "gloo"
        assert facts["still_formed"]
        assert f"this is rank {rank}, but the Trainer runs as rank 0 of 1" in facts["not_ddp"]
        assert "give the Trainer strategy='ddp'" in facts["not_ddp"]
    # 2 epochs of 4 steps, validated every 2 batches: 4 reports, the last at step 8
    assert result.metrics["step"] == 8 and result.metrics["epoch"] == 1
    assert {"val_loss", "train_loss"} <= result.metrics.keys()
    reports = result.metrics_dataframe
    assert list(reports["step"]) == [2, 4, 6, 8]
    # Ray keeps rank 0's checkpoint of each report; the last one is the final state
    state, _ = checkpoint.load(os.path.join(result.checkpoint.path, CHECKPOINT_FILE))
    assert state.progress.step == 8 and state.progress.epoch == 2
    # the files written for the reports were deleted once Ray had copied them
    assert not (folder / "uninterrupted" / "ray_report").exists()
    assert (folder / "uninterrupted").is_dir()


@on_the_cluster
@pytest.mark.bitwise
def test_a_killed_worker_is_restarted_and_the_run_ends_bitwise_equal(uninterrupted, tmp_path):
    expected = _final_params(uninterrupted[0])
    marker = tmp_path / "killed"
    # step 7: epoch 1's fourth batch; the last report was at step 6 (epoch 1, mid-epoch)
    result = _run(tmp_path, "killed", max_failures=1, kill_at=7, marker=str(marker))
    assert marker.exists()  # the worker did die once
    # the restarted group resumed after the last report (step 6), not from the start
    assert list(result.metrics_dataframe["step"]) == [2, 4, 6, 8]
    got = _final_params(result)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@on_the_cluster
def test_the_example_trains_on_the_cluster_it_finds(cluster, tmp_path, capsys):
    main = runpy.run_path(EXAMPLE)["main"]
    folders = ["--storage-path", str(tmp_path / "ray"), "--root", str(tmp_path / "runs")]
    loss = main(["--epochs", "2", "--samples", "256", *folders])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"val_loss={loss:.4f}"
    acc = float(lines[-2].removeprefix("val_acc="))
    assert acc > 0.6  # 4 classes: chance is 0.25


# ---------------------------------------------------------------------- misuse (no cluster)


def _quick_fit(callbacks) -> None:
    Trainer(
        max_epochs=1,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    ).fit(nn.Linear(6, 3), _loss, optim.sgd(0.1), DataLoader(_data(8, 0), batch_size=4))


@pytest.mark.parametrize("on", ["epoch", "validation"])
def test_outside_a_ray_train_worker_the_report_fails_saying_so(on):
    with pytest.raises(RuntimeError, match="does not run in a Ray Train worker"):
        _quick_fit(ray_train_report(on=on))
    with pytest.raises(RuntimeError, match=r"ray_ckpt_path\(\) runs in a Ray Train worker"):
        ray_ckpt_path()


def test_a_ray_checkpoint_without_a_purestep_file_is_refused(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"")
    found = ray.train.Checkpoint.from_directory(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="holds no purestep checkpoint file"):
        ray_ckpt_path(found)
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"")
    assert ray_ckpt_path(found) == str(tmp_path / CHECKPOINT_FILE)


def test_a_checkpoint_on_another_filesystem_is_copied_to_a_local_folder(tmp_path):
    import pyarrow.fs

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / CHECKPOINT_FILE).write_bytes(b"state")
    remote = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())
    got = ray_ckpt_path(ray.train.Checkpoint("c", filesystem=remote))
    assert not got.startswith(str(tmp_path)) and pathlib.Path(got).read_bytes() == b"state"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="on must be one of"):
        RayTrainReport(on="batch")
