"""The HTML report: one self-contained page per experiment and an index for a whole study, rendered
from the Jinja2 templates in ``templates/`` (shipped as package data).

The study page leads with its verdicts (each claim of the thread: holds / does not hold / not tested
here, with its key number, interval and sample count, and links to the sections that hold the
evidence), then one line per experiment, then the sections. A quick-profile run is a smoke run:
every page says so, and no number of it is shown as a finding. Tables are tidied before they are
drawn: columns empty in every row are dropped, and consecutive rows that differ only in an index
(30 identical per-layer rows) are merged into one ("0–29"). Plain HTML with inline CSS, images by
relative path: it opens from disk in any browser and renders in headless Chromium (tested).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.study.experiments.base import ExperimentResult, Table
from kvlab.study.report.glossary import GLOSSARY

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#16202e;color:#fff;padding:12px 32px}header h1{margin:0;font-size:21px}
header p{margin:3px 0 0;color:#b9c3d0;font-size:13px}
main{max-width:1180px;margin:0 auto;padding:10px 32px 48px}
section{background:#fff;border:1px solid #e1e5ea;border-radius:8px;margin:14px 0;padding:12px 22px}
h2{font-size:18px;margin:4px 0 8px}h3{font-size:15px;margin:18px 0 6px}
.status{font-size:12px;padding:2px 8px;border-radius:10px;margin-left:8px;vertical-align:middle}
.ok{background:#dff3e4;color:#17622f}.not_applicable{background:#fff1cc;color:#7a5800}.failed{background:#fde0e0;color:#8a1c1c}
.status.smoke,.smoke-result b{background:#ffe8cc;color:#8a4b00}
.smoke-banner{background:#fff4e0;border:1px solid #f0c27a;border-radius:8px;padding:8px 14px;font-size:14px;margin:10px 0 0}
figure{margin:12px 0;display:inline-block;max-width:100%;vertical-align:top}
figure img{max-width:100%;border:1px solid #e6e9ee;border-radius:4px}
figcaption{font-size:13px;color:#4a5566;margin-top:4px;max-width:720px}
table{border-collapse:collapse;font-size:13px;margin:6px 0 12px}
th,td{border:1px solid #e1e5ea;padding:4px 8px;text-align:right;vertical-align:top}th{background:#f0f3f6}
td:first-child,th:first-child{text-align:left}td.text,td.claim,th.text{text-align:left}
.notes li{font-size:13px;color:#4a5566}.desc{color:#4a5566;font-size:14px}
code{background:#f0f3f6;padding:1px 4px;border-radius:3px}
.manifest{font-size:12px;color:#667085}.small{font-size:12px;color:#667085}
.finding{font-size:15px;background:#eef4ff;border-left:4px solid #3b6fd8;padding:8px 12px;margin:8px 0 10px}
.finding.smoke-result{background:#fff8ee;border-left-color:#f0a040}
.headline td:last-child{font-weight:600}.links{font-size:13px}
.lead{font-size:15px;margin:4px 0 8px}
.verdict-table td{font-size:13.5px}.verdict-table th,.verdict-table td,.overview th,.overview td{text-align:left}
.verdict{font-weight:600;padding:2px 8px;border-radius:10px;white-space:nowrap}
.v-holds{background:#dff3e4;color:#17622f}.v-not{background:#fde0e0;color:#8a1c1c}.v-untested{background:#eceff3;color:#4a5566}
details>summary{cursor:pointer;color:#3b4a60;font-size:14px;margin:8px 0}
.glossary dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 14px;font-size:13px;margin:6px 0}
.glossary dt{font-weight:600}.glossary dd{margin:0;color:#4a5566}
"""

STATUS_TEXT = {"ok": "ok", "not_applicable": "not applicable", "failed": "failed"}
#: a claim's outcomes; "cannot decide": tested, but a paired difference it needs rests on too few samples for
#: an interval
OUTCOME_CSS = {
    "holds": "v-holds",
    "does not hold": "v-not",
    "cannot decide": "v-untested",
    "not tested here": "v-untested",
}


@functools.cache
def _env() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("kvlab.study.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, **context: Any) -> str:
    """Render one of the report's templates (``base``, ``experiment``, ``study``)."""
    return _env().get_template(f"{template}.html.j2").render(css=CSS, **context)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "–"
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
        return f"{value:.3e}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if value is None:
        return "–"
    return str(value)


def _empty(cell: str) -> bool:
    return cell.strip() in ("", "–", "—", "-")


#: a cell that reads as a number (an interval, a count, a signed percentage, "n = 2, no interval")
_NUMBER = re.compile(r"^\s*(?:\(n = |[\[(]?[~≈<>≤≥±+\-−]?\s*(?:\d|\.\d|inf\b|nan\b))")


def _prose(cells: list[str]) -> bool:
    """True for a column of words (left-aligned), False for one of numbers (right-aligned)."""
    return any(not _empty(c) and not _NUMBER.match(c) for c in cells)


def _index(cell: Any) -> int | None:
    return cell if isinstance(cell, int) and not isinstance(cell, bool) else None


def tidy_table(table: Table) -> dict[str, Any]:
    """The table as the template draws it: cells formatted, columns empty in every row dropped, and runs
    of consecutive rows that differ only in an integer first cell merged into one row (``0–29``)."""
    rows = [[_fmt(v) for v in row] for row in table.rows]
    keep = [
        j for j in range(len(table.columns)) if not rows or not all(_empty(r[j]) for r in rows if j < len(r))
    ]
    merged: list[list[str]] = []
    runs: list[tuple[int, int]] = []  # (first index, last index) of each merged row
    for raw, row in zip(table.rows, rows, strict=True):
        i = _index(raw[0]) if raw else None
        if (
            i is not None
            and merged
            and runs[-1][1] == i - 1
            and merged[-1][1:] == row[1:]
            and _index(table.rows[0][0]) is not None
        ):
            runs[-1] = (runs[-1][0], i)
            continue
        merged.append(row)
        runs.append((i, i) if i is not None else (-2, -2))
    collapsed = False
    for row, (a, b) in zip(merged, runs, strict=True):
        if a != b:
            row[0] = f"{a}–{b}"
            collapsed = True
    caption = table.caption
    if collapsed:
        caption = (caption + " " if caption else "") + (
            f"Rows identical but for their {table.columns[0]} are merged ({len(table.rows)} rows shown as {len(merged)})."
        )
    shown = [[r[j] for j in keep if j < len(r)] for r in merged]
    return {
        "title": table.title,
        "caption": caption,
        "columns": [table.columns[j] for j in keep],
        "rows": shown,
        "prose": [_prose([r[k] for r in shown if k < len(r)]) for k in range(len(keep))],
    }


def _plain(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _summary_rows(summary: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Flatten nested summaries to (name, value) rows; long or nested lists stay in result.json only."""
    rows: list[tuple[str, Any]] = []
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_summary_rows(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            if len(value) > 8 or any(isinstance(v, (dict, list, tuple)) for v in value):
                continue
            rows.append((name, ", ".join(_plain(v) for v in value)))
        else:
            rows.append((name, value))
    return rows


def section_data(result: ExperimentResult, img_prefix: str = "") -> dict[str, Any]:
    """What the ``section`` macro draws for one experiment."""
    links = [(f"{img_prefix}result.json", "result.json")]
    if result.arrays:
        links.append((f"{img_prefix}arrays.npz", "arrays.npz"))
    rows = _summary_rows(result.summary)
    return {
        "name": result.name,
        "title": result.title,
        "status": result.status,
        "status_text": STATUS_TEXT.get(result.status, result.status),
        "description": result.description,
        "finding": result.finding,
        "headline": [(str(k), str(v)) for k, v in result.headline],
        "links": links,
        "figures": [{"src": img_prefix + f.filename, "caption": f.caption} for f in result.figures],
        "tables": [tidy_table(t) for t in result.tables],
        "all_numbers": tidy_table(Table("", ["quantity", "value"], [list(r) for r in rows]))
        if rows
        else None,
        "notes": result.notes,
        "data_sources": result.data_sources,
    }


def _key_text(key: dict | None) -> tuple[str, str]:
    """(``value [low, high]`` with its label, ``n = k <what>``) for a claim's key number."""
    from kvlab.study.report.format import format_interval

    if not key:
        return "—", "—"
    value = format_interval(key)
    n = key.get("n")
    samples = f"n = {n} {key.get('samples', 'samples')}" if n is not None else key.get("samples", "")
    label = key.get("label")
    return (f"{label}: {value}" if label else value), samples


def verdicts_data(results: Sequence[tuple[str, ExperimentResult]], smoke: bool) -> dict[str, Any]:
    """The first screen: every claim of the thread with its outcome, key number, samples and evidence
    links; claims without a result (the findings experiment did not run or failed) are not tested here."""
    from kvlab.study.experiments.findings import CLAIMS

    present = {r.name: r for _, r in results}
    titles = {r.name: r.title for _, r in results}
    found = present.get("findings")
    records = (found.summary.get("claims") or []) if found is not None and found.status == "ok" else []
    by_id = {c["id"]: c for c in records}
    claims = []
    for cid, claim, evidence in CLAIMS:
        c = by_id.get(cid)
        outcome = c["outcome"] if c else "not tested here"
        key, samples = _key_text(c.get("key") if c else None)
        note = ""
        if c and c["verdict"] == "artefact":
            note = "an artefact of how the thread measured it"
        elif not c:
            note = "the findings experiment did not run" if found is None else f"findings: {found.status}"
        elif outcome == "not tested here":
            note = c["measured"]
        claims.append(
            {
                "claim": claim,
                "outcome": outcome,
                "css": OUTCOME_CSS[outcome],
                "tested": outcome != "not tested here",
                "note": note,
                "key": key,
                "samples": samples,
                "evidence": [(f"#{e}", titles.get(e, e)) for e in evidence if e in present],
            }
        )
    count = {o: sum(1 for c in claims if c["outcome"] == o) for o in OUTCOME_CSS}
    sentence = (
        f"Of the thread's {len(claims)} claims, {count['holds']} hold, {count['does not hold']} do not"
        + (
            f", {count['cannot decide']} cannot be decided (too few samples)"
            if count["cannot decide"]
            else ""
        )
        + f" and {count['not tested here']} were not tested here."
    )
    if smoke:
        sentence = (
            "Smoke verdicts (quick profile, few samples; not findings): " + sentence[0].lower() + sentence[1:]
        )
    return {"claims": claims, "sentence": sentence, "rule_link": "#findings" if found is not None else ""}


def quality_verdicts_data(results: Sequence[tuple[str, ExperimentResult]], smoke: bool) -> dict[str, Any]:
    """The first screen's second table: the cache-quality claims the RULER-style yardstick judged (the
    ruler and positions experiments' records, computed from their numbers); empty when neither ran."""
    present = {r.name: r for _, r in results}
    claims = []
    for name in ("ruler", "positions"):
        found = present.get(name)
        if found is not None and found.status == "ok":
            claims += _quality_claims(found)
    held = sum(1 for c in claims if c["outcome"] == "holds")
    failed = sum(1 for c in claims if c["outcome"] == "does not hold")
    open_ = sum(1 for c in claims if c["outcome"] == "cannot decide")
    sentence = (
        f"On RULER-style tasks with KL to the full cache, of {len(claims)} claims about caches {held} hold "
        f"and {failed} do not" + (f"; {open_} cannot be decided (too few trials)." if open_ else ".")
        if claims
        else ""
    )
    if smoke and sentence:
        sentence = (
            "Smoke verdicts (quick profile, few trials; not findings): " + sentence[0].lower() + sentence[1:]
        )
    return {"claims": claims, "sentence": sentence}


def _quality_claims(found: ExperimentResult) -> list[dict[str, Any]]:
    """One experiment's claim records as the first screen's rows, linking to its section."""
    claims = []
    for c in found.summary.get("claims") or []:
        key, samples = _key_text(c.get("key"))
        outcome = c["outcome"]
        claims.append(
            {
                "claim": c["claim"],
                "outcome": outcome,
                "css": OUTCOME_CSS[outcome],
                "tested": outcome != "not tested here",
                "note": c["measured"],
                "key": key if key != "—" or outcome == "not tested here" else "",
                "samples": samples,
                "evidence": [(f"#{found.name}", found.title)],
            }
        )
    return claims


def page_html(
    title: str,
    subtitle: str,
    sections: Sequence[str],
    nav: Sequence[tuple[str, str]] = (),
    manifest_line: str = "",
    smoke: bool = False,
) -> str:
    """A page around ready-made HTML sections (the sweep report's)."""
    from markupsafe import Markup

    nav_html = "".join(
        f'<a href="{h}">{t}</a> ' for h, t in ((Markup.escape(h), Markup.escape(t)) for h, t in nav)
    )
    body = (f"<nav>{nav_html}</nav>" if nav else "") + "".join(sections)
    return (
        _env()
        .from_string('{% extends "base.html.j2" %}{% block content %}{{ body }}{% endblock %}')
        .render(
            css=CSS,
            title=title,
            subtitle=subtitle,
            manifest_line=manifest_line,
            smoke=smoke,
            body=Markup(body),
        )
    )


def write_experiment_page(
    result: ExperimentResult, out_dir: Path, manifest_line: str = "", profile: str = ""
) -> Path:
    path = Path(out_dir) / "index.html"
    path.write_text(
        render(
            "experiment",
            title=f"kvlab · {result.title}",
            subtitle=result.description or result.name,
            s=section_data(result),
            smoke=profile == "quick",
            glossary_items=GLOSSARY,
            manifest_line=manifest_line,
        )
    )
    return path


def write_study_index(
    run_dir: Path,
    results: Sequence[tuple[str, ExperimentResult]],
    subtitle: str,
    manifest_line: str = "",
    profile: str = "",
) -> Path:
    """``index.html`` of a study: the verdicts, one line per experiment, then every experiment's section
    (images from its sub-folder)."""
    smoke = profile == "quick"
    overview = [
        {
            "name": r.name,
            "title": r.title,
            "status": r.status,
            "status_text": STATUS_TEXT.get(r.status, r.status),
            "finding": r.finding
            or (r.notes[0].splitlines()[0][:240] if r.notes and r.status != "ok" else ""),
        }
        for _, r in results
    ]
    path = Path(run_dir) / "index.html"
    path.write_text(
        render(
            "study",
            title="kvlab study" + (": smoke run" if smoke else ""),
            subtitle=subtitle,
            verdicts=verdicts_data(results, smoke),
            quality=quality_verdicts_data(results, smoke),
            overview=overview,
            sections=[section_data(r, img_prefix=f"{sub}/") for sub, r in results],
            smoke=smoke,
            glossary_items=GLOSSARY,
            manifest_line=manifest_line,
        )
    )
    return path
