"""Device statistics during training and evaluation: memory and utilisation, logged.

``DeviceStatsMonitor`` (Lightning's callback of that name) reads, at the start and end of
every training, validation and test batch that is due for logging:

* on the CPU (``psutil``, an optional extra: ``pip install purestep[monitor]``): the
  system-wide ``cpu_percent``, ``cpu_vm_percent`` and ``cpu_swap_percent`` (Lightning's), and
  this process's ``process_cpu_percent`` (since the previous reading; may exceed 100 with
  several threads), ``process_rss_bytes`` and ``process_vms_bytes``;
* on CUDA: ``torch.cuda.memory_stats(device)`` (``allocated_bytes.all.current``,
  ``reserved_bytes.all.peak``, ``num_ooms``, ...), plus the CPU figures with
  ``cpu_stats=True``.

Keys are ``DeviceStatsMonitor.<event>/<name>`` (e.g. ``DeviceStatsMonitor.
on_train_batch_end/process_rss_bytes``). Training batches are due when
``log_every_n_steps`` says so (Lightning's rule, at the logger step); evaluation batches
every ``log_every_n_steps``-th batch of the evaluation. A reading is an effect, so this is
a ``Monitor`` (an observer), never part of the ``TrainState``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .. import schedule
from ..events import Context, Stage
from ..profiling.monitor import Monitor

__all__ = ["DeviceStatsMonitor", "cpu_stats", "cuda_stats"]

_PSUTIL_HINT = (
    "DeviceStatsMonitor needs psutil for CPU statistics: pip install psutil (or "
    "purestep[monitor]), or pass cpu_stats=False on a CUDA device"
)
_TRAIN_EVENTS = ("on_train_batch_start", "on_train_batch_end")
_EVAL_EVENTS = (
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
)


def _psutil() -> Any:
    try:
        import psutil
    except ImportError as e:
        raise ModuleNotFoundError(_PSUTIL_HINT) from e
    return psutil


def cpu_stats(process: Any = None) -> dict[str, float]:
    """System-wide and this process's CPU and memory figures (see the module docstring);
    ``process``: a ``psutil.Process`` to reuse (its CPU percentage is since its last call)."""
    psutil = _psutil()
    process = process if process is not None else psutil.Process()
    memory = process.memory_info()
    return {
        "cpu_percent": float(psutil.cpu_percent()),
        "cpu_vm_percent": float(psutil.virtual_memory().percent),
        "cpu_swap_percent": float(psutil.swap_memory().percent),
        "process_cpu_percent": float(process.cpu_percent()),
        "process_rss_bytes": float(memory.rss),
        "process_vms_bytes": float(memory.vms),
    }


def cuda_stats(device: torch.device | int | None = None) -> dict[str, float]:
    """``torch.cuda.memory_stats(device)``, as floats."""
    return {k: float(v) for k, v in torch.cuda.memory_stats(device).items()}


class DeviceStatsMonitor(Monitor):
    """Log device statistics (see the module docstring).

    ``cpu_stats``: None logs the CPU figures when the state is on the CPU; True logs them on
    any device; False never. ``filter_keys``: log only these names (before prefixing); a
    name no reading has is warned about once, at the first reading.
    """

    events = frozenset({"setup", *_TRAIN_EVENTS, *_EVAL_EVENTS})

    def __init__(self, cpu_stats: bool | None = None, filter_keys: Iterable[str] | None = None):
        if cpu_stats is not None and not isinstance(cpu_stats, bool):
            raise TypeError(f"cpu_stats must be a bool or None, got {cpu_stats!r}")
        if isinstance(filter_keys, str):
            raise TypeError("filter_keys must be a collection of names, not one string")
        self.cpu_stats = cpu_stats
        self.filter_keys = None if filter_keys is None else frozenset(filter_keys)
        self._device = torch.device("cpu")
        self._process: Any = None
        self._checked = False

    def on_event(self, event: str, ctx: Context) -> Any:
        if event == "setup":
            self._setup(ctx)
            return None
        if ctx.stage == Stage.SANITY_CHECK or not self._due(event, ctx):
            return None
        stats = self.read()
        if not stats:
            return None
        prefix = f"{type(self).__qualname__}.{event}/"
        return {prefix + k: v for k, v in stats.items()}

    def _setup(self, ctx: Context) -> None:
        if ctx.fn == "fit" and ctx.extra.get("num_loggers", 1) == 0:
            raise ValueError(
                "Cannot use DeviceStatsMonitor with Trainer(logger=False): it logs through "
                "the loggers"
            )
        self._device = _state_device(ctx)
        wants_cpu = self.cpu_stats or (self.cpu_stats is None and self._device.type == "cpu")
        if wants_cpu:
            self._process = _psutil().Process()
            self._process.cpu_percent()  # the first reading starts the interval
        self._checked = False

    def _due(self, event: str, ctx: Context) -> bool:
        config = ctx.config
        if config is None:
            return True
        if event in _TRAIN_EVENTS:
            stepped = event.endswith("_end") and bool(getattr(ctx.outputs, "stepped", False))
            return schedule.should_log_step(config, ctx.progress.step - stepped, ctx.should_stop)
        every = config.log_every_n_steps
        return every > 0 and ((ctx.batch_idx or 0) + 1) % every == 0

    def read(self) -> dict[str, float]:
        """One reading of the statistics this monitor logs (filtered)."""
        stats: dict[str, float] = {}
        on_cuda = self._device.type == "cuda"
        if on_cuda:
            stats.update(cuda_stats(self._device))
        if self.cpu_stats or (self.cpu_stats is None and not on_cuda):
            if self._process is None:
                self._process = _psutil().Process()
            stats.update(cpu_stats(self._process))
        if self.filter_keys is not None:
            if not self._checked:
                missing = self.filter_keys - stats.keys()
                if missing:
                    warnings.warn(
                        f"DeviceStatsMonitor(filter_keys=...) names no statistic for "
                        f"{sorted(missing)}; they are ignored",
                        UserWarning,
                        stacklevel=2,
                    )
            stats = {k: v for k, v in stats.items() if k in self.filter_keys}
        self._checked = True
        return stats


def _state_device(ctx: Context) -> torch.device:
    params = getattr(ctx.state, "params", None) or {}
    for p in params.values():
        if isinstance(p, torch.Tensor):
            return p.device
    return torch.device("cpu")
