"""Import layering, checked on the source (``ast``), so the architecture's claims stay true.

* the library never imports the study (``kvlab.study``) or the command line (``kvlab.cli``);
* only the adapter package ``kvlab.hf`` touches transformers' cache classes;
* only ``ModelHandle`` calls the model: no ``<something>.model(`` call anywhere else;
* one implementation each of the ideas that used to exist several times (see the names below).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvlab"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(("kvlab", *path.relative_to(SRC).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), filename=str(path))
    return out


MODULES = _modules()


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _layer(module: str) -> str:
    if module.startswith(("kvlab.cli", "kvlab.__main__")):
        return "cli"
    if module.startswith("kvlab.study"):
        return "study"
    return "library"


def test_modules_found():
    assert "kvlab.model.handle" in MODULES and "kvlab.study.runner" in MODULES


def test_library_never_imports_the_study_or_the_cli():
    bad = [
        f"{mod} imports {imp}"
        for mod, tree in MODULES.items()
        if _layer(mod) == "library"
        for imp in _imports(tree)
        if imp.startswith(("kvlab.study", "kvlab.cli"))
    ]
    assert not bad, bad


def test_study_never_imports_the_cli():
    bad = [
        f"{mod} imports {imp}"
        for mod, tree in MODULES.items()
        if _layer(mod) == "study"
        for imp in _imports(tree)
        if imp.startswith("kvlab.cli")
    ]
    assert not bad, bad


def test_only_the_adapter_touches_transformers_cache_classes():
    bad = [
        f"{mod} imports {imp}"
        for mod, tree in MODULES.items()
        if not mod.startswith("kvlab.hf")
        for imp in _imports(tree)
        if imp.startswith("transformers.cache_utils") or imp in ("transformers.DynamicCache",)
    ]
    assert not bad, bad


def _defined(name: str) -> list[str]:
    pattern = re.compile(rf"^\s*(def|class) {re.escape(name)}\b", re.M)
    return [mod for mod, _ in MODULES.items() if pattern.search((SRC / _path(mod)).read_text())]


def _path(module: str) -> str:
    rel = module.removeprefix("kvlab").lstrip(".").replace(".", "/")
    p = SRC / rel
    return str(p.relative_to(SRC) / "__init__.py") if p.is_dir() else rel + ".py"
