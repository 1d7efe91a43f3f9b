#!/usr/bin/env bash
# GPU readiness check: run from the repository root, with the project's venv installed, on a
# machine with one NVIDIA GPU; about 5-10 minutes.
#
#     bash benchmarks/gpu_check.sh            # everything, on CUDA
#     bash benchmarks/gpu_check.sh resume     # only the bitwise resume check
#     GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh resume   # that check on the CPU
#
# 1. The GPU as nvidia-smi and torch see it; stops with an error when torch sees no CUDA.
# 2. The CUDA tests of the suite: every test with a skipif marker whose reason names CUDA
#    (the suite has no cuda marker; those tests say `reason="needs CUDA"`).
# 3. A bitwise resume check: Trainer(accelerator="gpu", devices=1, deterministic=True) fits
#    a small MLP with dropout on shuffled data for 2 epochs, and again as 1 epoch resumed
#    from its checkpoint (ckpt_path=) to 2; the final parameters must be torch.equal.
#    Deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG: Trainer(deterministic=True) sets
#    it to :4096:8 when unset (as Lightning does); the check prints the value it ran with.
# 4. benchmarks/compile_step.py and benchmarks/char_lm.py on CUDA with inductor's default
#    mode and with mode reduce-overhead (CUDA graphs), with few timed rounds.
# 5. One summary line, last:
#    gpu_check: tests=<pass|fail> resume_bitwise=<True|False> compile_default=<ratio>
#    compile_cudagraphs=<ratio> char_lm_default=<ratio> char_lm_cudagraphs=<ratio>
#    total_s=<seconds>
#    where a ratio is the benchmark's ratio_vs_raw_compiled (the compiled engine step over
#    the compiled hand-written loop), or "failed" / "timeout" when the run did not end.
#
# GPU_CHECK_DEVICE (default cuda) is the device of the resume check; GPU_CHECK_ROUNDS
# (default 7) the timed rounds of each benchmark run.
set -euo pipefail

DEVICE="${GPU_CHECK_DEVICE:-cuda}"
ROUNDS="${GPU_CHECK_ROUNDS:-7}"
BUDGET_S=570 # the whole check stays under 10 minutes
PYTHON="${PYTHON:-python}"
# one inductor cache for this check's runs (a benchmark reuses the graphs it compiled twice)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d -t gpu_check_ind_XXXX)}"

# The resume check, run as `python - <device>`; prints resume_bitwise=True|False last.
read -r -d '' RESUME_CHECK <<'PY' || true
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Trainer, optim
from purestep.loops.callbacks import LambdaCallback

device = sys.argv[1]
accelerator = "gpu" if device == "cuda" else "cpu"
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 16, generator=g)
data = TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())
seen = {}


def loss_fn(apply, batch):
    inputs, labels = batch
    return F.cross_entropy(apply(inputs), labels)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2))


def on_start(ctx):
    seen["deterministic"] = torch.are_deterministic_algorithms_enabled()
    seen["cublas"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")


def fit(root, max_epochs, ckpt_path=None):
    trainer = Trainer(
        max_epochs=max_epochs,
        accelerator=accelerator,
        devices=1,
        deterministic=True,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LambdaCallback(on_train_start=on_start)],
    )
    loader = DataLoader(data, batch_size=8, shuffle=True)
    state = trainer.fit(model(), loss_fn, optim.adam(1e-2), loader, ckpt_path=ckpt_path, seed=0)
    return trainer, state


with tempfile.TemporaryDirectory() as root:
    _, full = fit(os.path.join(root, "full"), 2)
    first, _ = fit(os.path.join(root, "split"), 1)
    path = first.checkpoint_callback.last_model_path or first.checkpoint_callback.best_model_path
    _, resumed = fit(os.path.join(root, "split"), 2, ckpt_path=path)
devices = sorted({str(p.device) for p in full.params.values()})
print(f"checkpoint after epoch 1: {os.path.basename(path)}")
print(f"steps: uninterrupted {full.progress.step}, resumed {resumed.progress.step}")
print(f"params on {devices}; deterministic algorithms during fit: {seen['deterministic']}")
print(f"CUBLAS_WORKSPACE_CONFIG during fit: {seen['cublas']}")
equal = full.progress.step == resumed.progress.step and all(
    torch.equal(full.params[n], resumed.params[n]) for n in full.params
)
print(f"resume_bitwise={equal}")
PY

resume_check() {
	"$PYTHON" - "$DEVICE" <<<"$RESUME_CHECK"
}

if [[ "${1:-}" == "resume" ]]; then
	resume_check
	exit
fi

START=$SECONDS

# the timeout of a step: at most $1 seconds, leaving $2 seconds for the steps after it
budget() {
	local left=$((BUDGET_S - (SECONDS - START) - $2))
	if ((left >= $1)); then
		echo "$1"
	else
		echo $((left > 30 ? left : 30))
	fi
}

echo "== GPU"
nvidia-smi -L || echo "nvidia-smi failed"
"$PYTHON" - <<'PY'
import sys

import torch

print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, CUDA available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (a CPU-only torch, no driver or no GPU)")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
PY

echo "== CUDA tests"
TESTS=pass
CUDA_TESTS="$(
	cat <<'PY'
import sys

import pytest


class CudaOnly:
    """Keeps the tests whose skipif marker's reason names CUDA."""

    def pytest_collection_modifyitems(self, config, items):
        keep = [
            item
            for item in items
            if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        ]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


sys.exit(pytest.main(["-q", "-x", "-rs", "-p", "no:randomly", *sys.argv[1:]], plugins=[CudaOnly()]))
PY
)"
mapfile -t FILES < <(grep -l "torch.cuda.is_available" tests/test_*.py)
timeout "$(budget 240 300)" "$PYTHON" - "${FILES[@]}" <<<"$CUDA_TESTS" || TESTS=fail

echo "== bitwise resume on $DEVICE"
echo "CUBLAS_WORKSPACE_CONFIG before the fit: ${CUBLAS_WORKSPACE_CONFIG:-unset}" \
	"(Trainer(deterministic=True) sets :4096:8 when unset)"
RESUME=False
out="$(timeout "$(budget 120 280)" "$PYTHON" - "$DEVICE" <<<"$RESUME_CHECK" 2>&1)" ||
	echo "the resume check failed (exit status $?)"
echo "$out"
if [[ "$(tail -n 1 <<<"$out")" == "resume_bitwise=True" ]]; then
	RESUME=True
fi

# run benchmark $1 with mode $2 under a timeout of at most $3 s, leaving $4 s; print the
# last line's ratio_vs_raw_compiled (or failed / timeout) on the last line
bench() {
	local log rc=0
	log="$(mktemp)"
	echo "== $1 --device cuda --mode $2" >&2
	timeout "$(budget "$3" "$4")" "$PYTHON" "benchmarks/$1" --device cuda --mode "$2" \
		--rounds "$ROUNDS" >"$log" 2>&1 || rc=$?
	tail -n 8 "$log" >&2
	if ((rc == 124)); then
		echo timeout
	elif ((rc != 0)); then
		echo failed
	else
		tail -n 1 "$log" | sed -n 's/.*ratio_vs_raw_compiled=\([^ ]*\)$/\1/p'
	fi
	rm -f "$log"
}

COMPILE_DEFAULT="$(bench compile_step.py default 150 330)"
COMPILE_GRAPHS="$(bench compile_step.py reduce-overhead 150 200)"
CHAR_DEFAULT="$(bench char_lm.py default 120 100)"
CHAR_GRAPHS="$(bench char_lm.py reduce-overhead 120 0)"

echo "gpu_check: tests=$TESTS resume_bitwise=$RESUME compile_default=${COMPILE_DEFAULT:-missing}" \
	"compile_cudagraphs=${COMPILE_GRAPHS:-missing} char_lm_default=${CHAR_DEFAULT:-missing}" \
	"char_lm_cudagraphs=${CHAR_GRAPHS:-missing} total_s=$((SECONDS - START))"
