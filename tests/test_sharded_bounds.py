"""What a sharded checkpoint's data may decode to is bounded by what its DCP index declares
(``engine.checkpoint.dcp_metadata``): a small crafted folder cannot make ``sharded.load``,
``sharded.peek`` or the resume discovery allocate far more than it stores.

Crafted folders are built as an attacker would: a real checkpoint whose ``.metadata`` is
pickled back altered, or whose data slice is replaced by a hand-made ``torch.save``
archive (a deflated record: 33 KB that inflate to 32 MiB). All in one process, each test
well under a second.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import itertools
import os
import pickle
import struct
import time
import zipfile

import pytest
import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from purestep import engine
from purestep.engine import checkpoint
from purestep.engine.checkpoint import CheckpointError, sharded
from purestep.engine.checkpoint import dcp_metadata as dm
from tests.test_zip_layout import two_directories

pytestmark = pytest.mark.timeout(120)

# ---------------------------------------------------------------------- crafting helpers


def _state():
    """A state whose first parameter is a 64 x 128 float32 weight: 32 KiB in one chunk."""
    return engine.init(torch.nn.Linear(128, 64), engine.optim.sgd(0.1), seed=0)


def _saved(tmp_path, state=None, name="s.ckpt") -> str:
    path = str(tmp_path / name)
    sharded.save(_state() if state is None else state, path)
    return path


def _raw(path: str):
    """The folder's DCP index, unpickled without the checks (to alter it)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return dm.MetadataUnpickler(f).load()


def _write(path: str, meta) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _storage(meta, key: str):
    return next(info for index, info in meta.storage_data.items() if index.fqn == key)


_STORAGE = object()


class _Tensor:
    """Pickles as ``torch.save`` pickles a float32 tensor of ``shape`` viewing the start of
    the storage that ``_STORAGE`` stands for."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __reduce__(self):
        stride = tuple(
            int(torch.tensor(self.shape[i + 1 :]).prod()) for i in range(len(self.shape))
        )
        args = (_STORAGE, 0, self.shape, stride, False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


def _archive(shape, record: int, *, deflate: bool, control: int = 0, notes: int = 0) -> bytes:
    """A ``torch.save``-like archive of a ``shape`` float32 tensor whose storage record is
    ``record`` zero bytes, deflated or stored, with ``control`` bytes of extra control
    entry and ``notes`` empty entries with a 36000-byte comment each (comments live in the
    zip directory alone). The record is written in 1 MiB blocks: the test never holds it
    whole."""

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return (
                ("storage", torch.FloatStorage, "0", "cpu", record // 4)
                if obj is _STORAGE
                else None
            )

    pickled = io.BytesIO()
    _Pickler(pickled, protocol=2).dump(_Tensor(shape))
    out = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(out, "w", compression=method, compresslevel=9) as z:
        z.writestr("archive/data.pkl", pickled.getvalue(), compress_type=zipfile.ZIP_STORED)
        z.writestr("archive/byteorder", b"little", compress_type=zipfile.ZIP_STORED)
        with z.open("archive/data/0", "w") as w:
            for start in range(0, record, 1 << 20):
                w.write(bytes(min(1 << 20, record - start)))
        z.writestr("archive/version", b"3\n", compress_type=zipfile.ZIP_STORED)
        if control:
            z.writestr("archive/extra", bytes(control), compress_type=zipfile.ZIP_STORED)
        for i in range(notes):
            info = zipfile.ZipInfo(f"archive/note{i}")
            info.comment = bytes(36000)
            z.writestr(info, b"", compress_type=zipfile.ZIP_STORED)
    return out.getvalue()


def _replace_slice(path: str, key: str, data: bytes) -> tuple[str, int]:
    """Append ``data`` to ``key``'s data file and point its storage entry at it (the old
    slice stays, unreferenced). Returns the data file's name and the new slice's offset."""
    meta = _raw(path)
    info = _storage(meta, key)
    file = os.path.join(path, info.relative_path)
    info.offset, info.length = os.path.getsize(file), len(data)
    with open(file, "ab") as f:
        f.write(data)
    _write(path, meta)
    return info.relative_path, info.offset


def _record_span(data: bytes, at: int = 0) -> tuple[int, int]:
    """Where the tensor record's bytes of the archive ``data`` lie, ``data`` starting at
    byte ``at`` of its file (read from the record's local header, as torch reads it)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    name, extra = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = at + info.header_offset + 30 + name + extra
    return start, start + info.compress_size


class _Counting(io.RawIOBase):
    """The binary file ``stream``, logging ``(name, start, end)`` of every read from it."""

    def __init__(self, stream, name: str, log: list) -> None:
        super().__init__()
        self._stream, self._name, self._log = stream, name, log

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        return self._stream.seek(pos, whence)

    def tell(self) -> int:
        return self._stream.tell()

    def readinto(self, buffer) -> int:
        start = self._stream.tell()
        count = self._stream.readinto(buffer) or 0
        self._log.append((self._name, start, start + count))
        return count

    def read(self, size: int = -1) -> bytes:
        start = self._stream.tell()
        data = self._stream.read(size)
        self._log.append((self._name, start, start + len(data)))
        return data


@pytest.fixture
def reads(monkeypatch) -> list:
    """Every byte range read from a checkpoint's data files while DCP loads it, by the
    slice checks and DCP's own ``torch.load`` calls alike: ``(file name, start, end)``,
    logged by the streams DCP's ``FileSystem`` opens (however DCP reads through them)."""
    log: list = []
    opened = dcp_filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def counting(self, path, mode):
        with opened(self, path, mode) as stream:
            yield _Counting(stream, os.path.basename(path), log) if "r" in mode else stream

    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", counting)
    return log


def _read_in(reads: list, name: str, start: int, end: int) -> tuple[int, int]:
    """``(bytes read, distinct bytes read)`` of bytes ``start`` to ``end`` of file ``name``."""
    parts = sorted(
        (max(a, start), min(b, end)) for n, a, b in reads if n == name and a < end and b > start
    )
    distinct, reached = 0, start
    for a, b in parts:
        distinct += max(0, b - max(a, reached))
        reached = max(reached, b)
    return sum(b - a for a, b in parts), distinct


# ---------------------------------------------------------------------- item 3: slices


def test_a_decompression_bomb_slice_is_refused_before_it_inflates(tmp_path, reads):
    path = _saved(tmp_path / "runs")
    bomb = _archive((64, 128), 32 << 20, deflate=True)  # 32 MiB from about 33 KB
    assert 32 << 10 <= len(bomb) < 40_000  # about the chunk's 32 KiB: it passes the index
    name, offset = _replace_slice(path, "params.0", bomb)
    record = _record_span(bomb, offset)
    sharded.peek(path)  # the index alone is consistent: the slice is what lies
    for target in (None, _state()):  # the resume path loads into a fresh state
        with pytest.raises(CheckpointError, match="'params.0'.*compressed") as err:
            sharded.load(path, target)
        assert path in str(err.value)
    with pytest.warns(UserWarning, match="compressed"):  # fit(ckpt_path="last")'s discovery
        assert checkpoint.load_latest(str(tmp_path / "runs")) is None
    assert _read_in(reads, name, *record) == (0, 0)  # not a byte of the record: no inflating
    assert _read_in(reads, name, offset, offset + len(bomb))[0] <= 3 * dm.MAX_SLICE_OVERHEAD


@pytest.mark.parametrize(
    "record, control, notes, why",
    [
        # stored, but more tensor bytes than the 32 KiB chunk declares
        ((48 << 10), 0, 0, r"holds 49152 bytes of tensor data but its chunk declares 32768"),
        # the tensor's bytes, and control entries beyond anything torch.save writes
        ((8 << 10), (80 << 10) - 1, 0, "control entries hold"),
        # a zip directory of 72 KB for 8 entries: parsing it would be the amplification
        ((8 << 10), 0, 2, "its zip directory is 72"),
    ],
)
def test_a_slice_decoding_to_more_than_its_chunk_is_refused(
    tmp_path, reads, record, control, notes, why
):
    path = _saved(tmp_path)
    crafted = _archive((64, 128), record, deflate=False, control=control, notes=notes)
    name, offset = _replace_slice(path, "params.0", crafted)
    with pytest.raises(CheckpointError, match=why):
        sharded.load(path)
    assert _read_in(reads, name, *_record_span(crafted, offset)) == (0, 0)


@pytest.mark.parametrize("trick", ["offset", "zip64"])
def test_a_slice_with_two_zip_directories_is_refused_before_it_inflates(tmp_path, reads, trick):
    path = _saved(tmp_path, {"w": torch.zeros(4096)})  # a chunk of 16 KiB
    crafted, (start, end) = two_directories(4096, 32 << 20, trick)  # 33 KB, 32 MiB inflated
    name, offset = _replace_slice(path, "w.0", crafted)
    with pytest.raises(CheckpointError, match="'w.0'.* is corrupt .*readers could each find"):
        sharded.load(path)
    assert _read_in(reads, name, offset + start, offset + end) == (0, 0)


def _pickle_slice(pickled: bytes) -> bytes:
    """A slice whose ``data.pkl`` is ``pickled`` (stored, with a valid checksum)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")
    return out.getvalue()


def _bytearray_pickle(size: int) -> bytes:
    """``bytearray(size)``: allowed by the weights-only unpickler, allocating ``size``."""
    return b"\x80\x02cbuiltins\nbytearray\nJ" + struct.pack("<i", size) + b"\x85R."


def _shared_tuples(depth: int) -> bytes:
    """``{t: 1}`` with ``t`` tuples of two references to the one below, ``depth`` deep: a
    few hundred bytes that hashing the key walks ``2**depth`` times."""
    out = bytearray(b"\x80\x02}K\x01\x85q\x00")
    out += b"h\x00\x86q\x00" * depth
    return bytes(out + b"K\x01s.")


@pytest.mark.parametrize(
    "pickled, why",
    [
        (_bytearray_pickle(64 << 20), r"calling bytearray\(n\)"),
        (_shared_tuples(26), "its pickle expands to more than"),
    ],
    ids=["bytearray", "shared-tuples"],
)
def test_a_slice_whose_pickle_builds_more_than_it_holds_is_refused(tmp_path, pickled, why):
    path = _saved(tmp_path, {"w": torch.zeros(1)})
    crafted = _pickle_slice(pickled)
    assert len(crafted) < 600
    _replace_slice(path, "w.0", crafted)
    with pytest.raises(CheckpointError, match=f"'w.0'.*{why}"):
        sharded.load(path)


def test_slices_are_checked_however_dcp_reads_them(tmp_path, monkeypatch, reads):
    """A DCP whose ``read_data`` no longer slices files through the private
    ``FileSystemReader._slice_file`` still has every slice checked first."""
    path = _saved(tmp_path)
    bomb = _archive((64, 128), 32 << 20, deflate=True)
    name, offset = _replace_slice(path, "params.0", bomb)
    upstream = dcp_filesystem.FileSystemReader.read_data

    def without_the_hook(self, plan, planner):
        self._slice_file = functools.partial(dcp_filesystem.FileSystemReader._slice_file, self)
        return upstream(self, plan, planner)

    monkeypatch.setattr(dcp_filesystem.FileSystemReader, "read_data", without_the_hook)
    with pytest.raises(CheckpointError, match="'params.0'.*compressed"):
        sharded.load(path)
    assert _read_in(reads, name, *_record_span(bomb, offset)) == (0, 0)


def test_slices_as_dcp_writes_them_load_and_are_read_once(tmp_path, monkeypatch, reads):
    state = {"w": torch.arange(5000.0), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    path = _saved(tmp_path, state)
    checks: list = []  # the reads of each check_slice call
    check = dm.check_slice

    def watched(*args):
        before = len(reads)
        check(*args)
        checks.append(reads[before:])

    monkeypatch.setattr(dm, "check_slice", watched)
    loaded, _ = sharded.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert len(checks) >= 2 and all(_read_in(c, *_whole(c))[0] <= 2048 for c in checks)
    meta = _raw(path)
    for key in ("w.0", "scalar.0"):
        info = _storage(meta, key)
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            start, end = _record_span(f.read(info.length), info.offset)
        assert all(_read_in(c, info.relative_path, start, end) == (0, 0) for c in checks)
        read, distinct = _read_in(reads, info.relative_path, start, end)
        # torch.load reads the record once, plus the archive's last 4 KiB where its reader
        # searches for the end record
        assert distinct == end - start and read <= end - start + 4096
    peeked, _ = sharded.peek(path)
    assert peeked["empty"].shape == (0, 3) and peeked["scalar"].shape == ()


def _whole(log: list) -> tuple[str, int, int]:
    """The file of the reads ``log`` (one file) and a span holding them all."""
    (name,) = {n for n, _, _ in log}
    return name, 0, max(b for _, _, b in log)


def test_checking_a_slice_reads_its_directory_and_pickle_only(tmp_path):
    buffer = io.BytesIO()
    torch.save(torch.zeros(256, 256), buffer)  # a 256 KiB record
    data = b"before" + buffer.getvalue()
    log: list = []
    dm.check_slice(_Counting(io.BytesIO(data), "f", log), 6, len(data) - 6, 256 << 10, "s")
    assert _read_in(log, "f", *_record_span(data[6:], 6)) == (0, 0)
    assert 0 < _read_in(log, "f", 0, len(data))[0] <= 2048  # end records, directory, pickle


def _spanning() -> bytes:
    """An end of zip directory behind a zip64 locator that claims two disks."""
    return b"PK\x06\x07" + struct.pack("<LQL", 0, 0, 2) + b"PK\x05\x06" + bytes(18)


@pytest.mark.parametrize("cut", [0, 10, 21, 200, -22, -1])
def test_a_damaged_slice_is_a_checkpoint_error(cut):
    buffer = io.BytesIO()
    torch.save(torch.arange(64.0), buffer)
    good = buffer.getvalue()
    for data in (good[:cut] if cut >= 0 else good[cut:], _spanning()):
        file = io.BytesIO(b"before" + data + b"after")
        with pytest.raises(CheckpointError, match="slice 3 is corrupt or truncated"):
            dm.check_slice(file, 6, len(data), 256, "slice 3")
    dm.check_slice(io.BytesIO(b"before" + good), 6, len(good), 256, "slice 3")


# ---------------------------------------------------------------------- item 7: the index


def test_an_8_gib_tensor_on_a_sparse_64_mib_file_is_refused_without_a_target(tmp_path):
    path = _saved(tmp_path, {"w": torch.zeros(4)})
    meta = _raw(path)
    entry, (index, info) = meta.state_dict_metadata["w.0"], next(iter(meta.storage_data.items()))
    chunk, n = 1 << 24, 128  # 128 chunks of 64 MiB: 8 GiB of float32
    entry.size = torch.Size([chunk * n])
    entry.chunks = [
        type(entry.chunks[0])(torch.Size([i * chunk]), torch.Size([chunk])) for i in range(n)
    ]
    slice_length = 4 * chunk + 2048
    file = os.path.join(path, info.relative_path)
    with open(file, "r+b") as f:
        f.truncate(slice_length)  # sparse: 64 MiB that take no disk
    meta.storage_data = {
        type(index)("w.0", torch.Size([i * chunk])): type(info)(info.relative_path, 0, slice_length)
        for i in range(n)
    }
    _write(path, meta)
    for read in (sharded.peek, sharded.load):
        with pytest.raises(CheckpointError, match="share bytes 0 to .* of data file __0_0.distcp"):
            read(path)


def _grow(meta):
    """The first tensor twice as long, its one chunk left as it was."""
    entry = meta.state_dict_metadata["params.1"]
    entry.size = torch.Size([128])


def _overlapping(meta):
    """Two chunks that share 32 elements and leave 32 unread, each with its own slice."""
    entry = meta.state_dict_metadata["params.1"]
    chunk = entry.chunks[0]
    entry.chunks = [
        type(chunk)(torch.Size([0]), torch.Size([48])),
        type(chunk)(torch.Size([16]), torch.Size([16])),
    ]
    info = _storage(meta, "params.1")
    index = next(i for i in meta.storage_data if i.fqn == "params.1")
    meta.storage_data[type(index)("params.1", torch.Size([16]))] = type(info)(
        info.relative_path, 0, info.length
    )


def _unstored(meta):
    """A second chunk with no storage entry."""
    entry = meta.state_dict_metadata["params.1"]
    chunk = entry.chunks[0]
    entry.size = torch.Size([65])
    entry.chunks.append(type(chunk)(torch.Size([64]), torch.Size([1])))


def _stray(meta):
    """A storage entry keyed by offsets no chunk has."""
    index = next(i for i in meta.storage_data if i.fqn == "params.1")
    info = meta.storage_data.pop(index)
    meta.storage_data[type(index)("params.1", torch.Size([3]))] = info


def _short(meta):
    """Two chunks, the second on a slice shorter than its bytes: the tensor's total is
    still covered by the first one's long slice."""
    entry = meta.state_dict_metadata["params.1"]
    chunk = entry.chunks[0]
    entry.chunks = [
        type(chunk)(torch.Size([0]), torch.Size([32])),
        type(chunk)(torch.Size([32]), torch.Size([32])),
    ]
    index = next(i for i in meta.storage_data if i.fqn == "params.1")
    info = meta.storage_data[index]
    meta.storage_data[type(index)("params.1", torch.Size([32]))] = type(info)(
        info.relative_path, 0, 100
    )


@pytest.mark.parametrize(
    "change, why",
    [
        (_grow, "hold 64 elements but the tensor has 128"),
        (_overlapping, "chunks of entry 'params.1' overlap"),
        (_unstored, r"chunk of entry 'params.1' at \[64\] has no storage entry"),
        (_stray, "is for no chunk of entry 'params.1'"),
        (_short, r"chunk of entry 'params.1' at \[32\] is 128 bytes but its data files hold 100"),
    ],
)
def test_an_index_declaring_more_than_its_slices_hold_is_refused(tmp_path, change, why):
    path = _saved(tmp_path)
    meta = _raw(path)
    change(meta)
    _write(path, meta)
    for read in (sharded.peek, sharded.load):
        with pytest.raises(CheckpointError, match=why):
            read(path)


def test_a_small_chunk_on_a_long_slice_is_refused(tmp_path):
    path = _saved(tmp_path)
    meta = _raw(path)
    info = _storage(meta, "params.1")  # 256 bytes of bias
    file = os.path.join(path, info.relative_path)
    with open(file, "ab") as f:
        f.write(bytes(dm.MAX_SLICE_OVERHEAD + 1024))
    info.offset, info.length = (
        os.path.getsize(file) - dm.MAX_SLICE_OVERHEAD - 1024,
        dm.MAX_SLICE_OVERHEAD + 1024,
    )
    _write(path, meta)
    with pytest.raises(CheckpointError, match="is 256 bytes but its data files hold 66560"):
        sharded.peek(path)


# ---------------------------------------------------------------------- chunk layouts


def _grid(rows: list[int], cols: list[int]) -> list[dm._Box]:
    """The boxes of a grid cut at ``rows`` and ``cols`` (each list: the cut points)."""
    return [
        ((r0, c0), (r1 - r0, c1 - c0))
        for r0, r1 in itertools.pairwise(rows)
        for c0, c1 in itertools.pairwise(cols)
    ]


@pytest.mark.parametrize(
    "boxes, shared",
    [
        (_grid([0, 3, 5, 9], [0, 2, 7]), False),  # FSDP x TP: a 3 x 2 grid
        (_grid([0, 1, 2, 3, 4], [0, 8]), False),  # FSDP along dim 0
        ([*_grid([0, 3, 5], [0, 2, 7]), ((4, 6), (1, 1))], True),  # one element twice
        (_grid([0, 4], [0, 4]) * 2, True),  # the same chunk twice
        ([((0, 0), (2, 3)), ((2, 0), (2, 1)), ((2, 1), (2, 2))], False),  # uneven rows
        ([((0, 0), (3, 2)), ((2, 2), (3, 2)), ((0, 2), (2, 2)), ((3, 0), (2, 2))], False),  # bricks
        ([((0, 0), (3, 2)), ((2, 1), (3, 2))], True),  # bricks that touch
    ],
)
def test_chunk_overlap_is_found_in_grids_and_irregular_layouts(boxes, shared):
    assert dm._overlap(boxes, 0, [dm.MAX_IRREGULAR_PAIRS]) is shared


def test_a_layout_too_irregular_to_check_is_refused_within_its_budget():
    staircase = [((i, 0), (2, 1)) for i in range(0, 4000, 2)] + [((1, 1), (4000, 1))]
    assert dm._overlap(staircase[:-1], 0, [10]) is False  # a column: no pairs compared
    with pytest.raises(dm._TooIrregular):
        dm._overlap(staircase, 0, [1000])


def _with_dims(meta, dims: int) -> None:
    """``w.0`` declared with ``dims`` dimensions (the last 2 long), in two chunks."""
    entry = meta.state_dict_metadata["w.0"]
    chunk = type(entry.chunks[0])
    entry.size = torch.Size([1] * (dims - 1) + [2])
    entry.chunks = [
        chunk(torch.Size([0] * dims), torch.Size([1] * dims)),
        chunk(torch.Size([0] * (dims - 1) + [1]), torch.Size([1] * dims)),
    ]


@pytest.mark.parametrize("dims", [65, 3000])
def test_a_tensor_of_too_many_dimensions_is_refused_and_skipped_on_resume(tmp_path, dims):
    path = _saved(tmp_path / "runs", {"w": torch.zeros(2)})
    meta = _raw(path)
    _with_dims(meta, dims)
    _write(path, meta)
    with pytest.raises(CheckpointError, match=f"'w.0' declares a tensor of {dims} dimensions"):
        sharded.peek(path)
    with pytest.warns(UserWarning, match="dimensions"):  # fit(ckpt_path="last")'s discovery
        assert checkpoint.load_latest(str(tmp_path / "runs")) is None


def test_a_tensor_of_64_dimensions_loads(tmp_path):
    tensor = torch.arange(2.0).reshape([1] * 63 + [2])
    loaded, _ = sharded.load(_saved(tmp_path, {"w": tensor}))
    assert torch.equal(loaded["w"], tensor)


def test_chunk_overlap_is_checked_without_recursing_per_dimension():
    dims = 3 * 1000  # beyond Python's recursion limit, one level per dimension
    ones = (1,) * dims
    apart = [((0,) * dims, ones), ((0,) * (dims - 1) + (1,), ones)]
    assert dm._overlap(apart, 0, [dm.MAX_IRREGULAR_PAIRS]) is False
    assert dm._overlap(apart[:1] * 2, 0, [dm.MAX_IRREGULAR_PAIRS]) is True


def test_the_budget_counts_every_dimension_compared():
    """``count`` chunks whose rows overlap but whose columns do not: compared pair by pair,
    each pair along all ``dims`` dimensions."""
    count, dims = 40, 10
    rest = (0,) * (dims - 2), (1,) * (dims - 2)
    boxes = [((i, i, *rest[0]), (2, 1, *rest[1])) for i in range(count)]
    steps = count * (count - 1) // 2 * dims
    assert dm._overlap(boxes, 0, [steps]) is False
    with pytest.raises(dm._TooIrregular):
        dm._overlap(boxes, 0, [steps - 1])


# ---------------------------------------------------------------------- item 4: the pickle


def _shared_tuple(depth: int, index: int = 1 << 20) -> bytes:
    """Protocol-2 opcodes pushing a tuple ``depth`` deep, each level holding the one below
    twice (through the memo slot ``index``): 17 bytes a level, ``2**(depth + 1) - 1``
    values expanded."""
    slot = struct.pack("<I", index)
    level = b"0j" + slot + b"j" + slot + b"\x86r" + slot  # pop the level below, use it twice
    return b")r" + slot + level * depth


def _with_bomb(path: str, where: str, depth: int) -> None:
    """Rewrite the folder's ``.metadata`` with a ``depth``-deep shared tuple as a key of
    its entry table (``where="key"``) or as the offset of a storage entry's MetadataIndex
    (``"offset"``, which the storage table hashes as its key). Pickled at protocol 2, whose
    memo slots are numbered explicitly, with a placeholder string then swapped for the
    tuple's opcodes."""
    meta, marker = _raw(path), "PLACEHOLDER"
    if where == "key":
        meta.state_dict_metadata[marker] = meta.state_dict_metadata["params.1"]
    else:
        index, info = next(iter(meta.storage_data.items()))
        del meta.storage_data[index]
        object.__setattr__(index, "offset", marker)
        meta.storage_data[index] = info
    data = pickle.dumps(meta, protocol=2)
    text = b"X" + struct.pack("<I", len(marker)) + marker.encode()
    assert data.count(text) == 1
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(data.replace(text, _shared_tuple(depth)))


@pytest.mark.parametrize("where", ["key", "offset"])
def test_metadata_expanding_exponentially_is_refused_before_unpickling(tmp_path, where):
    path = _saved(tmp_path / "runs")
    _with_bomb(path, where, 28)  # 2**29 values: minutes to hash or walk
    assert os.path.getsize(os.path.join(path, ".metadata")) < 8000
    for read in (sharded.peek, sharded.load):
        start = time.perf_counter()
        with pytest.raises(CheckpointError, match="expands to more than 4,000,000 values") as err:
            read(path)
        assert time.perf_counter() - start < 1.0
        assert path in str(err.value)
    with pytest.warns(UserWarning, match="expands to more than"):  # resume discovery
        assert checkpoint.load_latest(str(tmp_path / "runs")) is None


def test_the_expansion_counts_every_use_of_a_shared_container():
    pair = (1, "a")
    assert dm._expanded(pickle.dumps([pair, pair, pair]), 100) == 1 + 3 * 3
    inner = [2.5]  # the dict, its 2 keys, the list twice (2 values each), the outer list
    assert dm._expanded(pickle.dumps({"a": inner, "b": [inner]}), 100) == 1 + 2 + 2 + 3
    deep = b"\x80\x02" + _shared_tuple(10) + b"."
    assert dm._expanded(deep, 10_000) == 2**11 - 1
    with pytest.raises(dm._TooLarge):
        dm._expanded(deep, 2**11 - 2)
    with pytest.raises(dm._TooLarge):  # stops at the limit: no huge numbers
        dm._expanded(b"\x80\x02" + _shared_tuple(100_000) + b".", 10_000)


_DCP = b"torch.distributed.checkpoint.metadata"


@pytest.mark.parametrize(
    "payload, why",
    [
        (pickle.dumps([[]] * 2)[:-3], "truncated"),
        (b"\x80\x02]q\x00h\x00a.", "cycle"),  # a list holding itself
        # BUILD on a class: the unpickler would set MetadataIndex.purestep_x in the process
        (b"\x80\x02c" + _DCP + b"\nMetadataIndex\nN}X\n\0\0\0purestep_xK\1s\x86b.", "not an open"),
        (b"\x80\x02\xff.", "unknown pickle opcode 0xff"),
    ],
)
def test_metadata_pickles_no_dcp_writer_makes_are_refused(tmp_path, payload, why):
    path = _saved(tmp_path, {"w": torch.zeros(1)})
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(payload)
    with pytest.raises(CheckpointError, match=f"refused to read .metadata: .*{why}"):
        sharded.peek(path)
    assert not hasattr(dcp_metadata.MetadataIndex, "purestep_x")


def test_metadata_of_thousands_of_tensors_loads(tmp_path):
    state = {f"t{i}": torch.full((3,), float(i)) for i in range(2000)}
    path = _saved(tmp_path, state)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        data = f.read()
    assert 2000 * 50 < dm._expanded(data, dm.MAX_METADATA_VALUES) < len(data)
    loaded, _ = sharded.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
