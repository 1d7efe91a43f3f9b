"""Versioned run folders, ``<save_dir>/<name>/version_<N>``, on any fsspec path.

Every run of an experiment gets its own folder under ``<save_dir>/<name>``: ``version_<N>``
with ``N`` one more than the largest existing ``version_<digits>`` folder (0 when there is
none), or the folder the user names. The CSV and TensorBoard loggers share this so their
runs line up, and so a resumed run can adopt the folder its checkpoint recorded.

Several loggers of one run share one version (``share_version``), as in Lightning: the
first one asked picks the smallest ``N`` that is free under every one of their roots, and
all of them take it; a logger given an explicit version keeps its own.

Claiming. Reading ``version`` or ``log_dir`` has no side effect, as in Lightning: the next
free ``N`` is computed (and remembered by that logger) without creating anything, so fresh
loggers read the same ``version_N`` and a read never leaves an empty folder. The folder is
claimed when the run starts writing (``RunFolder.claim``: the Trainer's main process at the
start of a run, a logger used alone at its first write): ``version_N`` is created
exclusively (``os.mkdir``, which fails when the folder exists), so of two runs started at
once on one root (two Trainers, two processes) that both saw ``N`` free only one takes it;
the other moves on to the next free number (up to ``MAX_CLAIMS`` tries). A version read
before the run may therefore move on when another run took it meanwhile (or its folder was
made by hand before the run). The other ranks of a distributed run never claim: they take
the version rank 0 claimed (``RunFolder.take``). Explicit and resumed (``adopt``) versions
are used as they are, existing or not. Other fsspec filesystems are claimed with their
``mkdir``, which is exclusive where the filesystem has real folders (not on object stores,
where folders are only name prefixes: there two runs started in the same instant can still
collide).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "MAX_CLAIMS",
    "RunFolder",
    "check_version",
    "claim_version",
    "is_local",
    "join",
    "next_version",
    "run_dir",
    "share_version",
    "url_to_fs",
]

#: How many version numbers a logger tries before giving up (each taken by another run).
MAX_CLAIMS = 1000
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


def _claim(root: str, version: int) -> str | None:
    """Create ``root/version_<version>`` if no one has; its URL, or ``None`` if it exists."""
    url = run_dir(root, None, version)
    fs, path = url_to_fs(url)
    try:
        if is_local(fs):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkdir(path)  # exclusive: exactly one of several racing runs succeeds
        else:
            fs.makedirs(path.rstrip("/").rsplit("/", 1)[0], exist_ok=True)
            if fs.exists(path):
                return None
            fs.mkdir(path, create_parents=False)
    except FileExistsError:
        return None
    return url


def _release(url: str) -> None:
    """Remove a version folder this process claimed and left empty (a claim given up)."""
    fs, path = url_to_fs(url)
    with contextlib.suppress(OSError):
        if is_local(fs):
            os.rmdir(path)
        else:
            fs.rmdir(path)


def claim_version(roots: list[str], start: int | None = None) -> int:
    """Claim one version under every one of ``roots``: the first ``N``, counting up from
    ``start`` (default ``max(next_version(root))``), whose ``version_N`` folder this call
    could create under each of them (see the module docstring). A ``RuntimeError`` after
    ``MAX_CLAIMS`` numbers were taken by other runs."""
    roots = list(dict.fromkeys(roots))
    version = max(next_version(*url_to_fs(root)) for root in roots) if start is None else start
    for _ in range(MAX_CLAIMS):
        made: list[str] = []
        for root in roots:
            url = _claim(root, version)
            if url is None:
                break
            made.append(url)
        else:
            return version
        for url in made:  # another run has version_N under one root: give them back
            _release(url)
        version = max(version + 1, *(next_version(*url_to_fs(root)) for root in roots))
    raise RuntimeError(
        f"could not claim a version folder under {', '.join(roots)}: {MAX_CLAIMS} version "
        "numbers in a row were taken by other runs; pass version=... to the logger"
    )


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

    The version is chosen lazily, on first read, and only read (nothing is created), so a
    resumed run can first ``adopt`` the version its checkpoint recorded instead of starting
    a new folder; ``claim`` creates the chosen ``version_N`` exclusively when the run starts
    writing (see the module docstring).
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
        # whether the version is settled: given, adopted, claimed or taken from rank 0 (a
        # version only read is not: claim may still move it on)
        self._settled = self._version is not None
        self._shared: list[RunFolder] | None = None  # the folders picking one version with us
        self._claimed: str | None = None  # the version folder this process created for us

    @property
    def root_dir(self) -> str:
        """The folder holding this experiment's versions (``save_dir/name``)."""
        return join(self.save_dir, self.name or None)

    @property
    def picked(self) -> bool:
        """Whether the version is settled (given, adopted, claimed or taken from the run's
        main process); a version only read is not."""
        return self._settled

    @property
    def version(self) -> int | str:
        """The version: on first read, the next free one (for the whole group), computed
        without creating anything; ``claim`` makes it this run's."""
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

    def claim(self) -> None:
        """Make the version this run's before anything is written: create ``version_N``
        exclusively (with the folders of its group that read the same ``N``), moving on to
        the next free number where another run has it. Nothing for a settled version."""
        if self._settled:
            return
        version = self.version
        group = [f for f in self._shared or [self] if not f._settled and f._version == version]
        claimed = claim_version([f.root_dir for f in group], start=version)
        for folder in group:
            folder._version = claimed
            folder._settled = True
            folder._claimed = run_dir(folder.save_dir, folder.name, claimed)

    def take(self, version: int | str) -> None:
        """Use ``version``, the one the run's main process settled (under DDP the other
        ranks write into rank 0's folder): nothing is created or checked here."""
        self._version = check_version(version)
        self._settled = self._version is not None

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
        if self._claimed is not None and self._version != version:
            _release(self._claimed)  # claimed before the resume: unused
        self._claimed = None
        self._version = version
        self._settled = True


def share_version(folders: list[RunFolder]) -> None:
    """Make the ``folders`` without a version yet pick one together, on first use.

    The first time any of them is asked for its version (before anything is written), the
    ones without a version take ``max(next_version(root))`` over their roots, so that
    ``version_N`` is new under each, and ``claim`` creates it under all of them at once.
    Folders with a given, adopted or already read version keep it.
    """
    group = list(folders)
    for folder in group:
        folder._shared = group
