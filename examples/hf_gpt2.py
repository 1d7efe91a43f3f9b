"""A tiny GPT-2 (a ``transformers`` model from a config, nothing downloaded) trained on the
characters of the Python standard library's own source, eagerly and compiled.

Run from the repository root::

    python examples/hf_gpt2.py              # 20 steps each way, seconds (+ compiling)
    python examples/hf_gpt2.py --steps 200  # longer: the loss falls further

The text is a few standard-library modules (``inspect.getsource``), read as bytes (a
vocabulary of 128 ASCII characters, anything else mapped to ``?``) and cut into windows of
64 characters. The windows are a ``datasets.Dataset`` served by ``hf_loader`` (one
``ds[indices]`` read per batch, purestep's deterministic order); the model is trained by
``engine.train_step`` on ``hf_loss`` (the model's own causal-LM loss, labels = inputs),
first eagerly, then with ``compile=True`` (the first compiled step includes tracing and
compiling, several seconds). Both runs start from the same state and print their losses.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import collections
import functools
import json

import datasets
import torch
import transformers

from purestep import engine
from purestep.engine import optim
from purestep.loops import data
from purestep.loops.integrations.hf_datasets import hf_loader
from purestep.loops.integrations.hf_models import hf_loss

VOCAB = 128
WINDOW = 64


def stdlib_text() -> str:
    """The source of a few standard-library modules."""
    return "\n".join(inspect.getsource(m) for m in (collections, functools, json, argparse))


def windows(text: str) -> datasets.Dataset:
    """Non-overlapping windows of ``WINDOW`` character codes, as a torch-formatted dataset."""
    codes = torch.tensor([b if b < VOCAB else ord("?") for b in text.encode()], dtype=torch.long)
    n = codes.numel() // WINDOW
    ids = codes[: n * WINDOW].view(n, WINDOW)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()}).with_format("torch")


def model(layers: int = 2) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=WINDOW,
        n_embd=32,
        n_layer=layers,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def with_labels(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The causal-LM batch: the model shifts the labels itself."""
    return {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}


def run(net, state, source, steps: int, compile: bool) -> tuple[list[float], float]:
    """``steps`` train steps; the losses and the seconds they took."""
    opt = optim.adamw(3e-3)
    step = engine.train_step(net, hf_loss, opt, compile=compile)
    losses: list[float] = []
    t0 = time.perf_counter()
    epoch = 0
    while len(losses) < steps:
        for batch in source.iterate(epoch):
            state, out = step(state, with_labels(batch))
            losses.append(float(out.loss))
            if len(losses) == steps:
                break
        epoch += 1
    return losses, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="train steps of each run")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="GPT-2 blocks")
    args = parser.parse_args()
    torch.set_num_threads(1)

    ds = windows(stdlib_text())
    source = data.source(hf_loader(ds, args.batch_size, shuffle=True, drop_last=True), seed=0)
    net = model(args.layers)
    state = engine.init(net, optim.adamw(3e-3), seed=0)
    print(f"{len(ds)} windows of {WINDOW} characters, {source.num_batches} batches per epoch")
    for name, compile in (("eager", False), ("compiled", True)):
        losses, seconds = run(net, state, source, args.steps, compile)
        print(
            f"{name:8s} loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"({args.steps} steps, {seconds:.1f} s)"
        )


if __name__ == "__main__":
    main()
