"""A table of the model's layers and parameter counts, shown when ``fit`` starts.

Counts come from the module template (they work on the meta device: only shapes are read);
sizes use the dtypes of the tensors in the training state, so a ``bf16-true`` run reports
two bytes per parameter. Megabytes are decimal (10**6 bytes). ``summarize`` builds the text;
``layer_summaries`` and ``totals`` give the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..events import NOTHING, Context, Requests
from .base import Callback

__all__ = ["LayerSummary", "ModelSummary", "Totals", "layer_summaries", "summarize", "totals"]


class LayerSummary(NamedTuple):
    """One row: the layer's name, class, parameter count (its submodules included, shared
    tensors once), size in MB, and ``"train"`` / ``"eval"`` as the template is set."""

    name: str
    type: str
    params: int
    size_mb: float
    mode: str


class Totals(NamedTuple):
    """Parameter counts of the whole model and its estimated size in MB."""

    total: int
    trainable: int
    non_trainable: int
    size_mb: float
    train_modules: int
    eval_modules: int


def _bytes_per_element(model: nn.Module, params: Mapping[str, torch.Tensor] | None):
    """``id(parameter) -> bytes per element``: the state's dtype when it holds the tensor."""
    out = {}
    for name, p in model.named_parameters():
        source = params.get(name) if params is not None else None
        out[id(p)] = (source if source is not None else p).element_size()
    return out


def _count(parameters: Any, sizes: Mapping[int, int]) -> tuple[int, float]:
    n = 0
    nbytes = 0
    for p in parameters:
        n += p.numel()
        nbytes += p.numel() * sizes.get(id(p), p.element_size())
    return n, nbytes / 1e6


def layer_summaries(
    model: nn.Module, params: Mapping[str, torch.Tensor] | None = None, max_depth: int = 1
) -> list[LayerSummary]:
    """The layers ``max_depth`` levels deep at most (``-1``: all; ``0``: none), in
    ``named_modules`` order."""
    _check_depth(max_depth)
    if max_depth == 0:
        return []
    sizes = _bytes_per_element(model, params)
    rows = []
    for name, module in model.named_modules():
        if not name or (max_depth > 0 and name.count(".") + 1 > max_depth):
            continue
        n, mb = _count(module.parameters(), sizes)
        mode = "train" if module.training else "eval"
        rows.append(LayerSummary(name, type(module).__name__, n, mb, mode))
    return rows


def totals(model: nn.Module, params: Mapping[str, torch.Tensor] | None = None) -> Totals:
    """Total, trainable (``requires_grad``) and frozen parameter counts and the size in MB."""
    sizes = _bytes_per_element(model, params)
    total, mb = _count(model.parameters(), sizes)
    trainable, _ = _count((p for p in model.parameters() if p.requires_grad), sizes)
    modes = [m.training for m in model.modules()]
    return Totals(total, trainable, total - trainable, mb, sum(modes), len(modes) - sum(modes))


def summarize(
    model: nn.Module, params: Mapping[str, torch.Tensor] | None = None, max_depth: int = 1
) -> str:
    """The summary text: a table of ``layer_summaries`` then the ``totals``."""
    rows = layer_summaries(model, params, max_depth)
    t = totals(model, params)
    lines = []
    if rows:
        header = ("", "Name", "Type", "Params", "Size (MB)", "Mode")
        cells = [
            (str(i), r.name, r.type, f"{r.params:,}", f"{r.size_mb:.3f}", r.mode)
            for i, r in enumerate(rows)
        ]
        widths = [max(len(c[k]) for c in [header, *cells]) for k in range(len(header))]
        right = (False, False, False, True, True, False)  # numbers right-aligned

        def line(row: tuple[str, ...]) -> str:
            parts = (c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right))
            return " | ".join(parts).rstrip()

        table = [line(row) for row in cells]
        head = line(header)
        rule = "-" * max(len(line) for line in [head, *table])
        lines += [head, rule, *table, rule]
    numbers = [
        (f"{t.trainable:,}", "Trainable params"),
        (f"{t.non_trainable:,}", "Non-trainable params"),
        (f"{t.total:,}", "Total params"),
        (f"{t.size_mb:.3f}", "Total estimated model params size (MB)"),
        (str(t.train_modules), "Modules in train mode"),
        (str(t.eval_modules), "Modules in eval mode"),
    ]
    width = max(len(v) for v, _ in numbers) + 2
    lines += [v.ljust(width) + label for v, label in numbers]
    return "\n".join(lines)


def _check_depth(max_depth: Any) -> None:
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < -1:
        raise ValueError(
            f"max_depth must be an int >= -1 (-1: all layers, 0: no table), got {max_depth!r}"
        )


class ModelSummary(Callback):
    """Show ``summarize(model, state.params, max_depth)`` at ``on_fit_start`` (rank 0 only;
    ``max_depth=0`` shows nothing). The loop passes the template as ``ctx.extra["model"]``."""

    def __init__(self, max_depth: int = 1, name: str | None = None) -> None:
        _check_depth(max_depth)
        self.max_depth = max_depth
        if name is not None:
            self.name = name

    def on_fit_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if self.max_depth == 0 or ctx.rank != 0:
            return state, NOTHING
        model = ctx.extra.get("model")
        if not isinstance(model, nn.Module):
            raise ValueError(
                "ModelSummary needs the module template in ctx.extra['model'] (an nn.Module); "
                f"the loop passed {type(model).__name__}"
            )
        return state, Requests(messages=(summarize(model, ctx.state.params, self.max_depth),))
