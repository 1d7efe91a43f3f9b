"""``MLFlowLogger``: parameters, metrics, tags and checkpoints in an MLflow tracking store.

An optional extra: ``pip install "purestep[mlflow]"`` (``mlflow-skinny`` plus SQLAlchemy and
alembic for ``sqlite:///`` and other SQL stores). ``mlflow`` is imported when the logger
first talks to the store, never when purestep is imported.

The store: ``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else ``file:<save_dir>`` (as
Lightning). MLflow 3 refuses new ``file:`` stores unless ``MLFLOW_ALLOW_FILE_STORE=true``;
``sqlite:///path/mlflow.db`` is MLflow's recommended local store. The run is created on
first use (``experiment`` / ``run_id``) in the experiment ``experiment_name`` (created if
missing) with ``run_name`` and ``tags`` (plus MLflow's source tags); ``run_id=`` continues an
existing run. Hyper-parameters are flattened with ``/`` as Lightning does (``opt/lr``) and
written as strings (cut to MLflow's 6000 characters); metrics are written with their step,
``prefix-`` before their names.

Checkpoints (``log_model``): ``True`` uploads the checkpoint files (``*.ckpt``) in
``checkpoint_dir`` at ``finalize``; ``"all"`` also uploads the new or changed ones each time
a checkpoint is taken (a file is uploaded once it is on disk: at the next checkpoint or at
``finalize``). They go to the run's artifacts under ``checkpoints/`` (after
``checkpoint_path_prefix``). Through the Trainer, ``checkpoint_dir`` defaults to the folder
its default ``ModelCheckpoint`` writes to; only files written since the run started count.

Resuming: ``state()`` holds the run id and the timestamp of the last point logged; a resumed
run continues the same MLflow run (set ``RUNNING`` again). MLflow's metric history cannot be
edited (the client has no call to delete a point), so nothing is deleted; instead every
point this logger writes gets a strictly increasing timestamp, and ``restore`` reads back
the points with a later timestamp than the checkpoint's, i.e. those the killed run logged
after its checkpoint. When the resumed run logs the same point again (same metric, step and
value: a resumed run repeats its computation exactly) it is not written a second time, so
the history is the uninterrupted run's, with no point doubled or lost. A point the resumed
run does not repeat stays in the history; ``finalize`` warns about how many.
``truncate_after(step)`` does the same for the points at steps after ``step``.
"""

from __future__ import annotations

import collections
import importlib
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .base import Logger, check_status, check_step, flatten, params_dict, prepare_metrics
from .hparams_yaml import to_plain

__all__ = ["MLFlowLogger"]

INSTALL = 'pip install "purestep[mlflow]"'
MAX_PARAM_VALUE = 6000  # MLflow's limit on a parameter value's length
PARAMS_PER_BATCH = 100  # MLflow's limit on parameters per log_batch call
METRICS_PER_BATCH = 1000  # MLflow's limit on metrics per log_batch call
STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
CHECKPOINT_SUFFIX = ".ckpt"


def import_mlflow() -> Any:
    """The ``mlflow`` module, or an ImportError naming the extra to install."""
    try:
        return importlib.import_module("mlflow")
    except ImportError as error:
        raise ImportError(
            f"MLFlowLogger needs MLflow, which is not installed: {INSTALL}"
        ) from error


def _same(a: float, b: float) -> bool:
    """Equal as MLflow stores them (NaN equals NaN; SQL stores clamp infinities)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if a == b:
        return True
    big = 1.7976931348623157e308
    return {a, b} <= {math.inf, big} or {a, b} <= {-math.inf, -big}


def _local_path(uri: str) -> str | None:
    """The folder of a local ``file:`` store URI (``None`` for other stores)."""
    if uri.startswith("file:"):
        path = uri[len("file:") :]
        if path.startswith("//"):
            path = path[2:]
        return path
    if "://" not in uri and not uri.startswith(("sqlite:", "databricks")):
        return uri
    return None


class MLFlowLogger(Logger):
    """Log to an MLflow run (see the module docstring).

    ``experiment_name``, ``run_name``, ``tracking_uri``, ``tags``, ``save_dir``, ``log_model``,
    ``prefix``, ``artifact_location``, ``run_id`` and ``checkpoint_path_prefix`` as
    Lightning's ``MLFlowLogger``; ``checkpoint_dir``: the folder whose checkpoint files
    ``log_model`` uploads (the Trainer's default checkpoint folder when not given).
    ``experiment`` is the ``MlflowClient``; ``name`` the experiment id, ``version`` the run id.
    Text (``log_text``) is not recorded.
    """

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, Any] | None = None,
        save_dir: str | os.PathLike[str] | None = "./mlruns",
        log_model: bool | str = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        checkpoint_path_prefix: str = "",
        checkpoint_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if log_model not in (True, False, "all"):
            raise ValueError(f"log_model must be True, False or 'all', got {log_model!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        if tags is not None and not isinstance(tags, Mapping):
            raise TypeError(f"tags must be a mapping of name -> value, got {tags!r}")
        if tracking_uri is None:
            tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if tracking_uri is None:
            if save_dir is None:
                raise ValueError("MLFlowLogger needs a tracking_uri or a save_dir")
            tracking_uri = "file:" + os.path.abspath(os.fspath(save_dir))
        self._tracking_uri = str(tracking_uri)
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._tags = dict(tags or {})
        self._log_model = log_model
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._checkpoint_path_prefix = checkpoint_path_prefix
        self._checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self._default_checkpoint_dir: Callable[[], str] | None = None
        self._client: Any = None
        self._experiment_id: str | None = None
        self._run_id = run_id
        self._resumed = run_id is not None  # continuing an existing run
        self._last_ts = 0  # timestamp (ms) of the last point written; strictly increasing
        self._after: tuple[str, int] | None = None  # ("timestamp" | "step", bound) to reread
        self._extra: dict[str, collections.deque] = {}  # points logged after the checkpoint
        self._stale = 0  # of those, points the resumed run did not log again
        self._uploaded: dict[str, tuple[int, int]] = {}  # checkpoint -> (size, mtime_ns)
        self._start_ms: int | None = None

    # ------------------------------------------------------------------ the run

    @property
    def experiment(self) -> Any:
        """The ``MlflowClient`` of the store (creating the experiment and the run)."""
        if self._client is None:
            import_mlflow()
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self._tracking_uri)
        if self._run_id is None:
            self._create_run()
        elif self._experiment_id is None:
            self._continue_run()
        return self._client

    def _create_run(self) -> None:
        client = self._client
        found = client.get_experiment_by_name(self._experiment_name)
        if found is None:
            self._experiment_id = client.create_experiment(
                self._experiment_name, artifact_location=self._artifact_location
            )
        else:
            self._experiment_id = found.experiment_id
        tags = {str(k): str(v) for k, v in self._tags.items()}
        try:
            from mlflow.tracking.context.registry import resolve_tags

            tags = resolve_tags(tags)
        except Exception:  # source tags are a nicety; never fail a run over them
            pass
        run = client.create_run(self._experiment_id, run_name=self._run_name, tags=tags)
        self._run_id = run.info.run_id
        self._start_ms = run.info.start_time

    def _continue_run(self) -> None:
        """Adopt the existing run ``run_id`` (a resume): mark it running, reread its points."""
        client = self._client
        run = client.get_run(self._run_id)
        self._experiment_id = run.info.experiment_id
        self._start_ms = run.info.start_time
        if run.info.status != "RUNNING":
            client.update_run(self._run_id, status="RUNNING")
        if self._after is not None:
            self._read_extra(*self._after)
            self._after = None

    def _read_extra(self, by: str, bound: int) -> None:
        """Keep, per metric, the stored points past ``bound`` (by timestamp or by step), in
        the order they were logged; remember the latest timestamp stored."""
        client = self._client
        self._extra = {}
        for key in client.get_run(self._run_id).data.metrics:
            points = client.get_metric_history(self._run_id, key)
            if points:
                self._last_ts = max(self._last_ts, max(p.timestamp for p in points))
            later = [p for p in points if (p.timestamp if by == "timestamp" else p.step) > bound]
            if later:
                later.sort(key=lambda p: (p.timestamp, p.step))
                self._extra[key] = collections.deque((p.step, p.value) for p in later)

    @property
    def run_id(self) -> str:
        """The MLflow run id (creating the run on first use)."""
        self.experiment  # noqa: B018
        return self._run_id

    @property
    def experiment_id(self) -> str:
        self.experiment  # noqa: B018
        return self._experiment_id

    @property
    def name(self) -> str:
        return self.experiment_id

    @property
    def version(self) -> str:
        return self.run_id

    @property
    def save_dir(self) -> str | None:
        """The folder of a local ``file:`` store, else ``None``."""
        return _local_path(self._tracking_uri)

    @property
    def tracking_uri(self) -> str:
        return self._tracking_uri

    # ------------------------------------------------------------------ logging

    def _timestamp(self) -> int:
        self._last_ts = max(int(time.time() * 1000), self._last_ts + 1)
        return self._last_ts

    def _logged_before(self, key: str, step: int, value: float) -> bool:
        """Whether ``(step, value)`` of ``key`` is already stored from before a resume."""
        queue = self._extra.get(key)
        if not queue:
            return False
        while queue and queue[0][0] < step:  # logged after the checkpoint, not repeated
            queue.popleft()
            self._stale += 1
        if queue and queue[0][0] == step and _same(queue[0][1], float(value)):
            queue.popleft()
            return True
        return False

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        step = check_step(step)
        values = prepare_metrics(metrics, self._prefix)
        client = self.experiment
        from mlflow.entities import Metric

        timestamp = self._timestamp()
        points = [
            Metric(key, float(value), timestamp, step)
            for key, value in values.items()
            if not self._logged_before(key, step, value)
        ]
        for i in range(0, len(points), METRICS_PER_BATCH):
            client.log_batch(self._run_id, metrics=points[i : i + METRICS_PER_BATCH])

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Log ``params`` flattened (``opt/lr``) as string parameters; ``metrics`` at step 0."""
        flat = flatten(to_plain(params_dict(params)))
        client = self.experiment
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:MAX_PARAM_VALUE]) for k, v in flat.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            client.log_batch(self._run_id, params=items[i : i + PARAMS_PER_BATCH])
        if metrics:
            self.log_metrics(metrics, 0)

    # ------------------------------------------------------------------ checkpoints

    def use_checkpoint_dir(self, folder: Callable[[], str]) -> None:
        """The Trainer's default checkpoint folder (a function, asked when uploading), used
        when no ``checkpoint_dir`` was given."""
        self._default_checkpoint_dir = folder

    def _checkpoint_folder(self) -> str | None:
        if self._checkpoint_dir is not None:
            return self._checkpoint_dir
        if self._default_checkpoint_dir is not None:
            return self._default_checkpoint_dir()
        return None

    def _upload_checkpoints(self) -> None:
        """Upload the new or changed ``*.ckpt`` files of the checkpoint folder written since
        the run started."""
        folder = self._checkpoint_folder()
        if folder is None or self._run_id is None or not os.path.isdir(folder):
            return
        client = self.experiment
        since_ns = (self._start_ms or 0) * 1_000_000 - 2_000_000_000  # 2 s of clock slack
        for parent, _, files in os.walk(folder):
            for filename in sorted(files):
                if not filename.endswith(CHECKPOINT_SUFFIX):
                    continue
                path = os.path.join(parent, filename)
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                stamp = (info.st_size, info.st_mtime_ns)
                if info.st_mtime_ns < since_ns or self._uploaded.get(path) == stamp:
                    continue
                relative = os.path.relpath(parent, folder).replace(os.sep, "/")
                target = f"{self._checkpoint_path_prefix}checkpoints"
                if relative != ".":
                    target = f"{target}/{relative}"
                client.log_artifact(self._run_id, path, target)
                self._uploaded[path] = stamp

    # ------------------------------------------------------------------ the end

    def finalize(self, status: str) -> None:
        """Upload the checkpoints (``log_model``) and end the run with MLflow's status."""
        check_status(status)
        if self._run_id is None and self._client is None:
            return  # nothing was logged: no run to end
        client = self.experiment
        if self._log_model:
            self._upload_checkpoints()
        if self._stale:
            warnings.warn(
                f"{self._stale} metric point(s) that the interrupted run logged after its "
                "checkpoint were not logged again by the resumed run; they stay in MLflow "
                f"run {self._run_id} (MLflow cannot delete metric points)",
                stacklevel=2,
            )
            self._stale = 0
        client.set_terminated(self._run_id, status=STATUS[status])

    # ------------------------------------------------------------------ resuming

    def state(self) -> dict[str, Any]:
        """``{"run_id", "timestamp"}``: the run and the timestamp of its last point."""
        self.experiment  # noqa: B018 - the run must exist for a resume to continue it
        if self._log_model == "all":
            self._upload_checkpoints()
        return {"run_id": self._run_id, "timestamp": self._last_ts}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue the run of ``state``; the points it logged after the checkpoint are
        not written again (see the module docstring)."""
        super().restore(state)
        if self._client is not None and self._run_id is not None and not self._resumed:
            raise RuntimeError("MLFlowLogger.restore() must be called before anything is logged")
        run_id = state.get("run_id")
        if run_id is None:
            return
        if not isinstance(run_id, str):
            raise ValueError(f"logger state 'run_id' must be a str, got {run_id!r}")
        timestamp = state.get("timestamp", 0)
        if isinstance(timestamp, bool) or not isinstance(timestamp, int) or timestamp < 0:
            raise ValueError(f"logger state 'timestamp' must be an int >= 0, got {timestamp!r}")
        self._run_id = run_id
        self._resumed = True
        self._experiment_id = None  # adopt the run on first use
        self._last_ts = max(self._last_ts, timestamp)
        self._after = ("timestamp", timestamp)

    def truncate_after(self, step: int) -> None:
        """Treat the stored points at steps after ``step`` as logged after a checkpoint."""
        step = check_step(step)
        if self._run_id is None:
            return
        self.experiment  # noqa: B018
        self._read_extra("step", step)
