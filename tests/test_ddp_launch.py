"""``hardware.launch`` and failure handling: results, errors, killed and hung ranks, cleanup.

Every launch here is bounded (``max_seconds``) and the tests check that no worker process
outlives it. Run time: about 25-35 s on 2 shared cores (seven launches of ~2.5-5 s, plus a
3 s collective timeout and short grace periods).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from purestep import engine, hardware
from purestep.engine import optim
from tests.helpers import batches, loss_fn, mlp

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids, seconds: float = 5.0) -> list[int]:
    """The pids still alive after up to ``seconds`` (zombies of ours are reaped already)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _record_pid(folder: str, rank: int) -> None:
    with open(os.path.join(folder, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def _pids(folder: str) -> list[int]:
    return [int(open(os.path.join(folder, n)).read()) for n in os.listdir(folder)]


# --------------------------------------------------------------------------- rank functions


def _identity(rank: int, tag: str) -> tuple:
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    return rank, tag, dist.get_world_size(), os.environ["LOCAL_RANK"], t


def _raise_on_one(rank: int) -> str:
    if rank == 1:
        raise ValueError("rank one refuses")
    return "fine"


def _unpicklable(rank: int):
    return lambda: rank


def _train_and_die(rank: int, folder: str) -> None:
    """Rank 1 is SIGKILLed after two steps; rank 0 keeps training."""
    _record_pid(folder, rank)
    strategy = hardware.ddp(timeout=10)
    net, opt = mlp(seed=0), optim.sgd(0.1)
    state = engine.init(net, opt, seed=0, strategy=strategy)
    step = engine.train_step(net, loss_fn, opt, strategy=strategy)
    for i, batch in enumerate(batches(50, seed=rank, size=4)):
        if rank == 1 and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        state, _ = step(state, batch)


def _hang_on_one(rank: int, folder: str) -> None:
    """Rank 1 never reaches the collective; rank 0 must give up after the timeout."""
    _record_pid(folder, rank)
    strategy = hardware.ddp()
    if rank == 1:
        time.sleep(60)
    strategy.all_reduce({"g": torch.ones(3)}, "mean")


_LEFT_OPEN: list = []


def _leave_work_for_exit(rank: int, folder: str) -> str:
    """What a normal exit would finish (the worker ends with ``os._exit``, after doing it):
    an ``atexit`` handler, a thread still running when ``fn`` returns, an idle thread pool
    never shut down (its workers end only through threading's exit hook) and a file left
    open with its data still buffered."""
    import atexit
    import threading
    from concurrent.futures import ThreadPoolExecutor

    def write(name: str) -> None:
        with open(os.path.join(folder, f"{name}{rank}"), "w") as f:
            f.write("done")

    atexit.register(write, "atexit")
    threading.Thread(target=lambda: (time.sleep(0.5), write("thread"))).start()
    pool = ThreadPoolExecutor(1)
    pool.submit(write, "pool").result()
    _LEFT_OPEN.append(pool)
    f = open(os.path.join(folder, f"open{rank}"), "w")  # noqa: SIM115 - left open on purpose
    f.write("done")
    _LEFT_OPEN.append(f)
    return "returned"


def _sleep(rank: int, folder: str) -> None:
    _record_pid(folder, rank)
    time.sleep(60)


# --------------------------------------------------------------------------- tests


def test_results_in_rank_order_with_the_torchrun_environment():
    results = hardware.launch(_identity, 2, "tag", max_seconds=60)
    assert [r[:4] for r in results] == [(0, "tag", 2, "0"), (1, "tag", 2, "1")]
    for r in results:
        assert torch.equal(r[4], torch.full((2,), 3.0))  # the group was ready to use


def test_a_rank_that_returns_still_does_what_exit_does(tmp_path):
    assert hardware.launch(_leave_work_for_exit, 2, str(tmp_path), max_seconds=30) == [
        "returned",
        "returned",
    ]
    names = sorted(os.listdir(tmp_path))
    assert names == [f"{what}{r}" for what in ("atexit", "open", "pool", "thread") for r in (0, 1)]
    for name in names:
        assert (tmp_path / name).read_text() == "done", name


def test_an_exception_names_the_rank_and_carries_its_traceback():
    with pytest.raises(hardware.LaunchError, match=r"rank 1 of 2 failed \(ValueError") as info:
        hardware.launch(_raise_on_one, 2, max_seconds=60)
    err = info.value
    assert err.rank == 1 and list(err.failures) == [1]
    assert err.failures[1] == "ValueError: rank one refuses"
    assert "--- rank 1 traceback ---" in str(err) and "_raise_on_one" in str(err)


def test_an_unpicklable_result_is_a_clear_error():
    with pytest.raises(hardware.LaunchError, match="result of rank 0 .* cannot be pickled"):
        hardware.launch(_unpicklable, 1, max_seconds=60)


def test_a_killed_rank_makes_the_other_fail_fast_with_a_collective_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(hardware.LaunchError) as info:
        hardware.launch(_train_and_die, 2, str(tmp_path), max_seconds=60, grace=20)
    elapsed = time.monotonic() - start
    failures = info.value.failures
    assert failures[1] == "killed by signal SIGKILL"
    # the step's gradient bucket is the collective that finds the peer gone
    assert failures[0].startswith("CollectiveError: rank 0: all_reduce of gradient bucket 0")
    assert "crashed, was killed" in failures[0]
    assert elapsed < 20, elapsed  # rank 0 failed by itself, well within the grace period
    assert _wait_gone(_pids(str(tmp_path))) == []


def test_a_hung_rank_makes_the_other_fail_after_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(hardware.LaunchError, match="rank 0 of 2 failed") as info:
        hardware.launch(_hang_on_one, 2, str(tmp_path), timeout=3, max_seconds=60, grace=1)
    elapsed = time.monotonic() - start
    failures = info.value.failures
    assert failures[0].startswith("CollectiveError: rank 0: all_reduce"), failures
    assert "Timed out" in failures[0] and "(3 s)" in failures[0]
    assert failures[1] == "still running 1 s after another rank failed (terminated)"
    assert 3 <= elapsed < 20, elapsed
    assert _wait_gone(_pids(str(tmp_path))) == []


def test_max_seconds_kills_every_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(hardware.LaunchTimeout, match="ran past max_seconds=4") as info:
        hardware.launch(_sleep, 2, str(tmp_path), max_seconds=4)
    assert time.monotonic() - start < 15
    assert set(info.value.failures) == {0, 1}
    assert isinstance(info.value, TimeoutError)
    assert _wait_gone(_pids(str(tmp_path))) == []


def test_workers_die_with_the_launching_process(tmp_path):
    """SIGKILL the process that called launch: the kernel takes its workers down too."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from purestep import hardware
        from tests.test_ddp_launch import _sleep
        hardware.launch(_sleep, 2, {str(tmp_path)!r})
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        end = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < end:
            time.sleep(0.1)
        pids = _pids(str(tmp_path))
        assert len(pids) == 2
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone(pids, 10) == []


def test_an_unpicklable_function_is_a_clear_error():
    with pytest.raises(TypeError, match="fn and args must be picklable"):
        hardware.launch(lambda rank: rank, 2, max_seconds=30)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fn": 3, "nprocs": 2}, TypeError, "fn must be callable"),
        ({"nprocs": 0}, ValueError, "nprocs must be an int >= 1"),
        ({"nprocs": True}, ValueError, "nprocs must be an int >= 1"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"max_seconds": -1}, ValueError, "max_seconds must be a positive number"),
        ({"grace": -1}, ValueError, "grace must be a positive number"),
        ({"threads": 0}, ValueError, "threads must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kwargs, error, match):
    kwargs = {"fn": _sleep, "nprocs": 2, **kwargs}
    with pytest.raises(error, match=match):
        hardware.launch(kwargs.pop("fn"), kwargs.pop("nprocs"), **kwargs)
