"""The site's figures, drawn when the site is built (an MkDocs hook), so none can go stale.

- ``figures/state_pytree.svg``: the ``TrainState`` of a real run (a small BatchNorm MLP fitted
  for one epoch by the Trainer, with a checkpoint callback), drawn as the tree it is.
- ``figures/lr_schedules.svg``: the native schedules of ``engine.optim.schedules`` plotted.
- ``figures/benchmarks.svg``: the ratios of the benchmarks page's table (its "last line"
  column, the benchmarks' own output), as a bar chart.

Each drawing is a function returning SVG text; ``on_files`` adds the three files to the site
(pages refer to them as ``figures/<name>.svg``). ``tests/test_docs_site.py`` calls them.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

#: The benchmarks page, whose table the bar chart is drawn from.
BENCHMARKS_PAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks.md")
_ROW = re.compile(r"^\|\s*`python benchmarks/(\w+)\.py[^`]*`\s*\|\s*`([^`]*)`", re.M)
_PAIR = re.compile(r"([a-z_]*(?:ratio|speedup)[a-z_]*)=(-?[0-9.]+)")


def _svg(fig: Any) -> str:
    """The figure as SVG text, without the build date or random ids (the same bits each build)."""
    matplotlib.rcParams["svg.hashsalt"] = "purestep"
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small, searchable
    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return out.getvalue()


def real_run_state() -> Any:
    """The final state of a small but real run: one epoch of ``Trainer.fit`` with validation,
    a BatchNorm layer (buffers), AdamW (optimizer state) and ``ModelCheckpoint`` (callback
    state), seeded so the drawing is the same each build."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from purestep import Trainer, optim, seed_everything
    from purestep.loops.callbacks import ModelCheckpoint

    seed_everything(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))

    def loss_fn(apply: Any, batch: Any) -> Any:
        x, y = batch
        return F.cross_entropy(apply(x), y)

    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            max_epochs=1,
            default_root_dir=root,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=root, monitor="val_loss")],
        )
        loader = DataLoader(data, batch_size=8)
        return trainer.fit(net, loss_fn, optim.adamw(1e-2), loader, loader)


def _leaf_label(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        shape = ", ".join(str(n) for n in value.shape)
        return f"{str(value.dtype).removeprefix('torch.')}[{shape}]"
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def tree_rows(state: Any) -> list[tuple[int, str, str]]:
    """``(depth, key, leaf label or "")`` in drawing order: the state's fields, each with its
    leaves below it (an empty container is shown as ``{}``)."""
    import dataclasses

    import optree

    from purestep.engine.tree import NAMESPACE

    rows: list[tuple[int, str, str]] = [(0, type(state).__name__, "")]
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        paths, leaves, _ = optree.tree_flatten_with_path(
            value, namespace=NAMESPACE, none_is_leaf=True
        )
        if not leaves:
            rows.append((1, field.name, "{}"))
            continue
        if paths == [()]:
            rows.append((1, field.name, _leaf_label(leaves[0])))
            continue
        rows.append((1, field.name, ""))
        seen: set[tuple[Any, ...]] = set()
        for path, leaf in zip(paths, leaves):
            for depth in range(1, len(path)):
                if path[:depth] not in seen:
                    seen.add(path[:depth])
                    rows.append((depth + 1, str(path[depth - 1]), ""))
            rows.append((len(path) + 1, str(path[-1]), _leaf_label(leaf)))
    return rows


def state_pytree_svg(state: Any = None) -> str:
    """The state drawn as a tree: one row per node, indented by depth, joined by lines."""
    rows = tree_rows(real_run_state() if state is None else state)
    fig, ax = plt.subplots(figsize=(7.5, 0.22 * len(rows) + 0.4))
    ax.set_xlim(0, 10)
    ax.set_ylim(len(rows), -1)
    ax.axis("off")
    parents: dict[int, int] = {}
    for i, (depth, key, label) in enumerate(rows):
        x = 0.45 * depth
        if depth:
            parent = parents[depth - 1]
            ax.plot([x - 0.3, x - 0.3, x - 0.05], [parent + 0.3, i, i], color="#9e9e9e", lw=0.8)
        parents[depth] = i
        colour = "#1a237e" if not label else "#263238"
        ax.text(
            x,
            i,
            key,
            va="center",
            fontsize=8,
            family="monospace",
            color=colour,
            weight="bold" if depth <= 1 else "normal",
        )
        if label:
            ax.text(6.2, i, label, va="center", fontsize=8, family="monospace", color="#00695c")
    return _svg(fig)


def lr_schedules_svg(steps: int = 100) -> str:
    """The native schedules over ``steps`` optimizer steps, at a peak learning rate of 0.1."""
    from purestep.engine.optim import schedules

    curves = {
        "step(0.1, step_size=30, gamma=0.5)": schedules.step(0.1, 30, 0.5),
        "multistep(0.1, [40, 70])": schedules.multistep(0.1, [40, 70]),
        "exponential(0.1, 0.97)": schedules.exponential(0.1, 0.97),
        "cosine(0.1, 100)": schedules.cosine(0.1, steps),
        "warmup_cosine(0.1, 10, 100)": schedules.warmup_cosine(0.1, 10, steps),
        "one_cycle(0.1, 100)": schedules.one_cycle(0.1, steps),
        "linear(0.1, 0.01, 100)": schedules.linear(0.1, 0.01, steps),
    }
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for name, schedule in curves.items():
        ax.plot(range(steps), [schedule(i) for i in range(steps)], label=name, lw=1.4)
    ax.set_xlabel("optimizer step (the schedule's count)")
    ax.set_ylabel("learning rate")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)
    return _svg(fig)


def benchmark_ratios(markdown: str) -> list[tuple[str, float]]:
    """``("<benchmark>.<key>", value)`` for each ratio or speedup in the table's last lines."""
    found = []
    for name, last_line in _ROW.findall(markdown):
        found += [(f"{name}.{key}", float(value)) for key, value in _PAIR.findall(last_line)]
    return found


def benchmarks_svg(markdown: str) -> str:
    """The benchmarks' ratios as horizontal bars, with parity (1.0) marked."""
    ratios = benchmark_ratios(markdown)
    if not ratios:
        raise ValueError("the benchmarks page's table holds no `key=value` ratios to draw")
    fig, ax = plt.subplots(figsize=(7.5, 0.24 * len(ratios) + 0.8))
    names = [name for name, _ in ratios]
    values = [value for _, value in ratios]
    colours = ["#2e7d32" if "speedup" in n else "#1565c0" for n in names]
    ax.barh(range(len(ratios)), values, color=colours)
    ax.set_yticks(range(len(ratios)), names, fontsize=7, family="monospace")
    ax.invert_yaxis()
    ax.axvline(1.0, color="#b71c1c", lw=1, ls="--")
    ax.set_xlabel("ratio: purestep over the reference (lower is better); speedup in green")
    for i, value in enumerate(values):
        ax.text(value, i, f" {value:g}", va="center", fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    return _svg(fig)


def figures() -> dict[str, str]:
    """Every figure of the site: ``path under docs/ -> SVG text``."""
    with open(BENCHMARKS_PAGE, encoding="utf-8") as f:
        benchmarks = f.read()
    return {
        "figures/state_pytree.svg": state_pytree_svg(),
        "figures/lr_schedules.svg": lr_schedules_svg(),
        "figures/benchmarks.svg": benchmarks_svg(benchmarks),
    }


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the figures to the site's files, drawn now."""
    from mkdocs.structure.files import File

    for path, svg in figures().items():
        files.append(File.generated(config, path, content=svg))
    return files
