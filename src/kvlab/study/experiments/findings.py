"""The thread's claims about rolling a context window, each checked against what kvlab measured.

Reads the summaries of ``roll_sweep``, ``roll_long`` and ``rope_derotation`` from the same study
folder when they exist (else runs them here at the current profile), measures the attention-row
claim itself (last query's attention over aligned slots, with and without the new sink), and
computes a verdict for each claim from the numbers with the rules in the table caption.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlab.errors import BadInputError
from kvlab.metrics import spectral as S
from kvlab.metrics.stats import MIN_SAMPLES, bootstrap_ci
from kvlab.study.experiments import _rolling as R
from kvlab.study.experiments import needed
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Progress
from kvlab.study.report.format import format_interval, side_of_zero
from kvlab.study.report.plots import plot_band, style, subplots

SOURCES = ("roll_sweep", "roll_long", "rope_derotation")
ATTN_ROLLS = (1, 5, 20)


def _last_rows(model: Any, rows: list[list[int]], batch: int = 8) -> np.ndarray:
    """The last query's attention over every slot, ``[W, layers, q_heads, T]`` (batched eager prefills)."""
    out = []
    for i in range(0, len(rows), batch):
        att = model.prefill(rows[i : i + batch], output_attentions=True, all_logits=False).attentions
        out.append(np.stack([a[:, :, -1, :].double().numpy() for a in att], axis=1))
    return np.concatenate(out)


def attention_rows(
    model: Any, windows: list[list[int]], ns: tuple[int, ...], progress: Progress
) -> dict[str, np.ndarray]:
    """Cosine of the last query's attention row, original vs rolled, per layer: ``[W, len(ns), layers]``.

    ``with_sink`` compares the rows over all aligned slots (the rolled row's slot 0 is its new sink);
    ``without_sink`` drops that aligned pair. ``sink_mass_*`` is the attention on slot 0 of each cache.
    """
    with progress.task("findings: attention rows", total=len(ns) + 1) as advance, model.eager_attention():
        orig = _last_rows(model, windows)  # [W, L, Hq, T]
        advance(1)
        out = {
            k: np.zeros((len(windows), len(ns), orig.shape[1]))
            for k in ("with_sink", "without_sink", "sink_mass_rolled")
        }
        out["sink_mass_original"] = orig[..., 0].mean(-1)
        for j, n in enumerate(ns):
            rolled = _last_rows(model, [ids[n:] for ids in windows])  # [W, L, Hq, T-n]
            a = orig[..., n:]
            for key, (x, y) in (("with_sink", (a, rolled)), ("without_sink", (a[..., 1:], rolled[..., 1:]))):
                cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1) + 1e-300)
                out[key][:, j] = cos.mean(-1)
            out["sink_mass_rolled"][:, j] = rolled[..., 0].mean(-1)
            advance(1)
    return out


def _iv(d: dict) -> str:
    """``value [low, high]``, or the value and why there is no interval (fewer than 2 samples)."""
    if d.get("low") is None or d.get("high") is None:
        return f"{d['value']:.3f} (n = {d.get('n', 1)}, no interval)"
    return f"{d['value']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


#: The thread's claims, in the order the report lists them: (id, claim, sections holding the evidence).
CLAIMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("k_drift_is_rope", "K drift under a roll is RoPE (position), not content", ("rope_derotation",)),
    (
        "derotation_null",
        "De-rotating keys does not restore similarity (the thread's null)",
        ("rope_derotation",),
    ),
    ("v_stable", "V barely changes under a roll", ("roll_long", "rope_derotation", "roll_sweep")),
    ("control_order", "unrelated < scrambled < rolled", ("roll_sweep",)),
    (
        "constant_offset",
        "The roll - truncate gap (last position, raw K) is a constant offset",
        ("roll_long",),
    ),
    (
        "attention_disrupted",
        "A roll disrupts attention (low attention-row cosine at every n)",
        ("findings", "attention"),
    ),
)
#: What each fine-grained verdict means for the claim (the first screen's three outcomes).
OUTCOME = {
    "holds": "holds",
    "cannot decide": "cannot decide",
    "does not hold": "does not hold",
    "artefact": "does not hold",
    "not applicable": "not tested here",
    "not tested here": "not tested here",
}


def _claim(
    cid: str, measured: str, thread: str, verdict: str, rule: str, key: dict | None, what: str
) -> dict[str, Any]:
    """One claim's record: the table row's fields, the outcome, and the key number with its samples."""
    claim, evidence = next((c, e) for i, c, e in CLAIMS if i == cid)
    return {
        "id": cid,
        "claim": claim,
        "measured": measured,
        "thread": thread,
        "verdict": verdict,
        "outcome": OUTCOME[verdict],
        "rule": rule,
        "evidence": list(evidence),
        "key": None if key is None else {**key, "label": what},
    }


def claims(sweep: dict, long: dict, derot: dict, attn: dict, ref: R.Reference, rope: Any) -> list[dict]:
    """One record per claim of :data:`CLAIMS`; a claim whose data this run lacks is "not tested here"."""
    ref14 = ref.get("orig_14b_base_results")
    found = {
        c["id"]: c
        for c in (
            *_claims_rope(derot, rope),
            *_claim_v(sweep, long, derot, ref14),
            *_claim_order(sweep, ref14),
            *_claim_offset(long, ref),
            *_claim_attention(attn, ref),
        )
    }
    return [
        found.get(cid)
        or _claim(cid, "—", "—", "not tested here", "its experiment did not run or has no result", None, "")
        for cid, _, _ in CLAIMS
    ]


def claim_rows(records: list[dict]) -> list[list[Any]]:
    """The findings table: claim, measured, thread's number, verdict, rule."""
    return [[c["claim"], c["measured"], c["thread"], c["verdict"], c["rule"]] for c in records]


def _claims_rope(derot: dict, rope: Any) -> list[dict]:
    """Records for the claims: K drift is RoPE, and the thread's de-rotation null."""
    out: list[dict] = []
    if derot:
        kd_min, k_max = derot["derotated_k_min_small_rolls"], derot["raw_k_max_small_rolls"]
        rolls = derot["rolls"]
        n_small, n_big = min(rolls, key=int), max(rolls, key=int)
        raw_big = rolls[n_big]["k"]["value"]
        holds = kd_min >= 0.99 and raw_big <= kd_min - 0.02
        blocks = f"blocks of a {derot['context_tokens']}-token context"
        out.append(
            _claim(
                "k_drift_is_rope",
                f"de-rotated K >= {kd_min:.4f} for n={n_small}..{n_big} vs raw {k_max:.3f}..{raw_big:.3f} "
                f"({derot['context_tokens']} tokens); RoPE-only predictor R² {derot['b3_r2_mean']:.3f}, "
                f"× de-rotated cosine R² {derot['b3_r2_mean_times_content']:.3f}",
                "suspected; its de-rotation test showed no recovery",
                "holds" if holds else "does not hold",
                f"holds if de-rotated K >= 0.99 for every n <= {n_big} and raw K at n={n_big} is >= 0.02 lower",
                {**rolls[n_big]["kd"], "samples": blocks},
                f"de-rotated K cosine, roll {n_big}",
            )
        )
        bug = derot["buggy_minus_raw_max_abs"]
        gains = [e["kd"]["value"] - e["k"]["value"] for e in rolls.values()]
        artefact = bug < 1e-6 and min(gains) > 0.005
        out.append(
            _claim(
                "derotation_null",
                f"thread's mode equals raw to {bug:.1e}; correct de-rotation raises K by "
                f"{min(gains):+.4f}..{max(gains):+.4f} (n={n_small}..{n_big})",
                "null: de-rotated ≈ raw",
                "artefact" if artefact else "holds",
                "artefact if the buggy mode reproduces raw (< 1e-6) while correct de-rotation raises K by > 0.005 at every n",
                {**rolls[n_small]["kd"], "samples": blocks},
                f"correctly de-rotated K cosine, roll {n_small} (raw {rolls[n_small]['k']['value']:.3f})",
            )
        )
    elif rope is None:
        out.append(_claim("k_drift_is_rope", "model has no RoPE", "—", "not applicable", "—", None, ""))
    return out


def _claim_v(sweep: dict, long: dict, derot: dict, ref14: Any) -> list[dict]:
    """Record for the claim: V barely changes under a roll."""
    if not (sweep and long):
        return []
    shown = [n for n in (1, 5, 20) if str(n) in long["roll_mean"] and f"roll_{n}" in sweep["conditions"]]
    v_short = [sweep["conditions"][f"roll_{n}"]["v_x0"] for n in shown]
    v_long = [long["roll_mean"][str(n)]["v"] for n in shown]
    k_long = [long["roll_mean"][str(n)]["k"] for n in shown]
    thread = (
        "/".join(f"{ref14[f'roll_{n}']['cos_v']['mean']:.3f}" for n in (1, 5, 20))
        + " (Qwen2.5-14B, 87 tokens)"
        if ref14
        else "—"
    )
    holds = min(v_long) >= 0.95 and all(v >= k for v, k in zip(v_long, k_long, strict=True))
    n_last = shown[-1]
    if derot and str(n_last) in derot.get("rolls", {}):  # the same long context, with its blocks' interval
        key = {
            **derot["rolls"][str(n_last)]["v"],
            "samples": f"blocks of a {derot['context_tokens']}-token context",
        }
    else:
        key = {**v_short[-1], "samples": f"text samples of {sweep['context_tokens']} tokens"}
    return [
        _claim(
            "v_stable",
            f"cos V at n={'/'.join(map(str, shown))}: {'/'.join(f'{v:.3f}' for v in v_long)} ({long['context_tokens']} tokens), "
            f"{'/'.join(format(v['value'], '.3f') for v in v_short)} ({sweep['context_tokens']} tokens)",
            thread,
            "holds" if holds else "does not hold",
            f"holds if long-context cos V >= 0.95 for n = {'/'.join(map(str, shown))} and V >= raw K at each",
            key,
            f"V cosine, roll {n_last}",
        )
    ]


def _claim_order(sweep: dict, ref14: Any) -> list[dict]:
    """Record for the claim: unrelated < scrambled < rolled, each step a paired per-text-sample difference."""
    if not sweep:
        return []
    c, diffs = sweep["conditions"], sweep.get("control_order_paired")
    thread = (
        "K " + " < ".join(f"{ref14[k]['cos_k']['mean']:.3f}" for k in ("unrelated", "scrambled", "roll_20"))
        if ref14
        else "—"
    )
    rule = (
        "holds if, for both K and V, the paired per-text-sample differences scrambled − unrelated and roll 20 − "
        f"scrambled (each against the same original window) have 95% bootstrap intervals wholly above 0 over "
        f"{sweep['windows']} text samples; fewer than {MIN_SAMPLES}: no interval, cannot decide"
    )
    if diffs is None:  # a roll_sweep result from before the paired differences
        measured = "roll_sweep's result has no paired differences (re-run roll_sweep)"
        return [_claim("control_order", measured, thread, "not tested here", rule, None, "")]
    parts, sides = [], []
    for m in ("k", "v"):
        u, s, r = (c[k][f"{m}_x0"] for k in ("unrelated", "scrambled", "roll_20"))
        steps = [
            (name, diffs[key][m])
            for name, key in (("s − u", "scrambled-unrelated"), ("r − s", "roll_20-scrambled"))
        ]
        sides += [side_of_zero(d) for _, d in steps]
        paired = ", ".join(f"{name} {format_interval(d, signed=True)}" for name, d in steps)
        parts.append(f"{m.upper()}: {_iv(u)} < {_iv(s)} < {_iv(r)} (paired {paired})")
    verdict = (
        "cannot decide"
        if any(x not in ("above 0", "below 0", "contains 0") for x in sides)
        else "holds"
        if all(x == "above 0" for x in sides)
        else "does not hold"
    )
    return [
        _claim(
            "control_order",
            "; ".join(parts) + " (u/s/r: unrelated / scrambled / roll 20)",
            thread,
            verdict,
            rule,
            {
                **diffs["roll_20-scrambled"]["k"],
                "samples": f"text samples of {sweep['context_tokens']} tokens",
            },
            "roll 20 minus scrambled, raw K cosine (paired per text sample)",
        )
    ]


def _claim_offset(long: dict, ref: R.Reference) -> list[dict]:
    """Record for the claim: the roll - truncate offset is constant."""
    if not long:
        return []
    reg = long["regression"]["difference"]
    offset, change = long["mean_difference_roll_minus_truncate"], long["difference_change_over_range"]
    holds = abs(change) < 0.25 * abs(offset)
    d = ref.get("results_14b_base_roll_truncate")
    if d:
        fit = S.linear_fit(np.asarray(d["ns"]), np.asarray(d["roll_last_k"]) - np.asarray(d["trunc_last_k"]))
        thread = (
            f"offset {np.mean(np.asarray(d['roll_last_k']) - np.asarray(d['trunc_last_k'])):.3f}, "
            f"slope {fit.slope:.1e}/token, R² {fit.r2:.3f} (Qwen2.5-14B, 2,000 tokens, step 5)"
        )
    else:
        thread = "—"
    by_end = long.get("difference_by_window_end")
    key = None if by_end is None else {**by_end, "samples": "window ends (a few tokens apart: correlated)"}
    return [
        _claim(
            "constant_offset",
            f"mean offset {offset:.3f}, slope {reg['slope']:.1e}/token (change {change:+.3f} over the range), "
            f"R² {reg['r2']:.3f} over {reg.get('n', len(long['roll_amounts']))} roll amounts; {long['aliasing']}",
            thread,
            "holds" if holds else "does not hold",
            "holds if the fitted line changes the difference by < 25% of its mean across the sampled rolls",
            key,
            f"roll − truncate raw K cosine, mean over rolls (change over the range {change:+.3f})",
        )
    ]


def _claim_attention(attn: dict, ref: R.Reference) -> list[dict]:
    """Record for the claim: a roll disrupts attention."""
    if not attn:
        return []
    w, wo = attn["with_sink"].mean(-1), attn["without_sink"].mean(-1)  # [W, N]
    iw, iwo = bootstrap_ci(w.mean(1)), bootstrap_ci(wo.mean(1))
    d = ref.get("results_attention_results_attn_attention_results")
    said = ref.brief.get("attention_row_cosine")
    parts = [f"≈{said} at every roll (research brief)"] if said is not None else []
    if d:
        parts.append(
            "reference file: layer-mean cosine "
            + "/".join(
                f"{np.mean(d['attention'][f'roll_{n}']['cosine_sim']):.2f}"
                for n in ATTN_ROLLS
                if f"roll_{n}" in d["attention"]
            )
        )
    thread = "; ".join(parts) or "—"
    verdict = (
        "does not hold"
        if iw.value >= 0.8
        else "artefact"
        if iwo.value >= 0.8 and iwo.value - iw.value > 0.1
        else "holds"
    )
    return [
        _claim(
            "attention_disrupted",
            f"last-query row cosine with the new sink {_iv(iw.to_json())}, without it {_iv(iwo.to_json())} "
            f"(mean over layers, n={'/'.join(map(str, ATTN_ROLLS))}, {w.shape[0]} text samples)",
            thread,
            verdict,
            "does not hold if the cosine with the sink is >= 0.8; artefact if it is low but >= 0.8 and 0.1 "
            "higher once the new sink's slot is dropped; else holds",
            {**iwo.to_json(), "samples": f"text samples of {int(attn['tokens'])} tokens"},
            f"attention-row cosine without the new sink (with it: {iw.value:.3f})",
        )
    ]


def _attention_figure(ctx: ExperimentContext, attn: dict, name: str) -> Any:
    fig, axes = subplots(1, 2, figsize=(12, 4))
    L = attn["with_sink"].shape[-1]
    for j, n in enumerate(ATTN_ROLLS):
        plot_band(
            axes[0], np.arange(L), attn["with_sink"][:, j], f"roll {n}, with the new sink", color=f"C{j}"
        )
        plot_band(
            axes[0], np.arange(L), attn["without_sink"][:, j], f"roll {n}, without it", color=f"C{j}", ls="--"
        )
    style(axes[0], "layer", "cosine of the last query's attention row", "Attention rows: original vs rolled")
    plot_band(axes[1], np.arange(L), attn["sink_mass_original"], "original: attention on slot 0", color="k")
    for j, n in enumerate(ATTN_ROLLS):
        plot_band(
            axes[1],
            np.arange(L),
            attn["sink_mass_rolled"][:, j],
            f"roll {n}: attention on its slot 0",
            color=f"C{j}",
        )
    style(axes[1], "layer", "attention mass on the first slot", "Sink mass, reported on its own")
    fig.suptitle(f"{name}: is the attention disruption the sink moving?")
    return fig


def run(
    ctx: ExperimentContext,
    *,
    text: str | None = None,
    attention_windows: int | None = None,
    attention_context: int | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    model = ctx.handle()
    got: dict[str, dict] = {}
    for name in SOURCES:
        if name == "rope_derotation" and model.rope is None:
            got[name] = {}
            continue
        got[name], how = needed(ctx, name, **({"text": text} if text else {}))
        result.data_sources.append(f"{name}: {how}")
    main = R.study_text(ctx, text)
    T = int(ctx.count("attention_context", attention_context, quick=64, default=128, full=128))
    W = int(ctx.count("attention_windows", attention_windows, quick=3, default=20, full=40))
    if max(ATTN_ROLLS) + 2 >= T:
        raise BadInputError(
            f"attention-row text samples need more than {max(ATTN_ROLLS) + 2} tokens, got {T}"
        )
    from kvlab.data import token_samples

    ids = R.encode_long(model, main, T * W, max_chars=T * W * 12)
    attn = attention_rows(model, token_samples(ids, T, W, seed=ctx.seed + 7), ATTN_ROLLS, ctx.progress)
    attn["tokens"] = np.asarray(T)
    ref = R.reference()
    records = claims(got["roll_sweep"], got["roll_long"], got["rope_derotation"], attn, ref, model.rope)
    result.table(
        "Findings",
        ["claim (thread)", f"measured on {model.name}", "thread's number", "verdict", "rule"],
        claim_rows(records),
        caption="Every verdict is computed from this run's numbers with the rule shown.",
    )
    result.summary = {
        "claims": records,
        "verdicts": {c["claim"]: c["verdict"] for c in records if c["verdict"] != "not tested here"},
        "attention": {
            "with_sink": bootstrap_ci(attn["with_sink"].mean((1, 2))).to_json(),
            "without_sink": bootstrap_ci(attn["without_sink"].mean((1, 2))).to_json(),
        },
    }
    result.arrays.update({f"attention_{k}": v for k, v in attn.items()})
    ctx.figure(
        "attention_rows",
        _attention_figure(ctx, attn, model.name),
        "Low attention-row cosine comes from the rolled cache's new sink; "
        "without that slot the rows agree (bands: bootstrap 95% over text samples).",
        into=result.figures,
    )
    result.data_sources.append(
        f"attention rows: {main.source}, {W} text samples of {T} tokens, rolls {ATTN_ROLLS}"
    )
    if ref.root is None:
        result.notes.append(ref.note + "; the claims have no thread numbers beside them.")
    else:
        result.data_sources.append(f"thread's numbers: {ref.source}")
    return result


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    records = s.get("claims") or [
        {"claim": c, "outcome": OUTCOME.get(v, v)} for c, v in (s.get("verdicts") or {}).items()
    ]
    count = {
        o: sum(1 for c in records if c["outcome"] == o)
        for o in ("holds", "does not hold", "cannot decide", "not tested here")
    }
    text = (
        f"Of the thread's {len(records)} claims, {count['holds']} hold, {count['does not hold']} do not"
        + (
            f", {count['cannot decide']} cannot be decided (too few samples)"
            if count["cannot decide"]
            else ""
        )
        + (f" and {count['not tested here']} were not tested here" if count["not tested here"] else "")
        + " (each verdict with its rule below)."
    )
    rows = [(c["claim"], c.get("verdict", c["outcome"])) for c in records]
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="the attention-row text samples, and through roll_sweep, roll_long and rope_derotation their samples",
    describe=describe,
    name="findings",
    title="Findings: the thread's claims, checked",
    run=run,
    order=95,
    needs=SOURCES,
    description="Each claim of the rolling-window thread with kvlab's number, the thread's, "
    "and a verdict computed from the results.",
)
