"""Accept a zip archive only if its directory lies exactly where ``torch.save`` puts it.

Why: purestep checks an archive's zip directory with Python's ``zipfile`` before
``torch.load`` reads the file (``safe_load.check_archive``, ``dcp_metadata.check_slice``:
stored entries only, sizes within the file), but ``torch.load`` reads the directory again
with its own reader (miniz, in C++), and the two do not look for it the same way:

* ``zipfile`` places the central directory relative to the end record: data before the
  archive shifts the offset the record states, and every entry's offset, by the
  difference (its "concat"). The miniz that torch builds reads the directory at the
  offset the end record states (some miniz releases shift it as ``zipfile`` does);
* ``zipfile`` reads the zip64 end record right before the zip64 locator and ignores the
  locator's pointer; torch's miniz follows the pointer (some releases try the place
  before the locator first);
* ``zipfile`` reads directory headers until the stated size is used up, miniz the stated
  number of headers; both search the end record backwards from the file's end, within
  a trailing comment of up to 64 KiB.

So one file can hold two directories: a harmless one (stored entries) that ``zipfile``
checks, and one that ``torch.load`` uses, with a record deflated a thousandfold (33 KB
that inflate to 32 MiB before torch notices the record's size is wrong). ``torch.save``
writes a single layout, in which every reading above finds the same directory, and
``check_layout`` accepts that layout only:

* the end record is the file's last 22 bytes (no comment), on disk 0, stating one count;
* if a zip64 locator precedes it (``torch.save`` always writes one), the locator names
  disk 0 of 1 disk and points at the zip64 end record right before it (56 bytes, no
  extensible data, disk 0), and each value of the end record is the zip64 record's or
  the placeholder that defers to it;
* the directory ends exactly where the record that locates it begins (``zipfile``'s
  "concat" is 0, and so is miniz's archive start);
* the directory is exactly the stated number of entry headers, end to end, each with
  well-formed extra fields of which at most one is a zip64 field (nothing says which
  of several a reader should use).

Errors are ``CheckpointError``s saying the file is "corrupt or truncated, or not a
checkpoint", naming the file and what lies where.
"""

from __future__ import annotations

import struct
from typing import IO, NamedTuple

from .codec import CheckpointError

__all__ = ["Directory", "check_entries", "check_layout", "corrupt", "find_directory"]

_END = struct.Struct("<4sHHHHIIH")  # the end of central directory record
_LOCATOR = struct.Struct("<4sIQI")  # the zip64 end of central directory locator
_END64 = struct.Struct("<4sQHHIIQQQQ")  # the zip64 end of central directory record
_HEADER = struct.Struct("<4s24xHHH12x")  # a central directory header: names' lengths
_SIGNATURES = (b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06", b"PK\x01\x02")
_END_SIG, _LOCATOR_SIG, _END64_SIG, _HEADER_SIG = _SIGNATURES
_ZIP64_FIELD = 0x0001  # the extra field holding an entry's 64-bit sizes and offset
_ALL_16, _ALL_32 = 0xFFFF, 0xFFFF_FFFF  # "see the zip64 record" placeholders


class Directory(NamedTuple):
    """Where an archive's central directory lies: ``offset`` and ``size`` in bytes, and
    the ``entries`` it holds."""

    offset: int
    size: int
    entries: int


def corrupt(url: str, detail: str) -> CheckpointError:
    """The error for a file that does not read as a checkpoint."""
    return CheckpointError(f"{url} is corrupt or truncated, or not a checkpoint: {detail}")


def _corrupt(url: str, detail: str) -> CheckpointError:
    return corrupt(url, detail + " (not the layout torch.save writes)")


def _read(f: IO[bytes], offset: int, count: int) -> bytes:
    """``count`` bytes of ``f`` from ``offset`` (fewer only at the file's end)."""
    f.seek(offset)
    parts, got = [], 0
    while got < count:
        part = f.read(count - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def find_directory(f: IO[bytes], size: int, url: str) -> Directory:
    """Where the central directory of the archive ``f`` (``size`` bytes, read from its
    start) lies, read from its end records, refused (``CheckpointError`` naming ``url``)
    unless they lie as ``torch.save`` writes them (see the module doc). Reads at most
    the archive's last 98 bytes; the directory itself is checked by ``check_entries``."""
    if size < _END.size:
        raise _corrupt(url, f"{size} bytes, too short for a zip archive's end record")
    tail_start = max(0, size - _END.size - _LOCATOR.size - _END64.size)
    tail = _read(f, tail_start, size - tail_start)
    if len(tail) != size - tail_start:
        raise _corrupt(url, "its end could not be read in full")
    end_at = size - _END.size
    sig, disk, cd_disk, here, count, cd_size, cd_offset, comment = _END.unpack(
        tail[end_at - tail_start :]
    )
    if sig != _END_SIG or comment:
        raise _corrupt(url, "its last 22 bytes are not a zip end record without a comment")
    if disk or cd_disk or here != count:
        raise _corrupt(url, "its end record describes an archive spanning several disks")
    located_at = end_at  # where the record that locates the directory begins
    locator = tail[end_at - tail_start - _LOCATOR.size : end_at - tail_start]
    if len(locator) == _LOCATOR.size and locator[:4] == _LOCATOR_SIG:
        located_at = end_at - _LOCATOR.size - _END64.size
        record = tail[max(0, located_at - tail_start) : end_at - tail_start - _LOCATOR.size]
        count, cd_size, cd_offset = _zip64_values(
            locator, record, located_at, (count, cd_size, cd_offset), url
        )
    if cd_offset + cd_size != located_at:
        raise _corrupt(
            url,
            f"its zip directory (bytes {cd_offset} to {cd_offset + cd_size}) does not end "
            f"where the record locating it begins (byte {located_at}): readers could each "
            "find a different directory",
        )
    return Directory(cd_offset, cd_size, count)


def _zip64_values(
    locator: bytes, record: bytes, located_at: int, plain: tuple[int, int, int], url: str
) -> tuple[int, int, int]:
    """``(entries, directory size, directory offset)`` from the zip64 end ``record`` (the
    bytes before the zip64 ``locator``, which begin at ``located_at``), checked against
    the locator and against the ``plain`` values of the end record."""
    _, disk, pointer, disks = _LOCATOR.unpack(locator)
    if disk or disks != 1:
        raise _corrupt(url, "its zip64 locator describes an archive spanning several disks")
    if located_at < 0 or pointer != located_at:
        raise _corrupt(
            url,
            f"its zip64 locator points at byte {pointer}, not at a zip64 end record right "
            f"before it (byte {located_at}): readers could each find a different directory",
        )
    sig, length, _, _, disk, cd_disk, here, count, cd_size, cd_offset = _END64.unpack(record)
    if sig != _END64_SIG or length != _END64.size - 12:
        raise _corrupt(url, f"there is no zip64 end record where its locator points ({pointer})")
    if disk or cd_disk or here != count:
        raise _corrupt(url, "its zip64 end record describes an archive spanning several disks")
    zip64 = (count, cd_size, cd_offset)
    for value, wide, placeholder in zip(plain, zip64, (_ALL_16, _ALL_32, _ALL_32)):
        if value not in (wide, placeholder):
            raise _corrupt(
                url,
                f"its end record and zip64 end record disagree on the zip directory "
                f"({plain} against {zip64}): readers could each use a different one",
            )
    return zip64


def check_entries(f: IO[bytes], directory: Directory, url: str) -> None:
    """Refuse the archive ``f`` unless its central ``directory`` (from ``find_directory``)
    is exactly ``directory.entries`` headers end to end, each with well-formed extra fields
    and at most one zip64 field: a reader that counts headers and one that uses up the
    directory's size then see the same entries, with the same sizes. Reads the directory
    once (``directory.size`` bytes)."""
    data = _read(f, directory.offset, directory.size)
    if len(data) != directory.size:
        raise _corrupt(url, "its zip directory could not be read in full")
    at = 0
    for number in range(directory.entries):
        header = data[at : at + _HEADER.size]
        if len(header) != _HEADER.size or header[:4] != _HEADER_SIG:
            raise _corrupt(
                url,
                f"its zip directory holds {number} entry headers, not the "
                f"{directory.entries} its end record states",
            )
        _, name, extra, comment = _HEADER.unpack(header)
        start = at + _HEADER.size + name
        at = start + extra + comment
        if at > len(data):
            raise _corrupt(url, f"entry header {number} of its zip directory is cut short")
        _check_extra(data[start : start + extra], number, url)
    if at != len(data):
        raise _corrupt(
            url,
            f"its zip directory holds {len(data) - at} bytes beyond the {directory.entries} "
            "entry headers its end record states",
        )


def _check_extra(extra: bytes, number: int, url: str) -> None:
    """The extra data of entry header ``number``: fields that fill it exactly, at most one
    of them a zip64 field."""
    at, zip64 = 0, 0
    while at < len(extra):
        if at + 4 > len(extra):
            raise _corrupt(url, f"entry header {number} has a malformed extra field")
        field, length = struct.unpack_from("<HH", extra, at)
        at += 4 + length
        zip64 += field == _ZIP64_FIELD
        if at > len(extra) or zip64 > 1:
            raise _corrupt(url, f"entry header {number} has malformed or repeated extra fields")


def check_layout(f: IO[bytes], size: int, url: str) -> Directory:
    """Refuse the archive ``f`` (``size`` bytes, read from its start) unless its end
    records and central directory lie exactly where ``torch.save`` writes them
    (``find_directory``, then ``check_entries``), so that Python's ``zipfile`` and
    torch's reader read the same directory; returns where it lies. ``url`` names the file
    in errors. Reads the last 98 bytes and the directory."""
    directory = find_directory(f, size, url)
    check_entries(f, directory, url)
    return directory
