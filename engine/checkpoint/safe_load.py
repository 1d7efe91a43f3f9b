"""Read a file with ``torch.load(weights_only=True)``, turning every failure into a clear error.

Checkpoints and weight files are both read here, so they refuse the same things with the
same messages: a file that needs the unpickler to build arbitrary objects is refused (nothing
from it runs) and a truncated or corrupt file is reported as such, naming the file. A missing
or uncommitted file stays a ``FileNotFoundError`` (see ``storage.open_read``).
"""

from __future__ import annotations

import pickle
import zipfile
from typing import Any

import torch

from . import storage
from .codec import CheckpointError

__all__ = ["torch_load"]

# What torch.load raises for a damaged file: a bad zip directory, a short read, a missing
# archive member, an I/O failure half way through.
_CORRUPT = (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError)


def torch_load(
    url: str,
    *,
    map_location: Any = "cpu",
    commit: str = "auto",
    storage_options: dict[str, Any] | None = None,
    advice: str = "",
) -> Any:
    """The object ``torch.save`` wrote to ``url``, read without running code from it.

    ``advice`` is added to the refusal of a file that holds arbitrary Python objects (e.g.
    how to extract the weights from a trusted file).
    """
    handle = storage.open_read(url, commit=commit, storage_options=storage_options)
    try:
        with handle as f:
            local = getattr(f, "name", None) if storage.is_local_url(url) else None
            source = local if isinstance(local, str) else f
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing to load {url}: it holds Python objects other than tensors and plain "
            f"containers (a pickle payload?); nothing from it was run. {advice}"
            f"Detail: {_unpickler_detail(err)}"
        ) from None
    except _CORRUPT as err:
        first_line = (str(err).splitlines() or [type(err).__name__])[0][:300]
        raise CheckpointError(
            f"{url} is corrupt or truncated and cannot be read: {first_line}"
        ) from None


def _unpickler_detail(err: Exception) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if "Unsupported" in ln or "error" in ln]
    return (lines[-1] if lines else (str(err).splitlines() or [""])[0])[:300]
