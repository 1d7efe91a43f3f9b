"""Read a file with ``torch.load(weights_only=True)``, turning every failure into a clear error.

Checkpoints and weight files are both read here, so they refuse the same things with the
same messages. Before ``torch.load`` sees a file, its zip directory is checked
(``check_archive``) for what ``torch.save`` never writes: a compressed entry (it could
inflate far beyond the file, e.g. 1 MB into 1 GiB), an entry that declares more bytes than
the file holds, entries whose sizes add up to more than the file; the small control entries
(``data.pkl``, ``version``, ...) must match their checksums. So nothing is allocated beyond
the file's size. A file that needs the unpickler to build arbitrary objects is refused
(nothing from it runs); anything else that does not read is "corrupt or truncated, or not a
checkpoint", naming the file. A missing or uncommitted file stays a ``FileNotFoundError``,
and a FIFO, device or directory is refused unopened (see ``storage.open_read``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterator
from typing import IO, Any

import torch

from . import storage
from .codec import CheckpointError

__all__ = ["check_archive", "open_archive", "read_entry", "torch_load"]

# What torch.load raises for a damaged file: a bad zip directory, a short read, a missing
# archive member, an I/O failure half way through, a garbled pickle stream.
_CORRUPT = (
    RuntimeError,
    EOFError,
    zipfile.BadZipFile,
    ValueError,
    OSError,
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    struct.error,
    OverflowError,
)
# What the weights-only unpickler says when it refuses a global or an object (anything
# else it raises means the pickle stream itself is garbled).
_REFUSALS = (
    "GLOBAL ",
    "Trying to call reduce",
    "Can only create new object",
    "Can only build",
    "must be imported to load",
)
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


def corrupt(url: str, detail: str) -> CheckpointError:
    """The error for a file that does not read as a checkpoint."""
    return CheckpointError(f"{url} is corrupt or truncated, or not a checkpoint: {detail}")


def check_archive(f: IO[bytes], url: str, *, verify: bool = True) -> zipfile.ZipFile:
    """The zip directory of the open file ``f``, refused unless it is one ``torch.save``
    could have written: stored (uncompressed) entries inside the file, a ``data.pkl``, and
    (``verify``) control entries that match their checksums. Reads the directory and, to
    verify, the control entries (``data.pkl`` grows with the state; tensors are not read)."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    try:
        archive = zipfile.ZipFile(f)
        infos = archive.infolist()
    except Exception as err:  # whatever zipfile makes of garbage
        detail = f"not a zip archive as torch.save writes ({_first_line(err)})"
        raise corrupt(url, detail + "; torch's legacy pre-1.6 format is not read") from None
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"refusing to load {url}: its entry {info.filename!r} is compressed (zip method "
                f"{info.compress_type}); torch.save stores entries uncompressed, so this file "
                "is corrupt or not a checkpoint (a compressed entry can inflate far beyond the "
                "file's size)"
            )
        total += info.file_size
        if info.file_size != info.compress_size:
            raise corrupt(
                url,
                f"its entry {info.filename!r} declares {info.file_size} bytes but stores "
                f"{info.compress_size}",
            )
        if info.header_offset < 0 or info.header_offset + info.file_size > size:
            raise CheckpointError(
                f"refusing to load {url}: its entry {info.filename!r} declares "
                f"{info.file_size} bytes at offset {info.header_offset}, more than the file "
                f"({size} bytes) holds; it is corrupt or not a checkpoint"
            )
    if total > size:
        raise CheckpointError(
            f"refusing to load {url}: its entries declare {total} bytes in all, more than the "
            f"file ({size} bytes) holds; it is corrupt or not a checkpoint"
        )
    pickles = [i for i in infos if i.filename.rsplit("/", 1)[-1] == "data.pkl"]
    if len(pickles) != 1:
        raise corrupt(url, "a zip archive, but not one torch.save wrote (no single data.pkl)")
    prefix = pickles[0].filename[: -len("data.pkl")]
    for info in infos if verify else ():
        if not info.filename.startswith(prefix + "data/"):
            read_entry(f, info, url)
    return archive


def read_entry(f: IO[bytes], info: zipfile.ZipInfo, url: str) -> bytes:
    """The bytes of the stored entry ``info`` of ``f`` (checked by ``check_archive``),
    verified against its checksum (unless the writer left it 0: torch can skip it)."""
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise corrupt(url, f"entry {info.filename!r} has no valid zip header")
    _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    f.seek(info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)
    data = f.read(info.file_size)
    if len(data) != info.file_size:
        raise corrupt(url, f"entry {info.filename!r} is cut short")
    if info.CRC and zlib.crc32(data) != info.CRC:
        raise corrupt(url, f"entry {info.filename!r} does not match its checksum")
    return data


@contextlib.contextmanager
def open_archive(
    url: str,
    *,
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
) -> Iterator[tuple[IO[bytes], zipfile.ZipFile]]:
    """``(file, zip directory)`` of ``url``, opened with ``storage.open_read`` and checked
    with ``check_archive``; the file is closed on exit."""
    with storage.open_read(url, commit=commit, storage_options=storage_options) as f:
        yield f, check_archive(f, url, verify=verify)


def torch_load(
    url: str,
    *,
    map_location: Any = "cpu",
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
    advice: str = "",
) -> Any:
    """The object ``torch.save`` wrote to ``url``, read without running code from it.

    ``advice`` is added to the refusal of a file that holds arbitrary Python objects (e.g.
    how to extract the weights from a trusted file).
    """
    with open_archive(url, commit=commit, storage_options=storage_options) as (f, _):
        local = getattr(f, "name", None) if storage.is_local_url(url) else None
        source = local if isinstance(local, str) else f
        f.seek(0)
        try:
            return torch.load(source, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            if not any(refusal in str(err) for refusal in _REFUSALS):
                raise corrupt(url, _unpickler_detail(err)) from None
            raise CheckpointError(
                f"refusing to load {url}: it holds Python objects other than tensors and "
                f"plain containers (a pickle payload?); nothing from it was run. {advice}"
                f"Detail: {_unpickler_detail(err)}"
            ) from None
        except _CORRUPT as err:
            raise corrupt(url, _first_line(err)) from None


def _unpickler_detail(err: Exception) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if "Unsupported" in ln or "error" in ln]
    return (lines[-1] if lines else (str(err).splitlines() or [""])[0])[:300]


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0][:300] or type(err).__name__
