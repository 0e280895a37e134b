"""The package has no import cycle among its module-level imports (function-level imports of
optional dependencies are not module-level, and `if TYPE_CHECKING:` blocks are).

import-linter's layers contract (pyproject.toml) keeps the parts in order; this test also covers
cycles inside one part, which a layers contract does not see.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import emberlink

ImportGraph = dict[str, set[str]]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package in folder `root`, by dotted name (a package is its __init__)."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements at module level: outside functions and classes, in every branch of
    top-level `if` (`if TYPE_CHECKING:` included: a type-only cycle is still a cycle), `try` and
    `with` blocks."""
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            yield stmt
        elif isinstance(stmt, ast.If | ast.With):
            yield from _module_level([*stmt.body, *getattr(stmt, "orelse", [])])
        elif isinstance(stmt, ast.Try):
            handlers = [s for h in stmt.handlers for s in h.body]
            yield from _module_level([*stmt.body, *handlers, *stmt.orelse, *stmt.finalbody])


def _anywhere(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _imported(stmt: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules one import statement names (`from pkg import sub` names pkg.sub)."""
    if isinstance(stmt, ast.Import):
        return {alias.name for alias in stmt.names} & known
    base = stmt.module or ""
    if stmt.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(stmt.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = set()
    for alias in stmt.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in known else base)
    return found & known


def import_graph(root: Path, package: str, *, function_level: bool = False) -> ImportGraph:
    """Module -> the project modules it imports at module level (and in functions and classes too
    with `function_level`)."""
    modules = module_names(root, package)
    known = set(modules)
    graph: ImportGraph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for stmt in _anywhere(tree) if function_level else _module_level(tree.body):
            edges |= _imported(stmt, name, path.name == "__init__.py", known)
        graph[name] = edges - {name}
    return graph


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle (a closed path, first node repeated at the end) per strongly connected group of
    modules that import each other, sorted; empty when the graph is acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_cycle_through(graph, group) for group in groups)


def _cycle_through(graph: Mapping[str, set[str]], group: set[str]) -> list[str]:
    """A shortest closed path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, set()) & group):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_find_cycles_reports_each_cycle_once_as_a_closed_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]


def test_find_cycles_finds_nothing_in_an_acyclic_graph() -> None:
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def _fake_package(folder: Path, **modules: str) -> Path:
    """A package `pkg` in `folder`, its modules given as dotted-name-under-pkg=source."""
    pkg = folder / "pkg"
    for name, source in {"__init__": "", **modules}.items():
        path = pkg.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(source)
    return pkg


def test_import_graph_reads_module_level_imports_in_every_form(tmp_path: Path) -> None:
    pkg = _fake_package(
        tmp_path,
        a="from pkg.sub import b\ntry:\n    from . import c\nexcept ImportError:\n    import pkg.d\n",
        c="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import name\n",
        d="import os\n",
        **{"sub.b": "def f():\n    from pkg import a\n"},
    )
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b", "pkg.c", "pkg.d"}
    assert graph["pkg.c"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == graph["pkg.d"] == set()
    assert find_cycles(graph) == []
    assert import_graph(pkg, "pkg", function_level=True)["pkg.sub.b"] == {"pkg.a"}
    assert find_cycles(import_graph(pkg, "pkg", function_level=True)) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_a_type_checking_import_back_is_a_module_level_cycle(tmp_path: Path) -> None:
    pkg = _fake_package(
        tmp_path,
        session="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.worker import Worker\n",
        worker="from pkg.session import Session\n",
    )
    assert find_cycles(import_graph(pkg, "pkg")) == [["pkg.session", "pkg.worker", "pkg.session"]]


ROOT = Path(emberlink.__file__).parent


def _shown(cycles: list[list[str]]) -> str:
    return "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_emberlink_has_no_module_level_import_cycle() -> None:
    cycles = find_cycles(import_graph(ROOT, "emberlink"))
    assert not cycles, _shown(cycles)


def test_emberlink_has_no_import_cycle_even_through_imports_inside_functions() -> None:
    # A function-level import may defer an optional dependency (nats, cupy) or a heavy part of the
    # package; it must not be a way around a cycle.
    cycles = find_cycles(import_graph(ROOT, "emberlink", function_level=True))
    assert not cycles, _shown(cycles)
