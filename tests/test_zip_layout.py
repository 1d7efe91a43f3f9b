"""An archive is read only if its zip directory lies exactly where ``torch.save`` writes it
(``engine.checkpoint.zip_layout``): Python's ``zipfile``, which purestep checks a file
with, and torch's reader (miniz), which ``torch.load`` reads it with, then read the same
directory.

The crafted archives hold two directories of one size: a stored-only one that ``zipfile``
finds and one with the tensor record deflated (33 KB that inflate to 32 MiB) that torch's
miniz finds, by the end record's stated offset or by the zip64 locator's pointer.
``two_directories`` is also used by ``test_sharded_bounds`` for DCP data slices.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import pytest
import torch

from purestep.engine.checkpoint import CheckpointError, safe_load, zip_layout

pytestmark = pytest.mark.timeout(60)

# ---------------------------------------------------------------------- crafting helpers


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _local(name: str, method: int, crc: int, csize: int, usize: int) -> bytes:
    """A local file header (no extra field)."""
    raw = name.encode()
    return (
        struct.pack(
            "<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0, crc, csize, usize, len(raw), 0
        )
        + raw
    )


def _central(
    name: str, method: int, crc: int, size: tuple[int, int], offset: int, extra: bytes = b""
) -> bytes:
    """A central directory header for an entry of ``size`` (compressed, uncompressed)."""
    raw = name.encode()
    csize, usize = size
    fields = (b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, csize, usize, len(raw), len(extra))
    return struct.pack("<4sHHHHHHIIIHHHHHII", *fields, 0, 0, 0, 0, offset) + raw + extra


def _end(count: int, size: int, offset: int) -> bytes:
    return struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, size, offset, 0)


def _end64(count: int, size: int, offset: int) -> bytes:
    return struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, offset)


def _locator(pointer: int, disks: int = 1) -> bytes:
    return struct.pack("<4sIQI", b"PK\x06\x07", 0, pointer, disks)


def _deflated_zeros(count: int) -> tuple[bytes, int]:
    """``count`` zero bytes, raw-deflated, and their CRC (built 1 MiB at a time)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    block, parts, crc = bytes(1 << 20), [], 0
    for start in range(0, count, len(block)):
        chunk = block[: min(len(block), count - start)]
        parts.append(packer.compress(chunk))
        crc = zlib.crc32(chunk, crc)
    parts.append(packer.flush())
    return b"".join(parts), crc


def two_directories(numel: int, inflate_to: int, trick: str) -> tuple[bytes, tuple[int, int]]:
    """The archive ``torch.save(torch.zeros(numel))`` writes, with its record deflated from
    ``inflate_to`` zero bytes and two directories of one size: a *stored* one (the record
    declared stored, ``4 * numel`` bytes) that Python's ``zipfile`` finds, and a
    *deflated* one that torch's miniz finds. ``trick`` is how they are told apart:

    * ``"offset"``: the record's entry first (``torch.load`` wants an entry at byte 0),
      then both directories; the end record states the deflated one's offset, and
      ``zipfile`` shifts it (its "concat": the bytes between the directory and the end
      record) onto the stored one, whose offsets are written that much short;
    * ``"zip64"``: each directory followed by its zip64 end record; ``zipfile`` reads the
      one right before the locator, miniz the one the locator points at.

    Returns the bytes and the span of the deflated record's data in them."""
    entries = []
    for info, data in _entries(_saved(torch.zeros(numel))):
        if info.filename.endswith("/data/0"):
            packed, crc = _deflated_zeros(inflate_to)
            entries.insert(
                0 if trick == "offset" else len(entries), (info.filename, packed, crc, inflate_to)
            )
        else:
            entries.append((info.filename, data, zlib.crc32(data), len(data)))
    size = sum(46 + len(name.encode()) for name, *_ in entries)  # one directory's bytes
    shift = size if trick == "offset" else 0
    body, stored, deflated, span = bytearray(), b"", b"", (0, 0)
    for name, data, crc, usize in entries:
        at = len(body)
        record = name.endswith("/data/0")
        body += _local(name, 8 if record else 0, crc, len(data), usize)
        if record:
            span = (len(body), len(body) + len(data))
        body += data
        deflated += _central(name, 8 if record else 0, crc, (len(data), usize), at)
        declared = (4 * numel,) * 2 if record else (len(data), len(data))
        stored += _central(name, 0, 0 if record else crc, declared, max(0, at - shift))
    count, start = len(entries), len(body)
    if trick == "offset":
        tail = deflated + stored + _end(count, size, start)
    else:
        second = start + size + 56
        tail = deflated + _end64(count, size, start) + stored + _end64(count, size, second)
        tail += _locator(start + size) + _end(count, size, second)
    return bytes(body) + tail, span


def _entries(data: bytes) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return [(info, archive.read(info)) for info in archive.infolist()]


def _stored_zip(entries: list[tuple[str, bytes]], extra: bytes = b"") -> bytes:
    """A plain archive of stored ``entries``, each central header with ``extra``."""
    body, directory = b"", b""
    for name, data in entries:
        crc = zlib.crc32(data)
        directory += _central(name, 0, crc, (len(data), len(data)), len(body), extra)
        body += _local(name, 0, crc, len(data), len(data)) + data
    return body + directory + _end(len(entries), len(directory), len(body))


def _miniz_directory(data: bytes, trick: str) -> list[int]:
    """The zip methods of the entries in the directory torch's miniz (as torch builds it)
    reads: at the end record's stated offset, or where the zip64 locator points."""
    count, _, offset = struct.unpack("<HII", data[-12:-2])
    if trick == "zip64":
        (pointer,) = struct.unpack("<Q", data[-34:-26])
        (offset,) = struct.unpack("<Q", data[pointer + 48 : pointer + 56])
    methods, at = [], offset
    for _ in range(count):
        method, name, extra, comment = (
            struct.unpack("<H", data[at + 10 : at + 12])[0],
            *struct.unpack("<HHH", data[at + 28 : at + 34]),
        )
        methods.append(method)
        at += 46 + name + extra + comment
    return methods


def _check(data: bytes) -> zip_layout.Directory:
    return zip_layout.check_layout(io.BytesIO(data), len(data), "x.pt")


# ---------------------------------------------------------------------- what is accepted


@pytest.mark.parametrize(
    "obj",
    [
        torch.zeros(3),
        torch.tensor(1.0),
        torch.zeros(0, 3),
        torch.randn(100, 10).bfloat16(),
        torch.ones(5) > 0,
        {"a": torch.zeros(2), "b": [torch.ones(3), 7]},
    ],
    ids=["float", "scalar", "empty", "bf16", "bool", "nested"],
)
def test_archives_torch_save_writes_are_accepted(obj):
    data = _saved(obj)
    directory = _check(data)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:  # the directory zipfile reads
        assert directory.entries == len(archive.infolist())
        assert directory.offset == archive.start_dir


def test_an_archive_without_zip64_records_is_accepted():
    assert _check(_PLAIN).entries == 2
    one_zip64_field = struct.pack("<HH", 1, 0)
    assert _check(_stored_zip([("archive/data.pkl", b".")], one_zip64_field)).entries == 1


# ---------------------------------------------------------------------- what is refused


@pytest.mark.parametrize("trick", ["offset", "zip64"])
def test_an_archive_with_two_directories_is_refused(trick):
    data, _ = two_directories(1024, 8 << 20, trick)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:  # what purestep's check sees
        assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_STORED}
    assert zipfile.ZIP_DEFLATED in _miniz_directory(data, trick)  # what torch.load would use
    with pytest.raises(CheckpointError, match="x.pt is corrupt .*readers could each find"):
        _check(data)


def _edit(data: bytes, at: int, fmt: str, *values) -> bytes:
    """``data`` with ``values`` packed as ``fmt`` at ``at`` (negative: from the end)."""
    out = bytearray(data)
    at %= len(out)
    out[at : at + struct.calcsize(fmt)] = struct.pack(fmt, *values)
    return bytes(out)


def _both_counts(data: bytes, count: int) -> bytes:
    """Both end records stating ``count`` entries."""
    return _edit(_edit(data, -14, "<HH", count, count), -98 + 24, "<QQ", count, count)


_GOOD = _saved(torch.arange(4.0))  # 7 entries, zip64 end records
_PLAIN = _stored_zip([("archive/data.pkl", b"\x80\x02K\x01."), ("archive/version", b"3\n")])


@pytest.mark.parametrize(
    "data, why",
    [
        (_edit(_GOOD, -2, "<H", 2) + b"hi", "not a zip end record without a comment"),
        (_GOOD + b"\0", "not a zip end record without a comment"),
        (bytes(8) + _GOOD, r"its zip64 locator points at byte \d+, not at a zip64 end"),
        (bytes(8) + _PLAIN, r"does not end where the record locating it begins \(byte"),
        (_edit(_GOOD, -34, "<Q", 0), "its zip64 locator points at byte 0"),
        (_edit(_GOOD, -26, "<I", 2), "zip64 locator describes an archive spanning several"),
        (_edit(_GOOD, -98, "<4s", b"PK\0\0"), "no zip64 end record where its locator points"),
        (_edit(_GOOD, -14, "<HH", 6, 6), "its end record and zip64 end record disagree"),
        (_edit(_GOOD, -16, "<H", 1), "end record describes an archive spanning several disks"),
        (_both_counts(_GOOD, 6), r"holds \d+ bytes beyond the 6 entry headers"),
        (_both_counts(_GOOD, 8), "holds 7 entry headers, not the 8"),
        (_stored_zip([("a", b"")], struct.pack("<HH", 1, 0) * 2), "repeated extra fields"),
        (_stored_zip([("a", b"")], b"\x01\x00"), "malformed extra field"),
        (_GOOD[:21], "too short for a zip archive"),
        (_GOOD[-22:], "does not end where the record locating it begins"),
    ],
    ids=[
        "comment",
        "trailing-byte",
        "leading-data",
        "leading-data-no-zip64",
        "locator-elsewhere",
        "two-disks",
        "no-zip64-record",
        "records-disagree",
        "disk-number",
        "fewer-entries-stated",
        "more-entries-stated",
        "two-zip64-fields",
        "cut-extra-field",
        "too-short",
        "end-record-only",
    ],
)
def test_layouts_torch_save_never_writes_are_refused(data, why):
    with pytest.raises(CheckpointError, match=f"x.pt is corrupt or truncated.*{why}"):
        _check(data)


def test_placeholders_deferring_to_the_zip64_record_are_accepted():
    data = _edit(_GOOD, -14, "<HHII", 0xFFFF, 0xFFFF, 0xFFFF_FFFF, 0xFFFF_FFFF)
    assert _check(data) == _check(_GOOD)


# ---------------------------------------------------------------------- plain files


@pytest.mark.parametrize("trick", ["offset", "zip64"])
def test_a_plain_file_with_two_directories_is_refused_before_torch_load(
    tmp_path, monkeypatch, trick
):
    data, _ = two_directories(1024, 8 << 20, trick)
    path = tmp_path / "w.pt"
    path.write_bytes(data)
    calls = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or load(*a, **k))
    with pytest.raises(CheckpointError, match="w.pt is corrupt .*readers could each find"):
        safe_load.torch_load(str(path))
    assert calls == []  # refused before torch's reader inflated anything
