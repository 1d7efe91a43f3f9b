"""Lazy re-exports for the packages' ``__init__`` (PEP 562): a name loads on first use.

``import purestep`` and the command line's ``--help`` then import only what they touch
(torch itself waits for the first tensor-facing name). ``exports(__name__, table,
globals())`` gives the package's module-level ``__getattr__`` and ``__dir__``; ``table``
maps each public name to the module it lives in, and to the attribute there when that is
not the same name (``None``: the module itself). A name once loaded is bound in the
package, so later look-ups do not come back here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["exports"]

Target = str | tuple[str, str | None]


def exports(
    package: str, table: Mapping[str, Target], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``) whose lazy names are
    ``table`` (``name -> module`` or ``name -> (module, attribute)``), bound into
    ``namespace`` (its ``globals()``) as they load."""

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, attribute = (target, name) if isinstance(target, str) else target
        module = importlib.import_module(module_name, package)
        value = module if attribute is None else getattr(module, attribute)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__
