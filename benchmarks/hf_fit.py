"""Per-step cost of ``Trainer.fit`` on a Hugging Face GPT-2 against a plain PyTorch loop.

Run from the repository root::

    .venv/bin/python benchmarks/hf_fit.py           # full run, about a minute and a half
    .venv/bin/python benchmarks/hf_fit.py --quick   # smoke run, seconds

Both sides run in this one process and train the same ``transformers.GPT2LMHeadModel``
(from a config: vocabulary 128, 64 positions, width 64, 2 blocks, 4 heads, dropout 0.1,
``use_cache=False``; the same initial weights) for one epoch over the same data: 2048
random token windows of 64 (128 in ``--quick``) in a ``datasets.Dataset``
(``with_format("torch")``), read by ``hf_loader(ds, 16, shuffle=True)`` (one
``ds[indices]`` per batch), so 128 batches per epoch; AdamW with lr 1e-3 and torch's
defaults otherwise (weight decay 1e-2):

* raw: a copy of the template, ``torch.optim.AdamW(model.parameters(), lr)`` and
  ``zero_grad()`` / ``model(**batch).loss`` / ``backward()`` / ``step()`` per batch of the
  loader, labels = input ids;
* fit: ``Trainer(enable_progress_bar=False, logger=False, enable_checkpointing=False,
  enable_model_summary=False, num_sanity_val_steps=0, max_epochs=1).fit(HFTask(template,
  engine.optim.adamw(lr)), loader)``: the fair baseline (the raw loop has no bar, logger,
  checkpoint or summary either). The Trainer re-creates the loader on its deterministic
  order, so the order of the samples differs, not the work.

Every side builds what it needs inside the timed call (model copy and optimizer, or Trainer
and state); a side's figure is the epoch's time divided by its batches. Threads:
``torch.set_num_threads(1)``. Timing: ``_harness.interleaved_calls``, one epoch per side
per round in rotating order; the ratio on the last line is the paired median (the median
over rounds of the per-round ratio fit / raw). Target: ratio <= 1.05 (eager).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness
import datasets
import torch
import transformers

from purestep import Trainer
from purestep.engine import optim
from purestep.loops.integrations.hf_datasets import hf_loader
from purestep.loops.integrations.hf_models import HFTask

VOCAB, WINDOW, BATCH, LR = 128, 64, 16, 1e-3


def template() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=WINDOW,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(config)


def dataset(samples: int) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (samples, WINDOW), generator=g)
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "labels": ids.tolist()}
    ).with_format("torch")


def raw_epoch(net, ds) -> int:
    model = copy.deepcopy(net).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    steps = 0
    for batch in hf_loader(ds, BATCH, shuffle=True):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
        steps += 1
    return steps


def fit_epoch(net, ds) -> int:
    trainer = Trainer(
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=1,
    )
    state = trainer.fit(HFTask(net, optim.adamw(LR)), hf_loader(ds, BATCH, shuffle=True))
    return state.progress.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    samples, rounds = (128, 2) if args.quick else (2048, 7)
    net, ds = template(), dataset(samples)
    n = samples // BATCH
    t0 = time.perf_counter()

    def checked(fn, name):
        def run(_):
            steps = fn(net, ds)
            assert steps == n, f"{name}: {steps} steps, expected {n}"

        return run

    def nothing():
        return None

    sides = {
        "raw": (nothing, checked(raw_epoch, "raw")),
        "fit": (nothing, checked(fit_epoch, "fit")),
    }
    for _, run in sides.values():  # warm-up: first calls, allocator
        run(None)
    print(f"GPT-2 (2 blocks, width 64), {n} batches of {BATCH}x{WINDOW} per epoch, {rounds} rounds")
    times = _harness.interleaved_calls(sides, rounds)
    for name, values in times.items():
        print(f"  {name:4s} {_harness.summary(values, 1e3 / n, 2)} ms/step")
    ratio = _harness.paired(times["fit"], times["raw"])
    medians = statistics.median(times["fit"]) / statistics.median(times["raw"])
    print(f"  fit / raw: paired median {ratio:.3f}, ratio of medians {medians:.3f}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
