"""``WandbLogger``: config, metrics and their steps in a Weights & Biases run.

An optional extra: ``pip install "purestep[wandb]"``. ``wandb`` is imported when the run is
first needed (``experiment``), never when purestep is imported.

The run is started on first use with ``wandb.init(project=, name=, id=, dir=save_dir,
resume="allow", ...)`` (``offline=True``: ``mode="offline"``, for ``wandb sync`` later;
other keyword arguments go to ``wandb.init``). As in Lightning, every row is logged with
its step as ``trainer/global_step``, the x-axis of every metric (``define_metric``), so rows
of one step (training and validation) may come in several calls. Hyper-parameters go to
the run's config (``config.update``, nested mappings kept).

Resuming: ``state()`` holds the run id, the last step logged and W&B's own row counter
(``_step``); a resumed run calls ``wandb.init(id=<that id>, resume="allow")`` and so
continues the same run. W&B's history is append-only, so the rows an interrupted run logged
after its checkpoint are not removed: the resumed run logs those steps again (online, W&B's
``resume_from="<id>?_step=<wandb_step>"`` rewinds a run server-side; pass it as a keyword
argument to start from the checkpoint's row).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from .base import Logger, check_status, check_step, params_dict, prepare_metrics
from .hparams_yaml import to_plain

__all__ = ["WandbLogger"]

INSTALL = 'pip install "purestep[wandb]"'
STEP_METRIC = "trainer/global_step"


def import_wandb() -> Any:
    """The ``wandb`` module, or an ImportError naming the extra to install."""
    try:
        return importlib.import_module("wandb")
    except ImportError as error:
        raise ImportError(
            f"WandbLogger needs Weights & Biases, which is not installed: {INSTALL}"
        ) from error


class WandbLogger(Logger):
    """Log to a W&B run (see the module docstring).

    ``name`` (the run's display name), ``save_dir`` (where ``wandb/`` goes), ``version`` /
    ``id`` (the run id), ``offline``, ``anonymous``, ``project`` (default
    ``$WANDB_PROJECT``, else ``"lightning_logs"``) and ``prefix`` as Lightning's
    ``WandbLogger``; the rest goes to ``wandb.init``. ``experiment`` is the ``wandb`` run;
    ``name`` is the project, ``version`` the run id. Text (``log_text``) is not recorded.
    """

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | os.PathLike[str] = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | os.PathLike[str] | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        prefix: str = "",
        **kwargs: Any,
    ) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        if "resume" in kwargs:
            raise TypeError(
                "WandbLogger resumes runs itself (resume='allow' with the id kept in its "
                "state); do not pass resume"
            )
        self._run_name = name
        self._save_dir = os.fspath(dir if dir is not None else save_dir)
        self._id = id or version
        self._offline = offline
        self._anonymous = "allow" if anonymous else None
        self._project = project or os.environ.get("WANDB_PROJECT") or "lightning_logs"
        self._prefix = prefix
        self._kwargs = kwargs
        self._run: Any = None
        self._finished = False
        self._last_step: int | None = None

    # ------------------------------------------------------------------ the run

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run (started on first use; a resumed one continues its id)."""
        if self._run is None:
            wandb = import_wandb()
            os.makedirs(self._save_dir, exist_ok=True)
            init = dict(
                project=self._project,
                name=self._run_name,
                id=self._id,
                dir=self._save_dir,
                resume="allow",
            )
            if self._anonymous is not None:
                init["anonymous"] = self._anonymous
            if self._offline:
                init["mode"] = "offline"
            init.update(self._kwargs)
            self._run = wandb.init(**init)
            self._id = self._run.id
            self._run.define_metric(STEP_METRIC)
            self._run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
        return self._run

    @property
    def name(self) -> str:
        return self._project

    @property
    def version(self) -> str | None:
        """The run id (``None`` until the run starts, unless one was given)."""
        return self._id

    @property
    def save_dir(self) -> str:
        return self._save_dir

    # ------------------------------------------------------------------ logging

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        step = check_step(step)
        values = prepare_metrics(metrics, self._prefix)
        if STEP_METRIC in values:
            raise ValueError(f"{STEP_METRIC!r} is the logger's own step metric; pass step=")
        self.experiment.log({**values, STEP_METRIC: step})
        self._last_step = step if self._last_step is None else max(self._last_step, step)

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Merge ``params`` into the run's config; ``metrics`` are logged at step 0."""
        self.experiment.config.update(to_plain(params_dict(params)), allow_val_change=True)
        if metrics:
            self.log_metrics(metrics, 0)

    def finalize(self, status: str) -> None:
        """Finish the run (exit code 0 for ``"success"``, 1 otherwise)."""
        check_status(status)
        if self._run is not None and not self._finished:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._finished = True

    # ------------------------------------------------------------------ resuming

    def state(self) -> dict[str, Any]:
        """``{"id", "step", "wandb_step"}``: the run, the last step logged, W&B's row count."""
        run = self.experiment
        return {"id": self._id, "step": self._last_step, "wandb_step": int(run.step)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue the run of ``state`` (``wandb.init(id=..., resume="allow")``)."""
        super().restore(state)
        if self._run is not None:
            raise RuntimeError("WandbLogger.restore() must be called before anything is logged")
        run_id = state.get("id")
        if run_id is None:
            return
        if not isinstance(run_id, str):
            raise ValueError(f"logger state 'id' must be a str, got {run_id!r}")
        self._id = run_id
        self._last_step = state.get("step")
