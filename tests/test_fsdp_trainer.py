"""``Trainer(strategy="fsdp")`` on 2 gloo ranks: sharded checkpoints at every step, a run
whose rank 1 is SIGKILLed mid-save leaves no committed folder for that step and resumes
(``ckpt_path="last"``) bitwise at the same world size (validation included), and
the same checkpoint resumes on 1 rank with the same global batch (to
``1e-5 * max|ref| + 1e-6``).

The launches are ``fsdp_job``'s shared ones (killed; uninterrupted and resumed, with the
parity and checkpoint runs; resumed on 1 rank), each bounded; a killed launch's survivors
are terminated by ``hardware.launch``.
"""

from __future__ import annotations

import pytest
import torch

from purestep.engine import tree
from tests import fsdp_job

pytestmark = pytest.mark.timeout(600)  # the first test waits for the shared launches


@pytest.fixture(scope="module")
def killed() -> dict:
    """Rank 1 was SIGKILLed in the middle of step 5's sharded save (its shard written)."""
    return fsdp_job.killed_run()


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """Each rank: an uninterrupted fit, and one resumed with ``ckpt_path="last"`` from the
    killed run's folder: its furthest committed checkpoint is step 4; a copy of it without
    its commit marker, named and recorded as step 9, is passed over."""
    return [r["trainer"] for r in fsdp_job.two_rank_run()[0]]


@pytest.fixture(scope="module")
def uninterrupted(runs) -> list[dict]:
    return [r["full"] for r in runs]


def test_a_rank_dying_mid_save_fails_the_run_in_bounded_time(killed):
    assert killed["error"] is not None and "rank 1" in killed["error"]
    assert killed["seconds"] < 60, killed["error"][-2000:]  # the launch's bound is 120 s


def test_a_rank_dying_mid_save_leaves_nothing_that_looks_committed(killed):
    names, done = killed["names"], [f"step={s}.ckpt" for s in range(1, fsdp_job.KILL_AT)]
    assert [n for n in names if n.endswith(".ckpt")] == done
    partial = [n for n in names if n.startswith(f".step={fsdp_job.KILL_AT}.ckpt.tmp-")]
    assert len(partial) == 1, names  # the cut write, hidden, as it was
    assert "__1_0.distcp" in killed["inside"][partial[0]]  # rank 1 had written its shard
    assert killed["committed"] == done


def test_trainer_fsdp_trains_a_sharded_state_and_checkpoints_every_step(uninterrupted):
    r = uninterrupted[0]
    assert r["sharded"] and r["step"] == 8
    assert r["files"] == sorted(f"step={s}.ckpt" for s in range(1, 9))


def test_evicted_sharded_folders_are_deleted_and_nothing_else(uninterrupted):
    """``save_top_k=1``: each save deletes the folder before it; a foreign DCP folder (no
    purestep manifest) and a file in the same dirpath stay."""
    assert uninterrupted[0]["top"] == ["foreign.ckpt", "notes.txt", "step=8.ckpt"]


@pytest.mark.bitwise
def test_validate_best_reads_the_sharded_folder(uninterrupted):
    for r in uninterrupted:  # best (no monitor): the last saved, step 8: the fit's weights
        assert r["best_val_loss"] == r["val_loss"]


def test_the_resumed_run_removes_the_dead_writer_s_partial_folder(runs, killed):
    assert any(n.startswith(".") for n in killed["names"])
    assert [r["resumed"]["hidden"] for r in runs] == [[], []]


def test_last_resumes_from_the_furthest_committed_folder(runs):
    assert [r["resumed"]["first"] for r in runs] == [4, 4]
    assert [r["full"]["first"] for r in runs] == [0, 0]


@pytest.mark.bitwise
def test_a_killed_fsdp_run_resumes_bitwise(runs):
    for rank in range(2):
        resumed, full = runs[rank]["resumed"], runs[rank]["full"]
        tree.assert_trees_equal(resumed["params"], full["params"])
        tree.assert_trees_equal(resumed["opt_state"], full["opt_state"])
        assert resumed["step"] == 8
        assert resumed["val_loss"] == full["val_loss"] == runs[0]["full"]["val_loss"]


def test_the_checkpoint_resumes_on_one_rank_with_the_same_global_batch(uninterrupted):
    one = [fsdp_job.one_rank_run()["trainer"]]
    assert one[0]["step"] == 8
    want = uninterrupted[0]["params"]
    for name, got in one[0]["params"].items():
        bound = 1e-5 * float(want[name].abs().max()) + 1e-6
        assert float((got - want[name]).abs().max()) <= bound, name
    assert not torch.equal(one[0]["params"]["0.weight"], fsdp_job.mlp(0)[0].weight)
    assert one[0]["val_loss"] == pytest.approx(uninterrupted[0]["val_loss"], rel=1e-5)


def test_a_plain_checkpoint_file_resumes_under_fsdp(uninterrupted):
    """Written by one process without a strategy, resumed by ``Trainer(strategy="fsdp")``
    (sharded on restore); the same global batches, so within the tolerance above."""
    got = fsdp_job.one_rank_run()["from_plain"]
    assert got["sharded"] and got["first"] == 4 and got["step"] == 8
    want = uninterrupted[0]["params"]
    for name, value in got["params"].items():
        bound = 1e-5 * float(want[name].abs().max()) + 1e-6
        assert float((value - want[name]).abs().max()) <= bound, name
