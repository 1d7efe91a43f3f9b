"""Smoke tests of the benchmarks: each runs with ``--quick`` and ends with its ratio line.

Each benchmark runs as a subprocess from the repository root (as its docstring says to run
it) and must exit cleanly with a last line ``key=value ...`` holding exactly its expected
keys and finite, positive numbers (and, where the headline figure must come last, that key
last). The figures of a quick run mean nothing, so nothing else is checked. The GPU check
script ``benchmarks/gpu_check.sh`` is checked for syntax, and its bitwise resume check is
run on the CPU. About 1.5 minutes in all on two shared cores.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPECTED = {
    "fit_overhead.py": {
        "ratio",
        "step_ratio",
        "loop_ratio",
        "immutable_ratio",
        "profiler_ratio",
        "compiled_ratio",
        "lightning_ratio",
    },
    "resume_cost.py": {"ratio", "data_ratio"},
    "checkpoint_io.py": {"save_ratio", "load_ratio"},
    "data_rng.py": {"ratio", "overhead_us", "worker_overhead_us"},
    "fsdp.py": {"mem_ratio", "time_ratio"},
    "dist_peer.py": {
        "ddp_vs_torch",
        "ddp_mem_vs_torch",
        "fsdp_vs_torch",
        "fsdp_mem_vs_torch",
        "fsdp_colls",
        "torch_fsdp_colls",
    },
    "step_overhead.py": {
        "ratio_small",
        "ratio_mid",
        "mem_ratio_mid",
        "from_torch_ratio_small",
        "from_torch_ratio_mid",
    },
    "char_lm.py": {"ratio_eager", "ratio_compiled", "ratio_vs_raw_compiled"},
    "lightning_loop.py": {"ratio", "task_ratio"},
    "cli_startup.py": {"help_s", "torch_import_s", "overhead_s", "ratio"},
    "hf_fit.py": {"ratio"},
    "sweep.py": {"speedup", "speedup_grouped"},
    "unroll.py": {"meta_time_ratio", "meta_mem_ratio", "hyper_time_ratio", "hyper_mem_ratio"},
    "compile_step.py": {
        "ratio_small",
        "ratio_small_vs_compiled",
        "ratio_mid",
        "compile_s",
        "warm_compile_s",
        "ratio_mid_vs_compiled",
        "ratio_vs_raw_compiled",
    },
}

#: the key that must end the last line: the compiled engine step over the compiled
#: hand-written loop, the figure the GPU check (``benchmarks/gpu_check.sh``) reads
LAST_KEY = {"char_lm.py": "ratio_vs_raw_compiled", "compile_step.py": "ratio_vs_raw_compiled"}


#: keys that may be zero or negative: ``python -m purestep fit --help`` can end sooner than
#: a bare ``import torch`` (it skips the garbage collector's passes over torch's objects)
SIGNED = {
    "cli_startup.py": {"overhead_s"},
    # differences of two timings: a quick run's few samples on a loaded machine can give 0
    "data_rng.py": {"overhead_us", "worker_overhead_us"},
}


def ratio_line(output: str) -> dict[str, float]:
    """The ``key=value`` pairs of the last non-empty line of ``output``, values as floats."""
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        raise ValueError("the benchmark printed nothing")
    values = {}
    for item in lines[-1].split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"the last line is not 'key=value ...': {lines[-1]!r}")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} in the last line is not a number") from None
    return values


#: the compiled sides of these smoke runs use the ``aot_eager`` backend: dynamo and AOT
#: autograd trace the same graphs, torch's kernels run them (inductor's code generation, the
#: slow part with a cold cache, is tested in tests/test_compile.py and tests/test_examples.py)
EXTRA_ARGS = {
    "char_lm.py": ["--backend", "aot_eager"],
    "compile_step.py": ["--backend", "aot_eager"],
    "fit_overhead.py": ["--backend", "aot_eager"],
}


def run_quick(script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", script),
            "--quick",
            *EXTRA_ARGS.get(script, []),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_quick_run_ends_with_its_ratio_line(script: str) -> None:
    done = run_quick(script)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    values = ratio_line(done.stdout)
    assert set(values) == EXPECTED[script], f"{script}: last line has keys {sorted(values)}"
    if script in LAST_KEY:
        assert list(values)[-1] == LAST_KEY[script], f"{script}: last key {list(values)[-1]}"
    for key, value in values.items():
        signed = key in SIGNED.get(script, ())
        assert math.isfinite(value) and (signed or value > 0), f"{script}: {key}={value}"


def test_ratio_line_reads_key_value_pairs() -> None:
    assert ratio_line("header\nratio=1.250 data_ratio=0.9\n\n") == {
        "ratio": 1.25,
        "data_ratio": 0.9,
    }


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("", "printed nothing"),
        ("ratio=1.0 done", "not 'key=value"),
        ("ratio=fast", "not a number"),
        ("=1.0", "not 'key=value"),
    ],
)
def test_ratio_line_rejects_malformed_output(output: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ratio_line(output)


GPU_CHECK = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_is_executable_bash_with_valid_syntax() -> None:
    assert os.access(GPU_CHECK, os.X_OK)
    done = subprocess.run(["bash", "-n", GPU_CHECK], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.bitwise
def test_gpu_check_resume_snippet_resumes_bitwise_on_the_cpu() -> None:
    """The script's resume check, with its device switched to the CPU: a 2-epoch fit and a
    1-epoch fit resumed from its checkpoint to 2 epochs end with torch.equal parameters."""
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", GPU_CHECK, "resume"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Restored the training state from" in done.stderr  # it resumed, not restarted
    lines = done.stdout.strip().splitlines()
    assert "steps: uninterrupted 24, resumed 24" in lines
    assert "deterministic algorithms during fit: True" in done.stdout
    assert "CUBLAS_WORKSPACE_CONFIG during fit: None" not in done.stdout  # the Trainer set it
    assert lines[-1] == "resume_bitwise=True", done.stdout
