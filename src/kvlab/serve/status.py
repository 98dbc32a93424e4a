"""The status page at ``/``: live sessions with their cache layout, store tiers with hit rates.

Plain HTML and inline CSS (no build step, no script); it reloads itself every 2 seconds. It shows
counts and layouts only, never a token of anybody's conversation; still, it lists every tenant's
sessions, so a server with keys serves it only for the admin key (``kvlab serve --admin-key``).
"""

from __future__ import annotations

from html import escape
from typing import Any

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:60rem;color:#1b1f24;padding:0 1rem}
h1{font-size:1.4rem;margin:0 0 .2rem} h2{font-size:1.1rem;margin-top:1.6rem}
.muted{color:#57606a} table{border-collapse:collapse;width:100%;margin:.5rem 0}
th,td{text-align:left;padding:.3rem .5rem;border-bottom:1px solid #d0d7de;vertical-align:middle}
th{font-weight:600;background:#f6f8fa} td.n{text-align:right;font-variant-numeric:tabular-nums}
.bar{display:flex;height:14px;width:18rem;border:1px solid #8c959f;border-radius:3px;overflow:hidden}
.bar span{display:block;height:100%} .s{background:#cf222e} .p{background:#bf8700} .w{background:#2da44e}
.free{background:#eaeef2} .key span{display:inline-block;width:.8rem;height:.8rem;margin:0 .25rem 0 .8rem}
"""


def describe_layout(layout: dict[str, Any]) -> str:
    """A session's cache in words: its attention sinks, its pinned system prompt, its window.

    The system prompt starts at the first slot, so when it is longer than the sinks its first tokens
    *are* the sinks: "4 sinks, 24 pinned (the sinks and 20 more), 60 in the window of 96".
    """
    sinks, pinned, kept = layout["sinks"], layout["pinned"], layout["kept"]
    if layout.get("budget"):  # a scored layout: kept by score, at most the budget + every
        return f"{kept} kept by score, at most {layout['window']} (budget + every)"
    if layout.get("keeps"):  # a layout that keeps a share of every token: the position limit bounds it
        return f"{kept} kept ({layout['keeps']}), at most {layout['window']} (at the model's position limit)"
    window = max(0, kept - max(sinks, pinned))
    if pinned > sinks:
        where = f" (the sinks and {pinned - sinks} more)" if sinks else ""
    elif pinned:
        where = " (within the sinks)"
    else:
        where = ""
    return f"{sinks} sinks, {pinned} pinned{where}, {window} in the window of {layout['window']}"


def _bar(layout: dict[str, Any]) -> str:
    """sinks | pinned system prompt beyond the sinks | window, scaled to the cache's capacity."""
    sinks, kept = layout["sinks"], layout["kept"]
    head = max(sinks, layout["pinned"])  # the first slots, never evicted
    cap = max(1, layout["window"] + head, kept)
    pinned = head - sinks
    window = max(0, kept - head)
    parts = [("s", sinks), ("p", pinned), ("w", window), ("free", max(0, cap - head - window))]
    spans = "".join(f'<span class="{c}" style="width:{100 * n / cap:.2f}%"></span>' for c, n in parts if n)
    title = describe_layout(layout)
    return f'<div class="bar" title="{escape(title)}" role="img" aria-label="{escape(title)}">{spans}</div>'


def _compressed(c: dict[str, Any]) -> str:
    """One line on the shared system prompts compressed once (kvlab.serve.prefixes), where there are any."""
    if not c.get("computed") and not c.get("reused"):
        return ""
    hits = ", ".join(f"{n} from {t}" for t, n in (c.get("hits") or {}).items() if n)
    return (
        f'<p class="muted">compressed shared prefixes: {c["computed"]} computed, {c["reused"]} reused'
        f"{f' ({escape(hits)})' if hits else ''}, {c.get('rejected', 0)} stored records rejected</p>"
    )


def status_page(model: str, status: dict[str, Any], store: dict[str, Any]) -> str:
    rows = (
        "".join(
            f"<tr><td><code>{escape(s['session'])}</code></td><td>{escape(s['state'])}</td><td>{_bar(s)}</td>"
            f"<td class=n>{s['sinks']}</td><td class=n>{s['pinned']}</td><td class=n>{s['kept']}</td><td class=n>{s['seen']}</td><td class=n>{s['rolls']}</td>"
            f"<td class=n>{s['requests']}</td><td class=n>{100 * s['reuse_ratio']:.0f}%</td></tr>"
            for s in status["sessions"]
        )
        or '<tr><td colspan=10 class="muted">no sessions yet</td></tr>'
    )
    tiers = store.get("tiers", {})
    tier_rows = (
        "".join(
            f"<tr><td>{escape(name)}</td><td class=n>{c.get('hits', 0)}</td><td class=n>{c.get('misses', 0)}</td>"
            f"<td class=n>{_rate(c)}</td><td class=n>{c.get('puts', 0)}</td><td class=n>{c.get('corrupt', 0)}</td>"
            f"<td class=n>{c.get('errors', 0)}</td></tr>"
            for name, c in tiers.items()
        )
        or '<tr><td colspan=7 class="muted">no store (start with --store PATH or redis://...)</td></tr>'
    )
    st = status["settings"]
    where = status.get("device") or {}
    gpu = f" ({where['gpu']})" if where.get("gpu") else ""
    device = (
        f" on <b>{escape(str(where.get('device', '?')) + gpu)}</b> in {escape(str(where.get('dtype', '?')))}"
        if where
        else ""
    )
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="2"><title>kvlab serve: {escape(model)}</title><style>{_CSS}</style></head>
<body><h1>kvlab serve</h1>
<p class="muted">model <b>{escape(model)}</b>{device} · window {st["window"]} + {st["sinks"]} sinks, eviction chunk {st["evict_chunk"]}
· batch up to {st["max_batch"]} · queue {status["queue"]}/{st["max_queue"]} · decoding {status["decoding"]}</p>
<h2>Sessions</h2>
<p class="key muted">cache layout:<span class="s"></span>sinks<span class="p"></span>pinned system prompt<span class="w"></span>window<span class="free"></span>free</p>
<table><thead><tr><th>session</th><th>state</th><th>cache</th><th>sinks</th><th>pinned</th><th>kept</th><th>seen</th><th>rolls</th><th>requests</th><th>reused</th></tr></thead>
<tbody>{rows}</tbody></table>
<h2>Store</h2><p class="muted">{escape(str(store.get("describe", "none")))}
{f" · {store['warnings']} store failures served without it" if store.get("warnings") else ""}</p>
<table><thead><tr><th>tier</th><th>hits</th><th>misses</th><th>hit rate</th><th>puts</th><th>corrupt</th><th>errors</th></tr></thead>
<tbody>{tier_rows}</tbody></table>
{_compressed(store.get("compressed_prefixes") or {})}
<p class="muted">JSON: <a href="/health">/health</a> · Prometheus: <a href="/metrics">/metrics</a></p>
</body></html>"""


def _rate(c: dict[str, Any]) -> str:
    total = c.get("hits", 0) + c.get("misses", 0)
    return f"{100 * c.get('hits', 0) / total:.0f}%" if total else "–"
