"""purestep inside other frameworks: Ray Train and Tune, Optuna, Hugging Face.

Each module here wraps one outside library, which is an optional extra (``ray``, ``optuna``,
``hf``): importing ``purestep`` or ``purestep.loops.integrations`` imports none of them, and
a name here loads its library on first use. When that library is missing, the error says
which extra to install instead of only naming the module Python could not find.
"""

from __future__ import annotations

from typing import Any

from purestep.engine.lazy import exports

#: ``name -> (module, attribute)``.
_LAZY: dict[str, tuple[str, str | None]] = {}

#: the extra each module's outside libraries come with (``pip install "purestep[extra]"``)
EXTRAS: dict[str, str] = {
    ".ray_train": "ray",
    ".ray_tune": "ray",
    ".optuna_pruning": "optuna",
    ".sweep": "optuna",
    ".hf_models": "hf",
    ".hf_datasets": "hf",
}

#: the top-level packages of the extras' libraries
_OUTSIDE = {"ray", "optuna", "optuna_integration", "transformers", "datasets", "sqlalchemy"}

__all__: list[str] = sorted(_LAZY)

_load, __dir__ = exports(__name__, _LAZY, globals())


def __getattr__(name: str) -> Any:
    try:
        return _load(name)
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".", 1)[0]
        if missing not in _OUTSIDE:
            raise
        extra = EXTRAS[_LAZY[name][0]]
        raise ModuleNotFoundError(
            f"purestep.loops.integrations.{name} needs {missing!r}, which is not installed: "
            f'pip install "purestep[{extra}]"',
            name=err.name,
        ) from err
