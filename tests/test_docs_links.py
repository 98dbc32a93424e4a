"""The project's Markdown says only what exists: every relative link resolves, and BENCHMARKS.md is what
``benchmarks/assemble.py`` makes of the result files' summary blocks (a result edited without re-assembling is
caught; the assembler's own refusals are ``tests/test_assemble.py``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import assemble  # noqa: E402

_LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [
    ROOT / "README.md",
    ROOT / "BENCHMARKS.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "benchmarks" / "results").glob("*.md")),
    *sorted((ROOT / "benchmarks" / "results" / "archive").glob("*.md")),
]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    missing = []
    for m in _LINK.finditer(page.read_text()):
        target = m.group(1).split("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
            missing.append(m.group(1))
    assert not missing, f"{page.name} links to what does not exist: {missing}"


def test_benchmarks_md_is_assembled_from_the_results():
    text = assemble.assembled()
    assert (ROOT / "BENCHMARKS.md").read_text() == text, "run: python benchmarks/assemble.py"
    assert len(text.encode()) <= assemble.MAX_BYTES
