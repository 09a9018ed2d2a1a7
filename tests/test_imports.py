"""No import cycles between the modules of viasd_tune, counting imports inside functions too.

A function-level import hides a cycle from Python (it runs after both modules are loaded) but not from a
reader: the two modules still depend on each other. The graph is read from the source with ``ast``, so the
test needs no import of the package and sees every import statement, wherever it sits (only blocks under
``if TYPE_CHECKING:`` are left out: they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "viasd_tune"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Edges (importer, imported) that are allowed for now: none.
KNOWN: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` bodies."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = (
                test.id
                if isinstance(test, ast.Name)
                else test.attr
                if isinstance(test, ast.Attribute)
                else ""
            )
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    skipped.update(id(n) for n in ast.walk(stmt))
    return skipped


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that ``module`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skipped = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` loads a.b.c; keep the longest prefix that is one of our modules
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != module:
                out.add(".".join(parts))
    return out


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One concrete cycle inside a component, for the failure message: a -> b -> ... -> a."""
    members, start = set(component), component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    chain = [v]
                    while chain[-1] != start:
                        chain.append(parents[chain[-1]])
                    return " -> ".join([start, *reversed(chain[:-1]), start]) if v != start else start
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return ", ".join(component)


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "viasd_tune.config" in graph["viasd_tune.decoding.decoder"]  # from ..config import (module level)
    assert "viasd_tune.search.run" in graph["viasd_tune.search.workers"]  # from .run import
    assert "viasd_tune.search.cli" in graph["viasd_tune.cli"]  # from .search.cli import (inside a function)
    assert "viasd_tune.models" in graph["viasd_tune.search.run"]  # from .. import models


def test_cycle_finder():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, ["a", "b", "c"]) == "a -> b -> c -> a"


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    for importer, imported in KNOWN:
        graph[importer].discard(imported)
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(_path(graph, c) for c in found)
