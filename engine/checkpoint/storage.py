"""Atomic writes and safe reads of checkpoint files on any fsspec filesystem.

A reader never sees a partial checkpoint. Where the filesystem can rename (local disks,
``memory://``), the file is written under a hidden temporary name in the same folder and
renamed into place. Where it cannot (object stores), the file is written in place and a
commit marker ``<name>.complete`` is written after it; a file without its marker is not a
checkpoint.

Temporary files are hidden and named by their writer:
``.<name>.tmp-<host>-<pid>-<start>-<random>``, where ``host`` is 12 hex digits of a hash of
the full host name, the boot id and the PID namespace (so it is this machine's, this boot's,
among comparable pids: another host, a container on another node, or this host before a
reboot has another), ``pid`` the writing process and ``start`` its start time from
``/proc`` (``0`` where there is none); ``<name>`` is shortened where the whole would pass
255 bytes. Discovery ignores them. ``remove_partial`` deletes only files whose writer is
gone: a writer with this machine's host token is gone when its pid no longer runs (or is a
zombie, or now belongs to a process with another start time); for a writer it cannot check
(another host token, a name without an identity or in an earlier format, a host without a
boot id, a running pid whose start cannot be compared without ``/proc``) the file must also
be untouched for ``STALE_AFTER_S`` (an hour). So cleaning is safe while other processes
write or read the folder; only the writer (``fit``) cleans, readers never delete.

A write that fails for lack of space (the error chain has ``ENOSPC``, or the local disk is
left with under 1 MiB free) is raised as ``OSError(ENOSPC)`` naming the file, chained to
the original error; its temporary file is removed. ``check_writable`` probes a folder: it
must be able to create a file there (a probe it cannot delete again is only a warning:
object stores may deny deletes, and ``save_top_k=-1`` never deletes).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import time
import uuid
import warnings
from collections.abc import Callable
from typing import IO, Any

import fsspec

__all__ = [
    "MARKER_SUFFIX",
    "STALE_AFTER_S",
    "check_writable",
    "exists",
    "filesystem",
    "is_committed",
    "is_local_url",
    "modified_time",
    "open_read",
    "remove",
    "remove_partial",
    "require_regular_file",
    "uses_marker",
    "write_atomic",
    "writer_alive",
    "writer_identity",
]

MARKER_SUFFIX = ".complete"
_RENAMING = ("file", "local", "memory")
#: Seconds a temporary file whose writer cannot be checked must be untouched before
#: ``remove_partial`` deletes it.
STALE_AFTER_S = 3600.0
_TMP = ".tmp-"
_FULL_BYTES = 1 << 20  # a local disk with less free after a failed write counts as full
_NAME_MAX = 255  # bytes of a file name on common filesystems
# The current identity format only: an earlier one (host name and namespace) never matches.
_IDENTITY_RE = re.compile(r"\.tmp-([0-9a-f]{12})-(\d+)-([0-9a-f]+)-[0-9a-f]{12}$")
_IDENTITIES: dict[int, str] = {}
_TIME_KEYS = ("mtime", "created", "LastModified", "last_modified")  # as discover reads them


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """``(fs, path)`` for ``url``."""
    return fsspec.core.url_to_fs(os.fspath(url), **(storage_options or {}))


def uses_marker(fs: Any, commit: str = "auto") -> bool:
    """Whether files on ``fs`` are committed with a marker instead of a rename.

    ``commit``: ``"auto"`` (a marker only where the filesystem cannot rename), ``"rename"``
    or ``"marker"``; readers must use the same setting as the writer.
    """
    if commit not in ("auto", "rename", "marker"):
        raise ValueError(f"commit must be 'auto', 'rename' or 'marker', got {commit!r}")
    if commit != "auto":
        return commit == "marker"
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return not any(p in _RENAMING for p in protocols)


def is_local_url(url: str) -> bool:
    """Whether ``url`` names a file on the local disk."""
    fs, _ = filesystem(url)
    return _is_local(fs)


def _is_local(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("file", "local") for p in protocols)


def write_atomic(
    url: str,
    write: Callable[[IO[bytes]], None],
    *,
    commit: str = "auto",
    fsync: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Write a file with ``write(file)`` so that it appears whole or not at all.

    ``commit``: ``"auto"`` (rename where possible, else a marker), ``"rename"`` or
    ``"marker"``. ``fsync``: also flush the data to the device before committing (local
    files), for power-loss durability; a killed process needs only the rename.
    """
    fs, path = filesystem(url, storage_options)
    use_marker = uses_marker(fs, commit)
    parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if use_marker:
        marker = path + MARKER_SUFFIX
        if fs.exists(marker):
            fs.rm(marker)
        try:
            with fs.open(path, "wb") as f:
                write(f)
            with fs.open(marker, "wb") as f:
                f.write(b"ok")
        except Exception as err:
            if _out_of_space(err, fs, parent):
                raise _no_space(url, "the file has no commit marker, so it is not used") from err
            raise
        return
    tmp = _join(parent, _temp_name(name))
    try:
        if _is_local(fs):
            with open(tmp, "wb") as f:
                write(f)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if fsync and parent:
                _fsync_dir(parent)
        else:
            with fs.open(tmp, "wb") as f:
                write(f)
            fs.mv(tmp, path)
    except BaseException as err:
        full = isinstance(err, Exception) and _out_of_space(err, fs, parent)
        with contextlib.suppress(OSError):
            if fs.exists(tmp):
                fs.rm(tmp)
        if full:
            raise _no_space(
                url, "its temporary file was removed; the file there before is intact"
            ) from err
        raise


def _temp_name(name: str) -> str:
    """The hidden temporary name for ``name``: ``name`` is cut (at a character) where the
    whole would pass ``_NAME_MAX`` bytes; the writer identity and random part stay whole."""
    tail = f"{_TMP}{writer_identity()}-{uuid.uuid4().hex[:12]}"
    return f".{_temp_stem(name, tail)}{tail}"


def _temp_stem(name: str, tail: str) -> str:
    """The part of ``name`` that ``_temp_name`` keeps before ``tail`` (its writer identity
    and random part): all of it, or its longest prefix (whole characters) that fits.
    Cleanup compares a temporary name with the name a record claims by this alone."""
    room = _NAME_MAX - 1 - len(tail.encode())
    return name.encode()[: max(room, 0)].decode(errors="ignore")


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _out_of_space(err: BaseException, fs: Any, folder: str) -> bool:
    """Whether a failed write ran out of space: ``ENOSPC``/``EDQUOT`` in the error chain
    (torch's zip writer reports a short write as a ``RuntimeError`` caused by it), else a
    local disk left with almost no free space."""
    if _space_error_in_chain(err):
        return True
    if isinstance(err, OSError) and err.errno not in (None, errno.EIO):
        return False  # an error of its own kind (a missing or read-only folder, ...)
    if not (_is_local(fs) and hasattr(os, "statvfs")):
        return False
    try:
        st = os.statvfs(folder or ".")
    except OSError:
        return False
    root = getattr(os, "geteuid", lambda: -1)() == 0  # root may use the reserved blocks
    return (st.f_bfree if root else st.f_bavail) * st.f_frsize < _FULL_BYTES


def _space_error_in_chain(err: BaseException) -> bool:
    """Whether ``ENOSPC`` or ``EDQUOT`` is in the error chain of ``err`` (the error says
    itself that the disk or quota ran full, whatever else is true of the disk now)."""
    codes = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno in codes:
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _no_space(url: str, outcome: str) -> OSError:
    return OSError(
        errno.ENOSPC,
        f"no space left on device: writing the checkpoint {url} failed ({outcome}); "
        "free some space and save again",
    )


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_committed(
    url: str, *, commit: str = "auto", storage_options: dict[str, Any] | None = None
) -> bool:
    """Whether ``url`` is a complete checkpoint file (its marker exists where one is used)."""
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        return False
    return fs.exists(path + MARKER_SUFFIX) if uses_marker(fs, commit) else True


def exists(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether anything is at ``url`` (a file of any kind; ``open_read`` refuses non-files)."""
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


def open_read(
    url: str, *, commit: str = "auto", storage_options: dict[str, Any] | None = None
) -> IO[bytes]:
    """Open a checkpoint for reading; a missing or uncommitted file is a clear error, and so
    is anything that is not a regular file (checked before opening: a FIFO would block)."""
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        raise FileNotFoundError(f"no checkpoint at {url}")
    if uses_marker(fs, commit) and not fs.exists(path + MARKER_SUFFIX):
        raise FileNotFoundError(
            f"{url} has no commit marker ({MARKER_SUFFIX}): it was not completely written"
        )
    require_regular_file(fs, path, url)
    return fs.open(path, "rb")


def require_regular_file(fs: Any, path: str, url: str) -> None:
    """Refuse ``path`` unless it is a regular file (symlinks followed): a FIFO, device,
    socket or directory is a ``CheckpointError`` naming ``url``, and is never opened.

    Local files are checked with ``os.stat``; other filesystems by their ``info`` type."""
    import stat

    from .codec import CheckpointError

    if _is_local(fs):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise FileNotFoundError(f"no checkpoint at {url}") from None
        if stat.S_ISREG(mode):
            return
        kinds = [
            (stat.S_ISDIR, "a directory"),
            (stat.S_ISFIFO, "a FIFO (named pipe)"),
            (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"),
        ]
        kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    else:
        kind = fs.info(path).get("type", "file")
        if kind == "file":
            return
        kind = f"a {kind}" if kind == "directory" else f"of type {kind!r}"
    raise CheckpointError(f"{url} is {kind}, not a checkpoint file; refusing to open it")


def remove(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete a checkpoint and its marker (missing files are fine)."""
    fs, path = filesystem(url, storage_options)
    for p in (path + MARKER_SUFFIX, path):
        if fs.exists(p):
            fs.rm(p)


def modified_time(info: dict[str, Any]) -> float:
    """A file's modification time from an fsspec ``info`` dict (0 when it has none)."""
    for key in ("mtime", "created", "LastModified", "last_modified"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return 0.0


def remove_partial(
    folder: str,
    storage_options: dict[str, Any] | None = None,
    *,
    stale_after: float = STALE_AFTER_S,
) -> list[str]:
    """Delete the temporary files in ``folder`` whose writer is gone; return their paths.

    A file of a writer with this machine's host token goes once that process has ended;
    any other (another host's or boot's writer, a name without a writer identity or in an
    earlier format) once it has been untouched for ``stale_after`` seconds. A live writer's
    file is never deleted, so this is safe while other processes use the folder. Files that
    cannot be deleted (a read-only folder) stay.
    """
    fs, path = filesystem(folder, storage_options)
    if not fs.exists(path):
        return []
    now = time.time()
    removed = []
    for info in fs.ls(path, detail=True):
        entry = info["name"]
        name = entry.rsplit("/", 1)[-1]
        if not name.startswith(".") or _TMP not in name or info.get("type") == "directory":
            continue
        alive = writer_alive(name)
        if alive is None:  # cannot tell: only an old file counts as abandoned
            dated = any(info.get(k) is not None for k in _TIME_KEYS)  # else: keep it
            alive = not dated or now - modified_time(info) < stale_after
        if alive:
            continue
        try:
            fs.rm(entry)
        except FileNotFoundError:  # its writer finished (renamed it) or removed it
            continue
        except OSError:  # a read-only folder, or not ours to delete: leave it
            continue
        removed.append(entry)
    return removed


def check_writable(folder: str, storage_options: dict[str, Any] | None = None) -> None:
    """Raise an ``OSError`` naming ``folder`` (chained to the error) unless a file can be
    created in it; a probe file that cannot be deleted again is a warning (delete may be
    denied, as on object stores with retention). A missing folder is created for the probe
    and removed again."""
    created: list[str] = []
    try:
        try:
            fs, path = filesystem(folder, storage_options)  # a missing backend fails here
            if _is_local(fs):
                parent = os.path.abspath(path)
                while not os.path.exists(parent) and os.path.dirname(parent) != parent:
                    created.append(parent)
                    parent = os.path.dirname(parent)
            probe = _join(path.rstrip("/"), _temp_name(".write-probe")[1:])
            fs.makedirs(path, exist_ok=True)
            with fs.open(probe, "wb"):
                pass  # empty: this checks permission; a full disk is reported by the save
        except Exception as err:  # fsspec backends raise their own kinds too
            reason = (err.strerror if isinstance(err, OSError) else None) or str(err)
            reason = reason or type(err).__name__
            message = f"cannot write checkpoints to {folder}: {reason}"
            code = err.errno if isinstance(err, OSError) else None
            raise (OSError(code, message) if code is not None else OSError(message)) from err
        try:
            fs.rm(probe)
        except FileNotFoundError:  # gone already (an eventually consistent listing)
            pass
        except Exception as err:
            warnings.warn(
                f"checkpoints can be written to {folder}, but its write probe {probe} could "
                f"not be deleted ({type(err).__name__}: {err}); evicting old checkpoints "
                "(save_top_k) may fail there too",
                stacklevel=2,
            )
    finally:
        for d in created:  # deepest first; a folder something else filled stays
            with contextlib.suppress(OSError):
                os.rmdir(d)


def writer_identity(pid: int | None = None) -> str:
    """The writer identity ``<host>-<pid>-<start>`` of this process, or of process ``pid``
    of this machine (see the module docstring); at most 12 + 1 + 20 + 1 + 16 characters."""
    if pid is not None:
        return f"{_host_token()}-{pid}-{_start_token(pid) or '0'}"
    pid = os.getpid()
    if pid not in _IDENTITIES:  # keyed by pid: a forked child has its own
        _IDENTITIES[pid] = writer_identity(pid)
    return _IDENTITIES[pid]


def writer_alive(name: str) -> bool | None:
    """Whether the writer named in the temporary file name ``name`` still runs; None when
    that cannot be told here (another host token, no identity or an earlier format in the
    name, no boot id or no ``/proc`` here)."""
    match = _IDENTITY_RE.search(name)
    if match is None or os.name == "nt" or match.group(1) != _host_token():
        return None
    pid, start = int(match.group(2)), match.group(3)
    if pid == os.getpid() and start == writer_identity().rsplit("-", 1)[1]:
        return True
    if not _boot_id():  # the token is not this machine's alone: a local pid says nothing
        return None
    if pid == os.getpid():
        return False  # an earlier process of this boot had this pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        pass
    except OSError:
        return None
    current = _start_token(pid)
    if current is None or start == "0":
        return None
    return current == start


def _host_token(host: str | None = None, boot: str | None = None, ns: str | None = None) -> str:
    """12 hex digits of a hash of the full host name, the boot id and the PID namespace
    (this machine's, or the given parts'): equal only for one machine's one boot, among
    comparable pids."""
    host = socket.gethostname() if host is None else host
    boot = _boot_id() if boot is None else boot
    ns = _pid_namespace() if ns is None else ns
    return hashlib.sha256(f"{host}\0{boot}\0{ns}".encode()).hexdigest()[:12]


def _boot_id() -> str:
    """This boot's id ("" where there is none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """The PID namespace's inode (hex; "" where there is none)."""
    try:
        return f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:
        return ""


def _start_token(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, hex); None where ``/proc``
    has none, ``"ended"`` for a zombie (it has exited, only not been reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return "ended"  # never equal to a start token
    return f"{int(fields[19]):x}"
