"""``prepare_data`` runs once per node (local rank 0) or once overall (global rank 0), and no
rank's ``setup`` starts before it finished.

Single-process tests check the calls and the rank rule on a stand-in trainer; one launch of
2 gloo ranks checks the real thing on one node and on a simulated 2-node layout (each rank
``LOCAL_RANK=0`` with its own ``NODE_RANK``). Every call appends a line to a file; rank 0's
``prepare_data`` sleeps before writing a marker that every ``setup`` asserts.
"""

from __future__ import annotations

import os
import time
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from purestep import hardware
from purestep.engine import optim
from purestep.loops import DataModule, Task, Trainer
from purestep.loops.trainer_data import prepare_data

pytestmark = pytest.mark.timeout(180)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (16,), generator=g)), batch_size=4)


class Recording(DataModule):
    """Appends ``<tag>:prepare:<global rank>`` to ``<folder>/calls.txt``; rank 0 sleeps
    first, then writes ``<folder>/<tag>.ready``, which ``setup`` asserts."""

    def __init__(self, folder: str, tag: str, per_node: bool | None = None):
        self.folder, self.tag = folder, tag
        if per_node is not None:
            self.prepare_data_per_node = per_node

    def prepare_data(self) -> None:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            time.sleep(0.3)  # a slow download: the other rank must wait for it
        with open(os.path.join(self.folder, "calls.txt"), "a") as f:
            f.write(f"{self.tag}:prepare:{rank}\n")
        with open(os.path.join(self.folder, f"{self.tag}.ready"), "w") as f:
            f.write("ready")

    def setup(self, stage: str) -> None:
        ready = os.path.join(self.folder, f"{self.tag}.ready")
        assert os.path.exists(ready), f"setup({stage!r}) started before prepare_data finished"

    def train_dataloader(self):
        return _loader()

    test_dataloader = predict_dataloader = val_dataloader = train_dataloader


class Model(Task):
    def __init__(self, folder: str | None = None, tag: str | None = None):
        super().__init__()
        self.folder, self.tag = folder, tag

    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    def configure_optimizers(self):
        return optim.sgd(0.1)

    def training_step(self, apply, batch):
        x, y = batch
        return F.cross_entropy(apply(x), y)

    validation_step = test_step = training_step


class PreparingModel(Model):
    """A task with its own ``prepare_data`` (Lightning's LightningModule hook)."""

    def prepare_data(self) -> None:
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(self.folder, "calls.txt"), "a") as f:
            f.write(f"{self.tag}:task:{rank}\n")


def _trainer(**flags) -> Trainer:
    flags.setdefault("max_epochs", 1)
    return Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **flags,
    )


def _calls(folder) -> list[str]:
    path = os.path.join(folder, "calls.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return sorted(f.read().split())


# --------------------------------------------------------------------------- one process


def test_every_entry_point_prepares_once_before_setup(tmp_path):
    dm, task = Recording(str(tmp_path), "one"), Model()
    t = _trainer()
    t.fit(task, datamodule=dm)
    t.validate(task, datamodule=dm, verbose=False)
    t.test(task, datamodule=dm, verbose=False)
    t.predict(task, datamodule=dm)
    assert _calls(tmp_path) == ["one:prepare:0"] * 4


def test_a_task_with_prepare_data_prepares_too(tmp_path):
    task = PreparingModel(str(tmp_path), "task")
    t = _trainer()
    t.fit(task, train_dataloaders=_loader())
    t.test(task, dataloaders=_loader(), verbose=False)
    assert _calls(tmp_path) == ["task:task:0"] * 2


def test_bad_prepare_data_per_node_values():
    with pytest.raises(TypeError, match="prepare_data_per_node must be a bool"):
        Trainer(prepare_data_per_node="no", logger=False)
    assert Trainer(logger=False).prepare_data_per_node is True
    dm = Recording("unused", "bad", per_node="yes")
    with pytest.raises(TypeError, match=r"Recording.prepare_data_per_node must be True or False"):
        prepare_data(_stand_in(), None, dm)


class _Counting(DataModule):
    def __init__(self, per_node=None):
        self.calls = 0
        if per_node is not None:
            self.prepare_data_per_node = per_node

    def prepare_data(self):
        self.calls += 1


def _stand_in(local=0, rank=0, per_node=True, world_size=1, gathered=None):
    strategy = types.SimpleNamespace(all_gather_object=lambda obj: gathered or [obj])
    return types.SimpleNamespace(
        local_rank=local,
        global_rank=rank,
        world_size=world_size,
        prepare_data_per_node=per_node,
        strategy=strategy,
    )


@pytest.mark.parametrize(
    ("local", "rank", "flag", "attribute", "prepares"),
    [
        (0, 0, True, None, True),
        (0, 2, True, None, True),  # local rank 0 of the second node
        (1, 1, True, None, False),
        (0, 2, False, None, False),  # once overall: global rank 0 only
        (0, 0, False, None, True),
        (0, 2, True, False, False),  # the DataModule's attribute wins over the flag
        (0, 2, False, True, True),
    ],
)
def test_which_ranks_prepare(local, rank, flag, attribute, prepares):
    dm = _Counting(attribute)
    prepare_data(_stand_in(local, rank, flag), None, dm)
    assert dm.calls == int(prepares)


def test_a_failure_on_one_rank_is_raised_on_the_others():
    dm = _Counting()
    stand_in = _stand_in(1, 1, world_size=2, gathered=["OSError: no network", None])
    with pytest.raises(RuntimeError, match="prepare_data failed on rank 0: OSError: no network"):
        prepare_data(stand_in, None, dm)


# --------------------------------------------------------------------------- two ranks


def _run(folder: str, strategy, tag: str, *, fit: bool = True, task=None, **flags) -> Trainer:
    dm = Recording(folder, tag, flags.pop("per_node", None))
    t = _trainer(strategy=strategy, limit_train_batches=2, **flags)
    if fit:
        t.fit(task or Model(), datamodule=dm)
    else:
        t.test(task or Model(), datamodule=dm, verbose=False)
    return t


def _ranks(t: Trainer) -> tuple[int, int, int, int]:
    return t.world_size, t.global_rank, t.local_rank, t.node_rank


def _rank_main(rank: int, folder: str) -> dict:
    one_node = hardware.ddp()
    first = _ranks(_run(folder, one_node, "node"))
    _run(folder, one_node, "node-once", fit=False, prepare_data_per_node=False)
    # two nodes of one process each: every rank is its node's local rank 0
    os.environ.update(LOCAL_RANK="0", NODE_RANK=str(rank))
    two_nodes = hardware.ddp()
    second = _run(folder, two_nodes, "nodes", task=PreparingModel(folder, "nodes"))
    _run(folder, two_nodes, "nodes-once", prepare_data_per_node=False)
    _run(folder, two_nodes, "nodes-attr", fit=False, per_node=False)
    failure = None

    class Failing(Recording):
        def prepare_data(self):
            if rank == 0:  # rank 1 prepares too (its own node) and succeeds
                raise OSError("no network")

    try:
        _trainer(strategy=two_nodes).fit(Model(), datamodule=Failing(folder, "fail"))
    except Exception as err:
        failure = f"{type(err).__name__}: {err}"
    return {"one_node": first, "two_nodes": _ranks(second), "failure": failure}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("prepare"))
    return hardware.launch(_rank_main, 2, folder, max_seconds=150, timeout=30), folder


def test_one_node_prepares_on_local_rank_zero_only(launched):
    _, folder = launched
    calls = _calls(folder)
    assert [c for c in calls if c.startswith("node:")] == ["node:prepare:0"]
    assert [c for c in calls if c.startswith("node-once:")] == ["node-once:prepare:0"]


def test_two_nodes_prepare_once_per_node_unless_told_once_overall(launched):
    _, folder = launched
    calls = _calls(folder)
    assert [c for c in calls if c.startswith("nodes:")] == [
        "nodes:prepare:0",
        "nodes:prepare:1",
        "nodes:task:0",
        "nodes:task:1",
    ]
    assert [c for c in calls if c.startswith("nodes-once:")] == ["nodes-once:prepare:0"]
    # DataModule.prepare_data_per_node=False wins over the Trainer's default True
    assert [c for c in calls if c.startswith("nodes-attr:")] == ["nodes-attr:prepare:0"]


def test_ranks_as_the_trainer_reports_them(launched):
    results, _ = launched
    assert [r["one_node"] for r in results] == [(2, 0, 0, 0), (2, 1, 1, 0)]
    assert [r["two_nodes"] for r in results] == [(2, 0, 0, 0), (2, 1, 0, 1)]


def test_a_failed_preparation_stops_every_rank(launched):
    results, _ = launched
    assert results[0]["failure"] == "OSError: no network"
    expected = "RuntimeError: prepare_data failed on rank 0: OSError: no network"
    assert results[1]["failure"] == expected
