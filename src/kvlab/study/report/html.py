"""The HTML report: one self-contained page per experiment and an index for a whole study.

Plain HTML with inline CSS, images by relative path: it opens from disk in any browser and renders
in headless Chromium (tested). Figures come first, with their captions; numbers and notes follow.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.study.experiments.base import ExperimentResult, Table
from kvlab.study.report.glossary import glossary_html

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#16202e;color:#fff;padding:18px 32px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#b9c3d0;font-size:14px}
main{max-width:1180px;margin:0 auto;padding:16px 32px 48px}
section{background:#fff;border:1px solid #e1e5ea;border-radius:8px;margin:18px 0;padding:16px 22px}
h2{font-size:19px;margin:4px 0 8px}h3{font-size:15px;margin:18px 0 6px}
.status{font-size:12px;padding:2px 8px;border-radius:10px;margin-left:8px;vertical-align:middle}
.ok{background:#dff3e4;color:#17622f}.not_applicable{background:#fff1cc;color:#7a5800}.failed{background:#fde0e0;color:#8a1c1c}
figure{margin:12px 0;display:inline-block;max-width:100%;vertical-align:top}
figure img{max-width:100%;border:1px solid #e6e9ee;border-radius:4px}
figcaption{font-size:13px;color:#4a5566;margin-top:4px;max-width:720px}
table{border-collapse:collapse;font-size:13px;margin:6px 0 12px}
th,td{border:1px solid #e1e5ea;padding:4px 8px;text-align:right}th{background:#f0f3f6}
td:first-child,th:first-child{text-align:left}
.notes li{font-size:13px;color:#4a5566}.desc{color:#4a5566;font-size:14px}
nav a{margin-right:14px;font-size:14px}code{background:#f0f3f6;padding:1px 4px;border-radius:3px}
.manifest{font-size:12px;color:#667085}
.finding{font-size:15px;background:#eef4ff;border-left:4px solid #3b6fd8;padding:8px 12px;margin:8px 0 10px}
.headline td:last-child{font-weight:600}.links{font-size:13px}
details>summary{cursor:pointer;color:#3b4a60;font-size:14px;margin:8px 0}
.glossary dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 14px;font-size:13px;margin:6px 0}
.glossary dt{font-weight:600}.glossary dd{margin:0;color:#4a5566}
"""


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
    return html.escape(str(value))


def table_html(table: Table) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>" for row in table.rows)
    cap = f'<p class="desc">{html.escape(table.caption)}</p>' if table.caption else ""
    title = f"<h3>{html.escape(table.title)}</h3>" if table.title else ""
    return f"{title}{cap}<table><tr>{head}</tr>{body}</table>"


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


def section_html(result: ExperimentResult, img_prefix: str = "") -> str:
    """One experiment: its finding and headline numbers first, then figures, tables, notes; the full
    flattened summary is collapsed; links to the raw ``result.json`` and ``arrays.npz``."""
    parts = [
        f'<section id="{html.escape(result.name)}"><h2>{html.escape(result.title)}'
        f'<span class="status {result.status}">{result.status.replace("_", " ")}</span></h2>'
    ]
    if result.description:
        parts.append(f'<p class="desc">{html.escape(result.description)}</p>')
    if result.finding:
        parts.append(f'<p class="finding">{html.escape(result.finding)}</p>')
    if result.headline:
        body = "".join(
            f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
            for k, v in result.headline
        )
        parts.append(
            f'<table class="headline"><tr><th>headline</th><th>value [95% interval]</th></tr>{body}</table>'
        )
    links = [f'<a href="{html.escape(img_prefix)}result.json">result.json</a>']
    if result.arrays:
        links.append(f'<a href="{html.escape(img_prefix)}arrays.npz">arrays.npz</a>')
    parts.append(f'<p class="links">Raw results: {" · ".join(links)}</p>')
    for fig in result.figures:
        parts.append(
            f'<figure><img src="{html.escape(img_prefix + fig.filename)}" alt="{html.escape(fig.caption)}">'
            f"<figcaption>{html.escape(fig.caption)}</figcaption></figure>"
        )
    for table in result.tables:
        parts.append(table_html(table))
    rows = _summary_rows(result.summary)
    if rows:
        parts.append(
            f"<details><summary>All numbers ({len(rows)} quantities; also in result.json)</summary>"
            + table_html(Table("", ["quantity", "value"], [list(r) for r in rows]))
            + "</details>"
        )
    if result.notes:
        parts.append(
            '<h3>Notes</h3><ul class="notes">'
            + "".join(f"<li>{html.escape(n)}</li>" for n in result.notes)
            + "</ul>"
        )
    if result.data_sources:
        parts.append(f'<p class="manifest">Data: {html.escape("; ".join(result.data_sources))}</p>')
    parts.append("</section>")
    return "".join(parts)


def page_html(
    title: str,
    subtitle: str,
    sections: Sequence[str],
    nav: Sequence[tuple[str, str]] = (),
    manifest_line: str = "",
) -> str:
    nav_html = (
        "<nav>" + "".join(f'<a href="{html.escape(h)}">{html.escape(t)}</a>' for h, t in nav) + "</nav>"
        if nav
        else ""
    )
    foot = f'<p class="manifest">{html.escape(manifest_line)}</p>' if manifest_line else ""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>'
        f"<body><header><h1>{html.escape(title)}</h1><p>{html.escape(subtitle)}</p></header>"
        f"<main>{nav_html}{''.join(sections)}{foot}</main></body></html>"
    )


def write_experiment_page(result: ExperimentResult, out_dir: Path, manifest_line: str = "") -> Path:
    path = Path(out_dir) / "index.html"
    path.write_text(
        page_html(
            f"kvlab · {result.title}",
            result.description or result.name,
            [glossary_html(), section_html(result)],
            manifest_line=manifest_line,
        )
    )
    return path


def write_study_index(
    run_dir: Path, results: Sequence[tuple[str, ExperimentResult]], subtitle: str, manifest_line: str = ""
) -> Path:
    """``index.html`` of a study: every experiment's section, images from its sub-folder."""
    sections = [glossary_html(), *(section_html(r, img_prefix=f"{sub}/") for sub, r in results)]
    nav = [("#glossary", "Glossary"), *((f"#{r.name}", r.title) for _, r in results)]
    path = Path(run_dir) / "index.html"
    path.write_text(page_html("kvlab study", subtitle, sections, nav=nav, manifest_line=manifest_line))
    return path
