"""No import cycles inside `quantkit/`: between modules, and between its packages.

The graph is read from the source (ast), not from `sys.modules`: every `import` / `from ... import`
of a quantkit module counts, at module level or inside a function (a deferred import is still a
dependency), except those under `if TYPE_CHECKING:` (never executed). Run it as a script to print
the graph's cycles: `python tests/test_imports.py`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "quantkit"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the quantkit modules it imports (a `from pkg import name` counts pkg.name when that
    is a module, else pkg)."""

    def owner(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names]
            for target in targets:
                if target.split(".")[0] == "quantkit":
                    dep = owner(target)
                    if dep and dep != mod:
                        graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = counter
                    counter += 1
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
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
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between quantkit's rooms: each subpackage is one node, each top-level module another."""

    def room(mod: str) -> str:
        return ".".join(mod.split(".")[:2])

    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        out.setdefault(room(mod), set()).update(room(d) for d in deps if room(d) != room(mod))
    return out


def _explain(graph: dict[str, set[str]], component: list[str]) -> str:
    members = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in component)


def test_the_graph_reader_sees_a_cycle(tmp_path):
    # the check must be able to fail: a two-module cycle, one edge deferred into a function, one relative
    pkg = tmp_path / "quantkit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from quantkit.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from quantkit import a\n")
    (pkg / "d.py").write_text("import quantkit.c\n")
    graph = import_graph(modules(pkg))
    assert graph["quantkit.a"] == {"quantkit.sub.b"} and graph["quantkit.sub.b"] == {"quantkit.a"}
    assert graph["quantkit.c"] == set() and graph["quantkit.d"] == {"quantkit.c"}
    assert cycles(graph) == [["quantkit.a", "quantkit.sub.b"]]
    assert cycles(package_graph(graph)) == [["quantkit.a", "quantkit.sub"]]


def test_no_import_cycle_between_modules():
    graph = import_graph(modules())
    assert len(graph) > 50  # the reader found the package
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_explain(graph, c) for c in found)


def test_no_import_cycle_between_packages():
    graph = package_graph(import_graph(modules()))
    found = cycles(graph)
    assert not found, "cycles between quantkit's packages: " + " | ".join(_explain(graph, c) for c in found)


if __name__ == "__main__":
    g = import_graph(modules())
    for label, graph in (("modules", g), ("packages", package_graph(g))):
        found = cycles(graph)
        print(f"{label}: {len(found)} cycle(s)")
        for c in found:
            print("  " + _explain(graph, c))
    sys.exit(1 if any(cycles(x) for x in (g, package_graph(g))) else 0)
