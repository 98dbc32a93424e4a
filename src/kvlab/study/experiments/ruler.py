"""RULER-style accuracy and KL to the full cache, per eviction policy and ratio and per codec.

Every trial of :mod:`kvlab.eval` (needles, variable tracking, common words, QA; the question never
compressed) runs under the full cache and every policy at every ratio (the fraction of the context
removed) and every codec, on the same tokens: accuracy with Wilson intervals over trials, the mean
per-token KL(full || cache) and top-1 agreement, and the K/V bytes per context token. The section
checks three claims that can come out false: "H2O is best at 50%", "int4 costs almost nothing" and
"scores fall steadily with the ratio", each by paired per-trial differences between two caches (every cache
answers the same trials) with paired intervals (Tango's score interval for accuracy and top-1, a
bootstrap for KL).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvlab.metrics.stats import MIN_SAMPLES, bootstrap_ci, paired_share_ci, wilson_ci
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import format_interval, format_number
from kvlab.study.report.format import side_of_zero as side
from kvlab.study.report.plots import subplots

#: KL below this (nats per token, mean over question + answer) is "almost nothing" (llama.cpp's q4_0: 0.009)
INT4_KL_NEAR_ZERO = 0.01
CLAIM_RATIO = 0.5


def settings(ctx: ExperimentContext, opts: dict[str, Any]) -> dict[str, Any]:
    """The run's tasks, lengths, trials, policies (scores), ratios and codecs: the profile's, or as given."""
    from kvlab.eval.specs import parse_ratios

    all_tasks = ["niah_single", "niah_multikey", "vt", "cwe", "qa"]
    # default: a few minutes on a laptop CPU (the study's other experiments take 1-5); full: the
    # issue's yardstick (>= 200 trials per task at 1k and 4k: hours on a CPU, minutes on a GPU)
    s = {
        "tasks": opts.get("tasks") or ctx.pick(["niah_single"], ["niah_single", "vt", "qa"], all_tasks),
        "lengths": opts.get("lengths") or ctx.pick([256], [512], [1024, 4096]),
        "trials": ctx.count("trials", opts.get("trials"), quick=2, default=10, full=200),
        "policies": opts.get("policies")
        or ctx.pick(
            ["h2o", "snapkv"],
            ["streaming_llm", "h2o", "snapkv"],
            ["streaming_llm", "h2o", "snapkv", "tova", "knorm"],
        ),
        "ratios": opts.get("ratios") or ctx.pick([CLAIM_RATIO], [0.25, 0.5, 0.75]),
        "codecs": opts.get("codecs") or ctx.pick(["int4"], ["int4", "kivi2"]),
        "max_new_tokens": opts.get("max_new_tokens") or ctx.pick(12, None),
    }
    ratios = s["ratios"]
    s["ratios"] = parse_ratios(ratios if isinstance(ratios, str) else ",".join(map(str, ratios)))
    for key in ("tasks", "policies", "codecs"):
        if isinstance(s[key], str):
            s[key] = [v.strip() for v in s[key].split(",") if v.strip()]
    if isinstance(s["lengths"], str | int):
        s["lengths"] = [int(v) for v in str(s["lengths"]).split(",")]
    return s


def _specs(s: dict[str, Any]) -> list[Any]:
    """``full`` + every policy at every ratio + every codec, parsed by the eval's one reader."""
    from kvlab.eval.specs import expand_specs, parse_cache_specs

    return parse_cache_specs(["full", *expand_specs(s["policies"], s["ratios"]), *s["codecs"]])


#: the per-trial quantities that are proportions (shares in [0, 1]): Wilson intervals, not a bootstrap
PROPORTIONS = ("score", "top1")


def mean_iv(values: list[float], seed: int, proportion: bool = False) -> dict | None:
    """Mean over trials with its interval (Wilson for a proportion), as JSON; None when nothing is finite."""
    finite = [v for v in values if np.isfinite(v)]
    if not finite:
        return None
    return (wilson_ci(finite) if proportion else bootstrap_ci(finite, seed=seed)).to_json()


def points(rows: list[dict], specs: list[Any], seed: int) -> list[dict]:
    """One point per (task, length, cache) and per (all tasks, length, cache): accuracy, KL, top-1 with
    intervals over trials, bytes per context token, and the cache's kind, method and ratio."""
    meta = {s.spec: s for s in specs}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["length"], r["spec"]), []).append(r)
        groups.setdefault(("all", r["length"], r["spec"]), []).append(r)
    out = []
    for (task, length, spec), rs in groups.items():
        m = meta[spec]
        out.append(
            {
                "task": task,
                "length": length,
                "cache": spec,
                "kind": m.kind,
                "method": m.method or "full",
                "ratio": m.ratio,
                "trials": len(rs),
                "accuracy": mean_iv([r["score"] for r in rs], seed, proportion=True),
                "kld": mean_iv([r["kld"] for r in rs], seed),
                "kld_infinite": sum(1 for r in rs if r["kld"] == float("inf")),
                "top1": mean_iv([r["top1"] for r in rs], seed, proportion=True),
                "bytes_per_token": float(np.mean([r["kv_bytes"] / r["context_tokens"] for r in rs])),
                "kept_fraction": float(np.mean([r["kept_slots"] / r["context_tokens"] for r in rs])),
            }
        )
    return out


def _v(p: dict | None, key: str) -> float:
    return float("nan") if p is None or p.get(key) is None else float(p[key]["value"])


def _tables(pts: list[dict], s: dict[str, Any]) -> list[Table]:
    """One table per task (and one pooled over tasks): every cache at every length."""
    cols = ["length", "cache", "ratio", "n", "accuracy [95% CI]", "KL nats [95% CI]", "top-1 [95% CI]"]
    cols += ["bytes / token", "kept"]
    out = []
    for task in _panels(s):
        sel = sorted((p for p in pts if p["task"] == task), key=lambda p: (p["length"], _order(p)))
        rows = [
            [
                p["length"],
                p["cache"],
                f"{p['ratio']:g}" if p["kind"] == "evict" else "–",
                p["trials"],
                format_interval(p["accuracy"], digits=2) if p["accuracy"] else "–",
                format_interval(p["kld"], digits=3) if p["kld"] else "–",
                format_interval(p["top1"], digits=3) if p["top1"] else "–",
                format_number(p["bytes_per_token"], 4),
                f"{p['kept_fraction']:.2f}",
            ]
            for p in sel
        ]
        title = "All tasks pooled" if task == "all" else f"Task {task}"
        out.append(
            Table(
                title,
                cols,
                rows,
                caption="Accuracy: exact-match score per trial (RULER's rules), mean with a 95% Wilson "
                "interval over trials; KL: mean per-token KL(full || cache) in nats over the question and "
                "the full cache's answer (teacher-forced), 95% bootstrap interval; top-1: share of those "
                "tokens whose argmax matches the full cache's (Wilson); ratio: fraction of the context removed; bytes / token: K/V "
                "bytes held per context token; kept: share of context slots held.",
            )
        )
    return out


def _paired_table(rows: list[dict], specs: list[Any], s: dict[str, Any], seed: int) -> Table:
    """Every cache minus the full cache, per length: the paired per-trial accuracy difference (pooled over
    tasks) with its interval and what it says."""
    out = []
    for length in s["lengths"]:
        at = [r for r in rows if r["length"] == length]
        for sp in (sp for sp in specs if sp.kind != "full"):  # in the run's order: policies, then codecs
            d = paired(at, sp.spec, "full", "score", seed)
            iv = format_interval(d, digits=2, signed=True) if d else "–"
            says = side(d) if d and d["low"] is not None else "cannot decide"
            out.append([length, sp.spec, d["n"] if d else 0, iv, says])
    return Table(
        "Each cache minus the full cache (accuracy, paired per trial, all tasks pooled)",
        ["length", "cache", "n", "accuracy − full [95% CI]", "its interval"],
        out,
        caption="The difference of exact-match scores on the same trial (the same tokens), mean with a 95% "
        f"paired score interval (Tango's) over trials; fewer than {MIN_SAMPLES} trials: no interval. KL and top-1 are "
        "already measured against the full cache, trial by trial (tables below).",
    )


def _panels(s: dict[str, Any]) -> list[str]:
    """The tasks shown one by one, and "all" (pooled) when there are several."""
    return [*s["tasks"], "all"] if len(s["tasks"]) > 1 else list(s["tasks"])


def _order(p: dict) -> tuple:
    return ({"full": 0, "evict": 1, "window": 1, "quant": 2}.get(p["kind"], 3), p["method"], p["ratio"])


def _curves(pts: list[dict], method: str, task: str, length: int) -> list[dict]:
    """A policy's points over its ratios (sorted), with the full cache as ratio 0."""
    sel = [p for p in pts if (p["task"], p["length"]) == (task, length)]
    full = [dict(p, ratio=0.0) for p in sel if p["kind"] == "full"]
    return full + sorted(
        (p for p in sel if p["method"] == method and p["kind"] == "evict"), key=lambda p: p["ratio"]
    )


def _accuracy_figure(ctx: ExperimentContext, pts: list[dict], s: dict[str, Any]):
    tasks, lengths = _panels(s), s["lengths"]
    fig, axes = subplots(
        len(lengths), len(tasks), figsize=(2.6 * len(tasks) + 1, 2.6 * len(lengths)), squeeze=False
    )
    for i, length in enumerate(lengths):
        for j, task in enumerate(tasks):
            ax = axes[i][j]
            for method in map(_method_of, s["policies"]):
                c = _curves(pts, method, task, length)
                if len(c) < 2:
                    continue
                x = np.array([p["ratio"] for p in c])
                y = np.array([_v(p, "accuracy") for p in c])
                (line,) = ax.plot(x, y, "o-", ms=3, lw=1.2, label=method)
                lo = [
                    p["accuracy"]["low"] if p["accuracy"]["low"] is not None else y[k]
                    for k, p in enumerate(c)
                ]
                hi = [
                    p["accuracy"]["high"] if p["accuracy"]["high"] is not None else y[k]
                    for k, p in enumerate(c)
                ]
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(f"{'all tasks' if task == 'all' else task}, {length} tok", fontsize=8)
            ax.grid(alpha=0.3)
            ax.set_xlabel("fraction removed", fontsize=7)
            if j == 0:
                ax.set_ylabel("accuracy", fontsize=8)
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"{ctx.handle().name}: accuracy vs compression ratio ({s['trials']} trials per point)")
    return ctx.figure(
        "accuracy_vs_ratio",
        fig,
        "Accuracy per eviction policy against the fraction of the context removed (ratio 0: the full "
        "cache), with 95% Wilson bands over trials; every policy answers the same trials.",
    )


def _method_of(policy: str) -> str:
    """The score a policy name stands for (``keynorm`` -> ``knorm``, ``window`` -> ``streaming_llm``,
    ``h2o,sinks=4`` -> ``h2o``)."""
    from kvlab.eval.specs import bare_score, parse_cache_spec

    base = bare_score(policy)
    return parse_cache_spec(f"{base},ratio=0.5").method if base else policy.strip().lower()


def _kl_figure(ctx: ExperimentContext, pts: list[dict], s: dict[str, Any]):
    lengths = s["lengths"]
    fig, axes = subplots(1, len(lengths), figsize=(5.5 * len(lengths), 3.8), squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        sel = [p for p in pts if p["task"] == "all" and p["length"] == length]
        for group in dict.fromkeys((p["kind"], p["method"]) for p in sel if p["kind"] != "full"):
            g = sorted(
                (p for p in sel if (p["kind"], p["method"]) == group), key=lambda p: -p["bytes_per_token"]
            )
            x = np.array([p["bytes_per_token"] for p in g])
            y = np.array([max(_v(p, "kld"), 1e-6) for p in g])
            lo = np.array([max(p["kld"]["low"] or y[k], 1e-6) if p["kld"] else y[k] for k, p in enumerate(g)])
            hi = np.array([p["kld"]["high"] or y[k] if p["kld"] else y[k] for k, p in enumerate(g)])
            label = g[0]["cache"] if group[0] == "quant" else group[1]
            ax.errorbar(
                x,
                y,
                yerr=[np.maximum(y - lo, 0), np.maximum(hi - y, 0)],
                fmt="s--" if group[0] == "quant" else "o-",
                ms=4,
                capsize=2,
                lw=1,
                label=label,
            )
        for p in sel:
            if p["kind"] == "full":
                ax.axvline(p["bytes_per_token"], color="grey", ls=":", lw=1, label="full cache")
        ax.axhline(INT4_KL_NEAR_ZERO, color="k", ls="--", lw=0.6, label=f"{INT4_KL_NEAR_ZERO} nats")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("K/V bytes per context token")
        ax.set_ylabel("KL(full || cache), nats/token")
        ax.set_title(f"{length} tokens, all tasks", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    return ctx.figure(
        "kl_vs_bytes",
        fig,
        "Mean per-token KL divergence to the full cache against the K/V bytes held per context token "
        "(pooled over tasks; eviction policies over their ratios, codecs as squares; 95% intervals).",
    )


# -- the claims ---------------------------------------------------------------------------------
#: a claim's verdict when a paired difference it needs has fewer than MIN_SAMPLES trials (no interval)
UNDECIDED = "cannot decide"


def _pooled(rows: list[dict], spec: str, key: str, seed: int) -> dict | None:
    """One cache's mean of ``key`` over every task, length and trial, with its interval."""
    return mean_iv([r[key] for r in rows if r["spec"] == spec], seed, proportion=key in PROPORTIONS)


def paired(rows: list[dict], a: str, b: str, key: str, seed: int) -> dict | None:
    """Mean of cache ``a``'s ``key`` minus cache ``b``'s over the trials both ran (a trial, with its task and
    length, is one pair: the same tokens), with its 95% interval (JSON): for a share (accuracy, top-1) Tango's
    paired score interval (:func:`~kvlab.metrics.stats.paired_share_ci`, not a point when every pair ties),
    else a bootstrap of the differences; None when no trial has both finite; no interval from fewer than
    :data:`MIN_SAMPLES` pairs."""
    x = {(r["task"], r["length"], r["trial"]): float(r[key]) for r in rows if r["spec"] == a}
    y = {(r["task"], r["length"], r["trial"]): float(r[key]) for r in rows if r["spec"] == b}
    keys = [k for k in sorted(x.keys() & y.keys()) if np.isfinite(x[k]) and np.isfinite(y[k])]
    if not keys:
        return None
    if key in PROPORTIONS:
        return paired_share_ci([x[k] for k in keys], [y[k] for k in keys]).to_json()
    return bootstrap_ci([x[k] - y[k] for k in keys], seed=seed).to_json()


def _diff_text(d: dict | None, label: str, digits: int = 3) -> str:
    """``paired h2o − snapkv +0.1 [+0.02, +0.18] (n = 20): above 0``, or ``... +0.5 (n = 2, no interval)``."""
    if d is None:
        return f"{label}: no common trials"
    text = f"{label} {format_interval(d, digits=digits, signed=True)}"
    return text if d.get("low") is None else f"{text}: {side(d)}"


def record(
    cid: str, claim: str, verdict: str, measured: str, rule: str, key: dict | None = None, outcome: str = ""
) -> dict:
    """A claim's record, in the shape of :mod:`findings`': its ``outcome`` (holds / does not hold / cannot
    decide / not tested here) is the ``verdict`` unless given."""
    return {
        "id": cid,
        "claim": claim,
        "verdict": verdict,
        "outcome": outcome or verdict,
        "measured": measured,
        "rule": rule,
        "key": key,
    }


def claim_h2o(rows: list[dict], specs: list[Any], seed: int, by: str) -> dict:
    """ "H2O is best at 50%" by accuracy (``by="score"``, higher is better) or KL (``by="kld"``, lower): the
    paired per-trial difference between H2O and the best other policy."""
    what = "accuracy" if by == "score" else "KL"
    cid, claim = f"h2o_best_{what.lower()}", f"H2O is best at {CLAIM_RATIO:.0%} (by {what})"
    good = "above" if by == "score" else "below"
    rule = (
        f"the paired per-trial difference of {what} (H2O minus the runner-up: the other eviction policy with "
        f"the {'highest' if by == 'score' else 'lowest'} mean {what}), both at ratio {CLAIM_RATIO}, over the "
        f"same trials of every task and length: holds when its 95% paired interval lies wholly {good} 0, "
        f"does not hold otherwise; fewer than {MIN_SAMPLES} trials give no interval: cannot decide"
    )
    at = {s.method: s.spec for s in specs if s.kind == "evict" and abs(s.ratio - CLAIM_RATIO) < 1e-9}
    if "h2o" not in at or len(at) < 2:
        return record(cid, claim, "not tested here", "needs h2o and another policy at 0.5", rule)
    ivs = {m: _pooled(rows, spec, by, seed) for m, spec in at.items()}
    sign = 1.0 if by == "score" else -1.0
    ranked = sorted(ivs, key=lambda m: (-sign * _val(ivs[m]), m != "h2o"))
    other = next(m for m in ranked if m != "h2o")
    diff = paired(rows, at["h2o"], at[other], by, seed)
    where = side(diff)
    verdict = (
        UNDECIDED
        if diff is None or diff["low"] is None
        else "holds"
        if where == good + " 0"
        else "does not hold"
    )
    measured = (
        f"h2o {format_interval(ivs['h2o'])} vs runner-up {other} {format_interval(ivs[other])}; "
        + _diff_text(diff, f"paired h2o − {other}")
    )
    unit = " (nats/token)" if by == "kld" else ""
    key = {**(diff or {}), "samples": "trials (pairs)", "label": f"H2O minus {other}, {what}{unit}"}
    rec = record(cid, claim, verdict, measured, rule, key)
    rec.update(best=ranked[0], runner_up=other, difference=diff, by_policy=ivs)
    return rec


def claim_int4(rows: list[dict], specs: list[Any], seed: int) -> dict:
    """ "int4 costs almost nothing": mean KL < 0.01 nats, and no accuracy cost the paired per-trial
    difference to the full cache can see."""
    claim = "int4 costs almost nothing"
    rule = (
        f"int4's mean per-token KL to the full cache < {INT4_KL_NEAR_ZERO} nats, and the paired per-trial "
        "accuracy difference int4 minus full over the same trials of every task and length has a 95% "
        "paired interval (Tango's) that contains 0 or lies above it (no accuracy cost the paired test can see); "
        f"fewer than {MIN_SAMPLES} trials give no interval: cannot decide"
    )
    spec = next((s.spec for s in specs if s.kind == "quant" and s.policy.spec == "codec=pertoken4"), None)
    if spec is None:
        return record("int4_free", claim, "not tested here", "int4 was not run", rule)
    kl, acc = _pooled(rows, spec, "kld", seed), _pooled(rows, spec, "score", seed)
    full = _pooled(rows, "full", "score", seed)
    diff = paired(rows, spec, "full", "score", seed)
    if full is None or diff is None:
        raise ValueError("the full cache has no finite score on int4's trials to compare int4's with")
    kl_ok, acc_ok = _val(kl) < INT4_KL_NEAR_ZERO, side(diff) in ("contains 0", "above 0")
    decided = diff["low"] is not None and kl is not None and kl["low"] is not None
    verdict = UNDECIDED if not decided else "holds" if kl_ok and acc_ok else "does not hold"
    measured = (
        f"KL {format_interval(kl)} nats ({'<' if kl_ok else '>='} {INT4_KL_NEAR_ZERO}); accuracy "
        f"{format_interval(acc)} vs full {format_interval(full)}; "
        + _diff_text(diff, "paired int4 − full accuracy", digits=2)
    )
    key = {**diff, "samples": "trials (pairs)", "label": "int4 minus full, accuracy"}
    rec = record("int4_free", claim, verdict, measured, rule, key)
    rec.update(kld=kl, accuracy=acc, full_accuracy=full, accuracy_difference=diff)
    rec.update(kl_ok=kl_ok, accuracy_ok=acc_ok)
    return rec


def _steps(rows: list[dict], specs: list[Any], method: str, seed: int) -> list[tuple[str, dict | None]]:
    """A policy's curve from the full cache through its ratios: each step's paired accuracy difference
    (the higher ratio minus the lower, on ``rows``' trials), labelled ``0.25→0.5``."""
    curve = [("0", "full")] + sorted(
        (f"{s.ratio:g}", s.spec) for s in specs if s.kind == "evict" and s.method == method
    )
    return [
        (f"{ra}→{rb}", paired(rows, b, a, "score", seed))
        for (ra, a), (rb, b) in zip(curve, curve[1:], strict=False)
    ]


def claim_monotone(rows: list[dict], specs: list[Any], s: dict[str, Any], seed: int) -> dict:
    """ "Scores fall steadily with the ratio": no step of a policy's curve (the full cache as ratio 0, then
    each ratio) raises accuracy by a paired difference the test can see, at every length; per task too."""
    claim = "Scores fall steadily with the ratio"
    rule = (
        "per policy and length, each step from the full cache (ratio 0) through every ratio: the paired "
        "per-trial accuracy difference (higher ratio minus lower, same trials, pooled over tasks); does not "
        "hold when some step's 95% bootstrap interval lies wholly above 0 (a rise), holds when every step's "
        f"interval contains 0 or lies below it; a step with fewer than {MIN_SAMPLES} trials has no interval: "
        "cannot decide (unless another step rises); per-task steps that rise are counted"
    )
    rising, undecided, per_task_rising, n_steps = [], 0, [], 0
    for length in s["lengths"]:
        at = [r for r in rows if r["length"] == length]
        for m in map(_method_of, s["policies"]):
            for step, d in _steps(at, specs, m, seed):
                n_steps += 1
                rising += [f"{m} {step} at {length}"] if side(d) == "above 0" else []
                undecided += side(d) not in ("above 0", "below 0", "contains 0")
            for task in s["tasks"]:
                on = [r for r in at if r["task"] == task]
                per_task_rising += [
                    f"{m} {st} on {task} at {length}"
                    for st, d in _steps(on, specs, m, seed)
                    if side(d) == "above 0"
                ]
    if n_steps == 0:
        return record("monotone", claim, "not tested here", "no eviction policy was run", rule)
    verdict = "does not hold" if rising else UNDECIDED if undecided else "holds"
    measured = (
        f"of {n_steps} pooled steps, {len(rising)} rise (paired interval above 0)"
        + (f" ({', '.join(rising)})" if rising else "")
        + f", {n_steps - len(rising) - undecided} do not"
        + (f", {undecided} have fewer than {MIN_SAMPLES} trials (no interval)" if undecided else "")
        + f"; per task, {len(per_task_rising)} step(s) rise"
    )
    rec = record("monotone", claim, verdict, measured, rule)
    rec.update(rising=rising, per_task_rising=per_task_rising, steps=n_steps)
    return rec


def _val(interval: dict | None) -> float:
    return float("nan") if interval is None else float(interval["value"])


def _arrays(rows: list[dict]) -> dict[str, np.ndarray]:
    """The raw per-trial table, one array per column (one row per trial and cache)."""
    cols = {"cache": "spec", "task": "task", "length": "length", "trial": "trial", "score": "score"}
    cols.update(kld="kld", top1="top1", kld_answer="kld_answer", kv_bytes="kv_bytes")
    cols.update(context_tokens="context_tokens", kept_slots="kept_slots")
    out = {name: np.array([r[key] for r in rows]) for name, key in cols.items()}
    out["cache"], out["task"] = out["cache"].astype(str), out["task"].astype(str)
    return out


def haystack(text_file: str | Path | None, result: ExperimentResult) -> str | None:
    """The text facts are hidden in (None: kvlab's default), named in ``result``'s data sources."""
    if text_file is None:
        result.data_sources.append("haystack: kvlab's default long text (kvlab.eval.tasks)")
        return None
    from kvlab.data import read_text_file

    text = read_text_file(text_file)
    result.data_sources.append(f"haystack: {text.source}")
    return text.text


def run_trials(
    ctx: ExperimentContext, s: dict, specs: list, hay: str | None, label: str, **extra: Any
) -> list[dict]:
    """:func:`kvlab.eval.run.run_suite` over the settings' tasks x lengths x trials on the context's model, one
    progress step per trial (``extra``: more of its options, e.g. ``positions``)."""
    from kvlab.eval.run import run_suite

    total = len(s["tasks"]) * len(s["lengths"]) * s["trials"]
    with ctx.progress.task(label, total=total) as advance:
        return run_suite(
            ctx.handle(),
            specs,
            tasks=s["tasks"],
            lengths=s["lengths"],
            trials=s["trials"],
            seed=ctx.seed,
            haystack_text=hay,
            max_new_tokens=s["max_new_tokens"],
            progress=lambda done, n: advance(1),
            **extra,
        )


def run(ctx: ExperimentContext, *, text_file: str | Path | None = None, **opts: Any) -> ExperimentResult:
    from kvlab.errors import BadInputError

    unknown = set(opts) - {"tasks", "lengths", "trials", "policies", "ratios", "codecs", "max_new_tokens"}
    if unknown:
        raise BadInputError(f"ruler: unknown option(s) {', '.join(sorted(unknown))}")
    result = EXPERIMENT.result(__doc__)
    s = settings(ctx, opts)
    specs = _specs(s)
    hay = haystack(text_file, result)
    rows = run_trials(ctx, s, specs, hay, f"ruler: {len(specs)} caches")
    pts = points(rows, specs, ctx.seed)
    claims = [
        claim_h2o(rows, specs, ctx.seed, "score"),
        claim_h2o(rows, specs, ctx.seed, "kld"),
        claim_int4(rows, specs, ctx.seed),
        claim_monotone(rows, specs, s, ctx.seed),
    ]
    result.tables += [_verdict_table(claims), _paired_table(rows, specs, s, ctx.seed), *_tables(pts, s)]
    result.figures += [_accuracy_figure(ctx, pts, s), _kl_figure(ctx, pts, s)]
    result.arrays.update(_arrays(rows))
    result.notes += [f"{c['claim']}: {c['verdict']} — {c['measured']}." for c in claims]
    if s["max_new_tokens"]:
        result.notes.append(f"answers are cut at {s['max_new_tokens']} new tokens (this profile's budget)")
    result.summary.update(
        settings={**s, "caches": [sp.spec for sp in specs], "seed": ctx.seed, "model": ctx.handle().name},
        points=pts,
        claims=claims,
        verdicts={c["id"]: c["verdict"] for c in claims},
    )
    return result


def claims_table(claims: list[dict], caption: str) -> Table:
    """The claims checked, one row each: claim, verdict, measured, rule (``caption`` says how)."""
    rows = [[c["claim"], c["verdict"], c["measured"], c["rule"]] for c in claims]
    return Table("Claims checked", ["claim", "verdict", "measured", "rule"], rows, caption=caption)


def _verdict_table(claims: list[dict]) -> Table:
    return claims_table(
        claims,
        "Each claim's verdict from this run's numbers, by the rule in its row. Every comparison of "
        "two caches is a paired difference over the trials both ran (the same tokens), its mean with a 95% "
        f"bootstrap interval over trials; fewer than {MIN_SAMPLES} trials give no interval, and a verdict that "
        "needs one cannot decide. A cache's own accuracy: Wilson interval; its KL: bootstrap.",
    )


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    claims = s.get("claims", [])
    pooled = [p for p in s.get("points", []) if p["task"] == "all"]
    shown = [
        p
        for p in sorted(pooled, key=lambda p: (p["length"], _order(p)))
        if p["accuracy"] is not None and (p["kind"] != "evict" or abs(p["ratio"] - CLAIM_RATIO) < 1e-9)
    ]
    rows = [(f"{p['cache']}, {p['length']} tokens: accuracy", format_interval(p["accuracy"])) for p in shown]
    rows += [
        (f"{p['cache']}, {p['length']} tokens: KL to full (nats/token)", format_interval(p["kld"]))
        for p in shown
        if p["kind"] != "full" and p["kld"] is not None
    ]
    held = [c["claim"] for c in claims if c["verdict"] == "holds"]
    failed = [c["claim"] for c in claims if c["verdict"] == "does not hold"]
    open_ = [c["claim"] for c in claims if c["verdict"] == UNDECIDED]
    text = (
        f"On RULER-style tasks, of {len(claims)} claims {len(held)} hold"
        + (f" ({'; '.join(held)})" if held else "")
        + f" and {len(failed)} do not"
        + (f" ({'; '.join(failed)})" if failed else "")
        + (f"; {len(open_)} cannot be decided (too few trials for a paired interval)" if open_ else "")
        + "."
    )
    return text, rows


EXPERIMENT = Experiment(
    name="ruler",
    title="RULER-style accuracy vs compression ratio, and KL to the full cache",
    run=run,
    order=48,
    describe=describe,
    description="RULER-style long-context tasks under eviction policies at several ratios and codecs: "
    "accuracy with intervals, KL and top-1 to the full cache, bytes per token; verdicts on three claims.",
    seed_changes="which trials are generated (needle keys and values, depths, haystack stretches)",
)
