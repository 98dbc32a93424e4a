"""Streaming perplexity: full context vs window vs sinks + window vs sliding window with re-computation.

The StreamingLLM table on this model: every method reads the same token stream; the exact sliding
window with re-computation runs on a random subsample of targets and every other method is also
scored on that subsample, so the ratios compare identical targets. Where the full context fits, every
method's per-token distributions are also compared with the full context's (KL and top-1 agreement).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvlab.data import Text, default_long_text, read_text_file, shared_book
from kvlab.errors import BadInputError
from kvlab.streaming.perplexity import (
    METHODS,
    TABLE_COLUMNS,
    StreamResult,
    streaming_perplexity,
    summarize,
    table_row,
)
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import format_interval, format_range, iv
from kvlab.study.report.plots import style, subplots

# the divergence columns, placed after the paired ratio's interval
KL_COLUMNS = ["KL to full (nats)", "top-1 agreement"]
COLUMNS = TABLE_COLUMNS[:8] + KL_COLUMNS + TABLE_COLUMNS[8:]


def source_name(source: str) -> str:
    """A short label for a text source: a file's stem (``frankenstein.txt`` -> ``frankenstein``), else
    the description before its parenthesis (``Python documentation (pydoc_data.topics, ...)`` ->
    ``Python documentation``), never cut at a dot inside the description."""
    head = source.split("; ", 1)[0].split(" (", 1)[0].strip()
    return Path(head).stem if " " not in head and Path(head).suffix else head


def _first_tokens(handle, text, n: int, *, exact: bool) -> list[int]:
    """The text's first ``n`` token ids; ``exact`` (asked for explicitly): fewer is refused, never scored silently."""
    ids = handle.encode(text.text[: n * 8])[:n]
    if exact and len(ids) < n:
        raise BadInputError(
            f"{text.source} has {len(ids)} tokens; --tokens {n} asks for more (give a longer text)"
        )
    return ids


def _texts(ctx: ExperimentContext, text_file: str | Path | None) -> list[Text]:
    if text_file is not None:
        return [seeded_text(read_text_file(text_file), ctx.seed)]
    names = ctx.pick(quick=["frankenstein"], default=["frankenstein"], full=["frankenstein", "shakespeare"])
    books = [b for b in (shared_book(n) for n in names) if b is not None]
    return [seeded_text(t, ctx.seed) for t in (books or [default_long_text()])]


def _running_ppl(r: StreamResult) -> np.ndarray:
    return np.exp(np.cumsum(r.nll) / np.arange(1, r.nll.size + 1))


def _figure(ctx: ExperimentContext, results: dict[str, StreamResult], title: str, stem: str, window: int):
    fig, ax = subplots(figsize=(8, 4.2))
    for name, r in results.items():
        if name == "recompute":
            continue
        ax.plot(r.targets, _running_ppl(r), lw=1.2, label=METHODS[name].label)
    rec = results.get("recompute")
    if rec is not None:
        ax.plot(
            rec.targets, _running_ppl(rec), "k--", lw=1.2, label=f"{METHODS['recompute'].label} (subsample)"
        )
    ax.axvline(window, color="grey", lw=0.8, ls=":", label=f"window = {window}")
    ax.set_yscale("log")
    style(ax, "token index in the stream", "running perplexity", title, ncol=2, which="both")
    return ctx.figure(
        stem,
        fig,
        f"Running perplexity over the stream, window {window}: window-only explodes once "
        "the first tokens are evicted; one or more sinks keep it near full context.",
    )


def _bars(ctx: ExperimentContext, rows: list[dict], stem: str):
    """Perplexity per method on the re-computation subsample, one horizontal bar per (text, window,
    method) so every label is written whole; the text and window go in the title when there is one."""
    groups = list(dict.fromkeys((r["source"], r["window"]) for r in rows))
    labels = [
        METHODS[r["method"]].label + ("" if len(groups) == 1 else f" ({r['source']}, window {r['window']})")
        for r in rows
    ]
    fig, ax = subplots(figsize=(8, 1.2 + 0.32 * len(rows)))
    y = np.array([r["ppl_subsample"] for r in rows])
    lo = np.array([r["ppl_subsample_low"] for r in rows])
    hi = np.array([r["ppl_subsample_high"] for r in rows])
    pos = np.arange(len(rows))[::-1]  # the first row on top
    ax.barh(pos, y, color="C0", alpha=0.7, label="perplexity on the re-computation subsample")
    ax.errorbar(
        y,
        pos,
        xerr=np.nan_to_num([y - lo, hi - y]),  # no interval (NaN bounds): no whisker
        fmt="none",
        ecolor="k",
        capsize=2,
        label="95% bootstrap interval",
    )
    ax.set_yticks(pos)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("perplexity")
    where = f": {groups[0][0]}, window {groups[0][1]}" if len(groups) == 1 else ""
    ax.set_title(f"Perplexity per method on identical targets{where}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="x")
    return ctx.figure(
        stem,
        fig,
        "Perplexity of every method on the targets the exact sliding window re-computed "
        "(bootstrap 95% intervals over targets).",
    )


def run(
    ctx: ExperimentContext,
    *,
    text_file: str | Path | None = None,
    windows: list[int] | None = None,
    sinks: list[int] | None = None,
    tokens: int | None = None,
    feed: int | None = None,
    recompute_samples: int | None = None,
    recompute_stride: int | None = None,
    loop: bool = False,
    caches: list[str] | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    handle = ctx.handle()
    windows = list(windows) if windows else ctx.pick(quick=[128], default=[256], full=[256, 512])
    n_tokens = ctx.count("tokens", tokens, quick=200, default=1000, full=3000)
    feed = ctx.count("feed", feed, quick=16, default=16, full=16)
    n_sub = ctx.count("recompute_samples", recompute_samples, quick=12, default=40, full=200)
    sink_methods = [f"sinks{s}" for s in (sinks or [1, 2, 4, 8])]
    if unknown := [n[5:] for n in sink_methods if n not in METHODS]:
        raise BadInputError(f"sinks must be among 1, 2, 4, 8 (got {', '.join(unknown)})")
    methods = [*sink_methods, *(caches or [])]  # cache specs are scored as methods too
    rows: list[dict] = []
    for text in _texts(ctx, text_file):
        ids = _first_tokens(handle, text, n_tokens, exact=tokens is not None)
        result.data_sources.append(f"{text.source}: first {len(ids)} tokens")
        for window in windows:
            if len(ids) <= window + feed + 1:
                raise BadInputError(f"{text.source} has {len(ids)} tokens, too few for window {window}")
            res = _stream(ctx, handle, ids, text, window, methods, feed, n_sub, recompute_stride, loop)
            sub = res["recompute"].targets
            key = f"{source_name(text.source)}_w{window}"
            result.arrays[f"{key}_subsample_targets"] = sub
            for name, r in res.items():
                result.arrays[f"{key}_{name}_nll"] = r.nll.astype(np.float32)
                result.arrays[f"{key}_{name}_targets"] = r.targets
                if r.kl is not None:  # per target: KL(full || method) in nats, top-1 agreement
                    result.arrays[f"{key}_{name}_kl_to_full"] = r.kl
                    result.arrays[f"{key}_{name}_top1_to_full"] = r.top1.astype(np.float32)
            rows += summarize(res, source_name(text.source), window, seed=ctx.seed)
            result.figures.append(
                _figure(
                    ctx,
                    res,
                    f"{handle.name}: {source_name(text.source)}, window {window}",
                    f"running_ppl_{key}",
                    window,
                )
            )
    result.tables.append(_table(rows, feed, n_sub, recompute_stride))
    result.notes.extend(_kl_notes(rows))
    result.figures.append(_bars(ctx, rows, "ppl_by_method"))
    summary: dict = {
        "rows": rows,
        "feed": feed,
        "recompute_samples": n_sub,
        "recompute_stride": recompute_stride,
    }
    for r in rows:
        if r["method"] == "sinks4":
            summary[f"sinks4_over_recompute_{r['source']}_w{r['window']}"] = r["ratio_to_recompute"]
        if r["method"] == "window":
            summary[f"window_over_recompute_{r['source']}_w{r['window']}"] = r["ratio_to_recompute"]
    result.summary.update(summary)
    result.notes.append(
        "'window only' (re-positioned from 0 at every roll) and 'no re-positioning' should agree to "
        "rounding: RoPE sees only relative positions. What hurts is losing the first tokens."
    )
    return result


def _table(rows: list[dict], feed: int, n_sub: int, recompute_stride) -> Table:
    """The perplexity table, with the KL / top-1 columns after the paired ratio."""
    cells = [(c := table_row(r))[:8] + [iv(r, "kl_to_full"), iv(r, "top1_to_full")] + c[8:] for r in rows]
    return Table(
        "Perplexity per method",
        COLUMNS,
        cells,
        caption=f"Rolling methods feed {feed} tokens per forward and evict in chunks of {feed}; "
        + (
            f"re-computation scores every {recompute_stride}th target from the window on"
            if recompute_stride
            else f"re-computation scores {n_sub} random targets per run"
        )
        + " (each from a fresh prefill of its window); every method is also scored on those targets. "
        "'x re-computation' is exp(mean paired NLL difference) on those targets. 'KL to full': mean "
        "per-token KL(full context || method) in nats (float64) over the targets from the window on "
        "(re-computation: its subsample), 'top-1 agreement' the share whose argmax matches the full "
        "context's; 95% intervals over those targets (bootstrap for KL, Wilson for top-1); '–' where "
        "the full context does not fit.",
    )


def _kl_notes(rows: list[dict]) -> list[str]:
    """Per text and window: which rolling method stays closest to the full context in KL."""
    out = []
    for key in dict.fromkeys((r["source"], r["window"]) for r in rows):
        kl = {
            r["method"]: r["kl_to_full"]["value"]
            for r in rows
            if (r["source"], r["window"]) == key and "kl_to_full" in r and r["method"] != "full"
        }
        if kl:
            best = min(kl, key=kl.__getitem__)
            others = [
                f"{METHODS[m].label} {kl[m]:.3g}" for m in ("window", "sinks4") if m in kl and m != best
            ]
            out.append(
                f"{key[0]}, W={key[1]}: closest to the full context in KL is {METHODS[best].label} "
                f"({kl[best]:.3g} nats)" + (f"; {', '.join(others)}." if others else ".")
            )
    return out


def _stream(
    ctx: ExperimentContext,
    handle,
    ids,
    text,
    window: int,
    sink_methods,
    feed: int,
    n_sub: int,
    recompute_stride,
    loop: bool = False,
):
    """Every method's per-token NLL over one text at one window (full prefill when positions allow)."""
    methods = ["full", "window", "window_abs", *sink_methods, "recompute"]
    if len(ids) > handle.max_positions:
        methods.remove("full")
    n_rec = len(range(window, len(ids), recompute_stride)) if recompute_stride else n_sub
    total = (len(methods) - 1) * len(ids) + n_rec * window
    with ctx.progress.task(f"stream-ppl {text.source[:20]} W={window}", total=total) as advance:
        res = streaming_perplexity(
            handle,
            ids,
            window=window,
            methods=methods,
            feed=feed,
            recompute_samples=n_sub,
            recompute_stride=recompute_stride,
            seed=ctx.seed,
            path="loop" if loop else "auto",
            on_progress=advance,
        )
    return res


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    rows_in = [r for r in s.get("rows", []) if r.get("method") in ("window", "sinks4")]
    rows = [
        (
            f"{r['source']}, W={r['window']}, {'4 sinks + window' if r['method'] == 'sinks4' else 'window only'}: "
            "perplexity / re-computation",
            format_interval(
                r["ratio_to_recompute"], r.get("ratio_low"), r.get("ratio_high"), n=r.get("subsample")
            ),
        )
        for r in rows_in
    ]
    rows += [
        (
            f"{r['source']}, W={r['window']}, {METHODS[r['method']].label}: KL to full (nats)",
            iv(r, "kl_to_full"),
        )
        for r in rows_in
        if "kl_to_full" in r
    ]
    sinks = [r["ratio_to_recompute"] for r in rows_in if r["method"] == "sinks4"]
    window = [r["ratio_to_recompute"] for r in rows_in if r["method"] == "window"]
    text = (
        f"Keeping 4 sink tokens makes a rolling window's perplexity {format_range(sinks)}x that of a sliding window "
        f"re-computed from scratch, while the window alone is {format_range(window)}x."
        if sinks and window
        else "Perplexity per cache policy (see the table)."
    )
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="where in the book the stream starts",
    describe=describe,
    name="streaming_ppl",
    title="Streaming perplexity (attention sinks)",
    run=run,
    order=45,
    description="Perplexity over a long stream per cache policy: full, window, sinks + window, "
    "sliding window with re-computation.",
)
