"""Suffix caching, measured: roll a context forward, keep the cached K/V, fix positions — with and without sinks.

For each passage (the thread-style prompt and >= 20 samples of book text) the context is prefilled,
rolled by ``n`` tokens with ``s`` sinks kept, and compared with the exact re-prefill of the rolled
text and with the full context (never rolled): first-token KL and logit cosine, teacher-forced NLL
of the true continuation, greedy agreement and degeneration. The rolled cache and the re-prefill are
also compared with the full context over every continuation token (mean per-token KL, top-1 agreement)
from the same forwards: the claim "suffix caching is closer to the model's past than re-prefill",
judged in KL. Selective recompute (first ``k`` slots, or the ``k`` slots a 2-layer probe flags)
reports how much of the gap to re-prefill it closes per recomputed token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.data import default_long_text, read_text_file, token_samples
from kvlab.errors import BadInputError
from kvlab.metrics import (
    agreement_length,
    bootstrap_ci,
    distinct_n,
    kl_divergence,
    logit_cosine,
    longest_repeated_ngram,
    nll,
    wilson_ci,
)
from kvlab.metrics.divergence import compare_logits
from kvlab.metrics.stats import MIN_SAMPLES, Interval
from kvlab.ops.suffix import recompute_first, recompute_most_deviant, roll, rolled_ids
from kvlab.policy.window import roll_amount
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import format_range, iv, says
from kvlab.study.report.plots import style, subplots

# A thread-style prompt (~87 tokens) written for kvlab: a rolling-context chat turn.
THREAD_PROMPT = (
    "You are a careful assistant keeping a running log of a long conversation. Earlier we discussed how a "
    "language model stores keys and values for every token it has read, and why a cache that keeps only the "
    "most recent part of the text might still let the model continue sensibly. Summarise, in two plain "
    "sentences, what the cache must keep so that the next reply stays coherent, and"
)

DROPS: tuple[int | str, ...] = (1, 5, 20, 100, "25%", "50%")
# per passage, ``[drops, sinks]`` each; ``*_to_full_*``: mean over the continuation's tokens
METRICS = (
    "kl_to_reprefill",
    "cos_to_reprefill",
    "kl_full_to_rolled",
    "kl_full_to_reprefill",
    "kl_to_full_rolled",
    "top1_to_full_rolled",
    "kl_to_full_reprefill",
    "top1_to_full_reprefill",
    "nll_rolled",
    "nll_reprefill",
    "nll_full",
    "agree",
    "distinct2_rolled",
    "distinct2_reprefill",
    "longest_rep_rolled",
    "longest_rep_reprefill",
)
SINKS: tuple[int, ...] = (0, 1, 2, 4, 8)


def _greedy(handle, past, first_logits: torch.Tensor, n: int) -> list[int]:
    return handle.generate(past, first_logits, n, stop_at_eos=False).token_ids


def _passages(
    handle, ctx: ExperimentContext, length: int, cont: int, count: int, text_file
) -> tuple[list, str]:
    text = seeded_text(read_text_file(text_file) if text_file else default_long_text(), ctx.seed)
    ids = handle.encode(text.text[: (length + cont) * count * 12])
    if len(ids) < length + cont:
        raise BadInputError(f"{text.source} has {len(ids)} tokens, fewer than one passage of {length + cont}")
    return token_samples(ids, length + cont, count, seed=ctx.seed), text.source


def _degeneration(a: list[int], b: list[int]) -> dict[str, float]:
    """Greedy agreement of the rolled (``a``) and re-prefilled (``b``) continuations, and their repetition."""
    return {
        "agree": agreement_length(a, b),
        "distinct2_rolled": distinct_n(a, 2),
        "distinct2_reprefill": distinct_n(b, 2),
        "longest_rep_rolled": longest_repeated_ngram(a),
        "longest_rep_reprefill": longest_repeated_ngram(b),
    }


def _recompute_rows(
    handle, rolled, query: int, ref_first: torch.Tensor, recompute, sinks: int, base_kl: float
):
    """First-token KL to the re-prefill after refreshing ``k`` slots, for each (how, k)."""
    rows = []
    for how, k in recompute:
        if how == "first":
            fixed = recompute_first(handle, rolled, k, sinks=sinks)
        else:
            fixed, _ = recompute_most_deviant(handle, rolled, k, sinks=sinks)
        lg = handle.extend(fixed, [query]).logits[0]
        rows.append(
            {
                "how": how,
                "k": k,
                "kl": float(kl_divergence(ref_first, lg)),
                "base_kl": base_kl,
                "recomputed_tokens": k,
            }
        )
    return rows


def evaluate_passage(
    handle,
    ids: list[int],
    ctx_len: int,
    cont_len: int,
    drops: list[int],
    sinks: list[int],
    greedy: dict[tuple[int, int], int],
    recompute: list[tuple[str, int]],
    recompute_at: tuple[int, int] | None,
    skip: frozenset = frozenset(),
) -> dict[str, Any]:
    """All metrics for one passage: ``ids[:ctx_len]`` is the context (its last token is the query),
    ``ids[ctx_len:ctx_len + cont_len]`` the true continuation. Arrays are ``[drops, sinks]``."""
    context, query, cont = ids[: ctx_len - 1], ids[ctx_len - 1], ids[ctx_len : ctx_len + cont_len]
    feed = [query, *cont[:-1]]
    targets = torch.tensor(cont, device="cpu")  # nll moves targets to the logits
    snap = handle.prefill(context, all_logits=False).snapshot
    full_logits = handle.extend(snap, feed).logits  # never rolled: the full-context model
    out: dict[str, Any] = {k: np.full((len(drops), len(sinks)), np.nan) for k in METRICS}
    own = compare_logits(full_logits, full_logits)  # the full context against itself: 0 and 1
    out["kl_to_full_full"], out["top1_to_full_full"] = np.array(own.kl), np.array(own.top1)
    rec_rows = []
    for i, n in enumerate(drops):
        for j, s in enumerate(sinks):
            if s + n >= len(context) - 1 or (n, s) in skip:
                continue
            rolled = roll(snap, n, s)
            ref_fwd = handle.prefill(rolled_ids(snap, n, s) + feed)
            ref_logits = ref_fwd.logits[-len(feed) :]
            rolled_logits = handle.extend(rolled, feed).logits
            out["kl_to_reprefill"][i, j] = float(kl_divergence(ref_logits[0], rolled_logits[0]))
            out["cos_to_reprefill"][i, j] = float(logit_cosine(ref_logits[0], rolled_logits[0]))
            out["kl_full_to_rolled"][i, j] = float(kl_divergence(full_logits[0], rolled_logits[0]))
            out["kl_full_to_reprefill"][i, j] = float(kl_divergence(full_logits[0], ref_logits[0]))
            for cache, lg in (("rolled", rolled_logits), ("reprefill", ref_logits)):
                d = compare_logits(full_logits, lg)  # every continuation token, KL in float64
                out[f"kl_to_full_{cache}"][i, j], out[f"top1_to_full_{cache}"][i, j] = d.kl, d.top1
            out["nll_rolled"][i, j] = float(nll(rolled_logits, targets).mean())
            out["nll_reprefill"][i, j] = float(nll(ref_logits, targets).mean())
            out["nll_full"][i, j] = float(nll(full_logits, targets).mean())
            g = greedy.get((n, s), 0)
            if g:
                ref_snap = ref_fwd.snapshot.slice(0, ref_fwd.snapshot.seq_len - len(feed) + 1)
                a = _greedy(handle, handle.extend(rolled, [query]).snapshot, rolled_logits[0], g)
                b = _greedy(handle, ref_snap, ref_logits[0], g)
                for key, value in _degeneration(a, b).items():
                    out[key][i, j] = value
            if recompute_at == (n, s):
                base_kl = float(out["kl_to_reprefill"][i, j])
                rec_rows += _recompute_rows(handle, rolled, query, ref_logits[0], recompute, s, base_kl)
                for row in rec_rows[-len(recompute) :]:
                    row["reprefill_tokens"] = len(context) - n
    out["recompute"] = rec_rows
    return out


@dataclass(frozen=True)
class Settings:
    """What one run measures, from the profile and the caller's options."""

    n_windows: int
    ctx_len: int
    cont_len: int
    n_greedy: int
    drop_specs: list[str]
    drop_n: list[int]
    sink_list: list[int]
    greedy_windows: int
    recompute_windows: int
    skip: frozenset
    greedy_cells: set
    recompute_cell: tuple[int, int]
    recompute_opts: list[tuple[str, int]]


def settings(ctx: ExperimentContext, windows, context_tokens, drops, sinks) -> Settings:
    """The profile's cells: the acceptance cells (n <= 20) plus 50% by default; --full runs every drop and sink."""
    n_windows = ctx.count("windows", windows, quick=2, default=20, full=40)
    ctx_len = ctx.count("context_tokens", context_tokens, quick=96, default=96, full=300)
    all_drops = [str(d) for d in DROPS]
    drop_specs = (
        list(drops) if drops else ctx.pick(quick=["5", "20"], default=["1", "5", "20", "50%"], full=all_drops)
    )
    sink_list = (
        list(sinks) if sinks is not None else ctx.pick(quick=[0, 4], default=[0, 1, 4], full=list(SINKS))
    )
    if any(s < 0 for s in sink_list):
        raise BadInputError("sinks must be >= 0")
    drop_n = [roll_amount(d, ctx_len) for d in drop_specs]
    # Below the full profile, the 1/2/8-sink columns are measured at the small drops only (the acceptance cells).
    skip = (
        frozenset()
        if ctx.profile == "full"
        else frozenset((n, s) for n in drop_n for s in sink_list if s not in (0, 4) and n > 20)
    )
    return Settings(
        n_windows=n_windows,
        ctx_len=ctx_len,
        cont_len=ctx.pick(quick=8, default=8, full=32),
        n_greedy=ctx.pick(quick=8, default=12, full=48),
        drop_specs=drop_specs,
        drop_n=drop_n,
        sink_list=sink_list,
        greedy_windows=ctx.pick(quick=2, default=4, full=n_windows),
        recompute_windows=ctx.pick(quick=2, default=8, full=n_windows),
        skip=skip,
        greedy_cells={
            (roll_amount(d, ctx_len), s)
            for d in ("5", "20")
            for s in (0, 4)
            if d in drop_specs and s in sink_list
        },
        recompute_cell=(roll_amount("20", ctx_len), 4 if 4 in sink_list else sink_list[-1]),
        recompute_opts=ctx.pick(
            quick=[("first", 4), ("probe", 4)],
            default=[("first", 4), ("first", 16), ("probe", 4), ("probe", 16)],
        ),
    )


def measure(
    handle, ctx: ExperimentContext, st: Settings, passages: list
) -> tuple[list[dict], list[dict], dict]:
    """Every passage, then the thread-style prompt: per-passage arrays, recompute rows, the prompt's result."""
    per: list[dict] = []
    rec_rows: list[dict] = []
    with ctx.progress.task("suffix caching: passages", total=len(passages) + 1) as advance:
        for w, ids in enumerate(passages):
            res = evaluate_passage(
                handle,
                ids,
                st.ctx_len,
                st.cont_len,
                st.drop_n,
                st.sink_list,
                {c: st.n_greedy for c in st.greedy_cells} if w < st.greedy_windows else {},
                st.recompute_opts,
                st.recompute_cell if w < st.recompute_windows else None,
                st.skip,
            )
            per.append(res)
            rec_rows += res.pop("recompute")
            advance(1)
        # The thread-style prompt: the next words after the prompt are unknown, so only agreement with re-prefill.
        prompt_ids = handle.encode(THREAD_PROMPT)
        prompt_drops = [n for n in st.drop_n if n + max(st.sink_list) < len(prompt_ids) - 3]
        thread = evaluate_passage(
            handle, prompt_ids + prompt_ids[:2], len(prompt_ids), 2, prompt_drops, st.sink_list, {}, [], None
        )
        thread.pop("recompute")
        thread.update(tokens=len(prompt_ids), drops=prompt_drops)
        advance(1)
    return per, rec_rows, thread


def run(
    ctx: ExperimentContext,
    *,
    text_file: str | Path | None = None,
    windows: int | None = None,
    context_tokens: int | None = None,
    drops: list[str] | None = None,
    sinks: list[int] | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    handle = ctx.handle()
    st = settings(ctx, windows, context_tokens, drops, sinks)
    passages, source = _passages(handle, ctx, st.ctx_len, st.cont_len, st.n_windows, text_file)
    result.data_sources.append(
        f"{source}: {len(passages)} text samples of {st.ctx_len} + {st.cont_len} tokens"
    )
    per, rec_rows, thread = measure(handle, ctx, st, passages)
    keys = [k for k in per[0] if isinstance(per[0][k], np.ndarray)]
    stacked = {k: np.stack([p[k] for p in per]) for k in keys}  # [windows, drops, sinks]
    result.arrays.update(stacked)
    result.arrays["drops"] = np.array(st.drop_n)
    result.arrays["sinks"] = np.array(st.sink_list)
    result.arrays["thread_prompt_kl_to_reprefill"] = thread["kl_to_reprefill"]
    result.arrays["thread_prompt_drops"] = np.array(thread["drops"])
    result.tables.append(_kl_table(stacked, st, ctx.seed))
    full_table, summary_kl = _full_table(stacked, st, ctx.seed)
    result.tables.append(full_table)
    summary: dict[str, Any] = {"windows": len(passages), "context_tokens": st.ctx_len, "source": source}
    summary.update(_acceptance(stacked, st, ctx.seed), kl_to_full=summary_kl)
    result.notes.append(_kl_note(summary_kl))
    result.tables.append(_greedy_table(stacked, st, ctx.seed))
    rec_table, rrows, rec_arrays = _recompute_table(rec_rows, st, ctx.seed)
    result.tables.append(rec_table)
    result.arrays.update(rec_arrays)
    summary["recompute"] = rrows
    summary["thread_prompt"] = {
        "tokens": thread["tokens"],
        "drops": thread["drops"],
        "sinks": st.sink_list,
        "kl_to_reprefill": thread["kl_to_reprefill"].tolist(),
    }
    result.summary.update(summary)
    result.figures.append(_kl_figure(ctx, stacked, st.drop_specs, st.sink_list))
    result.figures.append(_closer_figure(ctx, stacked, st.drop_specs, st.sink_list))
    return result


def _ci(stacked: dict, name: str, i: int, j: int, seed: int, stat: str = "median"):
    x = stacked[name][:, i, j]
    x = x[np.isfinite(x)]
    return bootstrap_ci(x, stat, seed=seed) if x.size else None


def _kl_table(stacked: dict, st: Settings, seed: int) -> Table:
    """Rolled cache vs the exact re-prefill and vs the full context, per drop and sink count."""
    rows = []
    for i, (spec, n) in enumerate(zip(st.drop_specs, st.drop_n, strict=True)):
        for j, s in enumerate(st.sink_list):
            kl = _ci(stacked, "kl_to_reprefill", i, j, seed)
            if kl is None:
                continue
            cos = _ci(stacked, "cos_to_reprefill", i, j, seed, "mean")
            kfr, kfp = (
                _ci(stacked, "kl_full_to_rolled", i, j, seed),
                _ci(stacked, "kl_full_to_reprefill", i, j, seed),
            )
            dn = _ci(stacked, "nll_rolled", i, j, seed, "mean")
            dp = _ci(stacked, "nll_reprefill", i, j, seed, "mean")
            rows.append(
                [spec, n, s, kl.value, kl.bracket(".3g"), cos.value, kfr.value, kfp.value]
                + [dn.value, dp.value, kl.n]
            )
    return Table(
        "Rolled cache vs exact re-prefill and vs full context",
        Table.header(
            "drop | n | sinks | median KL to re-prefill | 95% CI | mean logit cosine | "
            "median KL full->rolled | median KL full->re-prefill | NLL rolled | NLL re-prefill | "
            "samples"
        ),
        rows,
        caption=f"First-token KL in nats (reference first). NLL: teacher-forced mean NLL of the true {st.cont_len}-token "
        "continuation. 'full' is the never-rolled context: KL full->rolled < KL full->re-prefill means the "
        "suffix cache is closer to the model's computational past than a re-prefill is.",
    )


def _iv(x: np.ndarray, seed: int, proportion: bool = False):
    """Mean with its interval over text samples (JSON; Wilson for a proportion, else a bootstrap), or None
    where nothing was measured."""
    x = x[np.isfinite(x)]
    if not x.size:
        return None
    return (wilson_ci(x) if proportion else bootstrap_ci(x, "mean", seed=seed)).to_json()


def _verdict(diff: dict | None) -> str:
    """From the paired KL difference rolled - re-prefill (its interval): which is closer to the full context."""
    few = f"undecided (no interval: fewer than {MIN_SAMPLES} text samples)"
    return says(diff, "rolled closer", "re-prefill closer", "undecided", few)


def _full_table(stacked: dict, st: Settings, seed: int) -> tuple[Table, dict]:
    """The full context, the rolled cache and the re-prefill, each against the full context over every
    continuation token; the summary per cell, with a verdict on the paired difference."""
    own = {m: _iv(stacked[f"{m}_to_full_full"], seed, m == "top1") for m in ("kl", "top1")}
    rows = [["–", "–", "–", "full context", iv(own, "kl"), iv(own, "top1"), own["kl"]["n"]]]
    summary: dict[str, Any] = {"full": own}
    for i, (spec, n) in enumerate(zip(st.drop_specs, st.drop_n, strict=True)):
        for j, s in enumerate(st.sink_list):
            cell = {
                c: {m: _iv(stacked[f"{m}_to_full_{c}"][:, i, j], seed, m == "top1") for m in ("kl", "top1")}
                for c in ("rolled", "reprefill")
            }
            if cell["rolled"]["kl"] is None:
                continue
            diff = _iv(stacked["kl_to_full_rolled"][:, i, j] - stacked["kl_to_full_reprefill"][:, i, j], seed)
            summary[f"n{n}_sinks{s}"] = {**cell, "rolled_minus_reprefill": diff, "verdict": _verdict(diff)}
            for c, label in (
                ("rolled", f"rolled, {s} sinks"),
                ("reprefill", "re-prefill of the rolled text"),
            ):
                rows.append([spec, n, s, label, iv(cell[c], "kl"), iv(cell[c], "top1"), cell[c]["kl"]["n"]])
    table = Table(
        "Rolled cache and re-prefill against the full context, every continuation token",
        ["drop", "n", "sinks", "cache", "KL to full (nats)", "top-1 agreement", "samples"],
        rows,
        caption=f"Per text sample, the mean over the {st.cont_len} continuation tokens (teacher-forced) of "
        "KL(full context || cache) in nats (float64) and of top-1 agreement with the full context; means "
        "over text samples with 95% intervals (bootstrap for KL, Wilson for top-1). The full context against "
        "itself is 0 and 1 by construction.",
    )
    return table, summary


def _kl_note(summary_kl: dict) -> str:
    """The suffix-caching claim judged in KL: per cell, which is closer to the full context."""
    cells = {k: v for k, v in summary_kl.items() if k != "full"}
    verdicts = "; ".join(f"{k}: {v['verdict']}" for k, v in cells.items())
    return (
        "Is the rolled cache closer to the full context than a re-prefill, in KL over every continuation "
        f"token (paired difference, 95% interval over text samples)? {verdicts or 'no cells measured'}."
    )


def paired_ratio(a: np.ndarray, b: np.ndarray, seed: int) -> dict | None:
    """Per text sample ``a / b`` (both from the same sample): the geometric mean with a 95% bootstrap
    interval (the mean log ratio's, exponentiated) as JSON; None when no sample has both finite and > 0."""
    ok = np.isfinite(a) & np.isfinite(b) & (a > 0) & (b > 0)
    if not ok.any():
        return None
    logs = bootstrap_ci(np.log(a[ok] / b[ok]), seed=seed)
    value, low, high = (float(np.exp(x)) for x in (logs.value, logs.low, logs.high))
    return Interval(value, low, high, logs.n).to_json()


def _acceptance(stacked: dict, st: Settings, seed: int = 0) -> dict[str, Any]:
    """Sinks vs no sinks at n <= 20 (the ratio of medians, and paired per text sample), and how often the
    rolled cache is closer to the full context."""
    ratios, paired = {}, {}
    if 0 in st.sink_list:
        j0 = st.sink_list.index(0)
        for s in [s for s in st.sink_list if s > 0]:
            js = st.sink_list.index(s)
            for i, n in enumerate(st.drop_n):
                if n <= 20:
                    a, b = stacked["kl_to_reprefill"][:, i, j0], stacked["kl_to_reprefill"][:, i, js]
                    med_a, med_b = np.nanmedian(a), np.nanmedian(b)
                    ratios[f"n{n}_sinks{s}"] = float(med_a / med_b) if med_b > 0 else float("inf")
                    paired[f"n{n}_sinks{s}"] = paired_ratio(a, b, seed)
    closer = np.where(
        np.isfinite(stacked["kl_full_to_rolled"]) & np.isfinite(stacked["kl_full_to_reprefill"]),
        (stacked["kl_full_to_rolled"] < stacked["kl_full_to_reprefill"]).astype(float),
        np.nan,
    )
    return {
        "median_kl_ratio_no_sink_over_sinks": ratios,
        "kl_ratio_no_sink_over_sinks_paired": paired,
        "share_rolled_closer_to_full": {
            f"n{n}_sinks{s}": float(np.nanmean(closer[:, i, j]))
            for i, n in enumerate(st.drop_n)
            for j, s in enumerate(st.sink_list)
            if np.isfinite(closer[:, i, j]).any()
        },
    }


def _greedy_table(stacked: dict, st: Settings, seed: int) -> Table:
    """Greedy agreement with the re-prefill and degeneration, per drop and sink count."""
    grows = []
    for i, n in enumerate(st.drop_n):
        for j, s in enumerate(st.sink_list):
            x = stacked["agree"][:, i, j]
            if not np.isfinite(x).any():
                continue
            ag = bootstrap_ci(x[np.isfinite(x)], "mean", seed=seed)
            means = [
                float(np.nanmean(stacked[k][:, i, j]))
                for k in (
                    "distinct2_rolled",
                    "distinct2_reprefill",
                    "longest_rep_rolled",
                    "longest_rep_reprefill",
                )
            ]
            grows.append([n, s, ag.value, ag.bracket(".1f"), *means, ag.n])
    return Table(
        "Greedy continuation: agreement and degeneration",
        Table.header(
            f"n | sinks | mean agreement (of {st.n_greedy}) | 95% CI | distinct-2 rolled | "
            "distinct-2 re-prefill | longest repeat rolled | longest repeat re-prefill | samples"
        ),
        grows,
        caption="Agreement = tokens until the rolled cache's greedy continuation first differs from the re-prefill's.",
    )


def _recompute_table(rec_rows: list[dict], st: Settings, seed: int) -> tuple[Table, list, dict]:
    """How much of the gap to re-prefill selective recompute closes, per unit of compute."""
    rrows, arrays = [], {}
    for how, k in st.recompute_opts:
        sel = [r for r in rec_rows if r["how"] == how and r["k"] == k]
        if not sel:
            continue
        base = np.array([r["base_kl"] for r in sel])
        kl = np.array([r["kl"] for r in sel])
        closed = 1 - kl / np.where(base > 0, base, np.nan)
        ok = np.isfinite(closed)
        c = bootstrap_ci(closed[ok], "median", seed=seed) if ok.any() else None
        share = k / np.mean([r["reprefill_tokens"] for r in sel])
        rrows.append(
            [how, k, float(np.median(base)), float(np.median(kl)), c.value if c else float("nan")]
            + [c.bracket(".2f") if c else "", float(share)]
            + [float(c.value / share) if c else float("nan"), len(sel)]
        )
        arrays[f"recompute_{how}_{k}_kl"] = kl
        arrays[f"recompute_{how}_{k}_base_kl"] = base
    table = Table(
        f"Selective recompute after a roll (n={st.recompute_cell[0]}, sinks={st.recompute_cell[1]})",
        Table.header(
            "slots | k | median KL before | median KL after | median gap closed | 95% CI | "
            "compute / re-prefill | gap closed per unit compute | samples"
        ),
        rrows,
        caption="'first' recomputes the first k window slots (one k-token prefill); 'probe' the k slots whose "
        "layer-1 keys deviate most from a 2-layer probe prefill (probe cost ~2/L of a re-prefill, not counted).",
    )
    return table, rrows, arrays


def _drop_axes(ax: Any, drop_specs: list[str], ylabel: str, title: str) -> None:
    """What both figures share: one tick per drop, a log KL axis, labels, legend and grid."""
    ax.set_xticks(np.arange(len(drop_specs)))
    ax.set_xticklabels(drop_specs)
    ax.set_yscale("log")
    style(ax, "tokens dropped (n)", ylabel, title, legend=8, which="both")


def _kl_figure(ctx: ExperimentContext, stacked: dict, drop_specs: list[str], sink_list: list[int]):
    fig, ax = subplots(figsize=(7.5, 4.2))
    x = np.arange(len(drop_specs))
    for j, s in enumerate(sink_list):
        med, lo, hi = [], [], []
        for i in range(len(drop_specs)):
            v = stacked["kl_to_reprefill"][:, i, j]
            v = v[np.isfinite(v)]
            c = bootstrap_ci(v, "median", seed=ctx.seed) if v.size else None
            med.append(c.value if c else np.nan)
            lo.append(c.low if c else np.nan)
            hi.append(c.high if c else np.nan)
        ax.plot(x, med, marker="o", label=f"{s} sinks")
        ax.fill_between(x, lo, hi, alpha=0.2)
    _drop_axes(
        ax,
        drop_specs,
        "median first-token KL to re-prefill (nats)",
        "Suffix caching: rolled cache vs exact re-prefill",
    )
    return ctx.figure(
        "kl_by_drop",
        fig,
        "Median first-token KL between the rolled cache and an exact re-prefill, "
        "per drop and sink count (bootstrap 95% bands over text samples).",
    )


def _closer_figure(ctx: ExperimentContext, stacked: dict, drop_specs: list[str], sink_list: list[int]):
    fig, ax = subplots(figsize=(7.5, 4.2))
    x = np.arange(len(drop_specs))
    for j, s in enumerate(sink_list):
        col = stacked["kl_full_to_rolled"][:, :, j]
        a = np.array([np.nanmedian(c) if np.isfinite(c).any() else np.nan for c in col.T])
        ax.plot(x, a, marker="o", label=f"rolled, {s} sinks")
    ax.plot(
        x,
        np.nanmedian(stacked["kl_full_to_reprefill"][:, :, 0], axis=0),
        "k--",
        marker="s",
        label="re-prefill of the rolled text",
    )
    _drop_axes(
        ax,
        drop_specs,
        "median first-token KL from full context (nats)",
        "Which is closer to the never-rolled model?",
    )
    return ctx.figure(
        "closer_to_full",
        fig,
        "KL from the full (never-rolled) context to the rolled cache and to the "
        "re-prefill: the thread's 'more faithful to the computational past' claim.",
    )


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    ratios = s.get("median_kl_ratio_no_sink_over_sinks", {}) or {}
    shares = s.get("share_rolled_closer_to_full", {}) or {}
    paired = {k: v for k, v in (s.get("kl_ratio_no_sink_over_sinks_paired") or {}).items() if v}
    rows = [(f"KL without sinks / with sinks, paired per text sample ({k})", iv(paired, k)) for k in paired]
    rows += [(f"KL without sinks / with sinks, ratio of medians ({k})", iv(ratios, k)) for k in ratios]
    rows += [
        (f"share of text samples where the rolled cache is closer to the full context ({k})", iv(shares, k))
        for k in shares
    ]
    rows += [
        (
            f"KL to full ({k}): rolled / re-prefill",
            f"{iv(v, 'rolled.kl')} / {iv(v, 'reprefill.kl')}: {v['verdict']}",
        )
        for k, v in (s.get("kl_to_full", {}) or {}).items()
        if k != "full"
    ]
    vals = [float(v) for v in ratios.values() if isinstance(v, int | float)]
    text = (
        _sinks_sentence(paired)
        if paired
        else f"Rolling a cached context by re-rotating its keys is {format_range(vals)}x closer "
        "to re-prefilling (median KL) when the sink tokens are kept than when they are dropped."
        if vals
        else "Suffix caching with and without sinks (see the tables)."
    )
    return text, rows


def _sinks_sentence(paired: dict[str, dict]) -> str:
    """Sinks kept vs dropped, from the paired per-text-sample KL ratios (dropped / kept) of every cell."""
    if any(v.get("low") is None for v in paired.values()):
        says = (
            "too few text samples for a paired interval: this run cannot tell whether keeping the sinks helps"
        )
    elif all(v["low"] > 1 for v in paired.values()):
        says = "every cell's paired 95% interval lies above 1: keeping the sinks brings it closer"
    else:
        says = "not every cell's paired 95% interval lies above 1: keeping the sinks does not bring it closer everywhere"
    return (
        "Rolling a cached context by re-rotating its keys, the KL to re-prefilling with the sink tokens dropped is "
        f"{format_range([v['value'] for v in paired.values()])}x that with them kept (geometric mean of the "
        f"per-text-sample ratios); {says}."
    )


EXPERIMENT = Experiment(
    seed_changes="where in the text the passages are cut",
    describe=describe,
    name="suffix_caching",
    title="Suffix caching with attention sinks",
    run=run,
    order=46,
    description="Roll a cached context forward with and without attention sinks; compare with "
    "re-prefill and full context; selective recompute.",
)
