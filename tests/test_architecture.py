"""docs/ARCHITECTURE.md says only what the source has (issue 46 item 6), and its checkable invariants hold.

Every name the page cites in code spans is checked: a path exists, a class, function or constant is defined
in the library (or a test in tests/), a ``Class.member`` is defined in that class, and a ``kvlab.x`` module
exists. Invariant 5 is checked here on the source: no ``isinstance`` on a layout class outside the layouts'
own files.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvlab"
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
SPAN = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
#: spans that are not names in kvlab's source: option strings, words and outside names
NOT_NAMES = {
    "typing.Protocol",
    "Cache",  # transformers' cache base class
    "kvlab",
    "cache",
    "compress",
    "errors",
    "paths",
    "loop",
    "rope",
    "progress",
    "probe",
    "data",
    "kernels",
    "metrics",
    "policy",
    "hf",
    "model",
    "ops",
    "streaming",
    "eval",
    "store",
    "study",
    "serve",
    "cli",
}


@functools.cache
def _definitions() -> tuple[set[str], dict[str, set[str]]]:
    """Every name defined at any level of the library and tests, and each class's member names."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for path in [*SRC.rglob("*.py"), *(ROOT / "tests").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    members.setdefault(node.name, set()).update(_member_names(node))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names, members


def _member_names(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def _problem(span: str) -> str | None:
    """Why ``span`` names nothing in the source, or None (also for spans that are not names at all)."""
    token = span.split("(")[0].split(" ")[0].rstrip(",.:")
    if "/" in token or token.endswith((".py", ".md", ".json", ".npz")):
        if token.endswith((".json", ".npz")) or token.startswith(("--", "[")):
            return None
        found = (ROOT / token).exists() or (SRC / token).exists() or any(SRC.rglob(token))
        return None if found else f"no file {token}"
    if not NAME.fullmatch(token) or token in NOT_NAMES or token.isupper() and len(token) <= 4:
        return None
    if token.startswith("kvlab."):
        module = SRC.joinpath(*token.split(".")[1:])
        return None if module.with_suffix(".py").exists() or module.is_dir() else f"no module {token}"
    names, members = _definitions()
    parts = token.split(".")
    if len(parts) == 1:
        return None if token in names or not re.search(r"[A-Z_]", token) and "(" not in span else f"{token}?"
    owner, member = parts[-2], parts[-1]
    if owner in members:
        return None if member in members[owner] or member in names else f"{owner} has no {member}"
    return None if member in names else f"{token}?"


def test_every_name_the_architecture_page_cites_exists():
    problems = [p for span in SPAN.findall(PAGE.read_text()) if (p := _problem(span))]
    assert not problems, problems


def test_the_name_check_finds_what_is_missing():
    assert _problem("LiveCache") is None and _problem("ModelHandle.run") is None
    assert _problem("NoSuchCache") == "NoSuchCache?"
    assert _problem("ModelHandle.fly") == "ModelHandle has no fly"
    assert _problem("hf/no_such.py") == "no file hf/no_such.py"
    assert _problem("kvlab.no_such") == "no module kvlab.no_such"


def _layout_classes() -> set[str]:
    found = set()
    for path in (SRC / "policy" / "layouts").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", "").endswith("Layout") for b in node.bases
            ):
                found.add(node.name)
    return found | {"Layout"}


def test_no_isinstance_on_a_layout_outside_the_layouts():
    layouts = _layout_classes()
    assert {"FullLayout", "SinksWindowLayout", "ScoredLayout"} <= layouts
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "layouts":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "isinstance"
                and len(node.args) == 2
            ):
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if named & layouts:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"ask the layout instead: {found}"
