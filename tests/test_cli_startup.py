"""Start-up of ``import purestep`` and of the command line: what loads, not how long it takes.

Each probe runs in a fresh interpreter (``sys.modules`` of this test process holds whatever
the other tests imported) and reports the modules it found loaded. The lists name what a
start-up must not pay for: the compiler stack, the optional loggers' and progress bars'
libraries, the hardware strategies and the loops that only a run needs. A module that
``import torch`` itself already loads (in torch 2.13, ``torch.export`` and ``torch._decomp``)
cannot be avoided and is not counted. Timings are the job of ``benchmarks/cli_startup.py``;
no test here measures time.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap

import pytest

#: torch submodules that cost a lot to import and that no start-up needs
HEAVY_TORCH = (
    "torch._dynamo",
    "torch._inductor",
    "torch._functorch.aot_autograd",
    "torch.export",
    "torch._export",
    "torch._decomp",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.onnx",
    "torch.utils.tensorboard",
)
#: optional or heavy third-party libraries (the extras, the test tools)
HEAVY_THIRD_PARTY = (
    "tensorboardX",
    "tensorboard",
    "mlflow",
    "wandb",
    "rich",
    "matplotlib",
    "psutil",
    "lightning",
    "pytorch_lightning",
    "torchmetrics",
    "sklearn",
    "hypothesis",
    "ray",
    "optuna",
    "optuna_integration",
    "transformers",
    "datasets",
)
#: purestep's modules that only a run (or a rarely used name) needs
RUN_TIME_MODULES = (
    "purestep.hardware",
    "purestep.engine.export",
    "purestep.engine.per_sample",
    "purestep.loops.fit",
    "purestep.loops.evaluate",
    "purestep.loops.predict",
    "purestep.loops.trainer_fit",
    "purestep.loops.resume",
    "purestep.loops.tuning",
    "purestep.loops.lightning",
    "purestep.loops.testing",
    "purestep.loops.loggers.tensorboard",
    "purestep.loops.loggers.collection",
    "purestep.loops.loggers.mlflow",
    "purestep.loops.loggers.wandb",
    "purestep.loops.callbacks.swa",
    "purestep.loops.callbacks.ema",
    "purestep.loops.callbacks.rich_progress",
    "purestep.loops.callbacks.device_stats",
    "purestep.loops.callbacks.throughput",
    "purestep.loops.callbacks.prediction_writer",
)

# Reports, as JSON on its last line: the modules `import torch` loads ("torch"), the
# modules loaded after running BODY ("after"), and whatever BODY put in `report`.
_PROBE = """
import json, sys
report = {{}}
{torch_first}
torch_modules = sorted(sys.modules)
{body}
print(json.dumps({{"torch": torch_modules, "after": sorted(sys.modules), **report}}))
"""


def probe(body: str, cwd, *, torch_first: bool = True) -> dict:
    code = _PROBE.format(
        torch_first="import torch" if torch_first else "", body=textwrap.dedent(body)
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def loaded(found: dict, names) -> list[str]:
    """The ``names`` loaded (a package or any of its submodules) that torch alone did not
    load."""
    before, after = set(found["torch"]), set(found["after"])
    return sorted(
        name for name in names if any(m == name or m.startswith(name + ".") for m in after - before)
    )


def test_import_purestep_and_its_packages_load_nothing_else(tmp_path):
    """``import purestep``, ``purestep.engine``, ``purestep.loops``, its ``callbacks`` and
    ``loggers``: every name is imported on first use, so these load no torch at all."""
    found = probe(
        """
        import purestep, purestep.engine, purestep.loops
        import purestep.loops.callbacks, purestep.loops.loggers
        """,
        tmp_path,
        torch_first=False,
    )
    ours = [m for m in found["after"] if m == "purestep" or m.startswith("purestep.")]
    assert sorted(ours) == [
        "purestep",
        "purestep.engine",
        "purestep.engine.lazy",  # the packages' lazy re-exports (no import of its own)
        "purestep.loops",
        "purestep.loops.callbacks",
        "purestep.loops.loggers",
    ]
    assert "torch" not in found["after"]


def test_the_integrations_package_loads_none_of_the_frameworks_it_wraps(tmp_path):
    """``purestep.loops.integrations`` names Ray's, Optuna's and Hugging Face's wrappers
    but loads their libraries only when one of its names is first used."""
    found = probe("import purestep, purestep.loops.integrations", tmp_path)
    assert loaded(found, HEAVY_THIRD_PARTY) == []
    assert loaded(found, HEAVY_TORCH) == []
    ours = [m for m in found["after"] if m.startswith("purestep.loops.integrations.")]
    assert ours == []


def test_importing_the_command_line_loads_no_heavy_module(tmp_path):
    """``import purestep.loops.command_line`` (what ``python -m purestep`` imports first):
    the Trainer's class and signature, not the compiler stack, the optional libraries, the
    parser (jsonargparse loads when ``cli`` is called) or the run-time loops."""
    found = probe("import purestep.loops.command_line", tmp_path)
    assert loaded(found, HEAVY_TORCH) == []
    assert loaded(found, (*HEAVY_THIRD_PARTY, "jsonargparse")) == []
    assert loaded(found, RUN_TIME_MODULES) == []


@pytest.mark.skipif(importlib.util.find_spec("jsonargparse") is None, reason="the cli extra")
def test_fit_help_builds_the_parser_without_the_run_time_modules(tmp_path):
    """``python -m purestep fit --help`` (run as ``-m`` runs it): the help lists the
    built-in callbacks and loggers (they are imported for it), but the compiler stack, the
    optional loggers' and progress bars' libraries and the loops stay unloaded, and the
    start-up's objects are frozen out of the garbage collector's passes (``__main__``)."""
    found = probe(
        """
        import contextlib, gc, io, runpy
        sys.argv = ["purestep", "fit", "--help"]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_module("purestep", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            report["code"] = exit.code
        report["help"] = out.getvalue()
        report["frozen"] = gc.get_freeze_count()
        report["collecting"] = gc.isenabled()
        """,
        tmp_path,
    )
    assert found["code"] in (0, None), found["help"][-2000:]
    text = " ".join(found["help"].split())
    for name in ("--trainer.max_epochs", "--trainer.callbacks", "--model", "--ckpt_path"):
        assert name in text
    for name in ("loggers.TensorBoardLogger", "loggers.CSVLogger", "callbacks.EarlyStopping"):
        assert name in text, f"{name} is not among the known subclasses in --help"
    assert found["frozen"] > 0 and found["collecting"]
    assert loaded(found, HEAVY_TORCH) == []
    # tensorboardX is imported with TensorBoardLogger (listed in the help); the others not
    assert loaded(found, [m for m in HEAVY_THIRD_PARTY if m != "tensorboardX"]) == []
    # the built-in callbacks and loggers are imported for the help (and what they need:
    # StochasticWeightAveraging's to_module, purestep.engine.export)
    run_time = [
        m
        for m in RUN_TIME_MODULES
        if ".loggers." not in m and ".callbacks." not in m and m != "purestep.engine.export"
    ]
    assert loaded(found, run_time) == []


@pytest.mark.parametrize(
    "package",
    [
        "purestep.engine",
        "purestep.loops.callbacks",
        "purestep.loops.loggers",
        "purestep.loops.integrations",
    ],
)
def test_every_public_name_resolves_to_its_defining_module(package, tmp_path):
    """The lazy packages hand out exactly the objects the eager ``from .x import y`` did,
    to ``getattr``, ``from ... import`` and ``import *`` alike, and list them in ``dir()``."""
    found = probe(
        f"""
        import importlib
        package = importlib.import_module({package!r})
        names = list(package.__all__)
        star = {{}}
        exec("from {package} import *", star)
        bad = []
        for name in names:
            entry = package._LAZY[name]  # (module, attribute) or the module of the same name
            module_name, attribute = entry if isinstance(entry, tuple) else (entry, name)
            home = importlib.import_module(module_name, package.__name__)
            expected = home if attribute is None else getattr(home, attribute)
            value = getattr(package, name)
            if value is not expected or star.get(name) is not value or name not in dir(package):
                bad.append(name)
        try:
            package.no_such_name
        except AttributeError as err:
            report["error"] = str(err)
        report["bad"] = bad
        report["count"] = len(names)
        """,
        tmp_path,
    )
    assert found["bad"] == [] and found["count"] > 5
    assert "no_such_name" in found["error"]


@pytest.mark.parametrize(
    "name, library, extra",
    [
        ("ray_train_report", "ray", "ray"),
        ("OptunaPruning", "optuna", "optuna"),
        ("hf_loader", "datasets", "hf"),
    ],
)
def test_a_missing_framework_names_the_extra_to_install(name, library, extra, monkeypatch):
    import purestep.loops.integrations as integrations

    for module in [m for m in sys.modules if m.startswith("purestep.loops.integrations.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.delitem(vars(integrations), name, raising=False)
    monkeypatch.setitem(sys.modules, library, None)  # `import library` now fails
    with pytest.raises(ModuleNotFoundError, match=re.escape(f'pip install "purestep[{extra}]"')):
        getattr(integrations, name)
