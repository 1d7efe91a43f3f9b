"""Check a DCP data slice before DCP reads it: an archive as ``torch.save`` writes it, that
decodes to no more than its chunk declares.

``check_slice`` reads about a kilobyte of the slice: its zip end records and directory lie
exactly where ``torch.save`` writes them (``zip_layout``: so torch's reader uses the
directory checked here), stored entries only (a compressed entry could inflate a
thousandfold), tensor records of at most the chunk's bytes, control entries of at most
``MAX_SLICE_OVERHEAD``, and a ``data.pkl`` that matches its checksum and passes
``safe_load.scan_pickle`` (nothing built beyond what the slice holds). Nothing is
decompressed and the checks read no tensor data (DCP's ``torch.load`` reads it once).
"""

from __future__ import annotations

import io
import os
from typing import IO, Any

from . import zip_layout
from .codec import CheckpointError
from .safe_load import check_archive, read_entry, scan_pickle

__all__ = ["MAX_SLICE_OVERHEAD", "check_slice"]

#: The bytes a data slice may hold beyond its chunk's tensor bytes: ``torch.save``'s zip
#: headers, alignment padding and control entries (about 1 KiB for one tensor). Also the
#: largest zip directory, and the most control entries, a slice may hold.
MAX_SLICE_OVERHEAD = 64 * 1024


class _Window(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of the open binary ``file``, seekable as a
    file of their own: what ``zipfile`` needs to read one data slice's directory. (DCP's
    own view of a slice reports positions of the whole file.)"""

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the slice")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        if count == 0:
            return 0
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer).cast("B")[:count]) or 0
        self._pos += got
        return got


def check_slice(file: IO[bytes], offset: int, length: int, declared: int, where: str) -> None:
    """Refuse the data slice ``file[offset : offset + length]`` unless it is an archive as
    ``torch.save`` writes it that decodes to at most ``declared`` bytes of tensor records
    (its chunk's) and ``MAX_SLICE_OVERHEAD`` of control entries:

    * its zip directory lies where ``torch.save`` writes it (``zip_layout``: otherwise
      torch's reader could use another directory than the one checked here) and is at
      most ``MAX_SLICE_OVERHEAD`` bytes;
    * its entries are stored (uncompressed) inside the slice (``safe_load.check_archive``);
    * its ``data.pkl`` matches its checksum and builds nothing larger than the slice
      (``safe_load.scan_pickle``: no ``bytearray(n)``, no exponentially shared structure,
      no view past its storage; torch checks each storage against its record).

    Reads the end records, the directory (twice: here and by ``zipfile``) and
    ``data.pkl`` only: about a kilobyte for a slice ``torch.save`` wrote, a few times
    ``MAX_SLICE_OVERHEAD`` at most, and no tensor record. So a bomb is refused before
    anything inflates. ``where`` names the slice in errors."""
    window = _Window(file, offset, length)
    directory = zip_layout.find_directory(window, length, where)
    if directory.size > MAX_SLICE_OVERHEAD:
        raise CheckpointError(
            f"refusing to load {where}: its zip directory is {directory.size} bytes; "
            f"torch.save writes about a kilobyte for a tensor (at most {MAX_SLICE_OVERHEAD})"
        )
    zip_layout.check_entries(window, directory, where)
    infos = check_archive(window, where, verify=False).infolist()
    pickled = next(i for i in infos if i.filename.rsplit("/", 1)[-1] == "data.pkl")
    records = pickled.filename[: -len("data.pkl")] + "data/"
    data = sum(i.file_size for i in infos if i.filename.startswith(records))
    control = sum(i.file_size for i in infos if not i.filename.startswith(records))
    if data > declared:
        raise CheckpointError(
            f"refusing to load {where}: it holds {data} bytes of tensor data but its chunk "
            f"declares {declared}"
        )
    if control > MAX_SLICE_OVERHEAD:
        raise CheckpointError(
            f"refusing to load {where}: its control entries hold {control} bytes, more than "
            f"torch.save writes (at most {MAX_SLICE_OVERHEAD})"
        )
    scan_pickle(read_entry(window, pickled, where), where)
