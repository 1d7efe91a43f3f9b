"""``CSVLogger``: metrics in ``metrics.csv`` and hyper-parameters in ``hparams.yaml``.

One row per ``log_metrics`` call; the columns are every name logged so far plus ``step``,
sorted alphabetically, with empty cells where a row has no value. When a row brings a new
name the file is rewritten with the wider header. Rows are buffered and written every
``flush_logs_every_n_steps`` steps (when ``(step + 1)`` is a multiple) and on ``save()`` /
``finalize()``; rewrites go through a temporary file and a rename. All I/O is fsspec.

Resuming: ``state()`` (which saves first) records the version and the number of rows;
``restore(state)`` keeps exactly those first rows of ``metrics.csv`` and recomputes the
columns from them, so rows the killed run logged after its checkpoint disappear and the
finished file is the one an uninterrupted run writes.
"""

from __future__ import annotations

import csv
import io
import warnings
from collections.abc import Mapping
from typing import Any

from .base import FolderLogger, check_status, check_step, params_dict, prepare_metrics
from .folders import join
from .hparams_yaml import dump_yaml, to_plain

__all__ = ["CSVLogger"]

METRICS_FILE = "metrics.csv"
HPARAMS_FILE = "hparams.yaml"
STEP = "step"


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def _csv_text(columns: list[str], rows: list[Mapping[str, Any]], header: bool) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    if header:
        writer.writerow(columns)
    writer.writerows([_cell(row.get(c)) for c in columns] for row in rows)
    return buffer.getvalue()


class CSVLogger(FolderLogger):
    """Log to ``save_dir/name/version_N/metrics.csv`` (and ``hparams.yaml``) via fsspec.

    ``name`` ``None``/``""`` drops the name level; ``version`` an int gives ``version_<int>``,
    a str is the folder name itself, ``None`` the next free ``version_N``; ``prefix`` is put
    before every metric name (``"prefix-name"``). Values are numbers or one-element tensors
    (written via ``item()``). Text (``log_text``) is not recorded. Hyper-parameter metrics
    passed to ``log_hyperparams`` are not recorded either: log them with ``log_metrics``.
    """

    def __init__(
        self,
        save_dir: Any,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version, prefix=prefix)
        if (
            isinstance(flush_logs_every_n_steps, bool)
            or not isinstance(flush_logs_every_n_steps, int)
            or flush_logs_every_n_steps < 1
        ):
            raise ValueError(
                f"flush_logs_every_n_steps must be an int >= 1, got {flush_logs_every_n_steps!r}"
            )
        self._flush_every = flush_logs_every_n_steps
        self._buffer: list[dict[str, Any]] = []
        self._columns: list[str] | None = None  # header of the file; None until it exists
        self._rows = 0  # rows logged in this run (in the file + buffered)
        self._restored = False  # continuing an earlier run's metrics.csv
        self._opened = False  # metrics.csv has been written by this logger
        self.hparams: dict[str, Any] = {}

    # ------------------------------------------------------------------ files

    @property
    def metrics_file(self) -> str:
        """The URL/path of ``metrics.csv``."""
        return join(self.log_dir, METRICS_FILE)

    def _read_rows(self) -> list[dict[str, str]]:
        data = self._files().read(METRICS_FILE)
        if data is None:
            return []
        return list(csv.DictReader(io.StringIO(data.decode("utf-8"))))

    def _rewrite(self, columns: list[str], rows: list[Mapping[str, Any]]) -> None:
        """Replace ``metrics.csv`` atomically (a temporary file, then a rename; a link
        planted there is refused, see ``run_files``)."""
        data = _csv_text(columns, rows, header=True).encode("utf-8")
        self._write_files().write(METRICS_FILE, data)
        self._columns = columns

    def _append(self, rows: list[Mapping[str, Any]]) -> None:
        data = _csv_text(self._columns, rows, header=False).encode("utf-8")
        try:
            self._write_files().append(METRICS_FILE, data)
        except (NotImplementedError, ValueError):  # stores without appends: rewrite
            self._rewrite(self._columns, [*self._read_rows(), *rows])

    def _open(self) -> None:
        """First write of a fresh (not restored) run: a leftover metrics.csv is replaced
        (a link there is refused, not removed: someone planted it)."""
        self._opened = True
        if self._restored:
            return
        files = self._write_files()
        if files.exists(METRICS_FILE):
            files.check(METRICS_FILE)  # a planted link is refused, not removed
            warnings.warn(
                f"{self.metrics_file} already exists; it will be overwritten by this run "
                "(to continue a run, restore the logger's state from its checkpoint)",
                stacklevel=3,
            )
            files.remove(METRICS_FILE)

    def _flush(self) -> None:
        if not self._buffer:
            return
        if not self._opened:
            self._open()
        rows, self._buffer = self._buffer, []
        keys = {key for row in rows for key in row}
        if self._columns is None:
            self._rewrite(sorted(keys), rows)
        elif not keys <= set(self._columns):
            columns = sorted(keys | set(self._columns))
            self._rewrite(columns, [*self._read_rows(), *rows])
        else:
            self._append(rows)

    # ------------------------------------------------------------------ logging

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        step = check_step(step)
        row = prepare_metrics(metrics, self._prefix)
        if STEP in row:
            raise ValueError(
                "'step' is the CSV's own column; pass the step as the step argument, "
                "not as a metric"
            )
        row[STEP] = step
        self._started = True
        self._buffer.append(row)
        self._rows += 1
        if (step + 1) % self._flush_every == 0:
            self._flush()

    def log_hyperparams(self, params: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Merge ``params`` into ``self.hparams`` and write them all to ``hparams.yaml``."""
        self.hparams.update(to_plain(params_dict(params)))
        self._started = True
        self._write_files().write(HPARAMS_FILE, dump_yaml(self.hparams).encode("utf-8"))

    def save(self) -> None:
        self._flush()

    def finalize(self, status: str) -> None:
        check_status(status)
        self._flush()

    # ------------------------------------------------------------------ resuming

    def state(self) -> dict[str, Any]:
        """``{"version", "rows"}``; saves first, so every counted row is in the file (and
        claims the run folder: the recorded version is this run's)."""
        self._flush()
        self.claim()
        return {"version": self.version, "rows": self._rows}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue the run of ``state``: same folder, only its first ``rows`` rows kept."""
        self._adopt(state)
        rows = state.get("rows", 0)
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"logger state 'rows' must be an int >= 0, got {rows!r}")
        kept = self._read_rows()
        if len(kept) < rows:
            warnings.warn(
                f"{self.metrics_file} has {len(kept)} rows but the checkpoint counted {rows}; "
                "keeping all of them",
                stacklevel=2,
            )
        self._restored = True
        self._keep(kept[:rows])

    def truncate_after(self, step: int) -> None:
        """Drop the rows (written or buffered) whose step is greater than ``step``."""
        step = check_step(step)
        self._flush()
        self._restored = True
        self._keep([row for row in self._read_rows() if int(float(row[STEP])) <= step])

    def _keep(self, rows: list[dict[str, str]]) -> None:
        """Make ``rows`` (read back from the file) the whole of ``metrics.csv``."""
        self._buffer = []
        self._rows = len(rows)
        if not rows:
            self._columns = None
            self._files().remove(METRICS_FILE)
            return
        columns = {key for row in rows for key, value in row.items() if key and value}
        self._rewrite(sorted(columns | {STEP}), rows)
