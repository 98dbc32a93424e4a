"""One page for a sweep: per experiment, a cross-model table of each cell's headline numbers and a
plot of the first headline quantity that is not 0 in every cell, by model and seed (with its interval),
each cell linking to its folder. A quick-profile sweep is marked as a smoke run."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from kvlab.study.report.html import page_html

_NUMBER = re.compile(
    r"^\s*(-?[\d,]*\.?\d+(?:e[-+]?\d+)?)(?:\s*\[(-?[\d,]*\.?\d+(?:e[-+]?\d+)?),\s*(-?[\d,]*\.?\d+(?:e[-+]?\d+)?)\])?"
)


def parse_value(text: str) -> tuple[float, float | None, float | None] | None:
    """``"0.998 [0.997, 0.999]"`` -> (0.998, 0.997, 0.999); None for a non-numeric headline."""
    m = _NUMBER.match(str(text))
    if not m:
        return None
    low, high = (float(g.replace(",", "")) if g else None for g in m.groups()[1:])
    return float(m.group(1).replace(",", "")), low, high


def chart_label(labels: list[str], cells: list[dict]) -> str | None:
    """The first headline quantity that is a number in some cell and not 0 in every cell (a chart of
    zeros says nothing), or None."""
    for label in labels:
        values = []
        for c in cells:
            parsed = parse_value(dict((k, v) for k, v in c.get("headline", [])).get(label, ""))
            if parsed is not None:
                values.append(parsed[0])
        if values and any(v != 0 for v in values):
            return label
    return None


def _plot(out: Path, name: str, label: str, cells: list[dict]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys, lo, hi = [], [], [], []
    for c in cells:
        row = dict((k, v) for k, v in c.get("headline", []))
        parsed = parse_value(row.get(label, ""))
        if parsed is None:
            continue
        v, low, high = parsed
        xs.append(f"{c.get('model_name', c['model'])}\nseed {c['seed']}")
        ys.append(v)
        lo.append(v - low if low is not None else 0)
        hi.append(high - v if high is not None else 0)
    if not ys:
        return None
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(ys)), 3.2))
    ax.bar(range(len(ys)), ys, yerr=[lo, hi], capsize=4, color="#3b6fd8")
    ax.set_xticks(range(len(ys)), xs, fontsize=8)
    ax.set_title(f"{name}: {label}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    filename = f"{name}.png"
    fig.savefig(out / filename, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return filename


def write_sweep_report(out: Path, result: dict) -> Path:
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    sections = []
    by_exp: dict[str, list[dict]] = {}
    for c in result["cells"]:
        by_exp.setdefault(c["experiment"], []).append(c)
    for name, cells in by_exp.items():
        labels: list[str] = []
        for c in cells:
            for label, _ in c.get("headline", []):
                if label not in labels:
                    labels.append(label)
        head = "".join(f"<th>{html.escape(h)}</th>" for h in ["model", "text", "seed", "status", *labels])
        rows = []
        for c in cells:
            values = dict((k, v) for k, v in c.get("headline", []))
            link = f'<a href="{html.escape(c.get("folder", ""))}/index.html">{html.escape(c.get("model_name", c["model"]))}</a>'
            text = Path(c["text"]).name if c.get("text") else "default"
            cols = [link, html.escape(text), str(c["seed"]), html.escape(c["status"])]
            cols += [html.escape(str(values.get(label, "–"))) for label in labels]
            rows.append("<tr>" + "".join(f"<td>{v}</td>" for v in cols) + "</tr>")
        label = chart_label(labels, cells)
        plot = _plot(out, name, label, cells) if label else None
        if label and plot:
            fig = (
                f'<figure><img src="{plot}" alt="{html.escape(name)}"><figcaption>{html.escape(label)}, by model '
                "and seed (bars: the headline value; whiskers: its 95% interval where it has one)</figcaption></figure>"
            )
        else:
            fig = (
                '<p class="desc">No chart: no headline quantity of this experiment is a number other than 0 in '
                "any cell.</p>"
                if labels
                else ""
            )
        sections.append(
            f'<section id="{html.escape(name)}"><h2>{html.escape(name)}</h2>{fig}'
            f"<table><tr>{head}</tr>{''.join(rows)}</table></section>"
        )
    where = f", {result['device']} {result['dtype']}" if result.get("device") else ""
    subtitle = (
        f"{len(result['cells'])} cells ({result['ran']} run, {result['skipped']} resumed), backend {result['backend']}{where}, "
        f"{result['seconds']} s; raw: result.json"
    )
    path = out / "index.html"
    smoke = any(c.get("profile") == "quick" for c in result["cells"])
    path.write_text(
        page_html("kvlab sweep", subtitle, sections, nav=[(f"#{n}", n) for n in by_exp], smoke=smoke)
    )
    return path
