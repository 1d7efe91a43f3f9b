"""What a crafted checkpoint can make the loader build is bounded, and nothing in it runs.

Issue #22 items 4, 5 and 8: shared references that pickle stores once ("billion laughs")
are refused before they are expanded, in the state and in hyper-parameters; so are tensors
whose storage is smaller than their shape and strides need (a stride-0 ``expand``), in a
state, in hyper-parameters and in a weights file; a ``@struct`` name in a file makes no
module import; the editable install exposes only purestep's packages.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from purestep import engine
from purestep.engine import checkpoint as ck
from purestep.engine import optim
from purestep.engine.checkpoint import codec
from purestep.loops.lightning.module import LightningModule
from purestep.loops.task import Task

ROOT = Path(__file__).resolve().parent.parent
FAST = 2.0  # seconds: a refusal must not expand what it refuses


def _state():
    return engine.init(nn.Linear(3, 2), optim.adam(1e-3), seed=0)


def _laughs(depth: int) -> dict:
    """An encoded list whose two items are one shared node, ``depth`` times over: a few
    hundred bytes pickled, ``2**depth`` leaves decoded."""
    node = {"__kind__": "list", "items": ["lol" * 3, "lol" * 3]}
    for _ in range(depth):
        node = {"__kind__": "list", "items": [node, node]}
    return node


def _with_hparam(path, value, name="x"):
    """A checkpoint at ``path`` whose ``hparams[name]`` is ``value`` as stored (encoded)."""
    payload = ck.files.serialize(_state(), {"hparams": {name: 0}})
    hparams = dict(payload["metadata"]["items"])["hparams"]
    hparams["items"][0][1] = value
    ck.files.write_payload(payload, str(path))
    return str(path)


def _refused_fast(call, match):
    start = time.perf_counter()
    with pytest.raises(ck.CheckpointError, match=match):
        call()
    elapsed = time.perf_counter() - start
    assert elapsed < FAST, f"refused after {elapsed:.2f} s"


class _Persistent:
    def __init__(self, pid):
        self.pid = pid


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Persistent) else None


class _Call:
    """Pickles as ``func(*args)``: what a crafted file may ask the unpickler to call."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


_STORAGE_BYTES = 16


def _tensor(size, stride, offset=0, rebuild=torch._utils._rebuild_tensor_v2):
    """A tensor pickled as torch.save pickles one, with any layout, over the file's one
    16-byte storage (4 floats; 16 qint8 for a quantized tensor)."""
    if rebuild is torch._utils._rebuild_qtensor:
        storage = _Persistent(("storage", torch.QInt8Storage, "0", "cpu", _STORAGE_BYTES))
        params = (torch.per_tensor_affine, 0.1, 0)
        return _Call(rebuild, storage, offset, size, stride, params, False, {})
    storage = _Persistent(("storage", torch.FloatStorage, "0", "cpu", _STORAGE_BYTES // 4))
    return _Call(rebuild, storage, offset, size, stride, False, collections.OrderedDict())


def _crafted(path, obj):
    """A zip as torch.save writes one, whose pickle is ``obj`` pickled as given."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", buffer.getvalue())
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/data/0", bytes(_STORAGE_BYTES))
        archive.writestr("archive/version", "3\n")
    return str(path)


# ------------------------------------------------------------------ item 4: billion laughs


@pytest.mark.parametrize("depth", [20, 28])
@pytest.mark.parametrize("cls", [Task, LightningModule])
def test_shared_references_in_hparams_are_refused_fast(tmp_path, depth, cls):
    path = _with_hparam(tmp_path / "laughs.ckpt", _laughs(depth))
    assert os.path.getsize(path) < 20_000
    expected = "refers again to data already decoded|pickle expands to more than"
    _refused_fast(lambda: cls.load_from_checkpoint(path), f"laughs.ckpt: .*({expected})")


def test_shared_references_in_the_state_are_refused_fast_naming_the_place(tmp_path):
    payload = ck.files.serialize(_state())
    payload["state"]["data"]["extra"] = {"__kind__": "dict", "items": [["a", _laughs(22)]]}
    ck.files.write_payload(payload, str(tmp_path / "state.ckpt"))
    where = re.escape("at .extra['a'][0][0]")
    _refused_fast(lambda: ck.load(str(tmp_path / "state.ckpt")), f"{where}.*refers again")


def test_a_key_of_shared_tuples_is_refused_before_torch_load_hashes_it(tmp_path):
    """Unpickling ``OrderedDict([(key, 1)])`` hashes ``key``: 2**28 tuple hashes for this
    1.5 KB file (made without hashing it here)."""
    key = ()
    for _ in range(28):
        key = (key, key)
    path = _crafted(tmp_path / "hash.pt", _Call(collections.OrderedDict, [(key, 1)]))
    assert os.path.getsize(path) < 20_000
    _refused_fast(lambda: ck.load(path), "hash.pt: its pickle expands to more than")


def test_decoding_counts_values_and_text_against_the_budget(monkeypatch):
    encoded = ck.encode({"names": ["x" * 100] * 30})
    monkeypatch.setattr(codec, "MAX_NODES", 20)
    with pytest.raises(ck.CheckpointError, match=r"at \['names'\]\[\d+\]: it decodes to more"):
        ck.decode(encoded)
    monkeypatch.setattr(codec, "MAX_NODES", 1000)
    monkeypatch.setattr(codec, "MAX_TEXT_BYTES", 1000)
    with pytest.raises(ck.CheckpointError, match="more than 1,000 bytes of strings"):
        ck.decode(encoded)


def test_saving_shared_references_stops_at_the_budget(monkeypatch):
    """What encode writes, decode reads: a structure expanding past the budget is refused
    when saved (after the budget's worth of work, not the expansion's), in the state and
    in hyper-parameters checked by ``check_plain``."""
    shared = [0]
    for _ in range(60):
        shared = [shared, shared]
    monkeypatch.setattr(codec, "MAX_NODES", 10_000)
    _refused_fast(lambda: ck.encode({"a": shared}), r"cannot save \['a'\].*more than 10,000")
    _refused_fast(lambda: ck.check_plain(shared, "hparams"), "cannot save hparams.*values")


def test_long_keys_do_not_make_every_path_expensive():
    """A 4 MiB key over 20000 values: building each value's path from the whole key would
    copy 80 GiB; a message shows 40 characters of it."""
    key = "k" * 2**22
    encoded = {"__kind__": "dict", "items": [[key, ck.encode([*range(19_999), None])]]}
    start = time.perf_counter()
    decoded = ck.decode(encoded)
    ck.check_plain(decoded, "hparams", url="file")
    assert time.perf_counter() - start < 1.0
    assert decoded[key][-2] == 19_998
    decoded[key][-1] = object()
    with pytest.raises(ck.CheckpointError, match=r"hparams\['k{40}'\.\.\.\]\[19999\] holds") as err:
        ck.check_plain(decoded, "hparams", url="file")
    assert len(str(err.value)) < 300


def test_decoding_refuses_leaves_encode_never_writes():
    """A weights-only pickle can hold sets, bytes and storages; a state never does (a set
    of shared tuples would also carry its hashing cost into the state)."""
    for leaf, kind in [({1, 2}, "set"), (b"x", "bytes"), (torch.zeros(2).untyped_storage(), "")]:
        with pytest.raises(ck.CheckpointError, match=rf"at \[1\]: a {kind}.* not data purestep"):
            ck.decode({"__kind__": "list", "items": [1, leaf]})


def test_a_foreign_files_keys_are_named_briefly(tmp_path):
    torch.save({"k" * 2**20: 1, 5: 2, (1, 2): 3}, tmp_path / "foreign.pt")
    with pytest.raises(ck.CheckpointError, match=r"found \['5', 'k{40}\.\.\.', 'tuple'\]") as err:
        ck.load(str(tmp_path / "foreign.pt"))
    assert len(str(err.value)) < 400


def test_a_state_saved_normally_still_loads(tmp_path):
    state = _state().replace(extra={"names": [f"n{i}" for i in range(1000)], "d": {"a": 1}})
    ck.save(state, str(tmp_path / "ok.ckpt"), metadata={"hparams": {"lr": 0.1}})
    loaded, meta = ck.load(str(tmp_path / "ok.ckpt"))
    assert loaded.extra == state.extra and meta["hparams"] == {"lr": 0.1}
    engine.tree.assert_trees_equal(loaded.params, state.params)


# ------------------------------------------------------------------ item 5: stride-0 tensors


def test_a_stride0_parameter_in_a_state_is_refused_naming_it(tmp_path):
    payload = ck.files.serialize(_state())
    params = payload["state"]["data"]["params"]["items"]
    assert params[0][0] == "weight"
    params[0][1] = torch.zeros(1).expand(2, 3)
    ck.files.write_payload(payload, str(tmp_path / "s0.ckpt"))
    with pytest.raises(ck.CheckpointError, match=r"state\.params\['weight'\].*overlap"):
        ck.load(str(tmp_path / "s0.ckpt"))


@pytest.mark.parametrize("cls", [Task, LightningModule])
def test_a_stride0_hparam_is_refused_naming_it(tmp_path, cls):
    """The issue's 5.4 KB file: 2**27 floats (512 MiB) once a logger writes them."""
    path = _with_hparam(tmp_path / "big.ckpt", torch.zeros(1).expand(2**27), name="big")
    assert os.path.getsize(path) < 20_000
    where = re.escape("the tensor at metadata['hparams']['big'] (size (134217728,), strides (0,)")
    _refused_fast(lambda: cls.load_from_checkpoint(path), f"refusing to load .*big.ckpt: {where}")


def test_a_stride0_tensor_in_a_weights_file_is_refused(tmp_path):
    torch.save({"state_dict": {"w": torch.zeros(1).expand(2**20)}}, tmp_path / "w.pt")
    net = nn.Linear(4, 1, bias=False)
    with pytest.raises(ck.CheckpointError, match=r"\['state_dict'\]\['w'\].*overlap"):
        ck.load_weights(engine.init(net, optim.sgd(0.1)), str(tmp_path / "w.pt"), net)


def test_overlapping_views_are_saved_as_compact_copies(tmp_path):
    """A state or hyper-parameter holding an ``expand``-ed view saves and loads (a file of
    ours never holds a layout loading refuses); ordinary views keep their layout."""
    rows = torch.arange(3.0).expand(4, 3)
    view = torch.arange(12.0).reshape(3, 4).t()
    state = _state().replace(buffers={"rows": rows, "view": view})
    ck.save(state, str(tmp_path / "e.ckpt"), metadata={"hparams": {"rows": rows}})
    loaded, meta = ck.load(str(tmp_path / "e.ckpt"))
    for tensor in (loaded.buffers["rows"], meta["hparams"]["rows"]):
        assert torch.equal(tensor, rows) and tensor.stride() == (3, 1)
    assert torch.equal(loaded.buffers["view"], view) and loaded.buffers["view"].stride() == (1, 4)


def test_crafted_files_with_ordinary_layouts_load(tmp_path):
    """The crafting helper writes files torch loads; a scalar, a transpose, a strided slice
    and a stride 0 along a dimension of one element pass the scan."""
    layouts = {"m": ((2, 2), (2, 1)), "s": ((), ()), "t": ((2, 2), (1, 2)), "e": ((1, 2), (0, 1))}
    layouts["slice"] = ((2,), (2,))
    path = _crafted(tmp_path / "ok.pt", {k: _tensor(*v) for k, v in layouts.items()})
    loaded = ck.read_state_dict(path)
    assert {k: (tuple(t.shape), t.stride()) for k, t in loaded.items()} == layouts


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (_tensor((2**20,), (0,)), r"size \(1048576,\), strides \(0,\).*overlap"),
        (_tensor((2, 2), (1, 1)), "its 4 elements overlap in a storage of 4"),
        (_tensor((8,), (1,)), "reaches element 8 of a storage of 4"),
        (_tensor((2,), (1,), offset=-1), "negative"),
        (_tensor((2,), (-1,), offset=1), "negative"),
        (_tensor((2**20,), (0,), rebuild=torch._utils._rebuild_qtensor), "overlap"),
        (_Call(torch.FloatTensor, 2**20), r"calling torch\.FloatTensor\(\.\.\.\)"),
        (_Call(bytearray, 2**20), r"bytearray\(n\)"),
    ],
    ids=["stride0", "overlap", "extent", "offset", "negative", "qtensor", "FloatTensor", "bytes"],
)
def test_crafted_tensor_layouts_are_refused_before_unpickling(tmp_path, obj, reason):
    path = _crafted(tmp_path / "w.pt", {"state_dict": {"w": obj}})
    with pytest.raises(ck.CheckpointError, match=f"refusing to load .*w.pt: .*{reason}"):
        ck.read_state_dict(path)


def test_the_layout_rule():
    assert codec.layout_problem((2, 3), (3, 1), 0, 6) is None
    assert codec.layout_problem((3, 2), (1, 3), 0, 6) is None  # a transpose
    assert codec.layout_problem((2, 2), (4, 2), 1, 8) is None  # a strided slice
    assert codec.layout_problem((1, 5), (0, 1), 0, 5) is None  # stride 0 on a size-1 dim
    assert codec.layout_problem((0, 5), (0, 0), 9, 0) is None  # no element
    assert "overlap" in codec.layout_problem((4, 3), (0, 1), 0, 12)
    assert "reaches element 7" in codec.layout_problem((2, 3), (3, 1), 1, 6)


# ------------------------------------------------------------------ item 8: no imports


_SIDE_EFFECT = "import pathlib\npathlib.Path({flag!r}).write_text('imported')\nclass Thing: pass\n"


def test_a_struct_name_in_a_file_imports_no_module(tmp_path, monkeypatch):
    """Neither a module of the purestep package that defines no ``@struct`` (``__main__``,
    a file on the package's path, as ``purestep.examples.digits`` and
    ``purestep.tests.conftest`` were in an editable install) nor any other is imported
    because a checkpoint names it; the error says to import it first."""
    import purestep

    flag = tmp_path / "imported"
    (tmp_path / "side_effect_probe.py").write_text(_SIDE_EFFECT.format(flag=str(flag)))
    monkeypatch.setattr(purestep, "__path__", [*purestep.__path__, str(tmp_path)])
    monkeypatch.syspath_prepend(str(tmp_path))
    main_loaded = "purestep.__main__" in sys.modules
    names = ["purestep.side_effect_probe:Thing", "side_effect_probe:Thing"]
    names += ["purestep.__main__:Thing", "purestep.examples.digits:Thing"]
    for name in names:
        node = {"__kind__": "struct", "type": name, "data": {}, "static": {}}
        with pytest.raises(ck.CheckpointError, match="import the module that defines it"):
            ck.decode(node)
        payload = ck.files.serialize({"x": 1})
        payload["state"] = node
        ck.files.write_payload(payload, str(tmp_path / "s.ckpt"))
        with pytest.raises(ck.CheckpointError, match="no such @struct class is loaded"):
            ck.load(str(tmp_path / "s.ckpt"))
    assert not flag.exists()
    assert "purestep.side_effect_probe" not in sys.modules
    assert "side_effect_probe" not in sys.modules
    assert ("purestep.__main__" in sys.modules) == main_loaded
    assert "purestep.examples.digits" not in sys.modules


_STRUCT_DECORATOR = re.compile(r"^\s*@(?:tree\.)?struct\b", re.M)


def test_struct_modules_lists_every_module_that_defines_a_struct():
    """Checkpoints name purestep's ``@struct`` classes by module; those modules are the
    only ones a load imports, so each must be listed."""
    found = set()
    for package in ("engine", "loops", "hardware"):
        for path in (ROOT / package).rglob("*.py"):
            if _STRUCT_DECORATOR.search(path.read_text(encoding="utf-8")):
                found.add("purestep." + ".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert found == codec.STRUCT_MODULES, (
        f"missing: {sorted(found - codec.STRUCT_MODULES)}, "
        f"stale: {sorted(codec.STRUCT_MODULES - found)}"
    )


def test_a_fresh_process_loads_a_state_whose_modules_are_not_imported_yet(tmp_path):
    """A state holding optimizer and callback structs loads in a process that imported
    only the checkpoint package: their modules are purestep's listed ones."""
    state = engine.init(
        nn.Linear(3, 2), optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.1))
    )
    ck.save(state, str(tmp_path / "fresh.ckpt"))
    probe = (
        "import sys\n"
        "from purestep.engine import checkpoint as ck\n"
        f"state, _ = ck.load({str(tmp_path / 'fresh.ckpt')!r})\n"
        "print(type(state).__name__, type(state.opt_state).__module__ in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TrainState True"


# ------------------------------------------------------------------ item 8: packaging


def test_the_editable_install_is_strict():
    """The repository root is the package ``purestep``: a lenient editable install maps
    the whole folder, making ``purestep.tests``, ``purestep.examples`` and
    ``purestep.benchmarks`` importable; the strict one links the listed packages only."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert config["tool"]["distutils"]["editable_wheel"]["mode"] == "strict"


_ONLY_PACKAGES = """
import importlib
import purestep.engine, purestep.loops, purestep.hardware
import purestep.engine.checkpoint, purestep.loops.callbacks, purestep.loops.lightning
exposed = []
for name in ("tests", "examples", "benchmarks", "docs"):
    try:
        importlib.import_module(f"purestep.{name}")
    except ImportError:
        continue
    exposed.append(name)
assert not exposed, f"importable: {exposed}"
print("ok")
"""


def test_the_installed_package_exposes_only_its_packages(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import purestep; print(purestep.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    ).stdout.strip()
    if not where or Path(where).resolve() != (ROOT / "__init__.py").resolve():
        pytest.skip(f"purestep is not installed from this tree (found {where!r})")
    out = subprocess.run(
        [sys.executable, "-c", _ONLY_PACKAGES],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "purestep", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
