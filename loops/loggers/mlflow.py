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

The experiment is checked when a run is continued: a run id restored from a checkpoint's
logger state, or given with an explicit ``experiment_name``, must belong to that experiment
(``DEFAULT_EXPERIMENT`` when none is named), else ``ValueError`` naming both experiments;
nothing is logged into another experiment's run, and ``finalize`` leaves a refused run as it
is (so the run's other loggers are still finalised). Only ``run_id=`` without an
``experiment_name`` continues the run in whatever experiment holds it, as in Lightning
(which ignores ``experiment_name`` when ``run_id`` is given): here an explicit
``experiment_name="lightning_logs"`` with ``run_id=`` is checked, omitting it is not.

Checkpoints (``log_model``): ``True`` uploads the checkpoint files (``*.ckpt``) in
``checkpoint_dir`` at ``finalize``; ``"all"`` also uploads the new or changed ones each time
a checkpoint is taken (a file is uploaded once it is on disk: at the next checkpoint or at
``finalize``). They go to the run's artifacts under ``checkpoints/`` (after
``checkpoint_path_prefix``). Through the Trainer, ``checkpoint_dir`` defaults to the folder
its default ``ModelCheckpoint`` writes to; only files written since the run started count.

Run folder: as Lightning, ``log_dir`` is ``<save_dir or the Trainer's default_root_dir>/
<experiment_id>/<run_id>`` (``root_dir`` the experiment's folder), so as the first logger the
Trainer's default checkpoints go to ``log_dir/checkpoints``: each run its own folder, and
``ckpt_path="last"`` looks through the experiment's run folders (the newest wins) and
continues that run. Asking for ``log_dir`` creates the run.

Resuming: ``state()`` holds the run id, the timestamp of the last point logged and the
points of an earlier interrupted run still waiting to be repeated; a resumed run continues
the same MLflow run (set ``RUNNING`` again). MLflow's metric history cannot be edited (the
client has no call to delete a point), so nothing is deleted; instead every point this
logger writes gets a strictly increasing timestamp, and ``restore`` reads back the points
the killed run logged after its checkpoint (a later timestamp than the checkpoint's, plus
those still pending from before, so a run killed again after a resume loses or doubles
nothing either). Pending points are matched by metric and step: when the resumed run logs
a point the killed run logged with the same value (a deterministic metric: a resumed run
repeats its computation exactly) it is not written a second time, so the history is the
uninterrupted run's, with no point doubled or lost. When the value differs (a
non-deterministic metric) the new value is logged too (the history stays append-only and
honest: both values are there at that step). A point the resumed run never repeats stays
in the history. ``finalize`` warns once with both counts: points doubled with a different
value and points kept from the interrupted run. ``truncate_after(step)`` treats the points
at steps after ``step`` the same way.
"""

from __future__ import annotations

import collections
import contextlib
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
DEFAULT_EXPERIMENT = "lightning_logs"  # the experiment when no experiment_name is given


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

    ``experiment_name`` (``DEFAULT_EXPERIMENT``, "lightning_logs", when None), ``run_name``,
    ``tracking_uri``, ``tags``, ``save_dir``, ``log_model``,
    ``prefix``, ``artifact_location``, ``run_id`` and ``checkpoint_path_prefix`` as
    Lightning's ``MLFlowLogger``; ``checkpoint_dir``: the folder whose checkpoint files
    ``log_model`` uploads (the Trainer's default checkpoint folder when not given).
    ``experiment`` is the ``MlflowClient``; ``name`` the experiment id, ``version`` the run id.
    Text (``log_text``) is not recorded.
    """

    def __init__(
        self,
        experiment_name: str | None = None,
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
        if experiment_name is not None and not isinstance(experiment_name, str):
            raise TypeError(f"experiment_name must be a str or None, got {experiment_name!r}")
        self._experiment_name = DEFAULT_EXPERIMENT if experiment_name is None else experiment_name
        self._name_given = experiment_name is not None
        self._given_run_id = run_id  # the constructor's run id (its experiment is the user's)
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
        self._adopted = False  # the existing run was marked running and its points read
        self._refused: ValueError | None = None  # why the run to continue was refused
        self._written = False  # anything logged to the run by this logger
        self._default_root_dir: str | None = None  # the Trainer's, for log_dir (use_root_dir)
        self._last_ts = 0  # timestamp (ms) of the last point written; strictly increasing
        # the points to read back on adopting the run: a Select (see _read_extra)
        self._after: Callable[[str, Any], bool] | None = None
        # points logged after the checkpoint, per metric: (step, value, timestamp, index in
        # the metric's history ordered by timestamp), in the order they were logged
        self._extra: dict[str, collections.deque] = {}
        self._kept = 0  # of those, points the resumed run did not log again
        self._doubled = 0  # points logged again with a different value
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
        if self._refused is not None:  # refused once: refused again, without asking
            raise ValueError(str(self._refused))
        if self._run_id is None:
            self._create_run()
        elif not self._adopted:
            self._continue_run()
        return self._client

    def _store(self) -> Any:
        """The ``MlflowClient``, without creating or adopting a run."""
        if self._client is None:
            import_mlflow()
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self._tracking_uri)
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
        self._adopted = True
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
        try:
            self._check_experiment(run)
        except ValueError as error:
            self._refused = error  # finalize then leaves that run alone
            raise
        self._experiment_id = run.info.experiment_id
        self._start_ms = run.info.start_time
        self._adopted = True
        if run.info.status != "RUNNING":
            client.update_run(self._run_id, status="RUNNING")
        if self._after is not None:
            self._read_extra(self._after)
            self._after = None

    def _expected_experiment(self) -> tuple[str | None, str]:
        """``(id, name)`` of the experiment a continued run must belong to: the named one
        (id ``None`` when the store has no such experiment), else the experiment of the
        constructor's ``run_id``, else ``DEFAULT_EXPERIMENT``'s."""
        client = self._client
        if not self._name_given and self._given_run_id is not None:
            experiment_id = client.get_run(self._given_run_id).info.experiment_id
            return experiment_id, self._experiment_label(experiment_id)
        found = client.get_experiment_by_name(self._experiment_name)
        return (found.experiment_id if found is not None else None), self._experiment_name

    def _experiment_label(self, experiment_id: str) -> str:
        """The name of the experiment ``experiment_id`` (its id if it cannot be read)."""
        try:
            return self._client.get_experiment(experiment_id).name
        except Exception:  # a deleted or unreadable experiment: its id says enough
            return f"id {experiment_id}"

    def _check_experiment(self, run: Any) -> None:
        """Refuse to continue ``run`` when it belongs to another experiment than the
        configured one (a checkpoint's logger state naming another experiment's run);
        ``run_id=`` given without an ``experiment_name`` continues it wherever it is."""
        if self._run_id == self._given_run_id and not self._name_given:
            return
        expected_id, expected_name = self._expected_experiment()
        actual = run.info.experiment_id
        if expected_id is not None and str(expected_id) == str(actual):
            return
        raise ValueError(
            f"MLflow run {self._run_id} belongs to experiment "
            f"{self._experiment_label(actual)!r} (id {actual}), not to the configured "
            f"experiment {expected_name!r}"
            + (f" (id {expected_id})" if expected_id is not None else " (not in this store)")
            + f" of {self._tracking_uri}: refusing to log into another experiment's run; "
            "pass that experiment_name to continue it, or resume from a checkpoint of this "
            "experiment"
        )

    def _read_extra(self, select: Callable[[str, Any], bool]) -> None:
        """Keep, per metric, the stored points ``select(key, point)`` picks, in the order
        they were logged; remember the latest timestamp stored."""
        client = self._client
        self._extra = {}
        for key in client.get_run(self._run_id).data.metrics:
            points = sorted(
                client.get_metric_history(self._run_id, key), key=lambda p: (p.timestamp, p.step)
            )
            if points:
                self._last_ts = max(self._last_ts, points[-1].timestamp)
            later = [
                (p.step, p.value, p.timestamp, i) for i, p in enumerate(points) if select(key, p)
            ]
            if later:
                self._extra[key] = collections.deque(later)

    def _pending(self) -> dict[str, list[list[int]]]:
        """The points still waiting to be repeated, per metric, as timestamp ranges
        ``[after, upto]`` (exclusive, inclusive) of consecutive points of its history."""
        pending: dict[str, list[list[int]]] = {}
        for key, queue in self._extra.items():
            ranges: list[list[int]] = []
            previous = None
            for _, _, timestamp, index in queue:
                if previous is not None and index == previous + 1:
                    ranges[-1][1] = timestamp
                else:
                    ranges.append([timestamp - 1, timestamp])
                previous = index
            if ranges:
                pending[key] = ranges
        return pending

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

    def use_root_dir(self, folder: str | os.PathLike[str]) -> None:
        """The Trainer's ``default_root_dir``: where the run folders go when the store is not
        a local ``file:`` one (``create_loggers`` tells it)."""
        self._default_root_dir = os.fspath(folder)

    def _base_dir(self) -> str | None:
        return self.save_dir or self._default_root_dir

    @property
    def root_dir(self) -> str | None:
        """``<save_dir or default_root_dir>/<experiment_id>``: the run folders of the
        experiment (``None`` without a folder, or before the experiment exists). Creates
        no run."""
        base = self._base_dir()
        if base is None:
            return None
        experiment_id = self._experiment_id if self._adopted else None
        if experiment_id is None:
            client = self._store()
            if self._run_id is not None:
                experiment_id = client.get_run(self._run_id).info.experiment_id
            else:
                found = client.get_experiment_by_name(self._experiment_name)
                if found is None:
                    return None
                experiment_id = found.experiment_id
        return os.path.join(base, str(experiment_id))

    @property
    def log_dir(self) -> str | None:
        """``<save_dir or default_root_dir>/<experiment_id>/<run_id>`` (creating the run), or
        ``None`` without a folder; the Trainer's default checkpoints go to ``checkpoints/``
        under it when this is the first logger."""
        base = self._base_dir()
        if base is None:
            return None
        return os.path.join(base, str(self.experiment_id), str(self.run_id))

    # ------------------------------------------------------------------ logging

    def _timestamp(self) -> int:
        self._last_ts = max(int(time.time() * 1000), self._last_ts + 1)
        return self._last_ts

    def _logged_before(self, key: str, step: int, value: float) -> bool:
        """Whether the point of ``key`` at ``step`` is already stored, with this value, from
        before a resume (matched by step; a different value is logged and counted)."""
        queue = self._extra.get(key)
        if not queue:
            return False
        while queue and queue[0][0] < step:  # logged after the checkpoint, not repeated
            queue.popleft()
            self._kept += 1
        if queue and queue[0][0] == step:
            stored = queue.popleft()[1]
            if _same(stored, float(value)):
                return True
            self._doubled += 1  # a non-deterministic metric: both values stay
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
            self._written = True

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Log ``params`` flattened (``opt/lr``) as string parameters; ``metrics`` at step 0."""
        flat = flatten(to_plain(params_dict(params)))
        client = self.experiment
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:MAX_PARAM_VALUE]) for k, v in flat.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            client.log_batch(self._run_id, params=items[i : i + PARAMS_PER_BATCH])
            self._written = True
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
        if not self._adopted:
            # no run was created or continued here (nothing was logged, or the run to
            # continue was refused as another experiment's): there is no run of ours to end
            return
        client = self.experiment
        if self._log_model:
            self._upload_checkpoints()
        self._kept += sum(len(queue) for queue in self._extra.values())
        self._extra = {}
        if self._kept or self._doubled:
            warnings.warn(
                f"MLflow run {self._run_id} (MLflow cannot delete metric points): "
                f"{self._doubled} metric point(s) doubled: logged again by the resumed run "
                "at a step the interrupted run had logged, with a different value (a "
                "non-deterministic metric; both values stay); "
                f"{self._kept} point(s) kept from the interrupted run: logged after its "
                "checkpoint and not logged again by the resumed run",
                stacklevel=2,
            )
            self._kept = self._doubled = 0
        client.set_terminated(self._run_id, status=STATUS[status])

    # ------------------------------------------------------------------ resuming

    def state(self) -> dict[str, Any]:
        """``{"run_id", "timestamp", "pending"}``: the run, the timestamp of its last point
        and, per metric, the timestamp ranges of the points an earlier interrupted run
        logged that this run has not repeated yet (see ``_pending``)."""
        self.experiment  # noqa: B018 - the run must exist for a resume to continue it
        if self._log_model == "all":
            self._upload_checkpoints()
        state: dict[str, Any] = {"run_id": self._run_id, "timestamp": self._last_ts}
        pending = self._pending()
        if pending:
            state["pending"] = pending
        return state

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue the run of ``state``; the points it logged after the checkpoint are
        not written again (see the module docstring)."""
        super().restore(state)
        if self._client is not None and self._run_id is not None and not self._resumed:
            if self._written:
                raise RuntimeError(
                    "MLFlowLogger.restore() must be called before anything is logged"
                )
            self._drop_empty_run()
        run_id = state.get("run_id")
        if run_id is None:
            return
        if not isinstance(run_id, str):
            raise ValueError(f"logger state 'run_id' must be a str, got {run_id!r}")
        timestamp = state.get("timestamp", 0)
        if isinstance(timestamp, bool) or not isinstance(timestamp, int) or timestamp < 0:
            raise ValueError(f"logger state 'timestamp' must be an int >= 0, got {timestamp!r}")
        pending = _check_pending(state.get("pending", {}))
        self._run_id = run_id
        self._resumed = True
        self._adopted = False  # adopt the run on first use
        self._refused = None
        self._experiment_id = None
        self._last_ts = max(self._last_ts, timestamp)

        def select(key: str, point: Any) -> bool:
            if point.timestamp > timestamp:  # logged after the checkpoint
                return True
            # still pending from an earlier interrupted run when the checkpoint was taken
            return any(a < point.timestamp <= b for a, b in pending.get(key, ()))

        self._after = select

    def _drop_empty_run(self) -> None:
        """Delete the run this logger created without writing to it (``log_dir`` was asked
        before ``restore``): the resume continues another run."""
        with contextlib.suppress(Exception):  # an empty run left behind is harmless
            self._client.delete_run(self._run_id)
        self._run_id = None
        self._experiment_id = None
        self._start_ms = None

    def truncate_after(self, step: int) -> None:
        """Treat the stored points at steps after ``step`` as logged after a checkpoint."""
        step = check_step(step)
        if self._run_id is None:
            return
        self.experiment  # noqa: B018
        self._read_extra(lambda key, point: point.step > step)


def _check_pending(pending: Any) -> dict[str, list[tuple[int, int]]]:
    """The ``pending`` entry of a state: metric -> list of ``[after, upto]`` int pairs."""
    error = ValueError(
        f"logger state 'pending' must map metric names to [after, upto] pairs, got {pending!r}"
    )
    if not isinstance(pending, Mapping):
        raise error
    checked: dict[str, list[tuple[int, int]]] = {}
    for key, ranges in pending.items():
        if not isinstance(key, str) or not isinstance(ranges, (list, tuple)):
            raise error
        pairs = []
        for pair in ranges:
            if (
                not isinstance(pair, (list, tuple))
                or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
            ):
                raise error
            pairs.append((pair[0], pair[1]))
        checked[key] = pairs
    return checked
