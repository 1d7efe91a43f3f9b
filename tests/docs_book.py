"""The book: the README and the documentation site's pages, whose python blocks tests run.

One ``MarkdownBlocks`` over all of them, in reading order (the README, then the site's nav),
the Lightning guide aside (``tests/test_guide.py`` runs its blocks). The tests of the
README's and the pages' blocks live in ``tests/test_readme.py`` and ``tests/test_docs_*.py``;
each declares what it runs on this one ``PAGE``, and ``tests/test_readme.py`` checks that
every block of the book is declared by some test.
"""

from __future__ import annotations

import os

from tests.markdown_blocks import MarkdownBlocks, site_pages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BOOK = [README] + [p for p in site_pages(ROOT) if not p.endswith("coming_from_lightning.md")]
PAGE = MarkdownBlocks(BOOK, "the docs")
