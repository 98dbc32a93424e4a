"""No import cycle in kvlab (issue 46 item 3), inside a package or across packages, checked on the source
(``ast``).

Every import counts, deferred ones (inside a function) and ``TYPE_CHECKING`` ones included: a cycle kept
loadable by deferring an import is still a knot. Packages are the second component (``kvlab.hf``); an
import between two modules is an edge, and the modules reachable from each other form a cycle. (A package's
face re-exports by name, ``kvlab._lazy``, so importing a name from it is an edge to the face only.)
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvlab"


def _graph(root: Path = SRC, within: bool = True) -> dict[str, set[str]]:
    """``{module: modules it imports}`` for the package tree at ``root`` (``kvlab``): those of its own
    package (``within``), or any."""
    files = {p: ".".join(("kvlab", *p.relative_to(root).with_suffix("").parts)) for p in root.rglob("*.py")}
    names = {m.removesuffix(".__init__") for m in files.values()}
    graph: dict[str, set[str]] = {}
    for path, mod in files.items():
        pkg = mod.rsplit(".", 1)[0]  # the package a relative import starts from
        mod = mod.removesuffix(".__init__")
        edges = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            edges.update(
                t
                for t in targets
                if t in names and t != mod and (not within or t.split(".")[:2] == mod.split(".")[:2])
            )
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that reach themselves (each on some cycle)."""
    return sorted(mod for mod in graph if mod in _reach(graph, mod))


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycle_inside_a_package():
    cycles = _cycles(_graph())
    assert not cycles, f"modules on an import cycle inside their package: {cycles}"


def test_no_import_cycle_across_packages():
    """A layout builds its cache from ``kvlab.hf`` (a deferred import up), so nothing in ``kvlab.hf`` may read
    a spec back: ``cache_for`` lives in ``kvlab.policy.spec``, beside ``parse``."""
    cycles = _cycles(_graph(within=False))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_checker_sees_a_deferred_cycle(tmp_path):
    """A cycle kept loadable by a deferred import is found, inside a package and across packages."""
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.py").write_text("def f():\n    from kvlab.x import b\n")
    (tmp_path / "x" / "b.py").write_text("from kvlab.x.a import f\nfrom kvlab.y import c\n")
    (tmp_path / "x" / "c.py").write_text("from .a import f\n")
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "c.py").write_text("from kvlab.x import b\n")
    assert _cycles(_graph(tmp_path)) == ["kvlab.x.a", "kvlab.x.b"]
    assert _cycles(_graph(tmp_path, within=False)) == ["kvlab.x.a", "kvlab.x.b", "kvlab.y.c"]
