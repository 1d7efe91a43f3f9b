"""Cluster environments: which launcher started the process, and its variables read right.

Pure and fast: the environments read mappings given to them (never this process's own
variables, except where ``hardware.ddp()`` / the Trainer are checked to use them, in a world
of one rank on 127.0.0.1). SLURM's host list and tasks-per-node notations are checked by
round trips from generated lists.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from purestep import hardware
from purestep.hardware import cluster, slurm
from purestep.hardware.cluster import (
    EnvironmentVariables,
    KubeflowEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from purestep.hardware.flags import from_flags
from purestep.hardware.process_env import ProcessEnv
from purestep.loops import Trainer

pytestmark = pytest.mark.timeout(60)

SRUN = {  # task 3 of 4, two per node, on the second of two nodes
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "4",
    "SLURM_NNODES": "2",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_NODELIST": "node[07-08]",
}
TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "h0",
}


# --------------------------------------------------------------------------- SLURM formats


@st.composite
def host_groups(draw):
    """A SLURM host pattern (``gpu[008-010,3]-ib``) and the hosts it names, in order."""
    prefix = draw(st.text("abcxyz", min_size=1, max_size=4))
    suffix = draw(st.sampled_from(["", "-ib", "x"]))
    ranges, hosts = [], []
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(0, 120))
        stop = start + draw(st.integers(0, 4))
        width = draw(st.integers(1, 4))
        low, high = str(start).zfill(width), str(stop).zfill(width)
        ranges.append(low if stop == start else f"{low}-{high}")
        pad = len(low) if low.startswith("0") else 0
        hosts += [f"{prefix}{str(n).zfill(pad)}{suffix}" for n in range(start, stop + 1)]
    bracketed = draw(st.booleans()) or len(ranges) > 1 or "-" in ranges[0]
    pattern = (
        f"{prefix}[{','.join(ranges)}]{suffix}" if bracketed else f"{prefix}{ranges[0]}{suffix}"
    )
    return pattern, hosts


@given(st.lists(host_groups(), min_size=1, max_size=4))
def test_host_lists_expand_to_their_hosts_in_order(groups):
    nodelist = ",".join(pattern for pattern, _ in groups)
    hosts = [host for _, names in groups for host in names]
    assert slurm.expand_hostlist(nodelist) == hosts
    assert slurm.first_host(nodelist) == hosts[0]


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [  # Lightning's documented forms, and SLURM's own
        ("host0 host1 host3", "host0"),
        ("host0,host1,host3", "host0"),
        ("host[5-9]", "host5"),
        ("node[01-04,07]", "node01"),
        ("rack[2-3]-node[09-10],login", "rack2-node09"),
        ("127.0.0.1,localhost", "127.0.0.1"),
    ],
)
def test_the_first_host_is_rank_zeros(nodelist, first):
    assert slurm.first_host(nodelist) == first


@pytest.mark.parametrize(
    ("nodelist", "match"),
    [
        ("node[01-04", "'\\[' without its '\\]'"),
        ("node01]", "'\\]' without its '\\['"),
        ("node[4-1]", "runs backwards"),
        ("node[a-b]", "'a-b' is not a number or a range"),
        ("", "names no host"),
    ],
)
def test_bad_host_lists_are_refused(nodelist, match):
    with pytest.raises(ValueError, match=match):
        slurm.expand_hostlist(nodelist)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_tasks_per_node_reads_slurms_repeat_notation(counts):
    runs: list[list[int]] = []
    for n in counts:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    text = ",".join(f"{n}(x{k})" if k > 1 else str(n) for n, k in runs)
    assert slurm.tasks_per_node(text) == counts


def test_tasks_per_node_refuses_other_text():
    with pytest.raises(ValueError, match="'2x3' is not a count"):
        slurm.tasks_per_node("2x3")


def test_the_master_port_comes_from_the_job_id_unless_set():
    assert slurm.master_port({"SLURM_JOB_ID": "123456"}) == 3456 + 15000
    assert slurm.master_port({"SLURM_JOB_ID": "7"}) == 7 + 15000
    assert slurm.master_port({}) == slurm.DEFAULT_PORT == 12910
    assert slurm.master_port({"SLURM_JOB_ID": "123456", "MASTER_PORT": "2222"}) == 2222
    with pytest.raises(ValueError, match="MASTER_PORT='x' is not an integer"):
        slurm.master_port({"MASTER_PORT": "x"})


# --------------------------------------------------------------------------- each launcher


def test_slurm_reads_srun_variables():
    env = cluster.process_env(None, SRUN)
    assert env == ProcessEnv(3, 4, 1, 2, "node07", 18456)
    explicit = {**SRUN, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "3000"}  # Lightning's override
    assert cluster.process_env("slurm", explicit) == ProcessEnv(3, 4, 1, 2, "10.1.1.1", 3000)
    per_node = {**SRUN, "SLURM_NTASKS_PER_NODE": "2"}
    del per_node["SLURM_TASKS_PER_NODE"]
    assert cluster.process_env(None, per_node).local_world_size == 2
    one_node = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NNODES": "1"}
    assert cluster.process_env(None, one_node) == ProcessEnv(1, 2, 1, 2, "127.0.0.1", 12910)


def test_uneven_tasks_per_node_give_each_node_its_own_count():
    env = {**SRUN, "SLURM_TASKS_PER_NODE": "3,1", "SLURM_PROCID": "3", "SLURM_LOCALID": "0"}
    assert cluster.process_env(None, env).local_world_size == 1


def test_interactive_slurm_jobs_are_not_detected():
    for name in slurm.INTERACTIVE_JOB_NAMES:
        assert cluster.detect({**SRUN, "SLURM_JOB_NAME": name}) is None
        # chosen explicitly, its variables are still read
        assert cluster.process_env("slurm", {**SRUN, "SLURM_JOB_NAME": name}).rank == 3


def test_torchelastic_reads_torchrun_variables():
    assert isinstance(cluster.detect(TORCHRUN), TorchElasticEnvironment)
    assert cluster.process_env(None, TORCHRUN) == ProcessEnv.from_environ(TORCHRUN)


def test_hardware_launch_variables_are_torchelastics():
    env = ProcessEnv(1, 2, 1, 2, "127.0.0.1", 1234).to_environ()
    assert isinstance(cluster.detect(env), TorchElasticEnvironment)


def test_torchrun_variables_set_by_hand_keep_their_meaning():
    minimal = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    assert isinstance(cluster.detect(minimal), EnvironmentVariables)
    assert cluster.process_env(None, minimal) == ProcessEnv.from_environ(minimal)


def test_kubeflow_pods_run_one_process_each_when_chosen():
    pod = {"KUBERNETES_PORT": "tcp://10.0.0.1:443", "RANK": "2", "WORLD_SIZE": "3"}
    pod |= {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert KubeflowEnvironment().detect(pod)
    # not detected, as in Lightning: the variables read as torchrun's set by hand
    assert isinstance(cluster.detect(pod), EnvironmentVariables)
    assert cluster.process_env("kubeflow", pod) == ProcessEnv(2, 3, 0, 1, "job-master-0", 23456)
    # torchrun inside the pod: torchrun's local ranks
    assert isinstance(cluster.detect({**pod, **TORCHRUN}), TorchElasticEnvironment)


def test_lsf_reads_jsrun_variables_and_the_rank_file(tmp_path):
    rankfile = tmp_path / "ranks"
    rankfile.write_text("batch1\n" + "h1\n" * 2 + "h2\n" * 2)  # the launch node first
    env = {
        "LSB_JOBID": "98765",
        "LSB_DJOB_RANKFILE": str(rankfile),
        "JSM_NAMESPACE_RANK": "3",
        "JSM_NAMESPACE_LOCAL_RANK": "1",
        "JSM_NAMESPACE_SIZE": "4",
    }
    assert isinstance(cluster.detect(env), LSFEnvironment)
    assert cluster.process_env(None, env) == ProcessEnv(3, 4, 1, 2, "h1", 765 + 10000)
    rankfile.write_text("batch1\n")
    with pytest.raises(ValueError, match="lists no compute host after the launch node"):
        cluster.process_env(None, env)
    with pytest.raises(RuntimeError, match="cannot read LSB_DJOB_RANKFILE"):
        cluster.process_env(None, {**env, "LSB_DJOB_RANKFILE": str(tmp_path / "none")})


def test_mpi_reads_open_mpi_and_mpich_variables():
    assert isinstance(cluster.detect(OPEN_MPI), MPIEnvironment)
    assert cluster.process_env(None, OPEN_MPI) == ProcessEnv(2, 4, 0, 2, "h0", 29500)
    mpich = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert cluster.process_env(None, mpich) == ProcessEnv(1, 2, 1, 2, "127.0.0.1", 29500)
    several_hosts = {k: v for k, v in OPEN_MPI.items() if k != "MASTER_ADDR"}
    with pytest.raises(RuntimeError, match="export MASTER_ADDR"):
        cluster.process_env(None, several_hosts)


# --------------------------------------------------------------------------- choosing one


@pytest.mark.parametrize(
    ("environ", "chosen"),
    [
        ({**SRUN, **TORCHRUN}, TorchElasticEnvironment),  # torchrun inside an allocation
        ({**SRUN, **OPEN_MPI}, SLURMEnvironment),  # srun --mpi=... sets both
        ({**SRUN, "MASTER_ADDR": "a", "MASTER_PORT": "1"}, SLURMEnvironment),
        (OPEN_MPI, MPIEnvironment),
        ({}, type(None)),
    ],
)
def test_detection_order(environ, chosen):
    assert isinstance(cluster.detect(environ), chosen)


def test_the_order_is_stated():
    assert cluster.DETECTION_ORDER == ("torchelastic", "env", "slurm", "lsf", "mpi")
    assert set(cluster.CLUSTERS) == {*cluster.DETECTION_ORDER, "kubeflow"}


def test_an_explicit_cluster_overrides_detection():
    both = {**SRUN, **OPEN_MPI}
    assert cluster.process_env("mpi", both).rank == 2
    assert cluster.process_env(MPIEnvironment(), both).rank == 2
    assert cluster.process_env("SLURM", both).rank == 3
    assert cluster.resolve(" slurm ") == SLURMEnvironment()


@pytest.mark.parametrize(
    ("choice", "environ", "error", "match"),
    [
        ("slrum", SRUN, ValueError, "unknown cluster 'slrum' \\(did you mean 'slurm'\\?\\)"),
        (3, SRUN, TypeError, "cluster must be a cluster environment"),
        ("slurm", {}, RuntimeError, "needs SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID"),
        ("lsf", SRUN, RuntimeError, "needs LSB_JOBID.*not started by jsrun"),
        ("mpi", {}, RuntimeError, "not started by mpirun"),
        ("torchelastic", {"RANK": "0"}, RuntimeError, "needs GROUP_RANK"),
        (None, {}, RuntimeError, "torchrun --nproc_per_node=N.*srun.*hardware\\.launch"),
        (None, {"RANK": "0", "WORLD_SIZE": "1"}, RuntimeError, "MASTER_ADDR, MASTER_PORT are"),
    ],
)
def test_choosing_errors(choice, environ, error, match):
    with pytest.raises(error, match=match):
        cluster.process_env(choice, environ)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"SLURM_PROCID": "4"}, r"SLURM_PROCID=4 is outside \[0, SLURM_NTASKS=4\)"),
        ({"SLURM_LOCALID": "2"}, r"SLURM_LOCALID=2 is outside \[0, SLURM_TASKS_PER_NODE=2\)"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 but SLURM_TASKS_PER_NODE='2\\(x2\\)' lists 2"),
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "adds up to 6 tasks but SLURM_NTASKS=4"),
        ({"SLURM_NTASKS_PER_NODE": "8"}, "SLURM_NTASKS_PER_NODE=8 processes on this machine"),
        ({"RANK": "0"}, "SLURM_PROCID=3 but RANK='0' is set too"),
        ({"WORLD_SIZE": "2"}, "SLURM_NTASKS=4 but WORLD_SIZE='2' is set too"),
        ({"SLURM_PROCID": "three"}, "SLURM_PROCID='three' is not an integer"),
        ({"SLURM_JOB_ID": "12ab", "SLURM_JOB_NAME": "x"}, "does not end in digits"),
    ],
)
def test_inconsistent_slurm_variables_are_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        cluster.process_env(None, {**SRUN, **changes})


def test_without_a_tasks_per_node_count_slurm_says_what_to_set():
    env = {k: v for k, v in SRUN.items() if k != "SLURM_TASKS_PER_NODE"}
    with pytest.raises(RuntimeError, match="--ntasks-per-node"):
        cluster.process_env(None, env)


def test_agreeing_torchrun_variables_are_fine():
    assert cluster.process_env(None, {**SRUN, "RANK": "3", "LOCAL_RANK": "1"}).rank == 3


def test_slurm_environment_values():
    assert SLURMEnvironment() == SLURMEnvironment(True, signal.SIGUSR1)
    assert SLURMEnvironment(requeue_signal=12).requeue_signal is signal.SIGUSR2
    with pytest.raises(ValueError, match="requeue_signal must be a signal"):
        SLURMEnvironment(requeue_signal=999)
    with pytest.raises(ValueError, match="cannot be SIGKILL"):
        SLURMEnvironment(requeue_signal=signal.SIGKILL)
    with pytest.raises(TypeError, match="auto_requeue must be a bool"):
        SLURMEnvironment(auto_requeue="yes")


def test_process_env_from_environ_is_unchanged():
    # the torchrun reader does not look at SLURM: SLURM variables alone are not enough
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are"):
        ProcessEnv.from_environ(SRUN)


# --------------------------------------------------------------------------- the strategies


@pytest.fixture
def srun_alone(monkeypatch):
    """This process as the only task of a SLURM job: no torchrun variables."""
    for name in list(os.environ):
        if name.startswith(
            ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "JSM_", "LSB_")
        ) or name in (
            *TORCHRUN,
            "KUBERNETES_PORT",
        ):
            monkeypatch.delenv(name)
    single = {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NNODES": "1"}
    for name, value in single.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    monkeypatch.setenv("SLURM_NODELIST", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(hardware.free_port()))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert not dist.is_initialized()


def test_ddp_forms_its_group_from_slurm_variables(srun_alone):
    with hardware.ddp(timeout=10, device="cpu") as strategy:
        assert dist.is_initialized()
        assert (strategy.rank, strategy.world_size) == (0, 1)
        assert strategy.cluster == SLURMEnvironment()
    assert not dist.is_initialized()
    off = SLURMEnvironment(auto_requeue=False)
    with hardware.fsdp(timeout=10, device="cpu", cluster=off) as strategy:
        assert strategy.cluster is off
    with pytest.raises(RuntimeError, match="cluster='lsf' needs LSB_JOBID"):
        hardware.ddp(timeout=10, device="cpu", cluster="lsf")


def test_the_trainer_takes_a_cluster_environment_as_a_plugin(srun_alone):
    off = SLURMEnvironment(auto_requeue=False)
    trainer = Trainer(strategy="ddp", plugins=[off], enable_progress_bar=False)
    assert trainer.strategy.cluster is off
    auto = Trainer(plugins=off, enable_progress_bar=False)  # "auto" -> ddp, one plugin
    assert isinstance(auto.strategy, hardware.DDP) and auto.strategy.cluster is off
    sharded = Trainer.from_argparse_args({}, strategy="fsdp", plugins=[off])
    assert isinstance(sharded.strategy, hardware.FSDP) and sharded.strategy.cluster is off
    for value in (trainer.strategy, auto.strategy, sharded.strategy):
        value.close()


@pytest.mark.parametrize(
    ("flags", "error", "match"),
    [
        ({"plugins": [object()]}, TypeError, "unknown flag\\(s\\): `plugins`.*except cluster"),
        ({"plugins": [SLURMEnvironment(), "x"]}, TypeError, "unknown flag\\(s\\): `plugins`"),
        ({"plugins": [SLURMEnvironment(), MPIEnvironment()]}, ValueError, "2 cluster env"),
        (
            {"strategy": "single_device", "plugins": [SLURMEnvironment()]},
            ValueError,
            "needs strategy='ddp' or 'fsdp'",
        ),
        (
            {"strategy": hardware.single_device("cpu"), "plugins": [SLURMEnvironment()]},
            ValueError,
            "cannot change a ready strategy value",
        ),
    ],
)
def test_plugin_errors(flags, error, match):
    with pytest.raises(error, match=match):
        Trainer(**flags)


def test_from_flags_takes_a_cluster_name(srun_alone):
    strategy = from_flags(strategy="ddp", cluster="slurm")
    try:
        assert strategy.cluster == SLURMEnvironment()
        assert from_flags(strategy=strategy, cluster=SLURMEnvironment()) is strategy
    finally:
        strategy.close()
    with pytest.raises(ValueError, match="unknown cluster 'pbs'"):
        from_flags(strategy="ddp", cluster="pbs")
