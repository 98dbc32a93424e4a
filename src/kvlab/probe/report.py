"""The probe's report: one :class:`Section` per check (its verdict, a one-line summary, its statistics and
the raw rows the verdict was read from), written as ``report.json`` and a self-contained ``report.html``
(inline style, no script, every value escaped)."""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Verdict = Literal["ok", "finding", "skipped"]


@dataclass
class Section:
    """One check's outcome. ``finding``: the server did something wrong; ``skipped``: not measurable here
    (``summary`` says why); ``ok``: checked, nothing found."""

    key: str
    title: str
    verdict: Verdict
    summary: str
    stats: dict[str, object] = field(default_factory=dict)
    rows: list[dict[str, object]] = field(default_factory=list)


def assemble(head: dict[str, object], sections: list[Section]) -> dict[str, object]:
    """The report as one JSON-able dict: ``head`` (server, model, settings), the overall verdict, the
    findings' one-liners and the sections."""
    findings = [f"{s.title}: {s.summary}" for s in sections if s.verdict == "finding"]
    return {
        **head,
        "verdict": "finding" if findings else "clean",
        "findings": findings,
        "sections": [asdict(s) for s in sections],
    }


def write(report: dict[str, object], out: Path) -> tuple[Path, Path]:
    """``report.json`` and ``report.html`` under ``out`` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    js, page = out / "report.json", out / "report.html"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    page.write_text(to_html(report))
    return js, page


_STYLE = (
    "body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}"
    "table{border-collapse:collapse;margin:.6em 0 1.4em;font-size:12px}"
    "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}"
    "th{background:#f3f3f3}.finding{color:#b00;font-weight:bold}.ok{color:#070}.skipped{color:#777}"
    "code{background:#f5f5f5;padding:0 3px}"
)


def _cell(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return html.escape(text if len(text) <= 300 else text[:300] + "…")


def _table(rows: list[dict[str, object]]) -> str:
    """Rows of dicts as an HTML table, the columns in first-seen order."""
    if not rows:
        return "<p><em>no rows</em></p>"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    cell = {c: (_verdict if c == "verdict" else _cell) for c in cols}  # verdicts coloured
    body = "".join(
        "<tr>" + "".join(f"<td>{cell[c](r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _pairs(values: dict[str, object]) -> str:
    """A dict as a two-column table, one row a key (nested values as JSON)."""
    return _table([{"statistic": k, "value": v} for k, v in values.items()])


def _verdict(v: object) -> str:
    return f'<span class="{html.escape(str(v))}">{html.escape(str(v))}</span>'


def to_html(report: dict[str, Any]) -> str:
    """The report as one HTML page: what was probed, a verdict table, then each check with its rows."""
    sections = report["sections"]
    overview = [{"check": s["title"], "verdict": s["verdict"], "summary": s["summary"]} for s in sections]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvlab probe: {_cell(report['url'])}"
        f"</title><style>{_STYLE}</style></head><body>",
        f"<h1>kvlab probe: {_verdict(report['verdict'])}</h1>",
        f"<p>Server <code>{_cell(report['url'])}</code>, model <code>{_cell(report['model'])}</code>, "
        f"API <code>{_cell(report['api'])}</code>, {_cell(report['requests'])} requests in "
        f"{_cell(report['seconds'])} s, started {_cell(report['started'])}.</p>",
        "<h2>Verdicts</h2>",
        _table(overview),
        "<h2>Settings</h2>",
        _pairs(report.get("settings") or {}),
    ]
    for s in sections:
        parts += [
            f"<h2 id='{html.escape(s['key'])}'>{html.escape(s['title'])}: {_verdict(s['verdict'])}</h2>",
            f"<p>{html.escape(s['summary'])}</p>",
            "<h3>Statistics</h3>" + _pairs(s["stats"]) if s["stats"] else "",
            "<h3>Raw rows</h3>" + _table(s["rows"]),
        ]
    parts.append("</body></html>\n")
    return "\n".join(parts)
