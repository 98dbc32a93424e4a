"""``benchmarks/assemble.py`` builds BENCHMARKS.md only from result files that keep its rules: a summary block
whose figures are in the body, no machine path, no script missing from the repository; each refusal here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402
import assemble  # noqa: E402

HEAD = "| theme | claim | figure | versus | machine | date | commit | status |\n|---|---|---|---|---|---|---|---|"
ROW = "| speed | A lookup is fast | **1.39x** (median of 7) | a plain read | CPU 2 cores | 2026-11-29 | 78a62c9 | current |"
BODY = "Command: `python benchmarks/store_cold_lookup.py`\n\nMedian 1.39x a plain read over 7 rounds.\n"


def _file(row: str = ROW, body: str = BODY, head: str = HEAD) -> str:
    return f"## Title\n\n<!-- summary -->\n{head}\n{row}\n<!-- /summary -->\n\n{body}"


def test_a_good_file_gives_its_rows():
    (row,) = assemble.check_text(_file(), "x.md")
    assert (row.theme, row.figure, row.status, row.source) == (
        "speed",
        "**1.39x** (median of 7)",
        "current",
        "x.md",
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("## Title\n\n" + BODY, "no summary block"),
        (_file(head=HEAD.replace("| status |", "| state |")), "columns"),
        (_file(row=ROW.replace("| current |", "| superseded |")), "archive"),
        (_file(row=ROW.replace("| current |", "| fine |")), "status 'fine'"),
        (_file(row=ROW.replace("| speed |", "| vibes |")), "theme 'vibes'"),
        (_file(row=ROW.replace("2026-11-29", "29 Nov")), "YYYY-MM-DD"),
        (_file(row=ROW.replace("| A lookup is fast |", "")), "cells"),
        (_file(row=ROW.replace("1.39x", "1.29x")), "1.29, which its body does not"),
        (_file(body=BODY + "Ran in /tmp/run/out.\n"), "machine path on line 12"),
        (_file(body=BODY + "See `/work/main/x`.\n"), "machine path"),
        (
            _file(body=BODY + "From `benchmarks/gone.py`.\n"),
            "benchmarks/gone.py, which is not in the repository",
        ),
        (_file(body=BODY + "A one-off script, not kept.\n"), "not kept"),
    ],
)
def test_a_file_breaking_a_rule_is_refused(text, reason):
    with pytest.raises(assemble.Refused, match=reason.replace("(", r"\(").replace(".", r"\.")):
        assemble.check_text(text, "x.md")


def test_the_page_groups_rows_and_keeps_regressions_apart():
    rows = [
        assemble.Row("speed", "fast", "1x", "b", "CPU 2 cores", "2026-11-29", "78a62c9", "current", "a.md"),
        assemble.Row(
            "quality", "good", "2", "b", "CPU 2 cores", "2026-11-29", "78a62c9", "bar not met", "b.md"
        ),
        assemble.Row(
            "regression", "same", "3", "old", "CPU 2 cores", "2026-11-29", "78a62c9", "current", "c.md"
        ),
    ]
    text = assemble.page(rows, {"a.md": "benchmarks/store.py"}, ["old_run"])
    fastest = text.index("## Speed: what is fastest")
    not_met = text.index("## Not met")
    regress = text.index("## Regression checks")
    where = [
        text.index(f"[{c}](benchmarks/results/{f}.md)")
        for c, f in (("fast", "a"), ("good", "b"), ("same", "c"))
    ]
    assert fastest < where[0] < not_met < where[1] < regress < where[2]
    assert "| `store.py` |" in text
    assert "(benchmarks/results/archive/): `old_run`." in text
    assert "## Quality" not in text  # the only quality row is not current


def test_the_archive_names_runs_of_one_stem_once():
    stems = ["eval_ruler", "serve_decode_2b59823", "serve_decode_51fd8d0", "serve_decode_cpp_wrapper"]
    assert assemble._grouped(stems) == [
        "`eval_ruler`",
        "`serve_decode_{2b59823,51fd8d0}`",
        "`serve_decode_cpp_wrapper`",
    ]


def test_a_rerun_keeps_the_block_for_its_rows_to_be_updated(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "RESULTS", tmp_path)
    monkeypatch.setattr(_common, "machine", lambda: "test machine")
    monkeypatch.setattr(sys, "argv", ["benchmarks/store_cold_lookup.py"])
    (tmp_path / "x.md").write_text(_file())
    _common.write_results("x", "Title", "Median 1.52x a plain read over 7 rounds.")
    text = (tmp_path / "x.md").read_text()
    assert text.count("<!-- summary -->") == 1
    with pytest.raises(assemble.Refused, match="1.39, which its body does not"):
        assemble.check_text(text, "x.md")


def test_a_page_written_whole_keeps_the_block_after_its_title(tmp_path):
    page = tmp_path / "x.md"
    page.write_text(_file())
    _common.write_page(page, "# Title\n\nMedian 1.52x a plain read over 7 rounds.\n")
    text = page.read_text()
    assert text.startswith("# Title\n\n<!-- summary -->\n")
    assert text.count("<!-- summary -->") == 1 and text.endswith("Median 1.52x a plain read over 7 rounds.\n")
    with pytest.raises(assemble.Refused, match="1.39, which its body does not"):
        assemble.check_text(text, "x.md")


def test_a_page_that_brings_its_own_block_is_written_as_it_is(tmp_path):
    page = tmp_path / "x.md"
    page.write_text(_file())
    own = _file().replace("1.39", "1.52")
    _common.write_page(page, own)
    assert page.read_text() == own
