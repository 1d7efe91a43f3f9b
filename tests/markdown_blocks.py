"""The ```python blocks of a Markdown page, run by tests as a reader would run them.

A test declares the blocks it runs with ``@page.runs(<first line>, ...)`` and must run
exactly those (``page.run(prefix, namespace)``; ``page.ran`` records what it ran);
``page.unrun()`` lists the blocks no test declares, so a page cannot grow a block nobody
runs. The README's and the guide's tests share this.
"""

from __future__ import annotations

import functools
import re
import textwrap
from collections.abc import Callable
from typing import Any

_BLOCK = re.compile(r"^[ \t]*```(?:python|py|python3)[ \t]*\n(.*?)^[ \t]*```", re.S | re.M)


def first_line(block: str) -> str:
    """A block's first non-empty line, stripped: what tests name it by."""
    return block.strip().splitlines()[0].strip()


class MarkdownBlocks:
    """The python blocks of the page at ``path`` (read anew on each look)."""

    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = path, name
        self.declared: dict[str, str] = {}  # first-line prefix -> the test that runs it
        self.ran: list[str] = []  # prefixes run by the current test

    def blocks(self) -> list[str]:
        with open(self.path, encoding="utf-8") as f:
            return [textwrap.dedent(b) for b in _BLOCK.findall(f.read())]

    def matching(self, prefix: str) -> list[str]:
        return [b for b in self.blocks() if first_line(b).startswith(prefix)]

    def block(self, prefix: str) -> str:
        """The one block whose first line starts with ``prefix``."""
        found = self.matching(prefix)
        assert len(found) == 1, f"expected one {self.name} block starting with {prefix!r}"
        return found[0]

    def runs(self, *prefixes: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Declare the blocks (by the start of their first line) a test executes."""

        def decorate(test: Callable[..., Any]) -> Callable[..., Any]:
            for prefix in prefixes:
                assert prefix not in self.declared, f"{prefix!r} is declared twice"
                self.declared[prefix] = test.__name__

            @functools.wraps(test)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.ran.clear()
                result = test(*args, **kwargs)
                assert list(prefixes) == self.ran, (
                    f"{test.__name__} ran {self.ran}, declared {prefixes}"
                )
                return result

            return wrapper

        return decorate

    def exec(self, source: str, label: str, namespace: dict) -> None:
        exec(compile(source, f"{self.name} block {label!r}", "exec"), namespace)

    def run(self, prefix: str, namespace: dict) -> None:
        """Execute the one block whose first line starts with ``prefix``."""
        block = self.block(prefix)
        self.ran.append(prefix)
        self.exec(block, prefix, namespace)

    def unrun(self) -> list[str]:
        """The first lines of the blocks no test declares."""
        return [
            first_line(b)
            for b in self.blocks()
            if not any(first_line(b).startswith(p) for p in self.declared)
        ]
