"""The documentation site: its pages, its figures, and the README that leads into it.

``mkdocs build --strict`` itself runs in ``.ci/run`` (the ``docs`` extra); these tests hold
what the build does not: every page is in the nav, the figures drawn at build time show what
they claim (the state of a real run, the schedules, the benchmarks' table), and the README
stays short and links into the site.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import pytest
import torch

from tests.markdown_blocks import site_pages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _figures():
    pytest.importorskip("matplotlib")
    path = os.path.join(DOCS, "hooks", "figures.py")
    spec = importlib.util.spec_from_file_location("site_figures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = {os.path.relpath(p, DOCS) for p in site_pages(ROOT)}
    on_disk = {
        os.path.relpath(os.path.join(folder, name), DOCS)
        for folder, _, names in os.walk(DOCS)
        for name in names
        if name.endswith(".md")
    }
    assert pages == on_disk, (sorted(on_disk - pages), sorted(pages - on_disk))


def test_ci_builds_the_site_strictly():
    ci = [line.strip() for line in _read(".ci", "run").splitlines()]
    build = next(line for line in ci if "mkdocs build" in line)
    assert "--strict" in build and 'pip install -e ".[docs]"' in build
    assert "strict: true" in _read("mkdocs.yml")


def test_the_readme_is_short_and_its_links_into_the_site_resolve():
    readme = _read("README.md")
    assert len(readme.splitlines()) < 300
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(set(links)) >= 10, links  # the guide pages, not a single "see the docs"
    for link in links:
        assert os.path.isfile(os.path.join(ROOT, link)), link


def test_the_state_figure_draws_every_field_and_leaf_of_a_real_run():
    figures = _figures()
    state = figures.real_run_state()
    rows = figures.tree_rows(state)
    fields = [key for depth, key, _ in rows if depth == 1]
    assert fields == [f.name for f in dataclasses.fields(state)]
    leaves = {key: label for _, key, label in rows if label}
    for name, tensor in state.params.items():
        assert name in leaves
        assert leaves[name] == f"float32[{', '.join(map(str, tensor.shape))}]"
    assert state.buffers and all(name in leaves for name in state.buffers)
    assert state.callbacks, "the run's ModelCheckpoint state should be drawn"
    svg = figures.state_pytree_svg(state)
    assert svg.lstrip().startswith("<?xml") and "0.weight" in svg and "opt_state" in svg


def test_the_schedule_figure_plots_the_native_schedules():
    figures = _figures()
    svg = figures.lr_schedules_svg()
    for name in ("cosine(", "one_cycle(", "warmup_cosine(", "multistep("):
        assert name in svg


def test_the_benchmark_chart_reads_every_row_of_the_benchmarks_table():
    figures = _figures()
    page = _read("docs", "benchmarks.md")
    rows = [line for line in page.splitlines() if line.startswith("| `python benchmarks/")]
    ratios = figures.benchmark_ratios(page)
    assert rows and {name.split(".")[0] for name, _ in ratios} >= {
        re.match(r"\| `python benchmarks/(\w+)", row).group(1)
        for row in rows
        if re.search(r"(ratio|speedup)[a-z_]*=", row)
    }
    assert all(value == value and value > 0 for _, value in ratios)
    svg = figures.benchmarks_svg(page)
    assert all(name in svg for name, _ in ratios)
    with pytest.raises(ValueError, match="no `key=value` ratios"):
        figures.benchmarks_svg("| no table |")


def test_the_figures_are_the_same_bits_each_build():
    figures = _figures()
    torch.manual_seed(123)  # the hook seeds the run itself: outside state does not matter
    assert figures.state_pytree_svg() == figures.state_pytree_svg()
    assert figures.lr_schedules_svg() == figures.lr_schedules_svg()
