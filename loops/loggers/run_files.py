"""Files in a run folder, written without following a symbolic link the writer did not make.

A run folder (``save_dir/name/version_N``) is shared ground: anyone who can write into it
can plant ``hparams.yaml -> ~/.bashrc`` or ``predictions -> /elsewhere``, and a writer that
opens such a path writes outside the run. Every writer of the loggers, the CLI's
``config.yaml`` and the ``PredictionWriter`` goes through the functions here, which refuse
(``LinkRefusedError``, naming the path and where it points) any symbolic link at or below
the folder they are given as ``base``: ``base`` itself, and the folders above it, are the
user's choice (a ``lightning_logs`` linked to another disk is fine).

On POSIX systems the path is walked one folder at a time from ``base`` with directory file
descriptors and ``O_NOFOLLOW``, so a link swapped in between a check and a write is refused
too; files are written to an exclusively created temporary name and renamed over the
target (a reader never sees half a file, and a rename replaces a link, never writes
through it); reads refuse anything but a regular file (a FIFO would block). Where the
system lacks ``O_NOFOLLOW`` or ``dir_fd`` (Windows), every component is checked with
``os.path.islink`` first. Other fsspec filesystems have no links: their files are written
to a temporary name and moved over the target with ``fs.mv`` (a crash mid-write leaves the
old file whole; on object stores the move is a copy, still never a half-written target).

Temporary names are ``.<name>.tmp-<writer identity>-<random>``, with the writer identity of
``engine.checkpoint.storage`` (host, pid, process start). The first write into a folder in
a process removes the temporary files there whose writer has ended on this machine (a
killed run's); another machine's, or one whose writer cannot be told, are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import IO, Any

from .folders import is_local, url_to_fs

__all__ = [
    "LinkRefusedError",
    "RunFiles",
    "append_file",
    "check_file",
    "create_file",
    "list_folder",
    "local_path",
    "make_folder",
    "read_file",
    "remove_file",
    "temp_name",
    "write_file",
]

# Both are needed to walk a path without following links (POSIX systems have them).
_POSIX = hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY") and os.open in os.supports_dir_fd
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK, errno.EEXIST)


class LinkRefusedError(OSError):
    """A path a writer was about to open in a run folder is a symbolic link it did not make
    (or a folder there is not a folder)."""


def local_path(url: str | os.PathLike[str]) -> str | None:
    """The absolute local path of ``url`` when it is on the local disk, else ``None``."""
    fs, path = url_to_fs(os.fspath(url))
    return os.path.abspath(path) if is_local(fs) else None


def _parts(base: str, path: str) -> tuple[str, list[str]]:
    """``(base, the names from base down to path)`` (none when ``path`` is ``base``); a
    ``path`` outside ``base`` is taken relative to its own folder (only its last name is
    then checked)."""
    relative = os.path.relpath(path, base)
    if relative == os.curdir:
        return base, []
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return os.path.dirname(path), [os.path.basename(path)]
    return base, relative.split(os.sep)


def _refused(shown: str, target: str | None) -> LinkRefusedError:
    where = f" (to {target})" if target is not None else ""
    return LinkRefusedError(
        errno.ELOOP,
        f"{shown} is a symbolic link{where} that purestep did not create; it does not write "
        "through links planted in a run folder: remove the link or choose another folder",
        shown,
    )


def _check_entry(dir_fd: int | None, name: str, shown: str) -> None:
    """Raise ``LinkRefusedError`` if ``name`` (in the folder ``dir_fd``; a path when None)
    is a symbolic link; nothing if it is anything else or missing."""
    try:
        if dir_fd is None:
            mode = os.lstat(name).st_mode
        else:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd) if dir_fd is not None else os.readlink(name)
        except OSError:
            target = None
        raise _refused(shown, target)


def _open_child(dir_fd: int, name: str, shown: str, create: bool) -> int:
    """The descriptor of the folder ``name`` in ``dir_fd`` (made if missing and ``create``),
    refusing a link."""
    flags = os.O_RDONLY | _DIRECTORY | _NOFOLLOW
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError:
        _check_entry(dir_fd, name, shown)
        raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, dir_fd=dir_fd)
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        _check_entry(dir_fd, name, shown)
        raise


@contextlib.contextmanager
def _folder(base: str, names: list[str], create: bool) -> Iterator[int | None]:
    """The folder ``base/names...``, walked from ``base`` without following links: its
    descriptor on POSIX systems, ``None`` elsewhere (after an ``islink`` check of every
    level). ``create`` makes the missing levels (and ``base``)."""
    if create:
        os.makedirs(base, exist_ok=True)
    if not _POSIX:
        path = base
        for name in names:
            path = os.path.join(path, name)
            _check_entry(None, path, path)
            if create:
                os.makedirs(path, exist_ok=True)
        yield None
        return
    fd = os.open(base, os.O_RDONLY | _DIRECTORY)
    try:
        shown = base
        for name in names:
            shown = os.path.join(shown, name)
            child = _open_child(fd, name, shown, create)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _open(dir_fd: int | None, folder: str, name: str, flags: int, shown: str) -> int:
    """``os.open`` of ``name`` in the folder, never through a link (refused with a clear
    error)."""
    try:
        if dir_fd is None:
            _check_entry(None, os.path.join(folder, name), shown)
            return os.open(os.path.join(folder, name), flags, 0o666)
        return os.open(name, flags | _NOFOLLOW, 0o666, dir_fd=dir_fd)
    except OSError as error:
        # a link is ELOOP (EMLINK on FreeBSD) with O_NOFOLLOW, EEXIST with O_EXCL
        if isinstance(error, LinkRefusedError) or error.errno not in _LINK_ERRNOS:
            raise
        _check_entry(dir_fd, name if dir_fd is not None else os.path.join(folder, name), shown)
        raise


def _file_parts(base: str, path: str) -> tuple[str, list[str], str]:
    """``(base, the folders from base down to path's, path's name)``."""
    base, names = _parts(base, path)
    if not names:
        raise ValueError(f"{path} is the folder {base} itself, not a file in it")
    return base, names[:-1], names[-1]


#: Bytes of a target's name kept in its temporary name (a file name has 255 at most).
_TEMP_STEM = 160
_TEMP_MARK = ".tmp-"
# the folders (device, inode; remote: URL) this process has swept of dead writers' files
_SWEPT: set[Any] = set()


def temp_name(name: str) -> str:
    """The hidden temporary name a write of ``name`` goes through: ``.<name>.tmp-<writer
    identity>-<12 hex>`` (``name`` cut to ``_TEMP_STEM`` bytes)."""
    from purestep.engine.checkpoint import storage  # imported on first write: it loads torch

    stem = name.encode("utf-8")[:_TEMP_STEM].decode("utf-8", "ignore")
    return f".{stem}{_TEMP_MARK}{storage.writer_identity()}-{secrets.token_hex(6)}"


def _abandoned(name: str) -> bool:
    """Whether ``name`` is a temporary file of a writer that has ended on this machine."""
    if not name.startswith(".") or _TEMP_MARK not in name:
        return False
    from purestep.engine.checkpoint import storage

    return storage.writer_alive(name) is False


def _sweep(fd: int | None, folder: str) -> None:
    """Once per folder and process: remove the temporary files in ``folder`` (the
    descriptor ``fd`` where there is one) that a writer which has ended left (see the
    module docstring). Files that cannot be removed stay."""
    info = os.fstat(fd) if fd is not None else os.stat(folder)
    key = (info.st_dev, info.st_ino)
    if key in _SWEPT:
        return
    _SWEPT.add(key)
    for name in os.listdir(fd if fd is not None else folder):
        if _abandoned(name):
            with contextlib.suppress(OSError):
                if fd is not None:
                    os.unlink(name, dir_fd=fd)  # a link is removed, never its target
                else:
                    os.unlink(os.path.join(folder, name))


def _sweep_remote(fs: Any, folder: str) -> None:
    """``_sweep`` for a folder of another fsspec filesystem."""
    key = (fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0], folder)
    if key in _SWEPT:
        return
    _SWEPT.add(key)
    try:
        entries = fs.ls(folder, detail=False)
    except FileNotFoundError:
        return
    for entry in entries:
        if _abandoned(str(entry).rstrip("/").rsplit("/", 1)[-1]):
            with contextlib.suppress(OSError):
                fs.rm_file(entry)


def make_folder(base: str, folder: str) -> None:
    """Make the local folder ``folder`` (and the levels between it and ``base``), refusing a
    link at any level below ``base``."""
    base, names = _parts(base, folder)
    with _folder(base, names, create=True):
        pass


def write_file(base: str, path: str, data: bytes | Callable[[IO[bytes]], Any]) -> None:
    """Replace the local file ``path`` (under ``base``) by ``data`` atomically: a temporary
    file created exclusively in the same folder, then renamed over it. ``data`` is bytes or
    a function writing to the open file (``torch.save``). A link at ``path`` or at a folder
    between it and ``base`` is refused, not written through."""
    base, folders, name = _file_parts(base, path)
    folder = os.path.join(base, *folders)
    with _folder(base, folders, create=True) as fd:
        _check_entry(fd, name if fd is not None else path, path)
        _sweep(fd, folder)
        tmp = temp_name(name)
        out = _open(fd, folder, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, path)
        try:
            with os.fdopen(out, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data)
            if fd is not None:
                os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            else:
                os.replace(os.path.join(folder, tmp), path)
        except BaseException:
            with contextlib.suppress(OSError):
                if fd is not None:
                    os.unlink(tmp, dir_fd=fd)
                else:
                    os.unlink(os.path.join(folder, tmp))
            raise


def append_file(base: str, path: str, data: bytes) -> None:
    """Append ``data`` to the local file ``path`` (created if missing), refusing links."""
    base, folders, name = _file_parts(base, path)
    with _folder(base, folders, create=True) as fd:
        out = _open(
            fd, os.path.join(base, *folders), name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, path
        )
        with os.fdopen(out, "ab") as f:
            f.write(data)


def create_file(base: str, path: str) -> IO[bytes]:
    """A new local file ``path``, created exclusively (an existing file or link there is an
    error) and opened for writing, its folders made without following links."""
    base, folders, name = _file_parts(base, path)
    with _folder(base, folders, create=True) as fd:
        out = _open(
            fd, os.path.join(base, *folders), name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, path
        )
    return os.fdopen(out, "wb")


def read_file(base: str, path: str) -> bytes | None:
    """The bytes of the local regular file ``path`` (``None`` if it or its folder is
    missing); a link or anything but a regular file (a FIFO, a device) is refused."""
    base, folders, name = _file_parts(base, path)
    try:
        with _folder(base, folders, create=False) as fd:
            flags = os.O_RDONLY | _NONBLOCK  # a FIFO must not block the open
            source = _open(fd, os.path.join(base, *folders), name, flags, path)
    except FileNotFoundError:
        return None
    with os.fdopen(source, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise LinkRefusedError(
                errno.EINVAL, f"{path} is not a regular file; refusing to read it", path
            )
        return f.read()


def remove_file(base: str, path: str) -> bool:
    """Delete the local file ``path`` (a link there is removed, its target left alone);
    whether there was one. A link at a folder between it and ``base`` is refused."""
    base, folders, name = _file_parts(base, path)
    try:
        with _folder(base, folders, create=False) as fd:
            if fd is not None:
                os.unlink(name, dir_fd=fd)
            else:
                os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def check_file(base: str, path: str) -> None:
    """Refuse (``LinkRefusedError``) a link at the local ``path`` or at a folder between it
    and ``base``; nothing if it is missing or anything else."""
    base, folders, name = _file_parts(base, path)
    try:
        with _folder(base, folders, create=False) as fd:
            _check_entry(fd, name if fd is not None else path, path)
    except FileNotFoundError:
        return


def list_folder(base: str, folder: str) -> list[str]:
    """The names in the local folder ``folder`` (``[]`` if missing), refusing a link at it
    or at a level between it and ``base``."""
    base, names = _parts(base, folder)
    try:
        with _folder(base, names, create=False) as fd:
            return sorted(os.listdir(fd if fd is not None else os.path.join(base, *names)))
    except FileNotFoundError:
        return []


class RunFiles:
    """The files of one folder ``folder`` (a path or fsspec URL) under ``base``: on the local
    disk through the link-refusing functions above, elsewhere through fsspec."""

    def __init__(self, base: str, folder: str) -> None:
        self.folder = folder
        self._fs, self._path = url_to_fs(folder)
        self._local = local_path(folder)
        self._base = local_path(base) if self._local is not None else None

    def _at(self, name: str) -> str:
        if self._local is not None:
            return os.path.join(self._local, name)
        return f"{self._path.rstrip('/')}/{name}"

    def make(self) -> None:
        """Make the folder (refusing links below ``base``)."""
        if self._local is not None:
            make_folder(self._base, self._local)
        else:
            self._fs.makedirs(self._path, exist_ok=True)

    def write(self, name: str, data: bytes) -> None:
        """Replace the file ``name`` by ``data``: a temporary file renamed (locally) or
        moved (other filesystems) over it, so a crash mid-write leaves the old file."""
        if self._local is not None:
            write_file(self._base, self._at(name), data)
            return
        fs = self._fs
        fs.makedirs(self._path, exist_ok=True)
        _sweep_remote(fs, self._path)
        tmp = self._at(temp_name(name))
        try:
            fs.pipe_file(tmp, data)
            fs.mv(tmp, self._at(name))
        except BaseException:
            with contextlib.suppress(Exception):
                if fs.exists(tmp):
                    fs.rm_file(tmp)
            raise

    def append(self, name: str, data: bytes) -> None:
        """Add ``data`` at the end of the file ``name``; ``NotImplementedError`` or
        ``ValueError`` from stores without appends."""
        if self._local is not None:
            append_file(self._base, self._at(name), data)
            return
        with self._fs.open(self._at(name), "ab") as f:
            f.write(data)

    def read(self, name: str) -> bytes | None:
        """The bytes of the file ``name``, ``None`` if it is missing."""
        if self._local is not None:
            return read_file(self._base, self._at(name))
        path = self._at(name)
        return self._fs.cat_file(path) if self._fs.exists(path) else None

    def remove(self, name: str) -> bool:
        """Delete the file ``name``; whether there was one."""
        if self._local is not None:
            return remove_file(self._base, self._at(name))
        path = self._at(name)
        if not self._fs.exists(path):
            return False
        self._fs.rm_file(path)
        return True

    def check(self, name: str) -> None:
        """Refuse a link at ``name`` (or at the folders below ``base``) before using it."""
        if self._local is not None:
            check_file(self._base, self._at(name))

    def exists(self, name: str) -> bool:
        """Whether there is an entry ``name`` (a link counts: it is not followed)."""
        if self._local is not None:
            return os.path.lexists(self._at(name))
        return self._fs.exists(self._at(name))
