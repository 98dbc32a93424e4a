"""Positions after eviction: the same kept slots at their original positions, re-rotated to contiguous ones,
or at positions within the cache, head to head.

Every RULER-style trial (:mod:`kvlab.eval`) runs the full cache and every eviction score at every ratio;
each eviction's kept slots are then placed three ways (:mod:`kvlab.eval.positions`): (a) ``original``,
the kept keys at their positions with gaps, the question at the context's length T (mlx's SnapKV-D,
TensorRT-LLM's TriAttention; kvlab's default); (b) ``contiguous``, the kept keys re-rotated exactly to
0..k-1, the question still at T (OpenVINO Model Server); (c) ``cache``, the same keys with the question at
k (StreamingLLM's positions within the cache). Accuracy, KL and top-1 to the full cache per convention,
and the paired per-trial differences b - a and c - a with 95% paired intervals: the same trial, slots
and tokens on both sides, so the difference is the positions' alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvlab.metrics.stats import bootstrap_ci, paired_share_ci
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.experiments.ruler import claims_table, haystack, mean_iv, record, run_trials
from kvlab.study.report.format import format_interval, says

#: the conventions compared with ``original`` (a): (name, the difference's label)
PAIRS = (("contiguous", "b - a"), ("cache", "c - a"))
#: per-trial quantities: (row key, label, whether higher is better)
METRICS = (("kld", "KL", False), ("score", "accuracy", True), ("top1", "top-1", True))


def settings(ctx: ExperimentContext, opts: dict[str, Any]) -> dict[str, Any]:
    """Scores, ratios, lengths, tasks and trials: the profile's, or as given."""
    from kvlab.policy.catalogue import SCORES

    # default: the ruler experiment's scores and length (a few minutes on a laptop CPU; every score at 512
    # and 1,024 tokens took over 50); full: every score
    s = {
        "scores": opts.get("scores")
        or ctx.pick(["snapkv"], ["streaming_llm", "h2o", "snapkv"], list(SCORES)),
        "ratios": opts.get("ratios") or ctx.pick([0.5], [0.25, 0.5, 0.75]),
        "lengths": opts.get("lengths") or ctx.pick([160], [512], [1024, 4096]),
        "tasks": opts.get("tasks")
        or ctx.pick(["niah_single"], ["niah_single", "vt"], ["niah_single", "vt", "qa"]),
        "trials": ctx.count("trials", opts.get("trials"), quick=5, default=10, full=50),
        "max_new_tokens": opts.get("max_new_tokens") or ctx.pick(10, 16, None),
    }
    for key in ("scores", "tasks"):
        if isinstance(s[key], str):
            s[key] = [v.strip() for v in s[key].split(",") if v.strip()]
    s["scores"] = _distinct(s["scores"])
    for key, kind in (("ratios", float), ("lengths", int)):
        if isinstance(s[key], str | int | float):
            s[key] = [kind(v) for v in str(s[key]).split(",")]
    return s


def _distinct(scores: list[str]) -> list[str]:
    """The scores less those another one already names (``window`` is ``streaming_llm``)."""
    from kvlab.eval.specs import parse_cache_spec

    seen: dict[str, str] = {}
    for score in scores:
        seen.setdefault(parse_cache_spec(f"{score}:0.5").policy.spec, score)
    return list(seen.values())


def _by_trial(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Eviction rows by (spec, task, length, trial): {convention: row}."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r.get("positions") is not None:
            out.setdefault((r["spec"], r["task"], r["length"], r["trial"]), {})[r["positions"]] = r
    return out


def paired(trials: list[list[dict[str, dict]]], seed: int) -> dict[str, Any]:
    """Per convention: accuracy (Wilson), KL (bootstrap) and top-1 (Wilson: shares) over ``trials``; per
    pair, each metric's paired per-trial difference against ``original`` (:func:`_diff`). A trial
    is the sampling unit: its evictions (several scores or ratios) are averaged into one value first."""

    def mean(t: list[dict[str, dict]], conv: str, m: str) -> float:
        return float(np.mean([e[conv][m] for e in t]))

    out: dict[str, Any] = {"trials": len(trials)}
    for conv in ("original", *(c for c, _ in PAIRS)):
        out[conv] = {m: mean_iv([mean(t, conv, m) for t in trials], seed, up) for m, _, up in METRICS}
    for conv, _ in PAIRS:
        out[f"{conv}-original"] = {m: _diff(trials, conv, m, up, seed) for m, _, up in METRICS}
    return out


def _diff(trials: list[list[dict[str, dict]]], conv: str, m: str, share: bool, seed: int) -> dict | None:
    """Metric ``m`` of ``conv`` minus ``original``, paired per trial: Tango's paired interval for a share
    (:func:`~kvlab.metrics.stats.paired_share_ci`, not a point when every pair ties), else a bootstrap."""
    a = [float(np.mean([e[conv][m] for e in t])) for t in trials]
    b = [float(np.mean([e["original"][m] for e in t])) for t in trials]
    ok = [i for i in range(len(a)) if np.isfinite(a[i]) and np.isfinite(b[i])]
    if not ok:
        return None
    if share:
        return paired_share_ci([a[i] for i in ok], [b[i] for i in ok]).to_json()
    return bootstrap_ci([a[i] - b[i] for i in ok], seed=seed).to_json()


def _per_trial(rows: list[dict]) -> list[list[dict[str, dict]]]:
    """Every trial's evictions (each {convention: row}), one list per (task, length, trial)."""
    out: dict[tuple, list[dict[str, dict]]] = {}
    for (_, task, length, trial), convs in _by_trial(rows).items():
        out.setdefault((task, length, trial), []).append(convs)
    return list(out.values())


def points(rows: list[dict], specs: list[Any], seed: int) -> list[dict]:
    """One point per (score, ratio, length), pooled over tasks and trials: :func:`paired`."""
    meta = {s.spec: s for s in specs}
    groups: dict[tuple, list[list[dict[str, dict]]]] = {}
    for (spec, _, length, _), convs in _by_trial(rows).items():
        groups.setdefault((spec, length), []).append([convs])
    return [
        {"spec": spec, "score": meta[spec].method, "ratio": meta[spec].ratio, "length": length}
        | paired(trials, seed)
        for (spec, length), trials in groups.items()
    ]


def better(diff: dict | None, higher_is_better: bool, conv: str) -> str:
    """Which of ``original`` and ``conv`` a paired difference (conv - original) favours: the one its 95%
    interval excludes zero towards, else "no difference seen" (or "no interval" from too few trials)."""
    ours, theirs = f"{conv} better", "original better"
    above, below = (ours, theirs) if higher_is_better else (theirs, ours)  # conv - original above / below 0
    return says(diff, below, above, few="no interval (fewer than 5 trials)")


def claim(pooled: dict, conv: str, label: str) -> dict:
    """ "Original positions beat ``conv``": the verdict by KL (the paired difference's interval), with the
    accuracy and top-1 differences beside it."""
    diffs = pooled[f"{conv}-original"]
    verdict = better(diffs["kld"], False, conv)
    outcome = "holds" if verdict == "original better" else "does not hold"
    outcome = "cannot decide" if verdict.startswith("no interval") else outcome
    rest = "; ".join(
        f"{name} {label} {format_interval(diffs[m], signed=True)} ({better(diffs[m], up, conv)})"
        for m, name, up in METRICS[1:]
    )
    return record(
        f"positions_{conv}",
        f"Original positions beat {conv} ones after eviction ({label}, by KL)",
        verdict,
        f"{verdict}: KL {label} {format_interval(diffs['kld'], signed=True)} nats/token; {rest}",
        f"the paired per-trial difference {label} ({conv} minus original, same trial and kept slots) "
        "of the mean per-token KL to the full cache, each trial's evictions (scores, ratios) averaged, over "
        "every task, length and trial: a 95% bootstrap interval above 0 holds (original better), below 0 "
        "or across 0 does not; fewer than 5 trials give no interval: cannot decide",
        {**(diffs["kld"] or {}), "samples": "trials", "label": f"KL {label} (nats/token)"},
        outcome,
    )


def _tables(pts: list[dict], claims: list[dict]) -> list[Table]:
    verdicts = claims_table(
        claims,
        "a: original positions (question at T); b: re-rotated to 0..k-1 (question at T); c: "
        "re-rotated, question at k. Differences are paired per trial (same kept slots, same tokens).",
    )
    cols = ["length", "cache", "n", "KL a", "KL b - a", "KL c - a", "acc a", "acc b - a", "acc c - a"]
    cols += ["top-1 a", "top-1 b - a", "top-1 c - a"]
    rows = []
    for p in sorted(pts, key=lambda p: (p["length"], p["score"], p["ratio"])):
        row = [p["length"], p["spec"], p["trials"]]
        for m in ("kld", "score", "top1"):
            row.append(format_interval(p["original"][m]) if p["original"][m] else "–")
            row += [format_interval(p[f"{c}-original"][m], signed=True) or "–" for c, _ in PAIRS]
        rows.append(row)
    per = Table(
        "Per score, ratio and length",
        cols,
        rows,
        caption="Pooled over tasks and trials; a's accuracy and top-1 with Wilson intervals, its KL "
        "(nats/token, mean over question + the full cache's answer) with a bootstrap interval; every "
        "difference is the mean paired per-trial difference with a 95% interval (Tango's paired score "
        "interval for accuracy and top-1, a bootstrap for KL).",
    )
    return [verdicts, per]


def run(ctx: ExperimentContext, *, text_file: str | Path | None = None, **opts: Any) -> ExperimentResult:
    from kvlab.errors import BadInputError
    from kvlab.eval.positions import CONVENTIONS
    from kvlab.eval.specs import expand_specs, parse_cache_specs

    unknown = set(opts) - {"scores", "ratios", "lengths", "tasks", "trials", "max_new_tokens"}
    if unknown:
        raise BadInputError(f"positions: unknown option(s) {', '.join(sorted(unknown))}")
    result = EXPERIMENT.result(__doc__)
    s = settings(ctx, opts)
    specs = parse_cache_specs(["full", *expand_specs(s["scores"], s["ratios"])])
    hay = haystack(text_file, result)
    rows = run_trials(ctx, s, specs, hay, f"positions: {len(specs) - 1} evictions x 3", positions=CONVENTIONS)
    pts = points(rows, specs, ctx.seed)
    pooled = paired(_per_trial(rows), ctx.seed)
    claims = [claim(pooled, conv, label) for conv, label in PAIRS]
    result.tables += _tables(pts, claims)
    result.notes += [f"{c['claim']}: {c['measured']}." for c in claims]
    result.summary.update(
        settings={**s, "caches": [sp.spec for sp in specs], "seed": ctx.seed, "model": ctx.handle().name},
        points=pts,
        pooled=pooled,
        claims=claims,
        verdicts={c["id"]: c["verdict"] for c in claims},
    )
    return result


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    pooled, claims = s.get("pooled") or {}, s.get("claims", [])
    rows = [
        (f"KL {label}, pooled (nats/token)", format_interval(pooled[f"{conv}-original"]["kld"], signed=True))
        for conv, label in PAIRS
        if pooled.get(f"{conv}-original", {}).get("kld") is not None
    ]
    text = "After eviction, on the same kept slots: " + "; ".join(
        f"{conv} vs original: {c['verdict']}" for (conv, _), c in zip(PAIRS, claims, strict=False)
    )
    return text + ".", rows


EXPERIMENT = Experiment(
    name="positions",
    title="Positions after eviction: original, re-rotated contiguous, within the cache",
    run=run,
    order=49,
    describe=describe,
    description="The same evicted slots at original positions, re-rotated to contiguous ones (question at "
    "T) and within the cache (question at k): accuracy, KL and top-1, paired differences, a verdict.",
    seed_changes="which trials are generated (needle keys and values, depths, haystack stretches)",
)
