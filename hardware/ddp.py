"""Data-parallel training over ``torch.distributed``: one process per device, same state on all.

``hardware.ddp()`` is called in every worker process (started by ``torchrun`` or
``hardware.launch``). Each rank holds the whole ``TrainState``, steps on its own shard of
the data (``data_options()`` gives ``loops.data.source`` the rank and world size), and
averages the gradients across ranks once per optimizer step (``engine.train_step`` calls
``all_reduce(grads, "mean")`` when an accumulation window closes; micro-batches inside a
window accumulate locally, like torch DDP's ``no_sync``). With the loss a mean over the
batch, b samples per rank on W ranks trains like one process with W * b samples.

**Process group.** Created when ``ddp()`` runs (not lazily), from the torchrun variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so a missing or
unreachable rank fails at start-up, not at the first step. An existing default group (from
``hardware.launch`` or the user's own ``init_process_group``) is adopted as it is. Backend:
``"gloo"`` on CPU; on CUDA ``"cpu:gloo,cuda:nccl"`` (NCCL for the device tensors, gloo for
CPU tensors such as metrics or objects), the device being ``cuda:LOCAL_RANK``. ``timeout``
(seconds; default 60, or an adopted group's own) bounds every collective: when a peer
crashes or hangs, the others raise ``CollectiveError`` naming the operation instead of
waiting forever (with gloo a killed peer is usually noticed at once, a hung one after the
timeout; NCCL's watchdog aborts the process after the timeout). Forming the group is
bounded by ``timeout`` too (``hardware.group``: the store connection, every rank checking
in, the backend's rendezvous); the error names the ranks that did not come.

**Lifetime.** A group ``ddp()`` formed is purestep's: every ``ddp()`` value made while it is
alive, or while it is released (same torchrun variables and backend), holds it with the one
that formed it (``SharedGroup``), and any holder forms it again after a release. One the user
or ``hardware.launch`` formed is adopted as it is and never destroyed. ``release()``
destroys purestep's group but keeps the store, and the next collective (or ``open()``) of
any holder forms it again. ``run_scope()`` is what the Trainer wraps each run (``fit``,
``validate``, ``test``, ``predict``) in: it forms the group again if it was released and,
for a strategy built from ``Trainer(strategy="ddp")``, releases it at the end of the run,
success or failure, unless a holder built with ``hardware.ddp()`` still holds it; so no
group is alive when the process exits (an undestroyed group can abort the interpreter at
exit), and two such Trainers work in any order. Between runs under ``strategy="ddp"`` there
is then no process group: user code calling ``torch.distributed`` between ``fit`` and
``test`` forms its own (and destroys it before the next run, which otherwise fails saying
so), or passes ``strategy=hardware.ddp()``, whose group lives until ``close()``.
``close()`` (or ``with``) lets go of the group: it is destroyed unless a holder built with
``hardware.ddp()`` remains. Purestep's group is destroyed at exit in any case.

**State.** ``prepare_state`` (run by ``engine.init``) checks that every rank has the same
parameter and buffer names, shapes and dtypes, then broadcasts rank 0's values, so ranks
whose templates were initialised differently still start identical. ``build_state`` checks
that every rank passed the same seed (the data order and every random key derive from it).

**Buffers** (BatchNorm running statistics). ``buffers="broadcast"`` (default) mirrors torch
DDP's ``broadcast_buffers=True``: after every train-step call (every micro-batch), the
buffers of rank 0 are copied to all ranks, so the state stays identical on every rank and the
saved buffers are rank 0's (torch copies them before each forward instead; either way every
forward starts from rank 0's buffers). ``"mean"`` averages floating buffers instead (integer
ones, such as ``num_batches_tracked``, come from rank 0); ``"local"`` leaves each rank its
own (torch's ``broadcast_buffers=False``; the states then differ across ranks in their
buffers only). ``sync_batchnorm=True`` makes ``convert_model`` replace BatchNorm layers by
``nn.SyncBatchNorm`` (statistics over the global batch; torch runs it on CUDA only). The
loops apply ``convert_model`` to the template before building the state and the steps.

What the loops must do under this strategy: apply ``convert_model`` to the template; pass
``data_options()`` to every data source; merge metrics logged with ``sync_dist`` through
``sync_metrics`` before logging or monitoring them; agree on stop decisions with
``reduce_flag`` (any rank stopping stops all); take names rank 0 chooses (log directory,
checkpoint path) with ``broadcast_object``; write logs, progress bars and checkpoints on
``is_primary`` only, with ``barrier()`` after checkpoint writes that other ranks then read.
Gradient accumulators of an open window are per rank (``TrainState.grad_accum``): save
checkpoints at window boundaries, or every rank's own state.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import hashlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from purestep.engine import metrics
from purestep.engine.loss_scale import DynamicLossScale
from purestep.engine.strategy import Precision, Strategy
from purestep.engine.tree import PyTree, flatten_with_paths

from .cluster import launcher
from .collectives import all_reduce_tree, broadcast_tree, check_op, diagnosed
from .ddp_step import DDPTrainStep
from .grad_buckets import DEFAULT_BUCKET_CAP_MB, BucketLayout, CommHook, resolve_comm_hook
from .group import Formation
from .precision import precision as make_precision
from .process_env import ProcessEnv

__all__ = ["BUFFER_MODES", "DEFAULT_TIMEOUT", "DDP", "DDPTrainStep", "SharedGroup", "ddp"]

#: How buffers are kept in step across ranks after each train-step call.
BUFFER_MODES = ("broadcast", "mean", "local")

_FLAG_OPS = {"any": "max", "all": "min"}


class DDP(Strategy):
    """One rank of a data-parallel run; build it with ``hardware.ddp()`` in each worker."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        precision: Precision,
        backend: str,
        timeout: float,
        sync_batchnorm: bool,
        buffers: str,
        owns_group: bool = False,
        shared: SharedGroup | None = None,
        per_run: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        comm_hook: str | CommHook | None = None,
        comm_state: Any = None,
        overlap: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
    ) -> None:
        if buffers not in BUFFER_MODES:
            raise ValueError(f"buffers must be one of {BUFFER_MODES}, got {buffers!r}")
        BucketLayout.check_cap(bucket_cap_mb)
        if owns_group and shared is None:
            raise ValueError("owns_group=True needs the group's SharedGroup (use hardware.ddp())")
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.precision = precision
        self.backend = backend
        self.timeout = timeout
        self.sync_batchnorm = sync_batchnorm
        self.buffers = buffers
        #: Gradient buckets' size in MiB (torch DDP's ``bucket_cap_mb``; the first is 1 MiB).
        self.bucket_cap_mb = float(bucket_cap_mb)
        #: ``hook(comm_state, bucket) -> Future`` reducing a bucket (torch's comm-hook form).
        self.comm_hook = resolve_comm_hook(comm_hook)
        self.comm_state = comm_state
        #: Whether buckets are reduced during the backward pass (else after it).
        self.overlap = bool(overlap)
        #: Torch's flags, with its meaning (see ``ddp()``).
        self.static_graph = bool(static_graph)
        self.find_unused_parameters = bool(find_unused_parameters)
        # The group purestep formed, shared with every other DDP value that formed or
        # adopted it; None for a group the user or hardware.launch formed (never destroyed).
        self._shared = shared
        #: Whether each Trainer run releases the group at its end (Trainer(strategy="ddp")).
        self.per_run = per_run
        if shared is not None:
            shared.holders.add(self)
            _OWNED.add(self)

    def _settings(self) -> dict[str, Any]:
        """The constructor's arguments that make a strategy built on this one (FSDP, tensor
        parallelism) the same rank of the same group."""
        return dict(
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            device=self.device,
            precision=self.precision,
            backend=self.backend,
            timeout=self.timeout,
            sync_batchnorm=self.sync_batchnorm,
            buffers=self.buffers,
            owns_group=self._shared is not None,
            shared=self._shared,
            per_run=self.per_run,
        )

    @property
    def _owns_group(self) -> bool:
        """Whether the group is purestep's (formed by a ``ddp()`` value, this one or another)."""
        return self._shared is not None

    def __repr__(self) -> str:
        return (
            f"DDP(rank={self.rank}/{self.world_size}, device={self.device}, "
            f"backend={self.backend!r}, precision={self.precision.name!r}, "
            f"buffers={self.buffers!r})"
        )

    # Placement (``place``) and ``data_options`` are ``Strategy``'s: this rank's device, and
    # this rank's shard of the data.

    # ------------------------------------------------------------------ state

    def build_state(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        """Check that every rank uses the same seed, then let ``engine.init`` build the state."""
        seeds = self.all_gather_object(kwargs.get("seed"))
        if any(s != seeds[0] for s in seeds):
            raise ValueError(
                f"the ranks passed different seeds to engine.init ({seeds}); the data order "
                "and every random key derive from the seed, so it must be the same on all ranks"
            )
        return NotImplemented

    def prepare_state(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Rank 0's parameters and buffers on every rank, placed and converted."""
        self._check_same_layout({"params": params, "buffers": buffers})
        synced = self.broadcast({"params": self.place(params), "buffers": self.place(buffers)}, 0)
        # Each tensor gets its own storage (the broadcast returns views of one buffer).
        own = {k: {n: t.clone() for n, t in v.items()} for k, v in synced.items()}
        return self.precision.convert_state(own["params"], own["buffers"])

    def _check_same_layout(self, tree: PyTree) -> None:
        layout = [(p, tuple(t.shape), str(t.dtype)) for p, t in flatten_with_paths(tree)]
        layouts = self.all_gather_object(layout)
        for r, other in enumerate(layouts):
            if other != layouts[0]:
                why = _first_difference(layouts[0], other, r)
                raise ValueError(
                    f"rank {r}'s model does not match rank 0's: {why}; "
                    "every rank must build the same model"
                )

    def convert_model(self, model: nn.Module) -> nn.Module:
        """The template to train under this strategy: a copy with ``nn.SyncBatchNorm`` layers
        when ``sync_batchnorm=True``, else ``model`` itself (never modified)."""
        if not self.sync_batchnorm:
            return model
        if self.device.type == "cpu":
            raise ValueError(
                "sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm does not run "
                "on the CPU); on the CPU use buffers='mean' to average the running statistics"
            )
        return nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))

    # ------------------------------------------------------------------ steps

    def build_train_step(self, model: Any, loss_fn: Any, optimizer: Any, **kwargs: Any) -> Any:
        if self.find_unused_parameters and not kwargs.get("allow_unused"):
            kwargs["allow_unused"] = True  # an unused parameter's gradient reduces as zero
        return DDPTrainStep(model, loss_fn, optimizer, strategy=self, **kwargs)

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tree: Any, op: str = "mean") -> Any:
        """``tree`` reduced across ranks ("mean" | "sum" | "max" | "min"): one collective per
        (dtype, device) bucket; pure (new tensors); see ``hardware.collectives``."""
        self._ready()
        return all_reduce_tree(tree, op, timeout=self.timeout)

    def broadcast(self, tree: Any, src: int = 0) -> Any:
        """``tree`` as rank ``src`` has it, on every rank (new tensors)."""
        self._ready()
        return broadcast_tree(tree, src, timeout=self.timeout)

    def barrier(self) -> None:
        """Wait for every rank (gloo: ``monitored_barrier``, which names a missing rank)."""
        self._ready()
        with diagnosed("barrier", self.timeout):
            if self.backend == "gloo":
                dist.monitored_barrier(
                    timeout=datetime.timedelta(seconds=self.timeout), wait_all_ranks=True
                )
            elif self.device.type == "cuda" and "nccl" in self.backend:
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        out: list[Any] = [None] * self.world_size
        self._ready()
        with diagnosed("all_gather_object", self.timeout):
            dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable) on every rank, e.g. a checkpoint path or a log
        directory that rank 0 chose."""
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"src must be a rank in [0, {self.world_size}), got {src!r}")
        box = [obj]
        self._ready()
        with diagnosed(f"broadcast_object from rank {src}", self.timeout):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce_flag(self, flag: bool, op: str = "any") -> bool:
        """A decision all ranks agree on: ``"any"`` (one rank saying True is enough, e.g. to
        stop) or ``"all"``."""
        if op not in _FLAG_OPS:
            raise ValueError(f"op must be 'any' or 'all', got {op!r}")
        value = torch.tensor([bool(flag)], dtype=torch.uint8, device=self._small_device())
        return bool(self.all_reduce(value, _FLAG_OPS[op]).item())

    def sync_metrics(self, tree: PyTree) -> PyTree:
        """Every metric in ``tree`` merged across ranks (``engine.metrics.sync``): equal to
        merging all ranks' metrics in one process."""
        return metrics.sync(tree, self.all_reduce, device=self._small_device())

    def sync_buffers(
        self, buffers: dict[str, torch.Tensor], op: str = "mean"
    ) -> dict[str, torch.Tensor]:
        """Floating buffers reduced across ranks with ``op``; the others taken from rank 0."""
        check_op(op)
        floating = {n: b for n, b in buffers.items() if b.is_floating_point()}
        other = {n: b for n, b in buffers.items() if n not in floating}
        out = {**self.all_reduce(floating, op), **self.broadcast(other, 0)}
        return {n: out[n] for n in buffers}

    def sync_step_buffers(self, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The buffers after a train-step call under the ``buffers=`` policy: rank 0's
        ("broadcast"), averaged ("mean") or each rank's own ("local")."""
        if not buffers or self.buffers == "local":
            return buffers
        if self.buffers == "broadcast":
            return self.broadcast(buffers, 0)
        return self.sync_buffers(buffers, "mean")

    def in_sync(self, tree: PyTree) -> bool:
        """Whether every rank holds bitwise the same ``tree`` (a debugging aid: hashes)."""
        digest = hashlib.sha256()
        for path, leaf in flatten_with_paths(tree):
            digest.update(path.encode())
            if isinstance(leaf, torch.Tensor):
                t = leaf.detach().cpu().contiguous()
                digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
                digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(leaf).encode())
        digests = self.all_gather_object(digest.hexdigest())
        return all(d == digests[0] for d in digests)

    def _small_device(self) -> torch.device:
        """Where small control tensors travel: CPU when gloo serves it, else the device."""
        return torch.device("cpu") if "gloo" in self.backend else self.device

    # ------------------------------------------------------------------ lifetime

    def open(self) -> None:
        """Form the process group again if it is purestep's and was released (every rank
        must call it, as for a collective); otherwise nothing happens."""
        if self._shared is not None:
            self._shared.formation.form()

    def release(self) -> None:
        """Destroy the process group if it is purestep's, keeping what is needed to form it
        again (``open()``, or the next collective of any DDP value holding it); idempotent."""
        if self._shared is not None:
            self._shared.formation.destroy()

    @contextlib.contextmanager
    def run_scope(self) -> Iterator[None]:
        """One Trainer run: the group formed again if released; at the end (also on failure)
        released again when ``per_run`` (the strategy came from ``Trainer(strategy="ddp")``),
        unless another run is still going or a value that is not per-run holds it."""
        shared = self._shared
        if shared is None:
            yield
            return
        shared.formation.form()
        shared.runs += 1
        try:
            yield
        finally:
            shared.runs -= 1
            if self.per_run and shared.runs == 0 and not shared.pinned():
                shared.formation.destroy()

    def close(self) -> None:
        """Let go of the process group (idempotent; final): it is destroyed if it is
        purestep's and no other value that is not per-run still holds it."""
        shared, self._shared = self._shared, None
        _OWNED.discard(self)
        if shared is None:
            return
        shared.holders.discard(self)
        if not shared.holders:
            shared.formation.destroy(final=True)
            _forget(shared)
        elif not shared.pinned() and shared.runs == 0:
            shared.formation.destroy()

    def _ready(self) -> None:
        if self._shared is not None and not self._shared.formation.alive:
            self.open()

    def __enter__(self) -> DDP:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _first_difference(ours: list, theirs: list, rank: int) -> str:
    names, other_names = [p for p, _, _ in ours], [p for p, _, _ in theirs]
    if names != other_names:
        missing = sorted(set(names) - set(other_names))
        extra = sorted(set(other_names) - set(names))
        return f"rank {rank} lacks {missing} and has {extra} more"
    for (path, shape, dtype), (_, other_shape, other_dtype) in zip(ours, theirs):
        if (shape, dtype) != (other_shape, other_dtype):
            return (
                f"{path} is {list(shape)} {dtype} on rank 0 but {list(other_shape)} "
                f"{other_dtype} on rank {rank}"
            )
    return "unknown difference"


# ---------------------------------------------------------------------- construction


#: Seconds a collective may wait when ``ddp()`` creates the group and no timeout is given.
DEFAULT_TIMEOUT = 60.0


class SharedGroup:
    """The process group purestep's ``ddp()`` formed in this process, and the DDP values
    holding it: the one that formed it and those that adopted it while it was alive (or
    found it released). Any of them forms it again after a release; it is destroyed at the
    end of a per-run value's run only when no run is going and every holder is per-run."""

    def __init__(self, formation: Formation) -> None:
        self.formation = formation
        self.holders: weakref.WeakSet[DDP] = weakref.WeakSet()
        self.runs = 0  # Trainer runs going on over all holders (nesting counts)

    def pinned(self) -> bool:
        """Whether a holder that is not per-run (``hardware.ddp()``) keeps the group alive."""
        return any(not value.per_run for value in list(self.holders))


# The group purestep formed in this process (at most one default group exists at a time).
_SHARED: SharedGroup | None = None

# The values holding a purestep group; closed at exit.
_OWNED: weakref.WeakSet[DDP] = weakref.WeakSet()


def _forget(shared: SharedGroup) -> None:
    global _SHARED
    if _SHARED is shared:
        _SHARED = None


@atexit.register
def _close_owned() -> None:
    for value in list(_OWNED):
        with contextlib.suppress(Exception):
            value.close()
    if _SHARED is not None:  # its holders may all have been garbage-collected
        with contextlib.suppress(Exception):
            _SHARED.formation.destroy(final=True)


def _group_timeout() -> float:
    """The default group's collective timeout, read back from its backend (best effort)."""
    group = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # private API, or no backend for this device type
            continue
    return DEFAULT_TIMEOUT


def _seconds(timeout: float | datetime.timedelta) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(seconds)


def _device(device: torch.device | str | None, local_rank: int) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} was requested but CUDA is not available")
        if dev.index is None:
            count = torch.cuda.device_count()
            if local_rank >= count:
                raise RuntimeError(
                    f"LOCAL_RANK={local_rank} but this machine has {count} CUDA device(s); "
                    "start at most one process per GPU"
                )
            dev = torch.device("cuda", local_rank)
    elif dev.type != "cpu":
        raise ValueError(f"ddp runs on 'cpu' or 'cuda' devices, got {device!r}")
    return dev


def _default_backend(dev: torch.device) -> str:
    return "gloo" if dev.type == "cpu" else "cpu:gloo,cuda:nccl"


def ddp(
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    precision: str | int | Precision = "32-true",
    sync_batchnorm: bool = False,
    device: torch.device | str | None = None,
    *,
    buffers: str = "broadcast",
    loss_scale: DynamicLossScale | None = None,
    per_run: bool = False,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    comm_hook: str | CommHook | None = None,
    comm_state: Any = None,
    overlap: bool = True,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    cluster: Any = None,
) -> DDP:
    """This process's rank of a data-parallel run, with the process group initialised.

    ``backend``: default ``"gloo"`` on CPU, ``"cpu:gloo,cuda:nccl"`` on CUDA. ``timeout``:
    seconds (or a ``timedelta``) any collective may wait before failing; default 60 s, or
    the timeout of an already initialised group, which is adopted as it is (an explicit
    ``backend`` must match it; an explicit ``timeout`` is applied to it). ``device``:
    default ``cuda:LOCAL_RANK`` when CUDA is available, else CPU. ``buffers``: one of
    ``BUFFER_MODES`` (see the module docstring). ``per_run``: a Trainer run releases the
    group at its end (``DDP.run_scope``).

    Gradient reduction, as torch DDP's: ``bucket_cap_mb`` (default 25; the first bucket
    1 MiB) sizes the buckets, reduced during the backward pass (``overlap=False``: after
    it). ``comm_hook``: "fp16" or "bf16" (torch's compression hooks: the bucket is cast,
    divided by the world size, all-reduced and cast back) or any torch comm hook
    ``hook(comm_state, bucket) -> Future`` (e.g. from
    ``torch.distributed.algorithms.ddp_comm_hooks``; a stateful hook's ``comm_state``, e.g.
    PowerSGD's error feedback, lives outside the ``TrainState``, so runs with one do not
    resume bitwise). ``find_unused_parameters=True``:
    parameters the loss does not use get a zero gradient (reduced with the others)
    instead of an error. ``static_graph``: accepted for torch's meaning (the graph is the
    same every step); the bucket layout is static in any case (see
    ``hardware.grad_buckets``), so it changes nothing here.

    ``cluster``: who started the processes (``hardware.cluster``: a value or a name such as
    ``"slurm"``; default: detected), kept as ``.cluster`` (SLURM auto-requeue reads it).
    """
    seconds = None if timeout is None else _seconds(timeout)
    if buffers not in BUFFER_MODES:
        raise ValueError(f"buffers must be one of {BUFFER_MODES}, got {buffers!r}")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support")
    global _SHARED
    shared = None
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        chosen, env = launcher(cluster, optional=True)  # None: a group formed by hand
        local_rank = env.local_rank if env is not None else rank
        dev = _device(device, local_rank)
        active = str(dist.get_backend())
        if backend is not None and backend != active:
            raise ValueError(
                f"the process group already exists with backend {active!r}, not {backend!r}"
            )
        backend = active
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if seconds is None:
            seconds = _group_timeout()
        else:
            dist.group.WORLD.set_timeout(datetime.timedelta(seconds=seconds))
        if _SHARED is not None and _SHARED.formation.alive:
            shared = _SHARED  # purestep's group: held with the values that hold it
            if timeout is not None:
                shared.formation.timeout = seconds
    else:
        seconds = DEFAULT_TIMEOUT if seconds is None else seconds
        chosen, env = launcher(cluster)
        rank, world, local_rank = env.rank, env.world_size, env.local_rank
        dev = _device(device, local_rank)
        backend = backend if backend is not None else _default_backend(dev)
        if dev.type == "cpu" and backend == "nccl":
            raise ValueError("backend 'nccl' reduces CUDA tensors only; on CPU use 'gloo'")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if (
            _SHARED is not None
            and _SHARED.formation.env == env
            and _SHARED.formation.backend == backend
        ):
            shared = _SHARED  # released by a run: formed again over its store, and held
            shared.formation.timeout = seconds
        else:
            shared = SharedGroup(Formation(backend, env, seconds))
        try:
            shared.formation.form()
        except (RuntimeError, ValueError) as err:
            raise RuntimeError(
                f"rank {rank}: could not form the process group of {world} ranks at "
                f"{env.master_addr}:{env.master_port} with backend {backend!r} within "
                f"{seconds:g} s: {err}"
            ) from err
        _SHARED = shared
    policy = (
        precision
        if isinstance(precision, Precision)
        else make_precision(precision, dev, loss_scale=loss_scale)
    )
    value = DDP(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        device=dev,
        precision=policy,
        backend=backend,
        timeout=seconds,
        sync_batchnorm=bool(sync_batchnorm),
        buffers=buffers,
        owns_group=shared is not None,
        shared=shared,
        per_run=per_run,
        bucket_cap_mb=bucket_cap_mb,
        comm_hook=comm_hook,
        comm_state=comm_state,
        overlap=overlap,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
    )
    value.cluster = chosen  # who started the processes (None: a group formed by hand)
    return value


def ddp_from_flags(
    use_cuda: bool, devices: Any, count: int | None, precision: Any, cluster: Any = None
) -> DDP:
    """``ddp()`` for the Trainer's flags: ``devices`` must agree with the processes started
    on this machine (``LOCAL_WORLD_SIZE``); a list of indices maps ``LOCAL_RANK`` to a GPU.
    ``cluster``: as ``ddp()``'s (``Trainer(plugins=[SLURMEnvironment()])``)."""
    # None: a group made by hand, without a launcher's variables
    env: ProcessEnv | None = launcher(cluster, optional=dist.is_initialized())[1]
    local_rank = env.local_rank if env is not None else 0
    local_world = env.local_world_size if env is not None else None
    if count not in (None, -1) and local_world is not None and count != local_world:
        raise ValueError(
            f"devices={devices!r} asks for {count} process(es) on this machine but "
            f"{local_world} were started; match torchrun's --nproc_per_node (srun's "
            "--ntasks-per-node) to devices"
        )
    device: str | torch.device = "cuda" if use_cuda else "cpu"
    if use_cuda and isinstance(devices, (list, tuple)):
        device = torch.device("cuda", int(devices[local_rank]))
    # The Trainer made this value: each of its runs destroys the group at its end.
    return ddp(precision=precision, device=device, per_run=True, cluster=cluster)
