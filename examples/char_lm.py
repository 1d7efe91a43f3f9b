"""A character-level transformer language model, trained eagerly and compiled whole.

    .venv/bin/python examples/char_lm.py               # about a few minutes on 2 CPU cores
    .venv/bin/python examples/char_lm.py --steps 50    # shorter

The corpus is on every machine without a download: the Python standard library's own
source files (``*.py`` next to ``os.py``, in sorted order, as UTF-8 bytes; the vocabulary is
the 256 byte values). The text is cut into windows of ``context + 1`` bytes; the first 90%
of the windows train, the last 10% validate. The model: byte and position embeddings of
width 128, 2 pre-norm transformer blocks (4 heads, causal ``scaled_dot_product_attention``,
a 4x GELU MLP, dropout 0.1), a final LayerNorm and a linear head; AdamW.

The same run twice, from the same seed: ``Trainer(compile=False)`` and
``Trainer(compile=True)`` (forward, backward and AdamW as one inductor graph). Each prints
its validation loss (``engine.eval_step`` over the validation windows, compiled on the
compiled side) and its training throughput in tokens per second, measured after the first
few batches (the compiled side's first batch pays for compiling; that time is printed).
The last line: ``eager_val_loss=... compiled_val_loss=... eager_tokens_per_s=...
compiled_tokens_per_s=...``. ``--backend`` picks the compiled side's ``torch.compile``
backend (default ``inductor``; the test suite runs a tiny model with ``aot_eager``).
"""

from __future__ import annotations

import argparse
import glob
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import Trainer, engine, optim, seed_everything
from purestep.loops.callbacks import LambdaCallback

VOCAB = 256


def corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's source files as one byte tensor (at most ``max_bytes``)."""
    stdlib = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def windows(tokens: torch.Tensor, context: int) -> tuple[TensorDataset, TensorDataset]:
    """Non-overlapping windows of ``context + 1`` tokens: (train, validation) datasets."""
    n = tokens.numel() // (context + 1)
    rows = tokens[: n * (context + 1)].view(n, context + 1)
    split = int(n * 0.9)
    return TensorDataset(rows[:split]), TensorDataset(rows[split:])


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharLM(nn.Module):
    def __init__(self, context: int = 64, width: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads, 0.1) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        return self.head(self.ln(self.blocks(x)))


def loss_fn(apply: nn.Module, batch: Any) -> torch.Tensor:
    (rows,) = batch
    logits = apply(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))


def validation_loss(net: nn.Module, state: Any, val: TensorDataset, compile: Any) -> float:
    step = engine.eval_step(net, loss_fn, compile=compile)
    total, count = 0.0, 0
    for batch in DataLoader(val, batch_size=128):
        total += step(state, batch)["loss"].item() * len(batch[0])
        count += len(batch[0])
    return total / count


def train(compiled: bool, args: argparse.Namespace, data: tuple) -> dict[str, float]:
    train_set, val_set = data
    compile = {"backend": args.backend} if compiled else False
    seed_everything(args.seed)
    net = CharLM(context=args.context, width=args.width, layers=args.layers)
    marks: list[float] = []
    timer = LambdaCallback(on_train_batch_end=lambda ctx: marks.append(time.perf_counter()))
    trainer = Trainer(
        max_steps=args.steps,
        compile=compile,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
    )
    start = time.perf_counter()
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    state = trainer.fit(net, loss_fn, optim.adamw(3e-3, weight_decay=0.01), loader, seed=args.seed)
    skip = min(5, len(marks) - 2)
    tokens = args.batch_size * args.context * (len(marks) - 1 - skip)
    per_s = tokens / (marks[-1] - marks[skip])
    first = marks[0] - start
    val = validation_loss(net, state, val_set, compile)
    name = "compiled" if compiled else "eager"
    print(
        f"{name:8s}: {state.progress.step} steps, val_loss {val:.4f}, {per_s:,.0f} tokens/s "
        f"(first batch, start-up{' and compilation' if compiled else ''} included: {first:.1f} s)"
    )
    return {"val_loss": val, "tokens_per_s": per_s}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=2_000_000, help="corpus size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=None, help="the Trainer's folder")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = windows(corpus(args.bytes), args.context)
    print(
        f"corpus: {args.bytes:,} bytes of the standard library's sources; "
        f"{len(data[0])} training and {len(data[1])} validation windows of {args.context}"
    )
    results = {"eager": train(False, args, data), "compiled": train(True, args, data)}
    e, c = results["eager"], results["compiled"]
    print(
        f"eager_val_loss={e['val_loss']:.4f} compiled_val_loss={c['val_loss']:.4f} "
        f"eager_tokens_per_s={e['tokens_per_s']:.0f} compiled_tokens_per_s={c['tokens_per_s']:.0f}"
    )
    return results


if __name__ == "__main__":
    main()
