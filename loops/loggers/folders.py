"""Versioned run folders, ``<save_dir>/<name>/version_<N>``, on any fsspec path.

Every run of an experiment gets its own folder under ``<save_dir>/<name>``: ``version_<N>``
with ``N`` one more than the largest existing ``version_<digits>`` folder (0 when there is
none), or the folder the user names. The CSV and TensorBoard loggers share this so their
runs line up, and so a resumed run can adopt the folder its checkpoint recorded.

Several loggers of one run share one version (``share_version``), as in Lightning: the
first one asked picks the smallest ``N`` that is free under every one of their roots, and
all of them take it; a logger given an explicit version keeps its own.
"""

from __future__ import annotations

import os
import re
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "RunFolder",
    "check_version",
    "is_local",
    "join",
    "next_version",
    "run_dir",
    "share_version",
    "url_to_fs",
]

_VERSION_DIR = re.compile(r"version_(\d+)")
# Characters a version folder name may not hold: it must stay one level under the root.
_SEPARATORS = {"/", "\\", "\0", os.sep, *([os.altsep] if os.altsep else [])}


def _is_url(path: str) -> bool:
    return "://" in path


def url_to_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path inside it."""
    return fsspec.core.url_to_fs(url)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local disk (so other libraries can write there directly)."""
    return isinstance(fs, LocalFileSystem)


def join(base: str, *parts: str | None) -> str:
    """``base`` followed by the non-empty ``parts``, ``/``-separated (``os.path.join`` locally).

    ``~`` and environment variables in a local ``base`` are expanded; URLs are left alone.
    """
    if not _is_url(base):
        base = os.path.expandvars(os.path.expanduser(base))
        return os.path.join(base, *(p for p in parts if p))
    out = base
    for part in parts:
        if part:
            out = out + part if out.endswith("/") else f"{out}/{part}"
    return out


def check_version(version: Any) -> int | str | None:
    """Validate a user-given version: ``None``, an int >= 0, or a non-empty folder name."""
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, (int, str)):
        raise TypeError(f"version must be an int, a str or None, got {version!r}")
    if isinstance(version, int) and version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if isinstance(version, str) and (
        not version or any(c in version for c in _SEPARATORS) or version in (".", "..")
    ):
        raise ValueError(
            "version must be a folder name (non-empty, no '/', '\\' or NUL, not '.' or "
            f"'..'), got {version!r}"
        )
    return version


def next_version(fs: fsspec.AbstractFileSystem, path: str) -> int:
    """1 + the largest ``N`` of the ``version_<N>`` folders in ``path`` (0 if none/no folder).

    Only folders count, and only names that are ``version_`` followed by digits.
    """
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return 0
    found = [
        int(m.group(1))
        for entry in entries
        if entry.get("type") == "directory"
        and (m := _VERSION_DIR.fullmatch(entry["name"].rstrip("/").rsplit("/", 1)[-1]))
    ]
    return max(found) + 1 if found else 0


def run_dir(root: str, name: str | None, version: int | str) -> str:
    """``root/name/version_<version>`` (``root/name/<version>`` for a str version).

    ``name`` ``None`` or ``""`` leaves out the name level.
    """
    version = check_version(version)
    if version is None:
        raise ValueError("run_dir needs a version; use next_version() to pick one")
    folder = version if isinstance(version, str) else f"version_{version}"
    return join(root, name or None, folder)


class RunFolder:
    """Where one logger's run lives: ``save_dir/name/<version>[/sub_dir]``.

    The version is chosen lazily, on first use, so a resumed run can first ``adopt`` the
    version its checkpoint recorded instead of starting a new folder.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None,
        version: int | str | None = None,
        sub_dir: str | None = None,
    ) -> None:
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_dir must be a path or an fsspec URL, got {save_dir!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {name!r}")
        if sub_dir is not None and not isinstance(sub_dir, str):
            raise TypeError(f"sub_dir must be a str or None, got {sub_dir!r}")
        self.save_dir = os.fspath(save_dir)
        self.name = name
        self.given_version = check_version(version)
        self.sub_dir = sub_dir or None
        self._version = self.given_version
        self._shared: list[RunFolder] | None = None  # the folders picking one version with us

    @property
    def root_dir(self) -> str:
        """The folder holding this experiment's versions (``save_dir/name``)."""
        return join(self.save_dir, self.name or None)

    @property
    def version(self) -> int | str:
        # Asking any folder of a shared group picks the version of all that have none yet.
        pending = [f for f in self._shared or [self] if f._version is None]
        if pending:
            version = max(next_version(*url_to_fs(f.root_dir)) for f in pending)
            for folder in pending:
                folder._version = version
        return self._version

    @property
    def log_dir(self) -> str:
        return join(run_dir(self.save_dir, self.name, self.version), self.sub_dir)

    def adopt(self, version: int | str) -> None:
        """Continue the run in ``version`` (a checkpoint's); conflicts with a given version.

        A restored version must be a plain one (an int >= 0 or a folder name without path
        separators or ``..``), so a checkpoint cannot move the logs out of ``root_dir``.
        """
        try:
            version = check_version(version)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"the logger state to restore names version {version!r}, which is not a "
                f"plain version of a run under {self.root_dir} ({err})"
            ) from None
        if version is None:
            return
        if self.given_version is not None and self.given_version != version:
            raise ValueError(
                f"this logger was given version={self.given_version!r} but the state to "
                f"restore was logged to version {version!r}; pass version=None (or "
                f"{version!r}) to continue that run"
            )
        self._version = version


def share_version(folders: list[RunFolder]) -> None:
    """Make the ``folders`` without a version yet pick one together, on first use.

    The first time any of them is asked for its version (before anything is written), the
    ones without a version take ``max(next_version(root))`` over their roots, so that
    ``version_N`` is new under each. Folders with a given, adopted or already picked
    version keep it.
    """
    group = list(folders)
    for folder in group:
        folder._shared = group
