"""Every figure README and docs/ present as measured is a row of a benchmark summary, with its status (issue 47 item 2).

A measured figure is a number with a unit of time, size, speed or ratio (``62.6 s``, ``0.71x``, ``1379 MB``,
``95.8%``) in prose, outside code. It must appear in the figure cell of a summary row in
``benchmarks/results/*.md`` (what BENCHMARKS.md shows): a *current* row, or a row whose status (``code changed
since``, ``not reproduced``, ``bar not met``) the same paragraph states. A figure kept as history goes in a
``<details><summary>History ...</summary> ... </details>`` block, which says so to the reader.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import assemble  # noqa: E402

NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
UNIT = r"(?:x|ms|µs|s|sec|seconds?|min|minutes?|h|hours?|MB|MiB|GB|GiB|KB|KiB|tokens/s|CPU-s)\b|%"
#: a number or a range of two (``0.5-0.8 s``, ``1.15–1.21x``) and its unit; ``2×`` a ratio, ``6 × 128`` a product
FIGURE = re.compile(rf"(?<![\w.\-–/]){NUM}(?:\s?[-–]\s?{NUM})?(?:×|\s?(?:{UNIT}))")
FENCE = re.compile(r"```.*?```", re.S)
CODE = re.compile(r"`[^`\n]*`")
HISTORY = re.compile(r"<details><summary>History.*?</details>", re.S)
#: not measurements: a confidence level, and a bar, limit or setting named as such just before the number
LEVEL = re.compile(r"9[059]% (?:confidence|interval|bootstrap|Wilson|CI)")
SETTING = re.compile(
    r"(?:\b(?:bar|target|goal|limit|default|defaults to|at most|at least|up to|budget of|cap(?:ped)? at|more than"
    r"|less than|past|within|over|under):?|[≤<≥>])\s*$"
)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def measured_figures(text: str) -> list[tuple[int, str, str]]:
    """(line, figure, its paragraph) for each measured figure in ``text``'s prose (code and history left out)."""
    blank = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731 - keeps line numbers
    prose = HISTORY.sub(blank, FENCE.sub(blank, text))
    found = []
    line = 1
    # a paragraph ends at a blank line, and each list item is one of its own
    for paragraph in re.split(r"(\n\s*\n|\n(?=\s*(?:[-*+]|\d+\.)\s))", prose):
        for k, row in enumerate(paragraph.splitlines()):
            prose_row = CODE.sub("", row)
            found += [
                (line + k, m.group(0), paragraph)
                for m in FIGURE.finditer(prose_row)
                if not LEVEL.match(prose_row, m.start())
                and not SETTING.search(prose_row[max(0, m.start() - 20) : m.start()])
            ]
        line += paragraph.count("\n")
    return found


def stale_figures(text: str, rows: list[assemble.Row]) -> list[str]:
    """The figures of ``text`` that no row backs: neither a current row nor one whose status the paragraph says."""
    stale = []
    for line, figure, paragraph in measured_figures(text):
        whole = re.compile(rf"(?<![\d.,]){re.escape(figure)}(?![\d])")  # 1 s is not in 93.1 s
        backing = [r for r in rows if whole.search(r.figure)]
        if not any(r.status == "current" or r.status in paragraph for r in backing):
            stale.append(f"line {line}: {figure}")
    return stale


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_measured_figure_is_a_summary_row(page):
    rows, _ = assemble.read_results()
    stale = stale_figures(page.read_text(), rows)
    assert not stale, f"{page.name} quotes figures that are no summary row (or hide its status): {stale}"


def _row(figure: str, status: str) -> assemble.Row:
    return assemble.Row("speed", "c", figure, "v", "CPU 2 cores", "2026-11-29", "78a62c9", status, "x.md")


def test_the_scan_finds_figures_in_prose_only():
    text = "Took 62.6 s and 0.71x.\n`12.5 s` in code\n```\n9 ms\n```\n<details><summary>History</summary>\n3x\n</details>\n"
    assert [(n, f) for n, f, _ in measured_figures(text)] == [(1, "62.6 s"), (1, "0.71x")]
    settings = "95% intervals; a bar of ≤ 2x; the default 256 MiB; at most 4 s; target 10x; limit: 5 s"
    assert measured_figures(settings) == []


def test_a_figure_needs_a_current_row_or_its_status_said():
    rows = [_row("**62.6 s**", "current"), _row("0.86x", "code changed since")]
    assert stale_figures("It took 62.6 s.", rows) == []
    assert stale_figures("It was 0.86x.\n\nThe code changed since.", rows) == ["line 1: 0.86x"]
    assert stale_figures("It was 0.86x (code changed since).", rows) == []
    assert stale_figures("It took 61 s.", rows) == ["line 1: 61 s"]
    assert stale_figures("It took 2.6 s.", rows) == ["line 1: 2.6 s"]  # a whole figure, not a tail of one
    bullets = "- It was 0.86x.\n- The code changed since."
    assert stale_figures(bullets, rows) == ["line 1: 0.86x"]  # each list item is its own paragraph


def test_ranges_words_and_signs_count():
    text = "From 0.5-0.8 s, then 1.15–1.21x; about 11 minutes; ≈ 2× faster; 6 × 128 tokens."
    assert [f for _, f, _ in measured_figures(text)] == ["0.5-0.8 s", "1.15–1.21x", "11 minutes", "2×"]
