"""The ```python blocks of a Markdown page, run by tests as a reader would run them.

A test declares the blocks it runs with ``@page.runs(<first line>, ...)`` and must run
exactly those (``page.run(prefix, namespace)``; ``page.ran`` records what it ran);
``page.unrun()`` lists the blocks no test declares, so a page cannot grow a block nobody
runs. The README's and the guide's tests share this. A "page" may also be a book: several
files read in order as one (the README and the documentation site's pages), so that blocks
that build on each other may sit on different pages.
"""

from __future__ import annotations

import functools
import os
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

_BLOCK = re.compile(r"^[ \t]*```(?:python|py|python3)[ \t]*\n(.*?)^[ \t]*```", re.S | re.M)


def first_line(block: str) -> str:
    """A block's first non-empty line, stripped: what tests name it by."""
    return block.strip().splitlines()[0].strip()


class MarkdownBlocks:
    """The python blocks of the page at ``path``, or of the pages at ``path`` in that order
    (read anew on each look)."""

    def __init__(self, path: str | Sequence[str], name: str) -> None:
        self.paths = [path] if isinstance(path, str) else list(path)
        self.name = name
        self.declared: dict[str, str] = {}  # first-line prefix -> the test that runs it
        self.ran: list[str] = []  # prefixes run by the current test

    def blocks(self) -> list[str]:
        found = []
        for path in self.paths:
            with open(path, encoding="utf-8") as f:
                found += [textwrap.dedent(b) for b in _BLOCK.findall(f.read())]
        return found

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


def _ignore_python_tags(loader: Any, suffix: str, node: Any) -> None:
    return None


def site_pages(root: str) -> list[str]:
    """The documentation site's pages (``docs/...``), in the order of ``mkdocs.yml``'s nav."""
    import yaml

    class Loader(yaml.SafeLoader):
        """mkdocs.yml names Python objects (``!!python/name:``); their values do not matter."""

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", _ignore_python_tags)
    with open(os.path.join(root, "mkdocs.yml"), encoding="utf-8") as f:
        nav = yaml.load(f, Loader=Loader)["nav"]

    def walk(entries: Any) -> list[str]:
        found = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            found += walk(value) if isinstance(value, list) else [value]
        return found

    return [os.path.join(root, "docs", page) for page in walk(nav)]
