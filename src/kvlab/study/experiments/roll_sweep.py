"""Roll sweep, controls and sink-aware similarity, over many samples of one text.

For each window of ``T`` tokens: the original cache, the re-prefilled rolls (n = 1, 2, 3, 5, 10, 20
and 10/25/50% of the window), two truncations (cache slices), a seeded scramble and an unrelated
text. Each condition is compared with the original slot by slot (roll: original n..T-1 vs rolled
0..T-n-1; controls: same positions) for raw K, correctly de-rotated K and V, plain and mean-centred,
with the first 0/1/4 aligned slots excluded, and normalised against the unrelated baseline.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlab.errors import BadInputError
from kvlab.metrics.similarity import compare_caches, normalise_against_baseline
from kvlab.metrics.stats import bootstrap_ci
from kvlab.ops.perturb import align_positions, align_roll, align_tokens, align_truncate, scramble_tokens
from kvlab.policy.window import roll_amount
from kvlab.study.experiments import _rolling as R
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Progress, Table
from kvlab.study.report.format import format_interval, format_number, iv, num
from kvlab.study.report.plots import plot_band, style, subplots

ROLL_FRACTIONS = (0.1, 0.25, 0.5)
EXCLUDE = (0, 1, 4)
METRICS = ("k", "kd", "v", "kc", "vc", "l2k", "l2v")
METRIC_LABELS = {
    "k": "cos K (raw)",
    "kd": "cos K (de-rotated)",
    "v": "cos V",
    "kc": "cos K (centred)",
    "vc": "cos V (centred)",
    "l2k": "L2 K (norm.)",
    "l2v": "L2 V (norm.)",
}


def conditions(T: int) -> list[tuple[str, str, float]]:
    """``(name, kind, amount)`` for every condition of a window of ``T`` tokens (amount 0 for the controls)."""
    out: list[tuple[str, str, float]] = [(f"roll_{n}", "roll", n) for n in R.SMALL_ROLLS if n < T - 1]
    out += [(f"roll_{int(f * 100)}pct", "roll", f) for f in ROLL_FRACTIONS]
    out += [("truncate_1", "truncate", 1), ("truncate_25pct", "truncate", 0.25)]
    out += [
        ("scrambled", "scrambled", 0),
        ("scrambled_by_token", "scrambled_tokens", 0),
        ("unrelated", "unrelated", 0),
    ]
    return out


def _measure(a, b, ia, ib) -> dict[str, np.ndarray]:
    c = compare_caches(a, b, ia, ib, derotate="correct")
    cc = compare_caches(a, b, ia, ib, derotate="none", center=True)
    if c.l2_k is None or c.l2_v is None:
        raise ValueError("compare_caches left out the L2 arrays it computes by default")
    out = {"k": c.cos_k, "v": c.cos_v, "kc": cc.cos_k, "vc": cc.cos_v, "l2k": c.l2_k, "l2v": c.l2_v}
    if c.cos_k_derotated is not None:
        out["kd"] = c.cos_k_derotated
    return out


def measure_sweep(
    model: Any,
    windows: list[list[int]],
    control_windows: list[list[int]],
    seed: int,
    progress: Progress | None = None,
    batch: int = 16,
) -> dict[str, dict[str, list[np.ndarray]]]:
    """``{condition: {metric: [per-window [L, H, P] arrays]}}``; each condition is one batched prefill."""
    T = len(windows[0])
    conds = conditions(T)
    raw: dict[str, dict[str, list[np.ndarray]]] = {c[0]: {} for c in conds}
    origs = R.prefill_rows(model, windows, batch)
    scr_ids = [scramble_tokens(ids, seed=seed * 1000 + w) for w, ids in enumerate(windows)]
    scr = None
    with (progress or Progress()).task("roll sweep: conditions", total=len(conds)) as advance:
        for name, kind, amount in conds:
            if kind == "roll":
                n = roll_amount(amount, T)
                others = R.prefill_rows(model, [ids[n:] for ids in windows], batch)
                als = [align_roll(T, n)] * len(windows)
            elif kind == "truncate":
                n = roll_amount(amount, T)
                others = [
                    o.slice(0, T - n) for o in origs
                ]  # by causality, identical to re-prefilling ids[:-n]
                als = [align_truncate(T, n)] * len(windows)
            elif kind in ("scrambled", "scrambled_tokens"):
                scr = scr if scr is not None else R.prefill_rows(model, scr_ids, batch)
                others = scr
                als = (
                    [align_positions(T, T)] * len(windows)
                    if kind == "scrambled"
                    else [align_tokens(ids, s) for ids, s in zip(windows, scr_ids, strict=True)]
                )
            else:
                others = R.prefill_rows(model, control_windows, batch)
                als = [align_positions(T, len(c)) for c in control_windows]
            for orig, other, al in zip(origs, others, als, strict=True):
                for m, arr in _measure(orig, other, al.idx_a, al.idx_b).items():
                    raw[name].setdefault(m, []).append(arr)
            advance(1)
    return raw


def _ci(samples: np.ndarray, seed: int) -> dict[str, float | None]:
    """Bootstrap interval as JSON; NaN (n = 0) when no window has the value (e.g. all slots excluded)."""
    if not np.isfinite(samples).any():
        return {"value": float("nan"), "low": None, "high": None, "n": 0}
    return bootstrap_ci(samples, seed=seed).to_json()


def _bound(iv: dict, key: str) -> float:
    """An interval's ``low``/``high`` for plotting: NaN (nothing drawn) where it has none."""
    return float("nan") if iv[key] is None else iv[key]


def summarise(raw: dict[str, dict[str, list[np.ndarray]]], seed: int = 0) -> dict[str, dict[str, Any]]:
    """Mean and bootstrap 95% interval over text samples of every (condition, metric, excluded slots)."""
    out: dict[str, dict[str, Any]] = {}
    unrel = {m: np.array([a.mean() for a in raw["unrelated"][m]]) for m in raw["unrelated"]}
    for cond, metrics in raw.items():
        out[cond] = {}
        for m, arrs in metrics.items():
            for k in EXCLUDE:
                per_window = np.array([a[..., k:].mean() if a.shape[-1] > k else np.nan for a in arrs])
                out[cond][f"{m}_x{k}"] = _ci(per_window, seed)
            per_window = np.array([a.mean() for a in arrs])
            if m in ("k", "v", "kd", "kc", "vc"):
                normed = np.asarray(normalise_against_baseline(per_window, unrel[m]))
                out[cond][f"{m}_normalised"] = _ci(normed, seed)
    return out


#: the thread's control order, lowest cosine to the original first
CONTROL_ORDER = ("unrelated", "scrambled", "roll_20")


def paired_order(raw: dict[str, dict[str, list[np.ndarray]]], seed: int = 0) -> dict[str, dict[str, Any]]:
    """``{"scrambled-unrelated": {"k": iv, "v": iv}, "roll_20-scrambled": {...}}``: per text sample, the
    higher condition's mean K (V) cosine to the original minus the lower one's (both against the same
    original window), mean with a 95% bootstrap interval over text samples."""
    out: dict[str, dict[str, Any]] = {}
    for lo, hi in zip(CONTROL_ORDER, CONTROL_ORDER[1:], strict=False):
        out[f"{hi}-{lo}"] = {
            m: _ci(np.array([b.mean() - a.mean() for a, b in zip(raw[lo][m], raw[hi][m], strict=True)]), seed)
            for m in ("k", "v")
        }
    return out


def _stack_padded(arrs: list[np.ndarray], reduce_axes: tuple[int, ...], length: int) -> np.ndarray:
    """Per-window curves (mean over ``reduce_axes``), NaN-padded to ``length`` -> ``[W, length]``."""
    out = np.full((len(arrs), length), np.nan)
    for i, a in enumerate(arrs):
        c = a.mean(axis=reduce_axes)
        out[i, : c.shape[-1]] = c
    return out


def _figures(
    ctx: ExperimentContext, raw: dict, summ: dict, T: int, model_name: str, ref: R.Reference
) -> list:
    """The sweep, per layer, per aligned slot, and (with the reference files) the thread overlay."""
    figs = [
        _sweep_figure(ctx, raw, summ, T, model_name),
        _layer_figure(ctx, raw, model_name),
        _position_figure(ctx, raw, T),
    ]
    if ref.root is not None:
        figs.extend(_overlay(ctx, raw, summ, T, model_name, ref))
    return figs


def _sweep_figure(ctx: ExperimentContext, raw: dict, summ: dict, T: int, model_name: str):
    rolls = [c for c in raw if c.startswith("roll_")]
    counts = np.array(
        [roll_amount(float(c[5:-3]) / 100 if c.endswith("pct") else int(c[5:]), T) for c in rolls]
    )
    order = np.argsort(counts)
    fig, ax = subplots(figsize=(8, 4.4))
    for m, fmt in (("k", "o-"), ("kd", "s-"), ("v", "^-")):
        if m not in raw[rolls[0]]:
            continue
        mean = np.array([summ[rolls[i]][f"{m}_x0"]["value"] for i in order])
        lo = np.array([_bound(summ[rolls[i]][f"{m}_x0"], "low") for i in order])
        hi = np.array([_bound(summ[rolls[i]][f"{m}_x0"], "high") for i in order])
        (line,) = ax.plot(counts[order], mean, fmt, ms=4, label=f"roll: {METRIC_LABELS[m]}")
        ax.fill_between(counts[order], lo, hi, color=line.get_color(), alpha=0.25, lw=0)
    for cond, ls in (("scrambled", "--"), ("unrelated", ":")):
        for m, color in (("k", "C0"), ("v", "C2")):
            iv = summ[cond][f"{m}_x0"]
            ax.axhline(iv["value"], color=color, ls=ls, lw=1, label=f"{cond}: {METRIC_LABELS[m]}")
            ax.axhspan(_bound(iv, "low"), _bound(iv, "high"), color=color, alpha=0.12)
    ax.set_xscale("log")
    title = f"{model_name}: roll sweep over {len(raw[rolls[0]]['k'])} text samples of {T} tokens"
    ylabel = "cosine vs original (mean over layers, heads, slots)"
    style(ax, "tokens rolled off the front (n)", ylabel, title, ncol=2)
    return ctx.figure(
        "roll_sweep",
        fig,
        "Raw K drops with the roll while de-rotated K and V stay high; "
        "dashed/dotted: scrambled and unrelated controls (bands: bootstrap 95%).",
    )


def _layer_figure(ctx: ExperimentContext, raw: dict, model_name: str):
    fig, axes = subplots(1, 2, figsize=(11, 4))
    for ax, m in zip(axes, ("k", "v"), strict=True):
        for c in ("roll_1", "roll_5", "roll_20", "scrambled", "unrelated"):
            if c in raw:
                samples = np.stack([a.mean(axis=(1, 2)) for a in raw[c][m]])
                plot_band(ax, np.arange(samples.shape[1]), samples, c)
        style(ax, "layer", METRIC_LABELS[m], f"{METRIC_LABELS[m]} per layer")
    fig.suptitle(f"{model_name}: per-layer similarity to the original")
    return ctx.figure(
        "per_layer", fig, "Per-layer cosine for rolls and controls (bands: bootstrap 95% over text samples)."
    )


def _position_figure(ctx: ExperimentContext, raw: dict, T: int):
    fig, ax = subplots(figsize=(8, 4))
    for c in ("roll_1", "roll_5", "roll_20"):
        if c in raw:
            for m, ls in (("k", "-"), ("v", "--")):
                samples = _stack_padded(raw[c][m], (0, 1), T)
                keep = ~np.all(np.isnan(samples), axis=0)
                x = np.arange(T)[keep]
                plot_band(ax, x[:48], samples[:, keep][:, :48], f"{c} {METRIC_LABELS[m]}", ls=ls)
    xlabel = "aligned slot (0 = the rolled cache's first slot, its new attention sink)"
    style(ax, xlabel, "cosine vs original", "Sink-aware view: similarity per aligned slot (first 48)", ncol=2)
    return ctx.figure(
        "per_position",
        fig,
        "Slot 0 of a rolled cache becomes the new attention sink and "
        "differs most; report means with and without it.",
    )


def _overlay(
    ctx: ExperimentContext, raw: dict, summ: dict, T: int, model_name: str, ref: R.Reference
) -> list:
    """This model beside the thread's Qwen2.5 runs: per layer, and against the roll fraction."""
    return [_overlay_layers(ctx, raw, model_name, ref), _overlay_fraction(ctx, raw, summ, T, model_name, ref)]


def _overlay_layers(ctx: ExperimentContext, raw: dict, model_name: str, ref: R.Reference):
    fig, axes = subplots(1, 2, figsize=(11, 4))
    for ax, m, key in zip(axes, ("k", "v"), ("cos_k", "cos_v"), strict=True):
        for c, color in (("roll_1", "C0"), ("roll_5", "C1"), ("roll_20", "C3")):
            if c not in raw:
                continue
            samples = np.stack([a.mean(axis=(1, 2)) for a in raw[c][m]])
            plot_band(ax, np.linspace(0, 1, samples.shape[1]), samples, f"{model_name} {c}", color=color)
            for fname, ls in (("orig_7b_base_results", "--"), ("orig_14b_base_results", ":")):
                d = ref.get(fname)
                if d and c in d:
                    per_layer = np.asarray(d[c][key]["per_layer"])
                    ax.plot(
                        np.linspace(0, 1, per_layer.size),
                        per_layer,
                        ls,
                        color=color,
                        lw=1,
                        label=f"Qwen2.5-{fname.split('_')[1]} {c}",
                    )
        ax.set_title(f"{METRIC_LABELS[m]} per layer")
        style(ax, "layer depth (fraction of the stack)", METRIC_LABELS[m], legend=None)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{model_name} (solid, bands) vs the thread's Qwen2.5 (dashed 7B, dotted 14B)")
    return ctx.figure(
        "overlay_per_layer",
        fig,
        "Per-layer roll similarity against the thread's Qwen2.5 "
        "(87-token prompt, one run): depth as a fraction of the stack.",
    )


def _overlay_fraction(
    ctx: ExperimentContext, raw: dict, summ: dict, T: int, model_name: str, ref: R.Reference
):
    fig, ax = subplots(figsize=(8, 4))
    rolls = [c for c in raw if c.startswith("roll_") and not c.endswith("pct")]
    ns = np.array([int(c[5:]) for c in rolls])
    for m, color in (("k", "C0"), ("v", "C2")):
        ys = [summ[c][f"{m}_x0"] for c in rolls]
        ax.errorbar(
            ns / T,
            [y["value"] for y in ys],
            yerr=np.nan_to_num(
                [[y["value"] - _bound(y, "low") for y in ys], [_bound(y, "high") - y["value"] for y in ys]]
            ),
            fmt="o-",
            color=color,
            ms=4,
            capsize=2,
            label=f"{model_name} {METRIC_LABELS[m]} (T={T})",
        )
        for fname, ls in (("orig_7b_base_results", "--"), ("orig_14b_base_results", ":")):
            d = ref.get(fname)
            if d:
                keys = [c for c in rolls if c in d]
                n_ref = len(d["truncated"]["cos_k"]["per_position"]) + 1 if "truncated" in d else 87
                ax.plot(
                    [int(c[5:]) / n_ref for c in keys],
                    [d[c]["cos_" + m]["mean"] for c in keys],
                    ls + "x",
                    color=color,
                    lw=1,
                    label=f"Qwen2.5-{fname.split('_')[1]} {METRIC_LABELS[m]} (T={n_ref})",
                )
    ax.set_title("Roll sweep side by side with the thread")
    style(ax, "roll as a fraction of the context (n / T)", "mean cosine vs original")
    return ctx.figure(
        "overlay_roll_fraction",
        fig,
        "Mean K and V cosine against roll fraction, this model "
        "(bootstrap 95% bars) vs the thread's single Qwen2.5 runs.",
    )


def run(
    ctx: ExperimentContext, *, text: str | None = None, windows: int | None = None, context: int | None = None
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    handle = ctx.handle()
    T = int(ctx.count("context", context, quick=96, default=128, full=256))
    W = int(ctx.count("windows", windows, quick=4, default=20, full=50))
    if T < 24:
        raise BadInputError(f"the roll sweep needs text samples of at least 24 tokens, got {T}")
    main = R.study_text(ctx, text)
    wins, ctrls, ctrl_source = _samples(ctx, handle, main, T, W)
    raw = measure_sweep(handle, wins, ctrls, ctx.seed, ctx.progress)
    summ = summarise(raw, ctx.seed)
    ref = R.reference()

    result.tables.append(_similarity_table(raw, summ, T, W))
    result.tables.append(_sink_table(summ))
    if ref.root is not None:
        result.tables.append(_thread_table(ref, summ))
    else:
        result.notes.append(ref.note)
    result.summary = {
        "windows": W,
        "context_tokens": T,
        "conditions": summ,
        "control_order_paired": paired_order(raw, ctx.seed),
        "roll_counts": {c: roll_amount(a, T) for c, k, a in conditions(T) if k in ("roll", "truncate")},
    }
    result.arrays.update(_arrays(raw))
    result.figures.extend(_figures(ctx, raw, summ, T, handle.name, ref))
    result.data_sources += [
        f"{main.source}: {W} text samples of {T} tokens",
        f"unrelated control: {ctrl_source}",
    ]
    result.notes.append(
        "Full [sample, layer, head, slot] cosines for K, de-rotated K and V are saved as float16 in "
        "arrays.npz; centred cosines and L2 as [sample, layer, head] means."
    )
    return result


def _samples(ctx: ExperimentContext, handle, main, T: int, W: int):
    """``W`` samples of ``T`` tokens of the main text, and as many of the unrelated control."""
    from kvlab.data import token_samples

    ids = R.encode_long(handle, main, T * W, max_chars=T * W * 12)
    ctrl_text = R.control_text(main)
    if ctrl_text is main:
        ctrl_ids_all = ids[len(ids) // 2 :] + ids[: len(ids) // 2]  # distant windows of the same corpus
        ctrl_source = f"{main.source}, text samples half the corpus away"
    else:
        ctrl_ids_all = R.encode_long(handle, ctrl_text, T * W, max_chars=T * W * 12)
        ctrl_source = ctrl_text.source
    wins = token_samples(ids, T, W, seed=ctx.seed)
    ctrls = token_samples(ctrl_ids_all, T, W, seed=ctx.seed + 1)
    return wins, ctrls, ctrl_source


def _similarity_table(raw: dict, summ: dict, T: int, W: int) -> Table:
    """Similarity of every condition to the original: raw, de-rotated, centred, sink-excluded, normalised."""
    rows = []
    for cond in raw:
        row = [cond]
        for m in ("k", "kd", "v", "kc", "vc"):
            iv = summ[cond].get(f"{m}_x0")
            row.append(format_interval(iv, digits=4) if iv else "–")
        row += [
            summ[cond]["k_x1"]["value"],
            summ[cond]["v_x1"]["value"],
            summ[cond].get("k_normalised", {}).get("value"),
            summ[cond].get("v_normalised", {}).get("value"),
        ]
        rows.append(row)
    return Table(
        f"Similarity to the original ({W} text samples of {T} tokens; mean [bootstrap 95%] from 5 samples on)",
        Table.header(
            "condition | cos K | cos K de-rot. | cos V | cos K centred | cos V centred | "
            "cos K w/o slot 0 | cos V w/o slot 0 | K vs unrelated (norm.) | V vs unrelated (norm.)"
        ),
        rows,
        caption="Roll: original slots n..T-1 vs rolled 0..T-n-1. Truncate: cache slice (exactly 1 by causality). "
        "Scrambled: same positions (or same token ids: scrambled_by_token). Normalised: (c - c_unrel)/(1 - c_unrel).",
    )


def _sink_table(summ: dict) -> Table:
    """B2: means with the first k aligned slots excluded."""
    sink_rows = []
    for cond in ("roll_1", "roll_5", "roll_20"):
        if cond in summ:
            sink_rows.append([cond] + [summ[cond][f"{m}_x{k}"]["value"] for m in ("k", "v") for k in EXCLUDE])
    return Table(
        "Sink-aware means (first k aligned slots excluded)",
        ["condition"] + [f"cos {m.upper()} excl. {k}" for m in ("k", "v") for k in EXCLUDE],
        sink_rows,
    )


def _thread_table(ref, summ: dict) -> Table:
    """This model's numbers beside the thread's reference files."""
    rrows = []
    for fname in ("orig_7b_base_results", "orig_14b_base_results"):
        d = ref.get(fname) or {}
        for cond in ("roll_1", "roll_5", "roll_20", "scrambled", "unrelated"):
            if cond in d and cond in summ:
                rrows.append(
                    [
                        cond,
                        f"Qwen2.5-{fname.split('_')[1]}",
                        d[cond]["cos_k"]["mean"],
                        summ[cond]["k_x0"]["value"],
                        d[cond]["cos_v"]["mean"],
                        summ[cond]["v_x0"]["value"],
                    ]
                )
    return Table(
        "Side by side with the thread",
        Table.header(
            "condition | thread model | thread cos K | this model cos K | thread cos V | this model cos V"
        ),
        rrows,
        caption="Thread: one 87-token prompt, one run; this model: mean over text samples.",
    )


def _arrays(raw: dict) -> dict:
    """Full per-slot cosines as float16 and per-layer-head means of the rest."""
    arrays = {}
    for cond, metrics in raw.items():
        for m in ("k", "kd", "v"):
            if m in metrics:
                arrays[f"{cond}_{m}"] = np.stack(metrics[m]).astype(np.float16)  # [W, L, H, P]
        for m in ("kc", "vc", "l2k", "l2v"):
            arrays[f"{cond}_{m}_per_layer_head"] = np.stack([a.mean(-1) for a in metrics[m]])  # [W, L, H]
    return arrays


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    derotated, raw = num(s, "conditions.roll_1.kd_x4"), num(s, "conditions.roll_1.k_x4")
    text = (
        f"Rolling one token keeps de-rotated K at cosine {format_number(derotated)} and raw K at "
        f"{format_number(raw)} of the original (4 sinks excluded); scrambled and unrelated text fall to "
        f"{format_number(num(s, 'conditions.scrambled.k_x4'))} and {format_number(num(s, 'conditions.unrelated.k_x4'))} raw K cosine."
    )
    rows = [
        ("raw K cosine, roll 1", iv(s, "conditions.roll_1.k_x4")),
        ("de-rotated K cosine, roll 1", iv(s, "conditions.roll_1.kd_x4")),
        ("V cosine, roll 1", iv(s, "conditions.roll_1.v_x4")),
        ("raw K cosine, roll 25%", iv(s, "conditions.roll_25pct.k_x4")),
        ("raw K cosine, scrambled", iv(s, "conditions.scrambled.k_x4")),
        ("raw K cosine, unrelated text", iv(s, "conditions.unrelated.k_x4")),
    ]
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="where in the text the text samples and the control samples are cut, and the scramble",
    describe=describe,
    name="roll_sweep",
    title="Roll sweep and controls",
    run=run,
    order=30,
    description="How similar a rolled cache stays to the original, against scrambled and "
    "unrelated controls, sink-aware and baseline-normalised.",
)
