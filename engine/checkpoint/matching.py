"""Check a loaded tree against a target tree and place it like the target.

For two ``TrainState``s the target decides only what depends on the model and the optimizer
(``params``, ``buffers``, ``opt_state``, ``precision``): their structure, shapes and dtypes
must match, and the loaded tensors land on the target's devices. The run's position comes
from the file (``progress``, ``rng``, ``callbacks``, ``loop``, ``extra`` and the open
accumulation window's ``grad_accum``, whose tensors are checked against the target's parameters and
placed on their devices): a fresh ``engine.init`` state has none of it, and must not veto it.

``strict=False`` takes what matches and keeps the target's values for the rest. If the
weights came back only partly (params, buffers or the loss-scaler state), or the accumulated
gradients do not fit, an open accumulation window is dropped (``grad_accum=None``,
``micro_step=0``, as in the target): its gradients belong to weights that are not all there,
and a window counted open without its gradients would make the next step silently lose
them. The warning says so; the next micro-batch opens a new window (the dropped micro-batches
are not replayed). Any other target is matched leaf by leaf as a whole.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from purestep.engine import tree
from purestep.engine.state import TrainState

from .codec import CheckpointError

__all__ = ["MODEL_PARTS", "conform", "fit_to"]

MODEL_PARTS = ("params", "buffers", "opt_state", "precision")
_GRADIENT_PARTS = ("params", "buffers", "precision", "grad_accum")


def conform(
    loaded: Any, target: Any, *, url: str, what: str | None = None, strict: bool = True
) -> Any:
    """``loaded`` checked against ``target`` and placed on its devices (see the module doc).

    Every difference is listed in one ``CheckpointError`` (prefixed by ``what`` when given);
    with ``strict=False`` a warning lists them instead and the target's values are kept.
    """
    try:
        return fit_to(loaded, target, strict=strict, url=url, stacklevel=3)
    except CheckpointError as err:
        if what is None:
            raise
        raise CheckpointError(f"{what}: {err}") from None


def fit_to(loaded: Any, target: Any, *, strict: bool, url: str, stacklevel: int = 2) -> Any:
    """``conform`` without the prefix; ``stacklevel`` points the warning at the user's call
    (2: the caller of ``fit_to``)."""
    if isinstance(loaded, TrainState) and isinstance(target, TrainState):
        fitted, sections, notes = _fit_state(loaded, target, strict=strict)
    else:
        fitted, problems = _fit_tree(loaded, target, "")
        sections, notes = ({"": problems} if problems else {}), []
    count = sum(len(p) for p in sections.values())
    if count and strict:
        raise CheckpointError(
            f"{url} does not match the target state ({count} differences):\n"
            + _listing(sections)
            + "\nPass strict=False to load what matches (e.g. for fine-tuning)."
        )
    if count:
        warnings.warn(
            f"partial restore from {url}; kept the target's values for:\n"
            + _listing(sections)
            + "".join(f"\n{note}" for note in notes),
            stacklevel=stacklevel,
        )
    return fitted


def _listing(sections: dict[str, list[str]]) -> str:
    lines = []
    for part, problems in sections.items():
        if not part:
            lines += [f"  {p}" for p in problems]
            continue
        lines.append(f"  {part}: {len(problems)} difference{'s' if len(problems) > 1 else ''}")
        lines += [f"    {p}" for p in problems]
    return "\n".join(lines)


def _fit_state(
    loaded: TrainState, target: TrainState, *, strict: bool
) -> tuple[TrainState, dict[str, list[str]], list[str]]:
    sections: dict[str, list[str]] = {}
    parts: dict[str, Any] = {}
    for part in MODEL_PARTS:
        parts[part], problems = _fit_tree(getattr(loaded, part), getattr(target, part), f".{part}")
        if problems:
            sections[part] = problems
    progress = loaded.progress
    accum, accum_problems = _fit_grad_accum(loaded.grad_accum, progress.micro_step, target.params)
    if accum_problems:
        sections["grad_accum"] = accum_problems
    notes = []
    window_open = progress.micro_step > 0 or loaded.grad_accum is not None
    # The window's gradients were computed by the file's weights (and scaled by its loss
    # scaler): they are only valid if those came back whole.
    gradients_invalid = any(p in sections for p in _GRADIENT_PARTS)
    if not strict and window_open and gradients_invalid:
        notes.append(
            f"Dropped the open accumulation window ({progress.micro_step} micro-batches): its "
            "gradients do not fit the parameters restored; the next step opens a new window."
        )
        accum, progress = None, progress.replace(micro_step=0)
    fitted = loaded.replace(**parts, grad_accum=accum, progress=progress)
    return fitted, sections, notes


def _fit_grad_accum(
    accum: Any, micro_step: int, params: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor] | None, list[str]]:
    """The file's accumulated gradients checked against the target's parameters."""
    if accum is None:
        if micro_step > 0:
            return None, [
                f".progress.micro_step: {micro_step} micro-batches accumulated, but the "
                "checkpoint holds no gradients (.grad_accum is None)"
            ]
        return None, []
    if not isinstance(accum, Mapping):
        return None, [f".grad_accum: a {type(accum).__name__}, expected a dict of tensors"]
    placed, problems = {}, []
    for name, grad in accum.items():
        path = f".grad_accum[{name!r}]"
        param = params.get(name)
        if param is None:
            problems.append(f"{path}: the target has no parameter {name!r}")
            continue
        problem = _mismatch(grad, param)
        if problem:
            problems.append(f"{path}: {problem} (its parameter)")
            continue
        placed[name] = grad if grad.device == param.device else grad.to(param.device)
    return placed, problems


def _fit_tree(loaded: Any, target: Any, prefix: str) -> tuple[Any, list[str]]:
    """``loaded`` leaf by leaf against ``target``: ``(fitted tree, problems)``."""
    have = {_path(prefix, p): v for p, v in tree.flatten_with_paths(loaded)}
    want = [(_path(prefix, p), v) for p, v in tree.flatten_with_paths(target)]
    want_paths = {p for p, _ in want}
    problems: list[str] = []
    values = []
    for path, leaf in want:
        if path not in have:
            problems.append(f"{path}: missing in the checkpoint")
            values.append(leaf)
            continue
        got = have[path]
        problem = _mismatch(got, leaf)
        if problem:
            problems.append(f"{path}: {problem}")
            values.append(leaf)
            continue
        if isinstance(leaf, torch.Tensor) and got.device != leaf.device:
            got = got.to(leaf.device)
        values.append(got)
    problems += [
        f"{p}: in the checkpoint but not in the target" for p in have if p not in want_paths
    ]
    if not problems and tree.structure(loaded) == tree.structure(target):
        return tree.unflatten(tree.structure(loaded), values), problems
    return tree.unflatten(tree.structure(target), values), problems


def _path(prefix: str, path: str) -> str:
    """``path`` (from ``tree.flatten_with_paths``) under ``prefix`` (a part of the state)."""
    return prefix if prefix and path == "<root>" else prefix + path


def _mismatch(got: Any, want: Any) -> str | None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"a {type(got).__name__} in the checkpoint, a tensor in the target"
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)} in the checkpoint, {tuple(want.shape)} in the target"
        if got.dtype != want.dtype:
            return f"dtype {got.dtype} in the checkpoint, {want.dtype} in the target"
        return None
    if isinstance(got, torch.Tensor):
        return f"a tensor in the checkpoint, a {type(want).__name__} in the target"
    if type(got) is not type(want) and not (
        isinstance(got, (int, float)) and isinstance(want, (int, float))
    ):
        return f"a {type(got).__name__} in the checkpoint, a {type(want).__name__} in the target"
    return None
