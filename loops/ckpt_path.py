"""What a ``ckpt_path`` may name besides a path, and the error for one that names nothing.

``"last"`` (the furthest checkpoint a run can resume from; fit's only keyword) and
``"best"`` (the checkpoint callback's best, for validate / test / predict); a word close to
one of them is suggested, a Lightning keyword this Trainer lacks is named.
"""

from __future__ import annotations

import difflib
from typing import Any

from purestep.engine import checkpoint as ck
from purestep.engine.state import TrainState

__all__ = ["CKPT_KEYWORDS", "ckpt_keywords", "missing_checkpoint", "resumable"]

#: What ``ckpt_path`` accepts besides a path (fit: "last" only).
CKPT_KEYWORDS = ("last", "best")
# Lightning keywords this Trainer does not have.
_UNSUPPORTED_KEYWORDS = {"hpc": "Lightning's SLURM checkpoint keyword, not available yet"}


def ckpt_keywords(fn: str) -> tuple[str, ...]:
    """The ``ckpt_path`` keywords ``fn`` accepts ("best" is an evaluation's only)."""
    return CKPT_KEYWORDS if fn != "fit" else ("last",)


def missing_checkpoint(url: str, fn: str) -> str:
    """The error for a ``ckpt_path`` that is no file: the keyword it is close to, if any
    (a bare word only, not a path), and the keywords ``fn`` accepts."""
    keywords = ckpt_keywords(fn)
    hint = ""
    word = url.strip().lower()
    if word in _UNSUPPORTED_KEYWORDS:
        hint = f" ({word!r} is {_UNSUPPORTED_KEYWORDS[word]})"
    elif not any(c in url for c in "/\\."):
        close = difflib.get_close_matches(word, keywords, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    *others, final = [repr(k) for k in keywords]
    accepted = ", ".join(["a checkpoint path", *others]) + f" or {final}"
    return f"ckpt_path={url!r}: no checkpoint at {url}{hint}; {fn} takes {accepted}"


def resumable(state: Any, metadata: dict[str, Any]) -> bool:
    """Whether a loaded checkpoint can resume training: a weights-only file is passed over
    (False); any other state that is not a ``TrainState`` is an error (skipped, warned)."""
    if metadata.get("weights_only", False):
        return False
    if not isinstance(state, TrainState):
        raise ck.CheckpointError(
            f"it holds a {type(state).__name__}, not a TrainState, and cannot resume training"
        )
    return True
