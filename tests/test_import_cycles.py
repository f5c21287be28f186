"""No import cycles in Ketch's packages (``ketch.engine``, ``ketch.kernels``, ``ketch.operator``).

The graph is built from the source, not from what an import happens to run: every ``import`` and
``from ... import`` counts wherever it is written — at module level, inside functions (a lazy
import still ties the two modules together) and under ``if TYPE_CHECKING:`` (a type-only cycle
still means two modules know each other). ``from pkg import name`` is an edge to ``pkg.name`` when
that is a module, else to ``pkg``. A cycle is a strongly connected component of more than one
module; the test names each one and the imports that close it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"engine": "ketch.engine", "kernels": "ketch.kernels", "operator": "ketch.operator"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the three packages."""
    modules: dict[str, Path] = {}
    for top, package in PACKAGES.items():
        base = REPO / top
        for path in (base / package.replace(".", "/")).rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    kept = parts[: len(parts) - node.level + 1]
                    base = ".".join(kept + ([base] if base else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        edges.add(f"{base}.{alias.name}")
                    elif base in modules:
                        edges.add(base)
        graph[name] = edges - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, sorted."""
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
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"  {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"cycle of {len(component)} modules:\n" + "\n".join(edges)


def test_the_packages_have_no_import_cycle() -> None:
    graph = import_graph(module_files())
    cycles = strongly_connected(graph)
    assert not cycles, "\n".join(describe(c, graph) for c in cycles)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        (
            {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}},
            [["a", "b", "c"], ["d", "e"]],
        ),
    ],
)
def test_components_are_found(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert strongly_connected(graph) == expected


def test_lazy_and_type_checking_imports_count(tmp_path: Path) -> None:
    """An import inside a function or under TYPE_CHECKING is an edge like any other."""
    package = tmp_path / "ketch" / "engine"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from ketch.engine import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
    )
    modules = {
        "ketch.engine": package / "__init__.py",
        "ketch.engine.a": package / "a.py",
        "ketch.engine.b": package / "b.py",
    }
    assert strongly_connected(import_graph(modules)) == [["ketch.engine.a", "ketch.engine.b"]]
