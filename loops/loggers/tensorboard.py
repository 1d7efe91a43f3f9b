"""``TensorBoardLogger``: event files written by ``tensorboardX.SummaryWriter``.

Scalars go through ``add_scalar``, text through ``add_text``, hyper-parameters through the
hparams plugin's summaries (with ``hp_metric = -1`` when no metric is given and
``default_hp_metric``), plus an ``hparams.yaml`` in the run folder.

One event file per run: the writer is opened on first use and kept until ``finalize()``
(a resume or ``truncate_after`` adds one more, see below), as TensorBoard users expect.

Durability: tensorboardX's own writer queues events for a thread, and its ``flush()`` writes
only what that thread has taken, so making sure everything is in the file meant closing the
writer (and a new event file at the next event). Here the ``SummaryWriter`` writes each
event to its file as it is added (no queue, no thread; ``max_queue`` and ``flush_secs`` have
no effect), so ``save()`` and ``state()`` flush everything logged so far into the one file.
Do not keep a reference to ``experiment`` across ``truncate_after()``, ``restore()`` or
``finalize()``, which close the writer.

Links: the event files (``add_scalars``' per-tag ones too) and ``hparams.yaml`` are created
without following a symbolic link planted in the run folder (``run_files``). tensorboardX's
``experiment.add_embedding`` writes its projector files itself (``os.makedirs`` and
``open`` under ``<log_dir>/<step>/<tag>``) and so does follow links there: keep run folders
writable only by the people who run in them.

Other filesystems: tensorboardX writes only to local disk (and its own s3/gs clients), so for
a non-local fsspec URL the writer works in a local temporary folder and ``save()`` /
``finalize()`` upload the files that changed into the run folder through fsspec.

Resuming: event files are append-only, so nothing is deleted. ``truncate_after(step)`` (and
``restore(state)``, which calls it with the last step logged before the checkpoint) starts a
new event file opened with ``purge_step = step + 1``: TensorBoard's reader, on meeting it,
drops every earlier-read event at a step ``>= step + 1``, so the new events logged for those
steps supersede the killed run's. Event file names carry a nanosecond suffix so the new file
always sorts (and is read) after the old ones, even within the same second. Logging the
hyper-parameters again after a resume adds a second hparams entry at step 0 (a resuming
driver may skip it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from tensorboardX import SummaryWriter
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import RecordWriter
from tensorboardX.summary import hparams as hparams_summaries
from tensorboardX.writer import FileWriter

from .base import (
    FolderLogger,
    check_status,
    check_step,
    flatten,
    params_dict,
    prepare_metrics,
)
from .folders import is_local, url_to_fs
from .hparams_yaml import dump_yaml, to_plain
from .run_files import create_file, make_folder

__all__ = ["TensorBoardLogger"]

HPARAMS_FILE = "hparams.yaml"
DEFAULT_HP_METRIC = "hp_metric"
_last_suffix_ns = 0


def _unique_suffix() -> str:
    """A strictly increasing ``.<nanoseconds>`` so later event files sort after earlier ones."""
    global _last_suffix_ns
    _last_suffix_ns = max(time.time_ns(), _last_suffix_ns + 1)
    return f".{_last_suffix_ns:020d}"


class _RecordFile(RecordWriter):
    """tensorboardX's ``RecordWriter`` over a file opened by the caller (``run_files``)."""

    def __init__(self, path: str, file: Any) -> None:
        self._name_to_tf_name = {}
        self._tf_names = set()
        self.path = path
        self._writer = file


class _EventsFile(EventsWriter):
    """tensorboardX's ``EventsWriter`` whose event file (named as tensorboardX names it) is
    created exclusively under ``base`` without following links (``run_files``)."""

    def __init__(self, base: str, logdir: str, filename_suffix: str) -> None:
        seconds = str(time.time())[:10]
        name = f"events.out.tfevents.{seconds}.{socket.gethostname()}{filename_suffix}"
        self._file_name = os.path.join(logdir, name)
        self._num_outstanding_events = 0
        file = create_file(base, self._file_name)
        self._py_recordio_writer = _RecordFile(self._file_name, file)
        self._lock = threading.Lock()
        self._event = Event(wall_time=time.time(), file_version="brain.Event:2")
        self.write_event(self._event)


class _EventFile:
    """tensorboardX's ``EventFileWriter`` without its queue and thread: an event is written to
    the file when it is added, so ``flush()`` puts everything added so far in the file. The
    folder and the file are made under ``base`` without following links."""

    def __init__(self, logdir: str, filename_suffix: str, base: str) -> None:
        self._logdir = logdir
        make_folder(base, logdir)
        self._events = _EventsFile(base, logdir, filename_suffix)
        self._closed = False

    def get_logdir(self) -> str:
        return self._logdir

    def add_event(self, event: Event) -> None:
        if not self._closed:
            self._events.write_event(event)

    def flush(self) -> None:
        if not self._closed:
            self._events.flush()

    def close(self) -> None:
        if not self._closed:
            self._events.close()
            self._closed = True

    def reopen(self) -> None:
        """Nothing: a closed file stays closed (the logger opens a new writer instead)."""


def _close_at_exit(ref: weakref.ref) -> None:
    events = ref()
    if events is not None:
        events.close()


class _FileWriter(FileWriter):
    """A ``FileWriter`` over an ``_EventFile`` (``add_summary`` etc. as tensorboardX's)."""

    def __init__(self, logdir: str, filename_suffix: str = "", base: str | None = None) -> None:
        self.event_writer = _EventFile(str(logdir), filename_suffix, base or str(logdir))
        self._default_metadata = {}
        atexit.register(_close_at_exit, weakref.ref(self.event_writer))


class _SummaryWriter(SummaryWriter):
    """tensorboardX's ``SummaryWriter`` writing synchronously into one event file, made
    under ``base`` (the experiment's folder) without following links planted there."""

    def __init__(self, *, base: str, **kwargs: Any) -> None:
        self._base = base
        super().__init__(**kwargs)

    def _get_file_writer(self) -> FileWriter:
        if not self._write_to_disk:
            return super()._get_file_writer()
        if self.all_writers is None or self.file_writer is None:
            self.file_writer = _FileWriter(self.logdir, self._filename_suffix, self._base)
            if self.purge_step is not None:  # as tensorboardX writes it
                self.file_writer.add_event(
                    Event(step=self.purge_step, file_version="brain.Event:2")
                )
                start = SessionLog(status=SessionLog.START)
                self.file_writer.add_event(Event(step=self.purge_step, session_log=start))
            self.all_writers = {self.file_writer.get_logdir(): self.file_writer}
        return self.file_writer

    def add_scalars(
        self,
        main_tag: str,
        tag_scalar_dict: dict[str, float],
        global_step: int | None = None,
        walltime: float | None = None,
    ) -> None:
        """tensorboardX's ``add_scalars``, whose per-tag event files (one folder per tag
        under the run folder) are made as the main one is: under ``base``, never through
        a link planted there. The writers are put where tensorboardX looks them up."""
        if self._write_to_disk:
            logdir = str(self._get_file_writer().get_logdir())
            for tag in tag_scalar_dict:
                folder = os.path.join(logdir, main_tag, tag)  # as tensorboardX names it
                if folder not in self.all_writers:
                    self.all_writers[folder] = _FileWriter(
                        folder, self._filename_suffix, self._base
                    )
        super().add_scalars(main_tag, tag_scalar_dict, global_step, walltime)


def _hparam_value(value: Any) -> bool | int | float | str:
    """A value TensorBoard's hparams plugin can show: numbers, bools and strings."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class TensorBoardLogger(FolderLogger):
    """Log to TensorBoard event files in ``save_dir/name/version_N[/sub_dir]`` (any fsspec URL).

    ``name``/``version``/``prefix`` as for ``CSVLogger``; ``sub_dir`` adds a folder under the
    version folder; ``default_hp_metric`` logs ``hp_metric = -1`` with the hyper-parameters
    when no metrics are given; other keyword arguments go to ``tensorboardX.SummaryWriter``
    (e.g. ``comment``, ``write_to_disk``; a ``filename_suffix`` is appended to ours;
    ``max_queue`` and ``flush_secs`` are accepted and have no effect: events are written as
    they are logged).
    """

    def __init__(
        self,
        save_dir: Any,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | None = None,
        **writer_kwargs: Any,
    ) -> None:
        super().__init__(save_dir, name, version, sub_dir=sub_dir, prefix=prefix)
        for reserved in ("logdir", "log_dir", "purge_step"):
            if reserved in writer_kwargs:
                raise TypeError(
                    f"TensorBoardLogger sets the SummaryWriter's {reserved!r} itself; use "
                    "save_dir/name/version (and restore / truncate_after to purge steps)"
                )
        self._default_hp_metric = default_hp_metric
        self._writer_kwargs = writer_kwargs
        self._writer: SummaryWriter | None = None
        self._purge_step: int | None = None  # for the next writer opened
        self._last_step: int | None = None  # the largest step logged in this run
        self._local_dir: str | None = None  # the writer's folder when log_dir is not local
        self._uploaded: dict[str, tuple[int, int]] = {}  # local file -> (size, mtime_ns)
        self.hparams: dict[str, Any] = {}

    # ------------------------------------------------------------------ the writer

    @property
    def experiment(self) -> SummaryWriter:
        """The ``SummaryWriter`` (opened on first use) for anything this class does not wrap."""
        if self._writer is None:
            self._started = True
            self.claim()  # the run folder is this run's before its first event file
            fs, path = url_to_fs(self.log_dir)
            if is_local(fs):
                logdir, base = os.path.abspath(path), url_to_fs(self.root_dir)[1]
            else:
                if self._local_dir is None:
                    self._local_dir = tempfile.mkdtemp(prefix="purestep-tb-")
                logdir = base = self._local_dir
            kwargs = dict(self._writer_kwargs)
            kwargs["filename_suffix"] = _unique_suffix() + kwargs.get("filename_suffix", "")
            self._writer = _SummaryWriter(
                base=base, logdir=logdir, purge_step=self._purge_step, **kwargs
            )
            self._purge_step = None
        return self._writer

    def _note_step(self, step: int) -> None:
        self._last_step = step if self._last_step is None else max(self._last_step, step)

    def _upload(self) -> None:
        """Copy new or changed files of the local writer folder to a non-local log_dir."""
        if self._local_dir is None:
            return
        fs, remote = url_to_fs(self.log_dir)
        for folder, _, files in os.walk(self._local_dir):
            for filename in files:
                local = os.path.join(folder, filename)
                info = os.stat(local)
                stamp = (info.st_size, info.st_mtime_ns)
                if self._uploaded.get(local) == stamp:
                    continue
                relative = os.path.relpath(local, self._local_dir).replace(os.sep, "/")
                target = f"{remote.rstrip('/')}/{relative}"
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(local, target)
                self._uploaded[local] = stamp

    # ------------------------------------------------------------------ logging

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        step = check_step(step)
        values = prepare_metrics(metrics, self._prefix)
        writer = self.experiment
        for name, value in values.items():
            writer.add_scalar(name, value, step)
        self._note_step(step)

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Write the hparams summaries (nested names joined by ``/``) and ``hparams.yaml``.

        ``metrics`` (or ``{"hp_metric": -1}`` with ``default_hp_metric``) are also logged as
        scalars at step 0, so the hparams dashboard has a value to show for them.
        """
        params = to_plain(params_dict(params))
        self.hparams.update(params)
        self._write_files().write(HPARAMS_FILE, dump_yaml(self.hparams).encode())
        if metrics is None and self._default_hp_metric:
            metrics = {DEFAULT_HP_METRIC: -1}
        values = prepare_metrics(metrics or {}, self._prefix)
        writer = self.experiment
        for name, value in values.items():
            writer.add_scalar(name, value, 0)
        flat = {k: _hparam_value(v) for k, v in flatten(params).items() if v is not None}
        for summary in hparams_summaries(flat, values):
            writer.file_writer.add_summary(summary)
        self._note_step(0)

    def log_text(self, tag: str, text: str, step: int) -> None:
        step = check_step(step)
        if not isinstance(tag, str) or not isinstance(text, str):
            raise TypeError(f"log_text takes a str tag and a str text, got {tag!r}, {text!r}")
        self.experiment.add_text(tag, text, step)
        self._note_step(step)

    def save(self) -> None:
        """Flush everything logged so far into the event file (and upload it)."""
        if self._writer is not None:
            self._writer.flush()
        self._upload()

    def _drain(self) -> None:
        """Close the writer (the next event opens a new file) and upload the files."""
        if self._writer is not None:
            self._writer.purge_step = None  # a reopened writer must not purge again
            self._writer.close()
            self._writer = None
        self._upload()

    def finalize(self, status: str) -> None:
        check_status(status)
        self._drain()
        if self._local_dir is not None:
            shutil.rmtree(self._local_dir, ignore_errors=True)
            self._local_dir = None
            self._uploaded = {}

    # ------------------------------------------------------------------ resuming

    def state(self) -> dict[str, Any]:
        """``{"version", "step"}``: the run folder and the largest step logged (or None).

        Saves first, so all that the state covers is in the event file, which stays open
        (and claims the run folder: the recorded version is this run's).
        """
        self.save()
        self.claim()
        return {"version": self.version, "step": self._last_step}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue the run of ``state``: same folder; its events after ``step`` superseded."""
        self._adopt(state)
        step = state.get("step")
        if step is None:
            self._purge(0)  # nothing was logged before the checkpoint
        else:
            self.truncate_after(step)

    def truncate_after(self, step: int) -> None:
        """Hide events at steps after ``step``: open a new event file with that purge step."""
        self._purge(check_step(step) + 1)

    def _purge(self, purge_step: int) -> None:
        self._drain()
        self._purge_step = purge_step
        if self._last_step is not None:
            self._last_step = min(self._last_step, purge_step - 1) if purge_step else None
        self.experiment  # noqa: B018 - open the writer now, writing the purge marker
