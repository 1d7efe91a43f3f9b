"""Where this process runs: the launcher or scheduler that started it, read into a ``ProcessEnv``.

A multi-process run needs each process's rank, the world size, its rank and the process
count on its machine, and where rank 0 listens (``ProcessEnv``). Every launcher says so in
its own variables; a cluster environment value reads one launcher's:

- ``TorchElasticEnvironment`` (``"torchelastic"``): ``torchrun`` (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``);
- ``EnvironmentVariables`` (``"env"``): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` set by hand (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` default to them);
- ``SLURMEnvironment`` (``"slurm"``): ``srun`` (``SLURM_PROCID``, ``SLURM_LOCALID``,
  ``SLURM_NTASKS``, the tasks per node, rank 0's host from ``SLURM_NODELIST``);
- ``LSFEnvironment`` (``"lsf"``): ``jsrun`` (``JSM_NAMESPACE_RANK`` / ``_LOCAL_RANK`` /
  ``_SIZE``, the hosts from ``LSB_DJOB_RANKFILE``, the port from ``LSB_JOBID``);
- ``MPIEnvironment`` (``"mpi"``): ``mpirun`` (Open MPI's ``OMPI_COMM_WORLD_*``, or MPICH /
  Intel MPI's ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``);
- ``KubeflowEnvironment`` (``"kubeflow"``): a Kubeflow PyTorchJob pod (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; one process per pod), only when chosen.

``detect()`` returns the first of ``DETECTION_ORDER`` whose variables are present: torchrun
first (it may run inside a SLURM or LSF allocation, one agent per node, and then it, not the
scheduler, started the workers), then torchrun's variables set by hand (a launcher's
explicit word wins over the scheduler's), then SLURM, LSF and MPI. A Kubeflow pod is not
detected, as in Lightning: its variables are torchrun's set by hand (plus
``KUBERNETES_PORT``, which any pod has), and only the meaning of the local rank differs (0
of 1 per pod), so ``cluster="kubeflow"`` says so. SLURM counts as the launcher only when
``SLURM_NTASKS`` is set and the job is not an interactive allocation (``SLURM_JOB_NAME``
``bash`` or ``interactive``), as in Lightning. ``resolve(cluster)`` takes an explicit choice
instead: a value, or its name (``"slurm"``); the chosen environment must then have its
variables (a ``RuntimeError`` names the missing ones). Variables that disagree (a rank
outside the world, a ``RANK`` set beside ``SLURM_PROCID`` with another value) are a
``ValueError`` naming both.

``MASTER_ADDR`` / ``MASTER_PORT``, where set, override the address and port a scheduler's
variables give (as Lightning's SLURM and LSF environments allow). Without them: SLURM's
address is the first host of ``SLURM_NODELIST`` (``node[01-04,07]`` -> ``node01``) and its
port the last four digits of ``SLURM_JOB_ID`` + 15000 (``hardware.slurm``); LSF's address
is the first compute host of ``LSB_DJOB_RANKFILE`` (its first line is the launch node) and
its port ``LSB_JOBID % 1000 + 10000``; MPI has no host list, so a multi-node MPI run needs
``MASTER_ADDR`` (a single-node one uses 127.0.0.1), and its port defaults to 29500.
Unlike Lightning's ``MPIEnvironment``, no ``mpi4py`` is needed: the ranks come from the
variables ``mpirun`` sets.

``SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1)`` also says what a
fit does on the requeue signal (``loops.slurm_requeue``): checkpoint, ``scontrol requeue``,
exit.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import signal
from collections.abc import Mapping
from typing import ClassVar

from . import slurm
from .process_env import ProcessEnv

__all__ = [
    "CLUSTERS",
    "DETECTION_ORDER",
    "ClusterEnvironment",
    "EnvironmentVariables",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "detect",
    "launcher",
    "process_env",
    "resolve",
]

_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: MPI's port when MASTER_PORT is not set (torch's default rendezvous port).
MPI_DEFAULT_PORT = 29500


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclasses.dataclass(frozen=True)
class ClusterEnvironment:
    """One launcher's variables (subclasses name them); ``detect`` says whether this
    process was started by it, ``process_env`` reads its place in the run."""

    #: The name ``cluster=`` accepts for it.
    name: ClassVar[str] = ""
    #: Variables whose presence says this launcher started the process.
    markers: ClassVar[tuple[str, ...]] = ()
    #: Variables ``process_env`` cannot do without.
    required: ClassVar[tuple[str, ...]] = ()
    #: Who sets the variables, for error messages.
    launcher: ClassVar[str] = ""

    def detect(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether this launcher started the process (its marker variables are set)."""
        env = _environ(environ)
        return all(name in env for name in self.markers)

    def process_env(self, environ: Mapping[str, str] | None = None) -> ProcessEnv:
        """This process's place in the run, from the launcher's variables."""
        env = _environ(environ)
        missing = [name for name in self.required if name not in env]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise RuntimeError(
                f"cluster={self.name!r} needs {', '.join(missing)}, which {verb} not set: "
                f"this process was not started by {self.launcher}"
            )
        return self._read(env)

    def _read(self, env: Mapping[str, str]) -> ProcessEnv:
        raise NotImplementedError

    def _checked(
        self,
        env: Mapping[str, str],
        names: tuple[str, str, str, str],
        values: tuple[int, int, int, int],
        addr: str,
        port: int,
    ) -> ProcessEnv:
        """A ``ProcessEnv`` from values read from ``names`` (rank, world size, local rank,
        local world size), its ranges checked in the launcher's own names, and checked
        against torchrun's variables where those are set too."""
        (r, w, lr, lw), (rank, world, local_rank, local_world) = names, values
        where = f"cluster={self.name!r}"
        if world < 1:
            raise ValueError(f"{where}: {w}={world} must be at least 1")
        if not 0 <= rank < world:
            raise ValueError(f"{where}: {r}={rank} is outside [0, {w}={world})")
        if not 0 <= local_rank < local_world:
            raise ValueError(f"{where}: {lr}={local_rank} is outside [0, {lw}={local_world})")
        if local_world > world:
            raise ValueError(
                f"{where}: {lw}={local_world} processes on this machine, more than {w}={world}"
            )
        result = ProcessEnv(rank, world, local_rank, local_world, addr, port)
        own = {"RANK": r, "WORLD_SIZE": w, "LOCAL_RANK": lr, "LOCAL_WORLD_SIZE": lw}
        for var, value in (
            ("RANK", rank),
            ("WORLD_SIZE", world),
            ("LOCAL_RANK", local_rank),
            ("LOCAL_WORLD_SIZE", local_world),
        ):
            if var in env and own[var] != var and env[var].strip() != str(value):
                raise ValueError(
                    f"{where}: {own[var]}={value} but {var}={env[var]!r} is set too: the "
                    f"variables disagree (unset {var}, or choose the launcher that set it "
                    "with cluster=...)"
                )
        return result


@dataclasses.dataclass(frozen=True)
class TorchElasticEnvironment(ClusterEnvironment):
    """Started by ``torchrun`` (or ``hardware.launch``, which sets the same variables)."""

    name: ClassVar[str] = "torchelastic"
    markers: ClassVar[tuple[str, ...]] = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    required: ClassVar[tuple[str, ...]] = (*markers, "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    launcher: ClassVar[str] = "torchrun"

    def _read(self, env: Mapping[str, str]) -> ProcessEnv:
        return ProcessEnv.from_environ(env)


@dataclasses.dataclass(frozen=True)
class EnvironmentVariables(ClusterEnvironment):
    """torchrun's variables set by hand (or by another launcher): ``ProcessEnv.from_environ``."""

    name: ClassVar[str] = "env"
    markers: ClassVar[tuple[str, ...]] = _TORCHRUN
    required: ClassVar[tuple[str, ...]] = _TORCHRUN
    launcher: ClassVar[str] = "a launcher that sets torchrun's variables"

    def _read(self, env: Mapping[str, str]) -> ProcessEnv:
        return ProcessEnv.from_environ(env)


@dataclasses.dataclass(frozen=True)
class KubeflowEnvironment(ClusterEnvironment):
    """A pod of a Kubeflow PyTorchJob: the operator sets ``RANK`` (the pod's index),
    ``WORLD_SIZE`` (the pods), ``MASTER_ADDR`` and ``MASTER_PORT``; one process per pod,
    so the local rank is 0 of 1, as in Lightning. Not in ``DETECTION_ORDER`` (Lightning's
    rule too): pass ``cluster="kubeflow"``. A pod that runs ``torchrun`` needs nothing (it
    is torchelastic)."""

    name: ClassVar[str] = "kubeflow"
    markers: ClassVar[tuple[str, ...]] = ("KUBERNETES_PORT", *_TORCHRUN)
    required: ClassVar[tuple[str, ...]] = _TORCHRUN
    launcher: ClassVar[str] = "a Kubeflow PyTorchJob"

    def detect(self, environ: Mapping[str, str] | None = None) -> bool:
        env = _environ(environ)
        return super().detect(env) and "LOCAL_RANK" not in env

    def _read(self, env: Mapping[str, str]) -> ProcessEnv:
        values = (_int(env, "RANK"), _int(env, "WORLD_SIZE"), 0, 1)
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        # one process per pod: a LOCAL_RANK the pod may carry is not compared
        return self._checked({}, names, values, env["MASTER_ADDR"], _int(env, "MASTER_PORT"))


@dataclasses.dataclass(frozen=True)
class SLURMEnvironment(ClusterEnvironment):
    """Started by ``srun`` in a SLURM job (see the module docstring).

    ``auto_requeue``: on ``requeue_signal`` (``#SBATCH --signal=USR1@90`` sends SIGUSR1 90
    s before the time limit) a fit writes its checkpoint, rank 0 runs ``scontrol requeue
    $SLURM_JOB_ID`` and every process exits 0; the requeued job resumes with
    ``ckpt_path="last"`` (``loops.slurm_requeue``).
    """

    auto_requeue: bool = True
    requeue_signal: int = signal.SIGUSR1

    name: ClassVar[str] = "slurm"
    markers: ClassVar[tuple[str, ...]] = ("SLURM_NTASKS",)
    required: ClassVar[tuple[str, ...]] = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    launcher: ClassVar[str] = "srun in a SLURM job"

    def __post_init__(self) -> None:
        if not isinstance(self.auto_requeue, bool):
            raise TypeError(f"auto_requeue must be a bool, got {self.auto_requeue!r}")
        try:
            signum = signal.Signals(self.requeue_signal)
        except (ValueError, TypeError):
            raise ValueError(
                f"requeue_signal must be a signal (e.g. signal.SIGUSR1), got "
                f"{self.requeue_signal!r}"
            ) from None
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"requeue_signal cannot be {signum.name}: it cannot be caught")
        object.__setattr__(self, "requeue_signal", signum)

    def detect(self, environ: Mapping[str, str] | None = None) -> bool:
        """``SLURM_NTASKS`` is set and the job is no interactive allocation (Lightning's
        rule: ``srun --job-name=interactive`` / ``bash`` means processes started by hand)."""
        env = _environ(environ)
        return super().detect(env) and env.get("SLURM_JOB_NAME") not in slurm.INTERACTIVE_JOB_NAMES

    def _read(self, env: Mapping[str, str]) -> ProcessEnv:
        rank, world, local_rank = (
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID"),
        )
        local_name, local_world = self._local_world(env, world)
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif "SLURM_NODELIST" in env or "SLURM_JOB_NODELIST" in env:
            addr = slurm.first_host(env.get("SLURM_NODELIST") or env["SLURM_JOB_NODELIST"])
        elif world == 1 or local_world == world:
            addr = "127.0.0.1"  # one node: Lightning's default too
        else:
            raise RuntimeError(
                "cluster='slurm' needs SLURM_NODELIST (or MASTER_ADDR) to find rank 0's host "
                f"among several nodes ({world} tasks, {local_world} on this node)"
            )
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_name)
        return self._checked(
            env, names, (rank, world, local_rank, local_world), addr, slurm.master_port(env)
        )

    @staticmethod
    def _local_world(env: Mapping[str, str], world: int) -> tuple[str, int]:
        """``(variable, tasks on this node)``: ``SLURM_NTASKS_PER_NODE`` (``--ntasks-per-node``),
        else this node's entry (``SLURM_NODEID``) of ``SLURM_STEP_TASKS_PER_NODE`` /
        ``SLURM_TASKS_PER_NODE``, else all tasks on one node if ``SLURM_NNODES`` is 1."""
        if "SLURM_NTASKS_PER_NODE" in env:
            return "SLURM_NTASKS_PER_NODE", _int(env, "SLURM_NTASKS_PER_NODE")
        for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if var in env:
                counts = slurm.tasks_per_node(env[var])
                node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
                if not 0 <= node < len(counts):
                    raise ValueError(
                        f"cluster='slurm': SLURM_NODEID={node} but {var}={env[var]!r} "
                        f"lists {len(counts)} node(s)"
                    )
                if sum(counts) != world:
                    raise ValueError(
                        f"cluster='slurm': {var}={env[var]!r} adds up to {sum(counts)} tasks "
                        f"but SLURM_NTASKS={world}"
                    )
                return var, counts[node]
        if env.get("SLURM_NNODES", "").strip() == "1":
            return "SLURM_NTASKS", world
        raise RuntimeError(
            "cluster='slurm' cannot tell how many tasks run on this node: set "
            "--ntasks-per-node (SLURM_NTASKS_PER_NODE) or start the tasks with srun, which "
            "sets SLURM_TASKS_PER_NODE"
        )


@dataclasses.dataclass(frozen=True)
class LSFEnvironment(ClusterEnvironment):
    """Started by ``jsrun`` in an LSF job (IBM Spectrum LSF's Job Step Manager)."""

    name: ClassVar[str] = "lsf"
    markers: ClassVar[tuple[str, ...]] = (
        "LSB_JOBID",
        "LSB_DJOB_RANKFILE",
        "JSM_NAMESPACE_LOCAL_RANK",
        "JSM_NAMESPACE_SIZE",
    )
    required: ClassVar[tuple[str, ...]] = (*markers, "JSM_NAMESPACE_RANK")
    launcher: ClassVar[str] = "jsrun in an LSF job"

    @staticmethod
    def hosts(env: Mapping[str, str]) -> list[str]:
        """The compute hosts of the job, one line per slot of ``LSB_DJOB_RANKFILE`` without
        its first line (the launch node, which runs no task)."""
        path = env["LSB_DJOB_RANKFILE"]
        if not path:
            raise ValueError("cluster='lsf': LSB_DJOB_RANKFILE is empty")
        try:
            with open(path) as file:
                lines = [line.strip() for line in file if line.strip()]
        except OSError as err:
            raise RuntimeError(
                f"cluster='lsf': cannot read LSB_DJOB_RANKFILE={path!r}: {err}"
            ) from None
        if len(lines) < 2:
            raise ValueError(
                f"cluster='lsf': LSB_DJOB_RANKFILE={path!r} lists no compute host after the "
                "launch node"
            )
        return lines[1:]

    def _read(self, env: Mapping[str, str]) -> ProcessEnv:
        rank, world = _int(env, "JSM_NAMESPACE_RANK"), _int(env, "JSM_NAMESPACE_SIZE")
        local_rank = _int(env, "JSM_NAMESPACE_LOCAL_RANK")
        hosts = (
            self.hosts(env)
            if "MASTER_ADDR" not in env or "JSM_NAMESPACE_LOCAL_SIZE" not in env
            else []
        )
        if "JSM_NAMESPACE_LOCAL_SIZE" in env:
            local_name, local_world = (
                "JSM_NAMESPACE_LOCAL_SIZE",
                _int(env, "JSM_NAMESPACE_LOCAL_SIZE"),
            )
        else:
            nodes = len(dict.fromkeys(hosts))
            if world % nodes:
                raise ValueError(
                    f"cluster='lsf': JSM_NAMESPACE_SIZE={world} tasks do not split evenly over "
                    f"the {nodes} hosts of LSB_DJOB_RANKFILE; set JSM_NAMESPACE_LOCAL_SIZE"
                )
            local_name, local_world = "JSM_NAMESPACE_SIZE / hosts", world // nodes
        addr = env["MASTER_ADDR"] if "MASTER_ADDR" in env else hosts[0]
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            port = _int(env, "LSB_JOBID") % 1000 + 10000
        names = ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK", local_name)
        return self._checked(env, names, (rank, world, local_rank, local_world), addr, port)


_MPI_FLAVOURS = (
    # (rank, size, local rank, local size): Open MPI, then MPICH / Intel MPI (Hydra)
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


@dataclasses.dataclass(frozen=True)
class MPIEnvironment(ClusterEnvironment):
    """Started by ``mpirun`` / ``mpiexec`` (Open MPI, MPICH or Intel MPI)."""

    name: ClassVar[str] = "mpi"
    launcher: ClassVar[str] = "mpirun (Open MPI's OMPI_COMM_WORLD_* or MPICH's PMI_*)"

    @staticmethod
    def _flavour(env: Mapping[str, str]) -> tuple[str, str, str, str] | None:
        for names in _MPI_FLAVOURS:
            if names[0] in env and names[1] in env:
                return names
        return None

    def detect(self, environ: Mapping[str, str] | None = None) -> bool:
        return self._flavour(_environ(environ)) is not None

    def process_env(self, environ: Mapping[str, str] | None = None) -> ProcessEnv:
        env = _environ(environ)
        names = self._flavour(env)
        if names is None:
            raise RuntimeError(
                "cluster='mpi' needs OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (Open MPI) "
                "or PMI_RANK and PMI_SIZE (MPICH, Intel MPI), which are not set: this process "
                "was not started by mpirun"
            )
        rank, world = _int(env, names[0]), _int(env, names[1])
        if names[2] in env and names[3] in env:
            local_rank, local_world = _int(env, names[2]), _int(env, names[3])
        else:
            local_rank, local_world = rank, world  # one machine, as torchrun's defaults
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif local_world == world:
            addr = "127.0.0.1"
        else:
            raise RuntimeError(
                f"cluster='mpi': {world} ranks on several hosts and MPI names no host list: "
                "export MASTER_ADDR=<rank 0's host> (mpirun -x MASTER_ADDR)"
            )
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else MPI_DEFAULT_PORT
        return self._checked(env, names, (rank, world, local_rank, local_world), addr, port)


#: Every cluster environment by the name ``cluster=`` accepts.
CLUSTERS: dict[str, type[ClusterEnvironment]] = {
    cls.name: cls
    for cls in (
        TorchElasticEnvironment,
        EnvironmentVariables,
        SLURMEnvironment,
        LSFEnvironment,
        MPIEnvironment,
        KubeflowEnvironment,
    )
}
#: The order ``detect`` tries them in (the first whose variables are present wins);
#: Kubeflow only when chosen (see ``KubeflowEnvironment``).
DETECTION_ORDER: tuple[str, ...] = ("torchelastic", "env", "slurm", "lsf", "mpi")


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """The environment that started this process (first of ``DETECTION_ORDER``), or None."""
    env = _environ(environ)
    for name in DETECTION_ORDER:
        candidate = CLUSTERS[name]()
        if candidate.detect(env):
            return candidate
    return None


def resolve(
    cluster: ClusterEnvironment | str | None = None, environ: Mapping[str, str] | None = None
) -> ClusterEnvironment:
    """The cluster environment to use: ``cluster`` as given (a value, or a name of
    ``CLUSTERS``), else the detected one; ``RuntimeError`` when nothing is detected."""
    if isinstance(cluster, ClusterEnvironment):
        return cluster
    if isinstance(cluster, str):
        key = cluster.strip().lower()
        if key not in CLUSTERS:
            close = difflib.get_close_matches(key, list(CLUSTERS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown cluster {cluster!r}{hint}; use one of {', '.join(map(repr, CLUSTERS))} "
                "or a cluster environment value (e.g. hardware.SLURMEnvironment())"
            )
        return CLUSTERS[key]()
    if cluster is not None:
        raise TypeError(
            "cluster must be a cluster environment (e.g. hardware.SLURMEnvironment()), one of "
            f"{', '.join(map(repr, CLUSTERS))}, or None to detect it; got {type(cluster).__name__}"
        )
    env = _environ(environ)
    found = detect(env)
    if found is not None:
        return found
    if any(name in env for name in _TORCHRUN):
        ProcessEnv.from_environ(env)  # torchrun's variables set in part: its own message
    raise RuntimeError(
        "this process was not started as one of several ranks: no launcher's variables are "
        "set (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; SLURM's SLURM_NTASKS; "
        "LSF's JSM_NAMESPACE_*; MPI's OMPI_COMM_WORLD_* or PMI_*). Start the script with "
        "`torchrun --nproc_per_node=N script.py` (or `srun python script.py` in a SLURM job), "
        "or call the training function through hardware.launch(fn, N)"
    )


def process_env(
    cluster: ClusterEnvironment | str | None = None, environ: Mapping[str, str] | None = None
) -> ProcessEnv:
    """This process's ``ProcessEnv`` from ``cluster`` (see ``resolve``)."""
    env = _environ(environ)
    return resolve(cluster, env).process_env(env)


def launcher(
    cluster: ClusterEnvironment | str | None = None,
    *,
    optional: bool = False,
    environ: Mapping[str, str] | None = None,
) -> tuple[ClusterEnvironment | None, ProcessEnv | None]:
    """``(environment, its ProcessEnv)`` for ``cluster`` (see ``resolve``). ``optional``:
    ``(None, None)`` instead of a ``RuntimeError`` when ``cluster`` is None and no
    launcher's variables can be read (a process group formed by hand)."""
    env = _environ(environ)
    try:
        chosen = resolve(cluster, env)
        return chosen, chosen.process_env(env)
    except RuntimeError:
        if cluster is None and optional:
            return None, None
        raise
