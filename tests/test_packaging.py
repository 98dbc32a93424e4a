"""``pip install kvlab`` declares what kvlab imports, and nothing it does not need.

Every third-party module imported anywhere under ``src/kvlab`` (at the top or inside a function) must
come from a distribution named in ``[project].dependencies`` or an optional extra; every declared
runtime dependency must be imported, or be listed below with the reason kvlab needs it anyway.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "kvlab"

# Needed at run time although kvlab never imports them itself.
NOT_IMPORTED_BUT_NEEDED = {
    "gguf": "transformers reads the bundled model's GGUF file with it",
    "accelerate": "transformers refuses to load a GGUF file without it",
}


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {
        name: {_requirement_name(r) for r in reqs}
        for name, reqs in project.get("optional-dependencies", {}).items()
    }
    return core, extras


def imported_top_levels() -> dict[str, list[str]]:
    """Top-level module name -> files importing it (absolute imports only)."""
    found: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "kvlab" and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, []).append(str(path.relative_to(REPO)))
    return found


def _distributions(module: str) -> set[str]:
    mapping = importlib.metadata.packages_distributions()
    return {d.lower().replace("_", "-") for d in mapping.get(module, [])}


def test_every_import_is_declared():
    core, extras = declared()
    everything = core.union(*extras.values())
    missing = {}
    for module, files in imported_top_levels().items():
        # Optional extras may not be installed here (bitsandbytes needs CUDA): then the module name
        # must itself be a declared distribution.
        dists = _distributions(module) or {module.lower().replace("_", "-")}
        if not dists & everything:
            missing[module] = (sorted(dists), files[:2])
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_runtime_dependency_is_used():
    core, _ = declared()
    imported = set().union(*(_distributions(m) for m in imported_top_levels()))
    unused = core - imported - set(NOT_IMPORTED_BUT_NEEDED)
    assert not unused, f"declared but never imported (drop them or say why in this test): {sorted(unused)}"


def test_heavy_optional_imports_are_not_core():
    """Redis is an optional tier: only its extra may require it."""
    core, extras = declared()
    assert "redis" not in core and "redis" in extras.get("redis", set())
