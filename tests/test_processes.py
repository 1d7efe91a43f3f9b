"""Processes a run starts end with it: DataLoader workers, process groups, set-up timeouts.

Every test runs its processes in a new session and kills whatever is left of it in a
``finally``, so a failing test leaves nothing behind. Run time: about 30 s on 2 shared
cores (a torchrun job, a 2-rank job, two killed data loaders, two 5 s set-up timeouts).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_name, None)

# A small Trainer under strategy="ddp" with every effect off, for the rank processes below.
_DDP_FLAGS = {
    "strategy": "ddp",
    "max_epochs": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
    """A Python process in its own session (so ``_end`` can kill all it started)."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _end(procs: list[subprocess.Popen], pids: list[int] = ()) -> None:
    """SIGKILL every process of the sessions of ``procs`` and the given pids; reap."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _wait(procs: list[subprocess.Popen], seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    for p in procs:
        p.wait(max(0.1, end - time.monotonic()))  # raises TimeoutExpired: the test fails
    return [p.returncode for p in procs]


def _call(name: str, *args: str) -> list[str]:
    """Arguments for a Python process that runs ``name(*args)`` of this module."""
    return [
        "-c",
        f"import sys; from tests.test_processes import {name}; {name}(*sys.argv[1:])",
        *args,
    ]


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


# --------------------------------------------------------------------------- 13: workers


class Slow(Dataset):
    """Items that take minutes: a worker is inside ``__getitem__`` when its parent dies."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(300)
        return torch.tensor(i)


class RecordPid:
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        with open(os.path.join(self.folder, f"{os.getpid()}.pid"), "w") as f:
            f.write(str(worker_id))


def _iterate_slow(folder: str, context: str) -> None:
    """The killed process: iterate a source whose two workers block in ``__getitem__``."""
    from purestep.loops import data

    batches = data.source(
        Slow(),
        batch_size=1,
        num_workers=2,
        worker_init_fn=RecordPid(folder),
        multiprocessing_context=context,
    )
    for _ in batches.iterate(0):
        pass


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_data_workers_die_with_a_killed_parent(tmp_path, context):
    folder = tmp_path / "pids"
    folder.mkdir()
    main = _start(_call("_iterate_slow", str(folder), context), ENV, str(tmp_path / "log"))
    pids: list[int] = []
    try:
        end = time.monotonic() + 120
        while len(os.listdir(folder)) < 2 and time.monotonic() < end and main.poll() is None:
            time.sleep(0.05)
        pids = [int(name.split(".")[0]) for name in os.listdir(folder)]
        assert len(pids) == 2, _read(str(tmp_path / "log"))
        time.sleep(0.5)  # both workers are inside __getitem__ now
        main.kill()
        main.wait(30)
        assert _wait_gone(pids, 5) == [], "DataLoader workers outlived their killed parent"
    finally:
        _end([main], pids)


def test_die_with_parent_arms_the_kernel_and_exits_if_the_parent_is_gone():
    check = textwrap.dedent(
        """
        import ctypes, os, sys
        from purestep.hardware.pdeathsig import die_with_parent
        die_with_parent(int(sys.argv[1]))
        sig = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        print(sig.value)
        """
    )
    alive = subprocess.run(
        [sys.executable, "-c", check, str(os.getpid())],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alive.returncode == 0 and alive.stdout.strip() == str(int(signal.SIGKILL)), alive
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = subprocess.run(
        [sys.executable, "-c", check, str(gone.pid)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dead.returncode == 1 and dead.stdout == "", dead  # the parent was already gone


# --------------------------------------------------------------------------- 14: teardown


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def _trainer_job(report: str, fail_rank: str) -> None:
    """One rank: ``Trainer(strategy="ddp")``'s fit then test; whether a group is alive after
    each goes to ``report``. ``fail_rank``: the loss raises on that rank ("-1": none)."""
    from purestep.engine import optim
    from purestep.loops import Trainer
    from tests.helpers import mlp

    flags = dict(_DDP_FLAGS)
    trainer = Trainer(**flags)
    rank, seen = trainer.strategy.rank, {"created": dist.is_initialized()}

    def loss(apply, batch):
        if rank == int(fail_rank):
            raise ValueError(f"the loss fails on rank {rank}")
        x, y = batch
        return F.cross_entropy(apply(x), y)

    def write() -> None:
        with open(f"{report}.{rank}", "w") as f:
            json.dump(seen, f)

    train, test = DataLoader(_data(32, 0), batch_size=4), DataLoader(_data(16, 1), batch_size=4)
    try:
        trainer.fit(mlp(seed=0), loss, optim.sgd(0.1), train, seed=0)
        seen["after_fit"] = dist.is_initialized()
        seen["test"] = trainer.test(dataloaders=test)
        seen["after_test"] = dist.is_initialized()
        # a second Trainer, built between runs, forms the group again (new store keys)
        # and destroys it too
        seen["again"] = Trainer(**flags).test(mlp(seed=0), test, fn=loss)
        seen["after_again"] = dist.is_initialized()
        # between runs a collective forms the released group again; close() ends it
        seen["sum"] = float(trainer.strategy.all_reduce(torch.ones(1), "sum"))
        trainer.strategy.close()
        seen["after_close"] = dist.is_initialized()
    except Exception as err:
        seen["error"] = f"{type(err).__name__}: {err}"
        seen["after_error"] = dist.is_initialized()
        write()
        raise
    write()


def _rank_env(rank: int, port: int) -> dict[str, str]:
    return {
        **ENV,
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _reports(report: str) -> list[dict]:
    return [json.loads(_read(f"{report}.{r}")) for r in range(2)]


def test_torchrun_fit_then_test_exits_zero_with_the_group_destroyed(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(_call("_trainer_job")[1].replace("; ", "\n") + "\n")
    report, log = str(tmp_path / "report"), str(tmp_path / "log")
    args = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    args += [f"--master_port={_free_port()}", str(job), report, "-1"]
    run = _start(args, ENV, log)
    try:
        assert _wait([run], 180) == [0], _read(log)
    finally:
        _end([run])
    assert "terminate called" not in _read(log)
    for seen in _reports(report):
        assert seen["created"] is True  # the Trainer's strategy made the group
        assert seen["after_fit"] is False and seen["after_test"] is False, seen
        assert seen["test"] and "test_loss" in seen["test"][0], seen
        assert seen["again"] and seen["after_again"] is False, seen
        assert seen["sum"] == 2.0 and seen["after_close"] is False, seen


def test_a_failing_rank_tears_down_and_both_exit_non_zero(tmp_path):
    report, port = str(tmp_path / "report"), _free_port()
    procs = [
        _start(_call("_trainer_job", report, "1"), _rank_env(r, port), str(tmp_path / f"log{r}"))
        for r in range(2)
    ]
    try:
        codes = _wait(procs, 150)
    finally:
        _end(procs)
    logs = [_read(str(tmp_path / f"log{r}")) for r in range(2)]
    assert codes[0] != 0 and codes[1] != 0, logs
    assert not any("terminate called" in log for log in logs), logs
    first, second = _reports(report)
    assert second["error"] == "ValueError: the loss fails on rank 1", second
    assert "error" in first, first  # the peer's collective failed
    assert first["after_error"] is False and second["after_error"] is False


def _two_trainers_job(report: str, order: str) -> None:
    """One rank: two ``Trainer(strategy="ddp")`` built while the first's group is alive (the
    second holds it too); ``order`` "ab": the first fits, then the second tests; "ba": the
    other way round. Then a third built after the release, and a ``hardware.ddp()`` value
    that keeps the group alive across a Trainer run until its ``close()``."""
    from purestep import hardware
    from purestep.engine import optim
    from purestep.loops import Trainer
    from tests.helpers import mlp

    flags = dict(_DDP_FLAGS)

    def loss(apply, batch):
        x, y = batch
        return F.cross_entropy(apply(x), y)

    a = Trainer(**flags)
    b = Trainer(**flags)
    rank, seen = a.strategy.rank, {"b_holds": b.strategy._owns_group}
    first, second = (a, b) if order == "ab" else (b, a)
    train, test = DataLoader(_data(32, 0), batch_size=4), DataLoader(_data(16, 1), batch_size=4)
    try:
        first.fit(mlp(seed=0), loss, optim.sgd(0.1), train, seed=0)
        seen["after_fit"] = dist.is_initialized()
        seen["test"] = second.test(mlp(seed=0), test, fn=loss)
        seen["after_test"] = dist.is_initialized()
        seen["first_test"] = first.test(dataloaders=test)
        second.fit(mlp(seed=0), loss, optim.sgd(0.1), train, seed=0)
        seen["after_second_fit"] = dist.is_initialized()
        third = Trainer(**flags)  # built while the group is released: forms and holds it
        seen["third"] = third.test(mlp(seed=0), test, fn=loss)
        seen["first_again"] = first.test(mlp(seed=0), test, fn=loss)
        seen["after_third"] = dist.is_initialized()
        kept = hardware.ddp()  # not per-run: the group lives until its close()
        first.test(mlp(seed=0), test, fn=loss)
        seen["kept"] = dist.is_initialized()
        kept.close()
        seen["after_close"] = dist.is_initialized()
    except Exception as err:
        seen["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        with open(f"{report}.{rank}", "w") as f:
            json.dump(seen, f)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_two_ddp_trainers_work_in_either_order(tmp_path, order):
    report, port = str(tmp_path / "report"), _free_port()
    args = _call("_two_trainers_job", report, order)
    procs = [_start(args, _rank_env(r, port), str(tmp_path / f"log{r}")) for r in range(2)]
    try:
        codes = _wait(procs, 150)
    finally:
        _end(procs)
    logs = [_read(str(tmp_path / f"log{r}")) for r in range(2)]
    assert codes == [0, 0], logs
    assert not any("terminate called" in log for log in logs), logs
    for seen in _reports(report):
        assert seen["b_holds"] is True, seen  # the second holds the first's group
        assert seen["test"] and "test_loss" in seen["test"][0], seen
        assert seen["first_test"] and seen["third"] and seen["first_again"], seen
        for key in ("after_fit", "after_test", "after_second_fit", "after_third"):
            assert seen[key] is False, (key, seen)  # destroyed at the end of every run
        assert seen["kept"] is True and seen["after_close"] is False, seen


# --------------------------------------------------------------------------- 15: set-up


def _setup_job(timeout: str) -> None:
    """Form the group with ``hardware.ddp(timeout=...)``; print how long the failure took."""
    from purestep import hardware

    print("start", flush=True)
    start = time.monotonic()
    try:
        hardware.ddp(timeout=float(timeout))
    except RuntimeError as err:
        print(json.dumps({"seconds": time.monotonic() - start, "error": str(err)}), flush=True)
        raise SystemExit(3) from None
    raise SystemExit("the group formed without the other rank")


def _setup_result(log: str) -> dict:
    lines = [line for line in _read(log).splitlines() if line.startswith("{")]
    assert lines, _read(log)
    return json.loads(lines[-1])


TIMEOUT = 5.0
MARGIN = 1.5  # the stated timeout, plus this, bounds the failure


def test_setup_waits_no_longer_than_the_timeout_for_a_rank_that_dies_in_it(tmp_path):
    """Rank 1 reaches rank 0's store after 3.5 s and dies before checking in."""
    port, log = _free_port(), str(tmp_path / "log")
    rank0 = _start(_call("_setup_job", str(TIMEOUT)), _rank_env(0, port), log)
    try:
        end = time.monotonic() + 120
        while "start" not in _read(log) and time.monotonic() < end and rank0.poll() is None:
            time.sleep(0.02)
        time.sleep(3.5)
        client = dist.TCPStore(
            "127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=5)
        )
        del client  # rank 1 is gone
        assert _wait([rank0], 60) == [3], _read(log)
    finally:
        _end([rank0])
    result = _setup_result(log)
    assert TIMEOUT - 0.5 <= result["seconds"] < TIMEOUT + MARGIN, result
    assert "rank(s) 1 of 2 did not join" in result["error"], result
    assert f"within {TIMEOUT:g} s" in result["error"], result


def test_setup_without_rank_zero_fails_within_the_timeout(tmp_path):
    port, log = _free_port(), str(tmp_path / "log")
    rank1 = _start(_call("_setup_job", str(TIMEOUT)), _rank_env(1, port), log)
    try:
        assert _wait([rank1], 60) == [3], _read(log)
    finally:
        _end([rank1])
    result = _setup_result(log)
    assert TIMEOUT - 0.5 <= result["seconds"] < TIMEOUT + MARGIN, result
    assert "rank 1: could not form the process group of 2 ranks" in result["error"], result
    assert "is it running?" in result["error"] and "rank 0 hosts" in result["error"], result
