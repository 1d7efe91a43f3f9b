"""Packaging: one import name, ``purestep``, in the wheel and in the editable install.

The wheel is built from a copy of the source tree and installed into a fresh virtual
environment; the dependencies (torch, ...) come from the test environment's site-packages
on ``PYTHONPATH``, where ``.pth`` files (and so an editable ``purestep``) are not read.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "loops", "hardware")
SHADOWS = {name: f"SHADOW = {name!r}\n" for name in PACKAGES}

# Run in a folder holding a user's engine.py / loops.py / hardware.py: purestep must import
# and train, and those names must stay the user's.
_USE_WITH_SHADOWS = """
import engine, hardware, loops
assert (engine.SHADOW, loops.SHADOW, hardware.SHADOW) == ("engine", "loops", "hardware")
import torch
import purestep
from purestep import Trainer, Task, optim, train_step, init, checkpoint
net = torch.nn.Linear(3, 2)
opt = optim.sgd(0.1)
state = init(net, opt, seed=0)
step = train_step(net, lambda apply, b: apply(b[0]).pow(2).mean(), opt)
state, out = step(state, (torch.ones(4, 3), None))
assert state.progress.step == 1
print(purestep.__file__)
"""

_NO_TOP_LEVEL = """
import importlib.util
import purestep
found = [n for n in ("engine", "loops", "hardware") if importlib.util.find_spec(n)]
assert not found, f"importable as top-level modules: {found}"
print(purestep.__file__)
"""


def _source_files() -> set[str]:
    """The package's ``.py`` files as the wheel should name them (``purestep/...``): the
    root's ``__init__.py`` and ``__main__.py`` (``python -m purestep``), and the subpackages."""
    files = {"purestep/__init__.py", "purestep/__main__.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" not in path.parts:
                files.add("purestep/" + path.relative_to(ROOT).as_posix())
    return files


def _copy_source(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "runs", ".hypothesis"
    )
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> str:
    result = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    work = tmp_path_factory.mktemp("wheel")
    source = _copy_source(work / "src")
    out = work / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            str(source),
        ],
        cwd=work,
    )
    (built,) = out.glob("purestep-*.whl")
    return built


def test_the_wheel_holds_only_the_purestep_tree_and_all_of_it(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"purestep"}, tops
    assert not [n for n in names if re.match(r"(tests|examples|benchmarks|docs)/", n)]
    py = {n for n in names if n.endswith(".py")}
    assert py == _source_files(), (
        f"missing from the wheel: {sorted(_source_files() - py)}; "
        f"unexpected: {sorted(py - _source_files())} (list new subpackages in pyproject.toml)"
    )


def test_the_installed_wheel_imports_beside_a_users_engine_loops_and_hardware(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)
    deps = sysconfig.get_paths()["purelib"]  # torch, optree, ... of the test environment
    env = {**os.environ, "PYTHONPATH": deps}
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=tmp_path,
        env=env,
    ).strip()

    clean = tmp_path / "clean"
    clean.mkdir()
    where = _run([str(python), "-c", _NO_TOP_LEVEL], cwd=clean, env=env).strip()
    assert Path(where).resolve() == (Path(site) / "purestep" / "__init__.py").resolve()

    user = tmp_path / "user"
    user.mkdir()
    for name, text in SHADOWS.items():
        (user / f"{name}.py").write_text(text)
    where = _run([str(python), "-c", _USE_WITH_SHADOWS], cwd=user, env=env).strip()
    assert Path(where).resolve().is_relative_to(Path(site).resolve())


def test_the_editable_install_imports_beside_a_users_engine_loops_and_hardware(tmp_path):
    probe = "import purestep, sys; print(purestep.__file__)"
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run([sys.executable, "-c", probe], cwd=tmp_path, env=clean_env).strip()
    if Path(where).resolve() != (ROOT / "__init__.py").resolve():
        pytest.skip(f"purestep is not installed editable from this tree (found {where})")
    _run([sys.executable, "-c", _NO_TOP_LEVEL], cwd=tmp_path, env=clean_env)
    for name, text in SHADOWS.items():
        (tmp_path / f"{name}.py").write_text(text)
    _run([sys.executable, "-c", _USE_WITH_SHADOWS], cwd=tmp_path, env=clean_env)


_BARE_IMPORT = re.compile(r"^\s*(?:from|import)\s+(engine|loops|hardware)\b", re.M)


def test_no_file_imports_the_subpackages_by_their_bare_names():
    """Inside the packages imports are relative or ``purestep.*``; so are tests, examples,
    benchmarks and the README's code (a bare ``import engine`` would only work from a source
    checkout, and would load a second copy of the module)."""
    offenders = []
    folders = (*PACKAGES, "tests", "examples", "benchmarks")
    files = [p for f in folders for p in (ROOT / f).rglob("*.py")]
    files += [ROOT / "README.md", ROOT / "docs" / "architecture.md", ROOT / "__init__.py"]
    for path in files:
        if path == Path(__file__).resolve():
            continue  # this file names them in its probes
        text = path.read_text(encoding="utf-8")
        for match in _BARE_IMPORT.finditer(text):
            line = text[: match.start()].count("\n") + 1
            if "the user's own" in text.splitlines()[line - 1]:
                continue  # a test's probe importing a user's module of that name
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0).strip()}")
    assert not offenders, "\n".join(offenders)


_LIGHT_ENGINE = """
import sys
import purestep.engine
heavy = [m for m in ("purestep.loops", "purestep.hardware", "tensorboardX", "yaml")
         if m in sys.modules]
assert not heavy, f"import purestep.engine loaded {heavy}"
import purestep
for name in purestep.__all__:
    assert getattr(purestep, name) is not None, name
assert purestep.init is purestep.engine.init and purestep.Trainer is purestep.loops.Trainer
try:
    purestep.no_such_name
except AttributeError as err:
    assert "no_such_name" in str(err)
else:
    raise AssertionError("an unknown attribute must raise AttributeError")
print("ok")
"""


def test_entry_points_load_on_first_use_and_the_engine_alone_stays_light(tmp_path):
    """A DataLoader worker or DDP rank importing only ``purestep.engine`` does not load the
    loops' loggers and progress bars; every name in ``purestep.__all__`` resolves."""
    out = _run([sys.executable, "-c", _LIGHT_ENGINE], cwd=tmp_path)
    assert out.strip() == "ok"
