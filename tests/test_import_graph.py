"""The shape of the house: purestep's modules import one another without circles, in one
direction (``loops -> engine``, ``loops -> hardware``, ``hardware -> engine``), and none is
over 700 lines.

The import graph is read from the source with ``ast``, so it sees every import that can run:
those at module level and those inside functions (a function-level import that closes a
circle is still a circle, only a later one). Imports under ``if TYPE_CHECKING:`` never run
and are left out. How an edge is counted:

- ``import a.b.c`` and ``from a.b import c`` (``c`` a module) are edges to ``a.b.c``;
  ``from a.b import name`` (``name`` not a module) is an edge to the package ``a.b``.
- Importing ``a.b.c`` from a module outside the package ``a.b`` runs ``a/b/__init__.py``
  first, so it is an edge to the package ``a.b`` as well. From inside ``a.b`` it is not: that
  package is already being imported.
- A package's ``__init__`` depends on every submodule it re-exports, eagerly or through a
  lazy table (``engine.lazy.exports``): every string in it that names one of its modules is an
  edge, because looking up a name of the package may import that module. So a submodule that
  imports a name from its own package's ``__init__`` closes a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "purestep"
FOLDERS = ("engine", "loops", "hardware")
MAX_LINES = 700
#: Modules allowed over ``MAX_LINES`` for now (relative paths); to be emptied.
TOO_LONG_ALLOWED: frozenset[str] = frozenset()


def _modules() -> dict[str, Path]:
    """``dotted name -> file`` for the root ``__init__`` and every module of the folders."""
    modules = {PACKAGE: ROOT / "__init__.py"}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((PACKAGE, *parts))] = path
    return modules


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _base(importer: str, level: int) -> str:
    """The package a relative import of ``level`` dots in ``importer`` starts from."""
    parts = importer.split(".")
    if not _is_package(importer):
        parts = parts[:-1]
    return ".".join(parts[: len(parts) - (level - 1)])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runnable_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node``, leaving out the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _runnable_nodes(other)
            continue
        yield child
        yield from _runnable_nodes(child)


def _named(importer: str, tree: ast.AST) -> Iterator[str]:
    """The purestep modules (or packages) ``importer`` names in its import statements."""
    for node in _runnable_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _base(importer, node.level)
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target not in MODULES:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield sub if sub in MODULES else target


def _reexported(package: str, tree: ast.AST) -> Iterator[str]:
    """The modules a package's ``__init__`` names in strings (its lazy re-export table)."""
    for node in _runnable_nodes(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        text = node.value
        if text.startswith("."):
            level = len(text) - len(text.lstrip("."))
            base = _base(package, level)
            candidate = f"{base}.{text[level:]}" if text[level:] else base
        elif text.startswith(f"{PACKAGE}."):
            candidate = text
        else:
            candidate = f"{package}.{text}"
        if candidate in MODULES and candidate != package:
            yield candidate


def _with_packages(importer: str, target: str) -> Iterator[str]:
    """``target`` and the packages above it that importing it runs first (those that do not
    already hold ``importer``)."""
    yield target
    parts = target.split(".")
    for cut in range(1, len(parts)):
        package = ".".join(parts[:cut])
        if not (importer == package or importer.startswith(f"{package}.")):
            yield package


def import_graph() -> dict[str, set[str]]:
    """``module -> the purestep modules importing it can run``."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = set(_named(name, tree))
        if _is_package(name):
            targets |= set(_reexported(name, tree))
        graph[name] = {
            edge for target in targets for edge in _with_packages(name, target) if edge != name
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, with
    an explicit stack), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _example_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, for the failure message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    return component


def test_the_graph_sees_the_imports_it_should() -> None:
    """The reader itself: relative, ``from package import submodule``, function-level and
    lazy-table imports are edges; ``if TYPE_CHECKING:`` ones are not."""
    graph = import_graph()
    assert "purestep.engine.tree" in graph["purestep.engine.state"]
    assert "purestep.engine.step" in graph["purestep.engine"]  # the lazy table
    assert "purestep.engine" in graph["purestep"]
    assert "purestep.engine" in graph["purestep.hardware.single"]  # runs engine/__init__
    assert "purestep.engine.checkpoint.storage" in graph["purestep.engine.checkpoint"]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import step\n"
        "def f():\n    from .checkpoint import storage\n    from . import tree\n"
    )
    assert set(_named("purestep.engine.export", tree)) == {
        "purestep.engine.checkpoint.storage",
        "purestep.engine.tree",
    }
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    graph = import_graph()
    found = cycles(graph)
    message = "\n".join(
        f"- {len(c)} modules: {', '.join(c)}\n  e.g. {' -> '.join(_example_path(graph, c))}"
        for c in found
    )
    assert not found, f"import circles between purestep's modules:\n{message}"


def test_dependencies_point_one_way() -> None:
    """``engine`` imports neither ``loops`` nor ``hardware``; ``hardware`` does not import
    ``loops``."""
    forbidden = {
        f"{PACKAGE}.engine": (f"{PACKAGE}.loops", f"{PACKAGE}.hardware"),
        f"{PACKAGE}.hardware": (f"{PACKAGE}.loops",),
    }
    wrong = []
    for module, targets in sorted(import_graph().items()):
        for layer, banned in forbidden.items():
            if module == layer or module.startswith(f"{layer}."):
                for target in sorted(targets):
                    if any(target == b or target.startswith(f"{b}.") for b in banned):
                        wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the dependency direction:\n" + "\n".join(wrong)


def test_no_module_over_700_lines() -> None:
    long = {}
    for path in MODULES.values():
        relative = path.relative_to(ROOT).as_posix()
        count = len(path.read_text(encoding="utf-8").splitlines())
        if count > MAX_LINES and relative not in TOO_LONG_ALLOWED:
            long[relative] = count
    listing = "\n".join(f"- {path}: {n} lines" for path, n in sorted(long.items()))
    assert not long, f"modules over {MAX_LINES} lines (split them by concept):\n{listing}"


def test_the_allowed_long_modules_are_still_long() -> None:
    """An exception that no longer applies is removed from the list."""
    stale = [
        p
        for p in sorted(TOO_LONG_ALLOWED)
        if len((ROOT / p).read_text(encoding="utf-8").splitlines()) <= MAX_LINES
    ]
    assert not stale, f"no longer over {MAX_LINES} lines, drop from TOO_LONG_ALLOWED: {stale}"
