"""A report that leads: the first screen of a study's page states every verdict of the thread with its
sample count and links to the evidence; a quick-profile run is a smoke run (no number of it is labelled
a finding); no reported interval rests on fewer than 5 samples or is NaN; identical rows are merged.

One quick study of the findings experiment and what it needs (plus inspect) serves the whole module.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from kvlab.study.experiments.base import Table
from kvlab.study.experiments.findings import CLAIMS
from kvlab.study.report.html import tidy_table
from tests.test_report_render import _browser, _chromium

ONLY = ["inspect", "roll_sweep", "roll_long", "rope_derotation", "findings"]


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    from kvlab.study.runner import run_study

    out = tmp_path_factory.mktemp("quick-study")
    outcome = run_study(only=ONLY, profile="quick", out=out, show_progress=False, workers=1)
    assert not outcome.failed
    return outcome.run_dir


def _docs(root: Path) -> list[tuple[Path, dict]]:
    return [(p, json.loads(p.read_text())) for p in sorted(root.rglob("result.json"))]


@pytest.mark.real_model  # a quick study on the bundled model
@pytest.mark.slow
def test_a_quick_study_is_a_smoke_run_and_nothing_is_labelled_a_finding(quick_study):
    docs = _docs(quick_study)
    assert len(docs) >= len(ONLY) + 1
    for path, doc in docs:
        assert doc["manifest"]["profile"] == "quick"
        assert doc["finding"] == "", f"{path}: a quick-profile sentence is labelled a finding"
        assert doc["evidence"].startswith("smoke run"), path
        if doc["status"] == "ok" and doc["name"] != "study":
            assert doc["smoke_result"], f"{path}: the smoke result's sentence is missing"
    for page in quick_study.rglob("index.html"):
        html = page.read_text()
        assert "Smoke run" in html, page
        assert 'class="finding"' not in html, f"{page}: a smoke result is shown as a finding"
        assert ">headline<" not in html, f"{page}: smoke numbers under a 'headline' label"


@pytest.mark.real_model  # a quick study on the bundled model
@pytest.mark.slow
def test_no_reported_interval_rests_on_fewer_than_five_samples_or_is_nan(quick_study):
    from tests.test_intervals import study_interval_problems

    assert study_interval_problems(quick_study) == []


@pytest.mark.real_model  # a quick study on the bundled model
@pytest.mark.process
@pytest.mark.slow
def test_the_first_screen_states_every_verdict_with_its_sample_count(quick_study, tmp_path):
    chromium = _chromium()
    index = quick_study / "index.html"
    # Measure the laid-out page: a copy with a script that writes where the verdicts end into the DOM.
    probe = index.with_name("probe.html")
    probe.write_text(
        index.read_text().replace(
            "</body>",
            "<script>const r=document.getElementById('verdicts').getBoundingClientRect();"
            "document.body.setAttribute('data-verdicts-bottom', String(Math.ceil(r.bottom)));</script></body>",
        )
    )
    dom = _browser(chromium, tmp_path / "p", "--window-size=1280,900", "--dump-dom", probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    bottom = int(re.search(r'data-verdicts-bottom="(\d+)"', dom.stdout).group(1))
    assert bottom <= 900, f"the verdicts end at {bottom} px: below a 1280x900 first screen"
    verdicts = dom.stdout[dom.stdout.index('id="verdicts"') : dom.stdout.index('id="overview"')]
    rows = re.findall(r"<tr>\s*<td class=\"claim\">(.*?)</tr>", verdicts, re.S)
    assert len(rows) == len(CLAIMS) == 6
    for (_, claim, evidence), row in zip(CLAIMS, rows, strict=True):
        assert html.escape(claim) in row or html.escape(claim, quote=False) in row
        outcome = re.search(r'class="verdict [^"]+">([^<]+)<', row).group(1)
        assert outcome.split(" (")[0] in ("holds", "does not hold", "cannot decide", "not tested here"), (
            outcome
        )
        assert (
            "(smoke)" in outcome or outcome == "not tested here"
        )  # a quick run's verdicts are smoke verdicts
        if outcome != "not tested here":
            n = int(re.search(r"n = (\d+)", row).group(1))
            assert n >= 2, row
            assert all(f'href="#{e}"' in row for e in evidence if (quick_study / e).is_dir()), row
    assert "Smoke verdicts" in verdicts
    text = re.sub(r"<[^>]+>", " ", dom.stdout)
    codes = re.findall(r"\b(?:R(?:1[0-3]|[1-9])|B[1-7])\b", text)
    assert codes == [], f"the research brief's codes are still on the page: {sorted(set(codes))}"


def test_identical_rows_merge_and_empty_columns_go():
    t = Table(
        "per layer",
        ["layer", "shape", "dtype", "thread cos"],
        [[i, "[1, 3, 9, 64]", "float32", None] for i in range(30)] + [[30, "[1, 3, 9, 32]", "float32", ""]],
    )
    out = tidy_table(t)
    assert out["columns"] == ["layer", "shape", "dtype"]
    assert out["rows"] == [["0–29", "[1, 3, 9, 64]", "float32"], ["30", "[1, 3, 9, 32]", "float32"]]
    assert "31 rows shown as 2" in out["caption"]


@pytest.mark.real_model  # a quick study on the bundled model
@pytest.mark.slow
def test_the_cache_quality_claims_follow_the_threads_on_the_first_screen(tmp_path):
    """With the ruler experiment in the run, its claims (computed from its numbers) are the second verdict
    table, right after the thread's and before the overview, each with its outcome, measurement and a link
    to the evidence; without it the table is absent (tested above: only the thread's claims)."""
    from kvlab.study.runner import run_study

    outcome = run_study(only=["ruler"], profile="quick", out=tmp_path, show_progress=False, workers=1)
    assert not outcome.failed
    page = (outcome.run_dir / "index.html").read_text()
    doc = json.loads(next(outcome.run_dir.rglob("ruler/result.json")).read_text())
    records = doc["summary"]["claims"]
    assert page.index('id="verdicts"') < page.index('id="quality-verdicts"') < page.index('id="overview"')
    block = page[page.index('id="quality-verdicts"') : page.index('id="overview"')]
    rows = re.findall(r'<td class="claim quality">(.*?)</tr>', block, re.S)
    assert len(rows) == len(records) >= 3
    for rec, row in zip(records, rows, strict=True):
        assert html.escape(rec["claim"], quote=False) in row
        shown = re.search(r'class="verdict [^"]+">([^<]+)<', row).group(1)
        assert shown == rec["outcome"] + (" (smoke)" if rec["outcome"] != "not tested here" else "")
        assert html.escape(rec["measured"], quote=False) in row and 'href="#ruler"' in row
    assert "Smoke verdicts" in block
