"""The timing checks, read from one set of timed requests (:func:`collect`; one generated token each, so
a request's time is mostly its prompt's prefill).

Each trial takes a fresh long prefix P (a nonce, then ``prefix_words`` words) and times four requests:
``cold_a`` (tenant A asks P+q0: nothing cached), ``own`` (A asks P+q1: A's own prefix hit), and, with a
second key, in alternating order, ``other`` (tenant B asks P+q2: A's prefix) and ``cold_b`` (B asks a fresh
prefix of the same length). ``floor``: five one-line prompts, the server's fixed cost.

* :func:`isolation`: ``other`` significantly faster than ``cold_b`` (one-sided Mann-Whitney U below
  ``alpha``, and at least 20% faster by the medians), or ``other`` claiming half its prompt cached while
  ``cold_b`` claims none: B was served A's cache.
* :func:`claims`: what ``usage.prompt_tokens_details.cached_tokens`` says against the times. A finding only
  when clearly contradictory: 80% of the prompt claimed cached but no speed-up (medians within 5%, p > 0.05,
  while a cold prompt takes 3x the floor, so a speed-up would show), or none claimed yet significantly
  faster by 30% or more.
"""

from __future__ import annotations

import statistics

from kvlab.probe.checks import nonce, question, words
from kvlab.probe.client import Client, Reply
from kvlab.probe.config import Log, ProbeConfig
from kvlab.probe.report import Section

Row = dict[str, object]


def _row(trial: int, arm: str, reply: Reply) -> Row:
    return {
        "trial": trial,
        "arm": arm,
        "status": reply.status,
        "seconds": round(reply.seconds, 5),
        "prompt_tokens": reply.prompt_tokens,
        "cached_tokens": reply.cached_tokens,
        "error": reply.error or "",
    }


def collect(client: Client, cfg: ProbeConfig, log: Log) -> list[Row]:
    """The timed requests of every trial (see the module's docstring), one row each. B's two requests
    alternate which goes first, so neither arm gains from its place (a server may still be busy with the
    request before)."""
    a, b = cfg.tenant_a, cfg.tenant_b
    rows = [_row(-1, "floor", client.ask(a, nonce() + "Say hello.", 1)) for _ in range(5)]
    text = words(500, cfg.prefix_words)
    for t in range(cfg.trials):
        log(f"timing: trial {t + 1}/{cfg.trials} ({cfg.prefix_words}-word prefix)")
        shared = nonce() + text
        rows.append(_row(t, "cold_a", client.ask(a, shared + question(0), 1)))
        rows.append(_row(t, "own", client.ask(a, shared + question(1), 1)))
        if b is not None:
            pair = [("other", shared), ("cold_b", nonce() + text)]
            rows += [
                _row(t, arm, client.ask(b, head + question(2), 1)) for arm, head in pair[:: 1 - 2 * (t % 2)]
            ]
    return rows


def _arm(rows: list[Row], arm: str, column: str = "seconds") -> list[float]:
    return [
        float(str(r[column]))
        for r in rows
        if r["arm"] == arm and r["status"] == 200 and r[column] is not None
    ]


def faster(rows: list[Row], fast: str, slow: str) -> dict[str, object]:
    """Is arm ``fast`` faster than arm ``slow``: the medians, their ratio and the one-sided Mann-Whitney U
    p-value (scipy; exact for small samples without ties)."""
    from scipy.stats import mannwhitneyu

    x, y = _arm(rows, fast), _arm(rows, slow)
    if len(x) < 3 or len(y) < 3:
        return {"n": [len(x), len(y)], "p": None, "ratio": None}
    mx, my = statistics.median(x), statistics.median(y)
    p = float(mannwhitneyu(x, y, alternative="less").pvalue)
    return {
        "n": [len(x), len(y)],
        f"median_{fast}_s": round(mx, 5),
        f"median_{slow}_s": round(my, 5),
        "ratio": round(mx / my, 4) if my > 0 else None,
        "p": round(p, 6),
    }


def _claimed(rows: list[Row], arm: str) -> float | None:
    """The median share of the prompt ``arm`` claims cached, or None when the server does not say."""
    pairs = [(r["cached_tokens"], r["prompt_tokens"]) for r in rows if r["arm"] == arm and r["status"] == 200]
    shares = [int(str(c)) / int(str(p)) for c, p in pairs if c is not None and p]
    return round(statistics.median(shares), 4) if shares else None


def _significant(test: dict[str, object], alpha: float, ratio: float) -> bool:
    p, r = test.get("p"), test.get("ratio")
    return isinstance(p, float) and isinstance(r, float) and p < alpha and r < ratio


def isolation(rows: list[Row], cfg: ProbeConfig) -> Section:
    """Tenant B's requests on tenant A's prefix against B's cold ones (see the module's docstring)."""
    title = "Isolation between tenants"
    if cfg.tenant_b is None:
        return Section("isolation", title, "skipped", "needs two keys: --api-key A --api-key B", rows=rows)
    other, own = faster(rows, "other", "cold_b"), faster(rows, "own", "cold_a")
    claims = {"other": _claimed(rows, "other"), "cold_b": _claimed(rows, "cold_b")}
    stats = {"other_vs_cold_b": other, "own_vs_cold_a": own, "claimed_share": claims, "alpha": cfg.alpha}
    timed = _significant(other, cfg.alpha, 0.8)
    said = (claims["other"] or 0) >= 0.5 and (claims["cold_b"] or 0) <= 0.1
    if timed or said:
        how = [f"faster by the timing (median ratio {other['ratio']}, p={other['p']})"] if timed else []
        how += [f"claimed {claims['other']:.0%} of the prompt cached"] if said else []
        summary = "tenant B's requests on tenant A's prefix were served A's cache: " + "; ".join(how)
        return Section("isolation", title, "finding", summary, stats, rows)
    summary = f"no sign of a shared cache (B on A's prefix vs cold: ratio {other['ratio']}, p={other['p']})"
    if not _significant(own, cfg.alpha, 0.8):
        summary += "; the server shows no prefix-cache speed-up for its own tenant either, so timing alone is weak here"
    return Section("isolation", title, "ok", summary, stats, rows)


def _claims_finding(rows: list[Row], arm: str, cold: str, cfg: ProbeConfig) -> tuple[str, dict[str, object]]:
    """('' or what contradicts, the numbers) for one warm arm against its cold arm."""
    test, share = faster(rows, arm, cold), _claimed(rows, arm)
    floor, cold_s = _arm(rows, "floor"), _arm(rows, cold)
    big = bool(floor and cold_s) and statistics.median(cold_s) >= 3 * statistics.median(floor)
    info = {
        **test,
        "claimed_share": share,
        "cold_claimed_share": _claimed(rows, cold),
        "cold_above_3x_floor": big,
    }
    if share is None:
        return "", info
    r, p = test.get("ratio"), test.get("p")
    if share >= 0.8 and big and isinstance(r, float) and isinstance(p, float) and r >= 0.95 and p > 0.05:
        return f"'{arm}' claims {share:.0%} of its prompt cached but is no faster (ratio {r}, p={p})", info
    if share == 0 and _significant(test, cfg.alpha, 0.7):
        return f"'{arm}' claims no cached tokens but is faster (ratio {r}, p={p})", info
    return "", info


def claims(rows: list[Row], cfg: ProbeConfig) -> Section:
    """``cached_tokens`` against the times (see the module's docstring)."""
    title = "Claimed cached tokens vs timing"
    arms = [("own", "cold_a")] + ([("other", "cold_b")] if cfg.tenant_b is not None else [])
    found: list[str] = []
    stats: dict[str, object] = {}
    for arm, cold in arms:
        why, info = _claims_finding(rows, arm, cold, cfg)
        stats[f"{arm}_vs_{cold}"] = info
        found += [why] if why else []
        if arm == "own":
            summary = f"consistent: own prefix hits claim {info['claimed_share']} of the prompt cached, "
            summary += f"time ratio {info['ratio']}"
    if all(_claimed(rows, arm) is None for arm, _ in arms):
        why = "the server reports no usage.prompt_tokens_details.cached_tokens"
        return Section("claims", title, "skipped", why, stats, rows)
    if found:
        return Section("claims", title, "finding", "; ".join(found), stats, rows)
    return Section("claims", title, "ok", summary, stats, rows)
