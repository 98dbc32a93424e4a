"""Does rolling the window change where the model looks and what it predicts? Sink-aware.

For many samples of a long text, the sample and the sample without its first n tokens are run
with eager attention. Attention rows of aligned queries are compared over aligned keys (original
slots n..T-1 against rolled 0..T-n-1), once with every aligned key and once without the first one
(the rolled run's new attention sink), each row renormalised. The sink mass is reported on its own.
Next-token logits at the last position are compared by cosine, Jensen-Shannon, KL and top-10 overlap.
A window against the next, unrelated window (same positions) gives the baseline.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.data import default_long_text, read_text_file, token_samples
from kvlab.errors import BadInputError
from kvlab.metrics import bootstrap_ci, js_divergence, kl_divergence, logit_cosine, topk_overlap
from kvlab.metrics.attention import (
    AttentionComparison,
    compare_attention_rows,
    roll_alignment,
    stack_attentions,
)
from kvlab.study.experiments._rolling import reference
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import format_number, iv, num
from kvlab.study.report.plots import colors, errorbars, shade, style, subplots

DEFAULT_ROLLS = (1, 5, 20)
TOPK_LOGITS = 10
TOPK_ATTENTION = 5
REFERENCE_NAME = "results_attention_results_attn_attention_results"  # the thread's result file
REFERENCE_PROMPT_TOKENS = 87  # the thread's attention run used its fixed 87-token prompt
#: the attention-row comparisons the table shows, with and without the new sink
ROW_COLUMNS = ("cos", "cos_rest", "js", "js_rest", "topk", "topk_rest")
ROW_METRICS = (*ROW_COLUMNS, "sink_a", "sink_b", "first_aligned_a", "aligned_mass_a")
LOGIT_METRICS = ("cos", "js", "kl", "topk")


def load_reference() -> dict[str, Any] | None:
    """The thread's attention/logit numbers (Qwen2.5-14B, one 87-token prompt), from kvlab's shipped copy."""
    doc = reference().get(REFERENCE_NAME)
    if doc is None:
        return None
    rolls = [int(n) for n in doc["roll_ns"]]
    att = {
        n: {m: np.asarray(v, dtype=np.float64) for m, v in doc["attention"][f"roll_{n}"].items()}
        for n in rolls
    }
    return {
        "rolls": rolls,
        "attention": att,
        "logit_cos": dict(zip(rolls, doc["logit_cos"], strict=True)),
        "top5_token_overlap": dict(zip(rolls, doc["top5_token_overlap"], strict=True)),
        "source": f"{REFERENCE_NAME}.json, as kvlab ships it (kvlab/study/data/thread_reference.json)",
    }


def _reduce(
    cmp: AttentionComparison, first_query: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per (layer, head): the mean over aligned queries from ``first_query`` on, and the last query's value."""
    means, last = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices stay NaN
        for m in ROW_METRICS:
            x = getattr(cmp, m)
            means[m] = np.nanmean(x[..., first_query:], axis=-1)
            last[m] = x[..., -1]
    return means, last


def _interval_str(iv) -> str:
    return iv.text(".4f")


def run(
    ctx: ExperimentContext,
    *,
    windows: int | None = None,
    window_tokens: int | None = None,
    rolls: list[int] | tuple[int, ...] | None = None,
    text: str | Path | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    n_windows, length, rolls, first_query = _settings(ctx, windows, window_tokens, rolls)
    handle = ctx.handle()
    wins = _samples(ctx, result, handle, text, length, n_windows)
    facts = handle.facts
    L = facts.num_layers
    rows, rows_last, per_query, base, logit, logit_base = _measure(
        ctx, handle, wins, rolls, length, first_query
    )
    result.arrays.update(_arrays(rows, rows_last, per_query, base, logit, logit_base, rolls, wins))
    ref = load_reference()
    if ref is None:
        result.notes.append(
            "The thread's reference numbers (kvlab/study/data/thread_reference.json) are missing from this "
            "installation: no overlay."
        )
    else:
        result.data_sources.append(
            f"thread reference (Qwen2.5-14B, one {REFERENCE_PROMPT_TOKENS}-token prompt): {ref['source']}"
        )
    _summarise(result, rolls, rows, base, logit, logit_base, ref, L, length, first_query)
    result.figures.extend(
        _figures(ctx, facts.name, rolls, rows, base, per_query, logit, logit_base, ref, length)
    )
    return result


def _settings(ctx: ExperimentContext, windows, window_tokens, rolls) -> tuple[int, int, tuple[int, ...], int]:
    """Windows, tokens per window, rolls, and the first query that enters the means; checked."""
    n_windows = int(windows if windows is not None else ctx.pick(4, 20, 50))
    length = int(window_tokens if window_tokens is not None else ctx.pick(128, 256, 512))
    rolls = tuple(int(n) for n in (rolls or DEFAULT_ROLLS))
    if n_windows < 2:
        raise BadInputError(
            f"need at least 2 windows (the unrelated baseline pairs neighbours), got {n_windows}"
        )
    first_query = min(16, length // 4)  # queries that see at least this many aligned keys enter the means
    if length < 8:
        raise BadInputError(f"window_tokens must be >= 8, got {length}")
    bad = [n for n in rolls if not 1 <= n <= length - first_query - 1]
    if bad:
        raise BadInputError(
            f"rolls {bad} do not fit a {length}-token window: use 1 <= n <= {length - first_query - 1}"
        )
    return n_windows, length, rolls, first_query


def _samples(
    ctx: ExperimentContext, result: ExperimentResult, handle, text, length: int, n_windows: int
) -> list:
    """Token samples of the study text (the model's maximum checked first)."""
    source = seeded_text(read_text_file(text) if text else default_long_text(), ctx.seed)
    ids = handle.encode(source.text)
    if length >= handle.max_positions:
        raise BadInputError(
            f"window_tokens {length} must be below the model's maximum of {handle.max_positions}"
        )
    wins = token_samples(ids, length, n_windows, seed=ctx.seed)
    result.data_sources.append(
        f"{source.source}: {n_windows} text samples of {length} tokens (of {len(ids):,})"
    )

    return wins


def _logit_metrics(p, q) -> dict[str, float]:
    return {
        "cos": float(logit_cosine(p, q)),
        "js": float(js_divergence(p, q)),
        "kl": float(kl_divergence(p, q)),
        "topk": float(topk_overlap(p, q, TOPK_LOGITS)),
    }


def _measure(ctx: ExperimentContext, handle, wins: list, rolls, length: int, first_query: int):
    """Attention rows and logits of every window against its rolls, and against its unrelated neighbour."""
    facts = handle.facts
    L, H, R, W = facts.num_layers, facts.num_attention_heads, len(rolls), len(wins)
    rows = {m: np.full((W, R, L, H), np.nan) for m in ROW_METRICS}
    rows_last = {m: np.full((W, R, L, H), np.nan) for m in ROW_METRICS}
    per_query = {m: np.full((W, R, length), np.nan) for m in ("cos", "cos_rest")}
    base = {m: np.full((W, L, H), np.nan) for m in ROW_METRICS}
    logit = {m: np.full((W, R), np.nan) for m in LOGIT_METRICS}
    logit_base = {m: np.full(W, np.nan) for m in LOGIT_METRICS}

    first_att, first_logits, prev_att, prev_logits = None, None, None, None
    with handle.eager_attention(), ctx.progress.task("attention: text samples", total=W * (R + 1)) as advance:
        for w, win in enumerate(wins):
            orig = handle.forward(win, output_attentions=True)
            att_o = stack_attentions(orig.attentions)
            advance(1)
            for r, n in enumerate(rolls):
                rolled = handle.forward(win[n:], output_attentions=True)
                ka, kb = roll_alignment(length, n)
                cmp = compare_attention_rows(
                    att_o, rolled.attentions, ka, kb, exclude_first=1, k=TOPK_ATTENTION
                )
                means, last = _reduce(cmp, first_query)
                for m in ROW_METRICS:
                    rows[m][w, r], rows_last[m][w, r] = means[m], last[m]
                with warnings.catch_warnings():
                    warnings.simplefilter(
                        "ignore", RuntimeWarning
                    )  # query 0 has no key left without the first
                    for m in per_query:
                        per_query[m][w, r, : length - n] = np.nanmean(getattr(cmp, m), axis=(0, 1))
                for m, v in _logit_metrics(orig.logits[-1], rolled.logits[-1]).items():
                    logit[m][w, r] = v
                advance(1)
            if prev_att is not None:
                _fill_baseline(
                    base, logit_base, w - 1, prev_att, att_o, prev_logits, orig.logits[-1], first_query
                )
            else:
                first_att, first_logits = att_o, orig.logits[-1]
            prev_att, prev_logits = att_o, orig.logits[-1]
        _fill_baseline(base, logit_base, W - 1, prev_att, first_att, prev_logits, first_logits, first_query)

    return rows, rows_last, per_query, base, logit, logit_base


def _arrays(rows, rows_last, per_query, base, logit, logit_base, rolls, wins) -> dict:
    """Every raw array behind the tables and figures."""
    arrays: dict = {}
    for m in ROW_METRICS:
        arrays[f"rows_{m}"] = rows[m]
        arrays[f"last_query_{m}"] = rows_last[m]
        arrays[f"unrelated_{m}"] = base[m]
    for m in per_query:
        arrays[f"per_query_{m}"] = per_query[m]
    for m in logit:
        arrays[f"logits_{m}"] = logit[m]
        arrays[f"logits_unrelated_{m}"] = logit_base[m]
    arrays["rolls"] = np.array(rolls)
    arrays["window_token_ids"] = np.array(wins)

    return arrays


def _fill_baseline(base, logit_base, w, att_a, att_b, logits_a, logits_b, first_query) -> None:
    """Window ``w`` against an unrelated window at the same positions: how alike rows are anyway."""
    cmp = compare_attention_rows(att_a, att_b, exclude_first=1, k=TOPK_ATTENTION)
    means, _ = _reduce(cmp, first_query)
    for m in ROW_METRICS:
        base[m][w] = means[m]
    for m, v in _logit_metrics(logits_a, logits_b).items():
        logit_base[m][w] = v


def _window_means(x: np.ndarray) -> np.ndarray:
    """``[W, ...] -> [W]``: one number per window."""
    return np.nanmean(x.reshape(x.shape[0], -1), axis=1)


def _summarise(result, rolls, rows, base, logit, logit_base, ref, L, length, first_query) -> None:
    """Summary, the three tables and the sink-artefact note, from the per-window arrays."""
    summary: dict[str, Any] = {
        "rolls": list(rolls),
        "window_tokens": length,
        "windows": int(rows["cos"].shape[0]),
        "queries_from": first_query,
        "topk_attention": TOPK_ATTENTION,
        "topk_logits": TOPK_LOGITS,
        "by_roll": {},
    }
    att_rows, sink_rows, logit_rows = _roll_rows(summary, rolls, rows, logit, ref)
    _unrelated_rows(summary, att_rows, logit_rows, base, logit_base)
    result.summary.update(summary)
    result.tables.append(_attention_table(att_rows, first_query))
    result.tables.append(_sink_table(sink_rows))
    result.tables.append(_logit_table(logit_rows))
    first = summary["by_roll"][str(rolls[0])]
    lastn = summary["by_roll"][str(rolls[-1])]
    result.notes.append(
        f"Sink artefact: over all aligned keys the attention-row cosine is {first['attention_cos']['value']:.3f} "
        f"(roll {rolls[0]}) and {lastn['attention_cos']['value']:.3f} (roll {rolls[-1]}); without the first aligned "
        f"key it is {first['attention_cos_rest']['value']:.3f} and {lastn['attention_cos_rest']['value']:.3f}. "
        f"The rolled run puts {first['attention_sink_b']['value']:.2f} of each row on its new first token, which "
        f"got {first['attention_first_aligned_a']['value']:.3f} in the original."
    )


def _roll_rows(summary: dict, rolls, rows: dict, logit: dict, ref) -> tuple[list, list, list]:
    """Per roll: intervals over text samples for attention rows, sink mass and logits (and the thread's numbers)."""
    att_rows, sink_rows, logit_rows = [], [], []
    for r, n in enumerate(rolls):
        iv = {m: bootstrap_ci(_window_means(rows[m][:, r]), seed=0) for m in ROW_METRICS}
        lv = {m: bootstrap_ci(logit[m][:, r], seed=0) for m in logit}
        per_layer = {
            m: np.nanmean(rows[m][:, r], axis=(0, 2)).tolist() for m in ("cos", "cos_rest", "js", "js_rest")
        }
        entry = {f"attention_{m}": iv[m].to_json() for m in ROW_METRICS}
        entry.update({f"logits_{m}": lv[m].to_json() for m in lv})
        entry["per_layer"] = per_layer
        ref_cos = ref_js = ref_top = ref_logit = ref_tok = None
        if ref is not None and n in ref["attention"]:
            ref_cos = float(ref["attention"][n]["cosine_sim"].mean())
            ref_js = float(ref["attention"][n]["js_div"].mean())
            ref_top = float(ref["attention"][n]["top5_overlap"].mean())
            ref_logit, ref_tok = float(ref["logit_cos"][n]), float(ref["top5_token_overlap"][n])
            entry["thread"] = {
                "attention_cos": ref_cos,
                "attention_js": ref_js,
                "attention_top5": ref_top,
                "logit_cos": ref_logit,
                "top5_token_overlap": ref_tok,
            }
        summary["by_roll"][str(n)] = entry
        att_rows.append([n, *(_interval_str(iv[m]) for m in ROW_COLUMNS), _fmt(ref_cos), _fmt(ref_js)])
        rolled_off = bootstrap_ci(1 - _window_means(rows["aligned_mass_a"][:, r]), seed=0)
        sink_rows.append(
            [
                n,
                *(_interval_str(iv[m]) for m in ("sink_a", "sink_b", "first_aligned_a")),
                _interval_str(rolled_off),
            ]
        )
        logit_rows.append(
            [f"roll {n}", *(_interval_str(lv[m]) for m in LOGIT_METRICS), _fmt(ref_logit), _fmt(ref_tok)]
        )
    return att_rows, sink_rows, logit_rows


def _unrelated_rows(summary: dict, att_rows: list, logit_rows: list, base: dict, logit_base: dict) -> None:
    """The unrelated-window baseline rows (appended) and summary entry."""
    biv = {m: bootstrap_ci(_window_means(base[m]), seed=0) for m in ROW_METRICS}
    att_rows.append(["unrelated sample", *(_interval_str(biv[m]) for m in ROW_COLUMNS), "", ""])
    lb = {m: bootstrap_ci(logit_base[m], seed=0) for m in logit_base}
    logit_rows.append(["unrelated sample", *(_interval_str(lb[m]) for m in LOGIT_METRICS), "", ""])
    summary["unrelated"] = {
        **{f"attention_{m}": biv[m].to_json() for m in ROW_METRICS},
        **{f"logits_{m}": lb[m].to_json() for m in lb},
    }


def _attention_table(att_rows: list, first_query: int) -> Table:
    return Table(
        "Attention rows, original vs rolled (mean over layers, heads and aligned queries; 95% CI over text samples)",
        Table.header(
            "roll n | cos, all aligned keys | cos, without first | JS, all aligned keys | "
            f"JS, without first | top-{TOPK_ATTENTION}, all | top-{TOPK_ATTENTION}, without first | "
            "thread cos | thread JS"
        ),
        att_rows,
        caption=f"Queries that see at least {first_query} aligned keys. 'Without first' drops the first aligned key "
        "(the rolled run's new sink) and renormalises both rows. JS in nats. Thread: Qwen2.5-14B, one "
        f"{REFERENCE_PROMPT_TOKENS}-token prompt, mean over its 48 layers (its exact row definition is not "
        "published; it matches the 'all aligned keys' column's construction best).",
    )


def _sink_table(sink_rows: list) -> Table:
    return Table(
        "Sink mass (share of each query's attention; mean over layers, heads, aligned queries)",
        Table.header(
            "roll n | original: on its slot 0 | rolled: on its slot 0 (new sink) | "
            "original: on the token that becomes the new sink | original: on rolled-off tokens"
        ),
        sink_rows,
        caption="The sink moves: the rolled run gives its first token the mass the original gave to its own first "
        "token, while the original gave that same token little.",
    )


def _logit_table(logit_rows: list) -> Table:
    return Table(
        "Next-token logits at the last position (95% CI over text samples)",
        Table.header(
            f"condition | cosine | JS (nats) | KL orig‖rolled (nats) | top-{TOPK_LOGITS} overlap | "
            "thread cos | thread top-5 overlap"
        ),
        logit_rows,
        caption="Thread numbers are from one prompt (no interval). Unrelated: two different text samples.",
    )


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


def _figures(ctx, name, rolls, rows, base, per_query, logit, logit_base, ref, length) -> list:
    """Attention rows by layer (cosine, JS), per query, the sink's mass, and the logits."""
    args = (ctx, name, rolls, rows, base, per_query, logit, logit_base, ref, length)
    return [*_layer_figures(*args), _figure_3(*args), _figure_4(*args), _figure_5(*args)]


def _layer_panel(ax, metric, title, ylabel, ref_key, rows, base, ref, rolls):
    L = rows["cos"].shape[2]
    depth = np.arange(L) / max(L - 1, 1)
    cs = colors()
    for r, n in enumerate(rolls):
        layers = np.nanmean(rows[metric][:, r], axis=-1)
        shade(ax, depth, layers, cs[r % len(cs)], 0.25, marker="o", ms=2.5, label=f"roll {n} (this model)")
    shade(ax, depth, np.nanmean(base[metric], axis=-1), "grey", ls="--", label="unrelated sample")
    if ref is not None and ref_key:
        for r, n in enumerate(rolls):
            if n in ref["attention"]:
                y = ref["attention"][n][ref_key]
                ax.plot(
                    np.arange(len(y)) / max(len(y) - 1, 1),
                    y,
                    color=cs[r % len(cs)],
                    ls=":",
                    lw=1,
                    label=f"roll {n} (thread, Qwen2.5-14B)",
                )
    style(ax, "layer depth (fraction of layers)", ylabel, title)


def _layer_figures(ctx, name, rolls, rows, base, per_query, logit, logit_base, ref, length) -> list:
    """Attention-row cosine and JS per layer, with the moved sink and without it."""
    figs: list = []
    for metric, ylabel, ref_key, stem in (
        ("cos", "attention-row cosine", "cosine_sim", "attention_cos_by_layer"),
        ("js", "attention-row JS divergence (nats)", "js_div", "attention_js_by_layer"),
    ):
        fig, axes = subplots(1, 2, figsize=(12, 4.2), sharey=True)
        data = (rows, base, ref, rolls)
        _layer_panel(axes[0], metric, "all aligned keys (the new sink included)", ylabel, ref_key, *data)
        _layer_panel(
            axes[1], f"{metric}_rest", "without the first aligned key (renormalised)", ylabel, None, *data
        )
        fig.suptitle(
            f"{name}: attention rows, original vs rolled, per layer ({rows['cos'].shape[0]} text samples × "
            f"{length} tokens, 95% bands)"
        )
        ctx.figure(
            stem,
            fig,
            f"Attention-row {'cosine' if metric == 'cos' else 'Jensen-Shannon'} per "
            "layer: with the moved sink (left) and without it (right)"
            + ("; dotted: the thread's Qwen curves." if ref is not None else "."),
            into=figs,
        )

    return figs


def _figure_3(ctx, name, rolls, rows, base, per_query, logit, logit_base, ref, length):
    """Where the attention mass goes, per layer: the old sink, the new one."""
    L = rows["cos"].shape[2]
    depth = np.arange(L) / max(L - 1, 1)
    cs = colors()
    fig, ax = subplots(figsize=(8, 4.2))
    for r, n in enumerate(rolls):
        for metric, ls, label in (
            ("sink_b", "-", f"rolled {n}: on its slot 0 (new sink)"),
            ("first_aligned_a", ":", f"original: on token {n} (the new sink's token)"),
        ):
            shade(ax, depth, np.nanmean(rows[metric][:, r], axis=-1), cs[r % len(cs)], ls=ls, label=label)
    sink = np.nanmean(rows["sink_a"][:, 0], axis=-1)
    shade(ax, depth, sink, "k", 0.15, lw=2, label="original: on its slot 0 (sink)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{name}: the attention sink moves to the rolled run's first token")
    style(ax, "layer depth (fraction of layers)", "share of each query's attention")
    return ctx.figure(
        "sink_mass_by_layer",
        fig,
        "Attention on each run's first slot, and on the token that "
        "becomes the rolled run's first slot, per layer (95% bands).",
    )


def _figure_4(ctx, name, rolls, rows, base, per_query, logit, logit_base, ref, length):
    """Attention-row similarity per query position."""
    cs = colors()
    fig, ax = subplots(figsize=(8, 4.2))
    for r, n in enumerate(rolls):
        for metric, ls in (("cos", "-"), ("cos_rest", "--")):
            start = 0 if metric == "cos" else 1  # aligned query 0 sees only the first aligned key
            label = f"roll {n}, {'all aligned keys' if metric == 'cos' else 'without first'}"
            x = per_query[metric][:, r, start : length - n]
            shade(ax, np.arange(start, length - n), x, cs[r % len(cs)], ls=ls, label=label)
    ax.set_title(f"{name}: attention-row similarity along the window")
    style(ax, "aligned query (rolled position)", "attention-row cosine (mean over layers, heads)")
    return ctx.figure(
        "attention_cos_by_query",
        fig,
        "Attention-row cosine per aligned query position, with and "
        "without the first aligned key (95% bands).",
    )


def _figure_5(ctx, name, rolls, rows, base, per_query, logit, logit_base, ref, length):
    """Next-token logits against the roll fraction, beside the unrelated baseline and the thread."""
    fig, axes = subplots(1, 3, figsize=(14, 4.0))
    frac = np.array(rolls) / length
    for ax, metric, ylabel in (
        (axes[0], "cos", "logit cosine"),
        (axes[2], "topk", f"top-{TOPK_LOGITS} overlap"),
    ):
        ivs = [bootstrap_ci(logit[metric][:, r], seed=0) for r in range(len(rolls))]
        errorbars(
            ax, frac, ivs, marker="o", capsize=3, label=f"this model ({length}-token text samples, 95% CI)"
        )
        b = bootstrap_ci(logit_base[metric], seed=0)
        if metric == "cos":  # far below the rolls: say it instead of squashing the axis
            ax.plot([], [], " ", label=f"unrelated samples: {b.text('.2f')}")
        else:
            ax.axhline(b.value, color="grey", ls="--", label="unrelated samples")
            ax.axhspan(b.low, b.high, color="grey", alpha=0.2)
        ref_key = "logit_cos" if metric == "cos" else "top5_token_overlap"
        if ref is not None:
            rn = sorted(ref[ref_key])
            ax.plot(
                np.array(rn) / REFERENCE_PROMPT_TOKENS,
                [ref[ref_key][n] for n in rn],
                "s:",
                color="C3",
                label=f"thread (Qwen2.5-14B, {REFERENCE_PROMPT_TOKENS}-token prompt"
                + (", top-5)" if metric == "topk" else ")"),
            )
        ax.set_xscale("log")
        style(ax, "roll (fraction of the context)", ylabel, which="both")
    axes[0].set_title("next-token logits: cosine")
    axes[2].set_title(f"next-token top-{TOPK_LOGITS} overlap")
    for metric, label in (("js", "JS"), ("kl", "KL orig‖rolled")):
        ivs = [bootstrap_ci(logit[metric][:, r], seed=0) for r in range(len(rolls))]
        errorbars(axes[1], rolls, ivs, marker="o", capsize=3, label=label)
    axes[1].axhline(
        bootstrap_ci(logit_base["js"]).value, color="grey", ls="--", label="JS, unrelated samples"
    )
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    style(axes[1], "roll n (tokens)", "divergence (nats)", "next-token logits: divergences", which="both")
    fig.suptitle(f"{name}: next-token distribution at the last position, original vs rolled")
    return ctx.figure(
        "next_token_logits",
        fig,
        "Next-token logits at the last position: cosine, JS/KL and "
        "top-10 overlap vs roll, with the thread's single-prompt numbers.",
    )


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    text = (
        f"After a 1-token roll, attention rows look disrupted when the sink is included (cosine "
        f"{format_number(num(s, 'by_roll.1.attention_cos'))}) but agree once it is set aside (cosine "
        f"{format_number(num(s, 'by_roll.1.attention_cos_rest'))}), and next-token logits barely move "
        f"(KL {format_number(num(s, 'by_roll.1.logits_kl'))} nats)."
    )
    rows = [
        ("attention-row cosine, roll 1, with sink", iv(s, "by_roll.1.attention_cos")),
        ("attention-row cosine, roll 1, without sink", iv(s, "by_roll.1.attention_cos_rest")),
        ("next-token KL (nats), roll 1", iv(s, "by_roll.1.logits_kl")),
        ("attention-row cosine, roll 20, without sink", iv(s, "by_roll.20.attention_cos_rest")),
        ("next-token KL (nats), roll 20", iv(s, "by_roll.20.logits_kl")),
    ]
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="where in the text the text samples are cut (the text starts at a paragraph the seed picks)",
    describe=describe,
    name="attention",
    title="Attention rows and next-token logits under a roll",
    run=run,
    order=60,
    description="Sink-aware attention-row and next-token comparison, original vs rolled.",
)
