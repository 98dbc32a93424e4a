"""Roll vs truncate on a long context, the analysis of their curves, and terminal-position de-rotation.

Roll by n (re-prefill without the first n tokens) against truncate by n (drop the last n slots) at
every n = 1..64 (step 1: RoPE's fastest period is ~6.3 tokens) and coarser beyond, on a >= 1,500
token window of the study text, plus the ten UltraChat conversations when present. The curves get a
linear regression (roll, truncate, difference), a detrended autocorrelation, an FFT with the
model's RoPE frequencies overlaid, a spectrogram and an aliasing check.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlab.data import shared_conversations
from kvlab.metrics import spectral as S
from kvlab.metrics.similarity import Derotate, compare_caches
from kvlab.metrics.stats import bootstrap_ci, bootstrap_curve
from kvlab.study.experiments import _rolling as R
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Progress, Table
from kvlab.study.report.format import format_interval, format_number, iv, num
from kvlab.study.report.plots import plot_band, style, subplots

CONV_ROLLS = (1, 8, 64)


def long_data(
    ctx: ExperimentContext, text: str | None = None, context: int | None = None
) -> tuple[dict[str, np.ndarray], Any, str]:
    """The memoised long-context measurement for this context's profile, with its text source."""
    model = ctx.handle()
    main = R.study_text(ctx, text)
    plan = R.plan_for(ctx, context=context)
    ids = R.encode_long(model, main, 0, max_chars=(plan.span + R.SKIP_FRONT_TOKENS) * 8)
    plan = R.plan_for(ctx, available=len(ids), context=context)
    data = R.long_roll_measure(model, ids, plan, ctx.progress, label=f"long rolls ({plan.context} tokens)")
    return data, plan, main.source


def curves(data: dict[str, np.ndarray], metric: str, kind: str = "roll") -> np.ndarray:
    """Last-position curves ``[ends, N]`` (mean over layers and heads) of ``roll``/``trunc`` for a metric."""
    return data[f"{kind}_{metric}_last"].mean(axis=(2, 3)).T


def conversation_rolls(
    model: Any, convs: list[dict], ns: tuple[int, ...], cap: int, progress: Progress
) -> dict:
    """Roll/truncate at the last position and roll mean over slots, per conversation: ``[C, len(ns)]``."""
    out = {
        k: np.full((len(convs), len(ns)), np.nan)
        for k in (
            "roll_k_last",
            "roll_kd_last",
            "roll_v_last",
            "trunc_k_last",
            "trunc_kd_last",
            "roll_k_mean",
            "roll_kd_mean",
        )
    }
    lengths = []
    with progress.task("long rolls: conversations", total=len(convs)) as advance:
        for c, conv in enumerate(convs):
            ids = model.encode(conv["full"])[:cap]
            T = len(ids)
            lengths.append(T)
            base = model.prefill(ids, all_logits=False).snapshot
            derot: Derotate = "correct" if base.rope is not None else "none"
            for j, n in enumerate(ns):
                if n >= T // 2:
                    continue
                rolled = model.prefill(ids[n:], all_logits=False).snapshot
                r = compare_caches(base, rolled, np.arange(n, T), np.arange(T - n), derotate=derot)
                t = compare_caches(base, base, [T - 1], [T - 1 - n], derotate=derot)
                out["roll_k_last"][c, j] = r.cos_k[..., -1].mean()
                out["roll_v_last"][c, j] = r.cos_v[..., -1].mean()
                out["roll_k_mean"][c, j] = r.cos_k.mean()
                out["trunc_k_last"][c, j] = t.cos_k.mean()
                if r.cos_k_derotated is not None:
                    out["roll_kd_last"][c, j] = r.cos_k_derotated[..., -1].mean()
                    out["roll_kd_mean"][c, j] = r.cos_k_derotated.mean()
                    out["trunc_kd_last"][c, j] = R.derotated(t).mean()
            advance(1)
    out["lengths"] = np.asarray(lengths)
    return out


def analysis(
    ns: np.ndarray, roll: np.ndarray, trunc: np.ndarray, rope: Any, fine_stop: int
) -> dict[str, Any]:
    """R4 on mean curves (n >= 1): regressions over all n, autocorrelation and FFT over the step-1 part."""
    sel = ns >= 1
    fits = S.roll_truncate_regression(ns[sel], roll[sel], trunc[sel])
    fine = sel & (ns <= fine_stop)
    out: dict[str, Any] = {
        "regression": {k: v.to_json() for k, v in fits.items()},
        "mean_difference": float(np.mean(roll[sel] - trunc[sel])),
    }
    out["autocorrelation_roll"] = S.detrended_autocorrelation(
        roll[fine], max_lag=min(32, int(fine.sum()) - 1)
    )
    out["autocorrelation_difference"] = S.detrended_autocorrelation(
        (roll - trunc)[fine], max_lag=min(32, int(fine.sum()) - 1)
    )
    out["spectrum_roll"] = S.spectrum(roll[fine], step=1.0)
    out["spectrum_truncate"] = S.spectrum(trunc[fine], step=1.0)
    if rope is not None:
        out["aliasing"] = S.aliasing_check(ns, rope)
    return out


def _rope_lines(ax: Any, rope: Any, nyquist: float = 0.5) -> None:
    freqs = [f for f in rope.frequencies_cycles_per_token() if f <= nyquist]
    for i, f in enumerate(freqs):
        ax.axvline(
            f, color="grey", lw=0.6, alpha=0.6, ls=":", label="RoPE pair frequencies" if i == 0 else None
        )


def _figures(
    ctx: ExperimentContext,
    data: dict,
    plan: Any,
    an: dict,
    rope: Any,
    name: str,
    conv: dict | None,
    ref: R.Reference,
) -> list:
    """Roll vs truncate, roll by n, curve analysis, and when their data exist: terminal de-rotation,
    conversations, the thread overlay."""
    ns = data["ns"]
    args = (ctx, data, plan, an, rope, name, conv, ref, ns, ns >= 1, plan.context)
    figs = [_fig_roll_vs_truncate(*args), _fig_roll_by_n(*args), _fig_curve_analysis(*args)]
    if "roll_kd_last" in data:
        figs.append(_fig_terminal_derotation(*args))
    if conv is not None:
        figs.append(_fig_conversations(*args))
    if ref.root is not None:
        figs.append(_fig_thread_overlay(*args))
    return figs


def _fig_roll_vs_truncate(ctx, data, plan, an, rope, name, conv, ref, ns, sel, T):
    fig, ax = subplots(figsize=(9, 4.4))
    for metric, kind, label in (
        ("k", "roll", "roll: raw K"),
        ("k", "trunc", "truncate: raw K"),
        ("v", "roll", "roll: V"),
        ("v", "trunc", "truncate: V"),
    ):
        plot_band(ax, ns[sel], curves(data, metric, kind)[:, sel], label, ls="-" if kind == "roll" else "--")
    ax.set_title(f"{name}: roll vs truncate at the last position ({T}-token window)")
    style(ax, "tokens removed (n)", "cosine of the last position vs the original's last position", legend=8)
    return ctx.figure(
        "roll_vs_truncate",
        fig,
        f"Roll keeps the last token (only its position moves); truncate "
        f"compares another token. Bands: bootstrap 95% over {len(plan.ends)} window ends.",
    )


def _fig_roll_by_n(ctx, data, plan, an, rope, name, conv, ref, ns, sel, T):
    fig, ax = subplots(figsize=(9, 4.2))
    for m, label in (("k", "raw K"), ("kd", "de-rotated K"), ("v", "V")):
        if f"roll_{m}_blocks" in data:
            plot_band(ax, ns[sel], data[f"roll_{m}_blocks"][sel].T, f"roll: {label}")
    ax.set_xscale("log")
    ax.set_title(f"Roll by n, mean over the window's slots ({T} tokens)")
    style(ax, "tokens rolled off (n)", "mean cosine over aligned slots", legend=8)
    return ctx.figure(
        "roll_mean_over_slots",
        fig,
        f"Mean over every aligned slot; bands: bootstrap over {plan.blocks} contiguous blocks of positions.",
    )


def _fig_curve_analysis(ctx, data, plan, an, rope, name, conv, ref, ns, sel, T):
    roll_m, trunc_m = curves(data, "k").mean(0), curves(data, "k", "trunc").mean(0)
    fig, axes = subplots(2, 2, figsize=(12, 8))
    ax = axes[0, 0]
    for key, label in (("roll", "roll"), ("truncate", "truncate"), ("difference", "roll - truncate")):
        y = roll_m if key == "roll" else trunc_m if key == "truncate" else roll_m - trunc_m
        (line,) = ax.plot(ns[sel], y[sel], lw=1, label=label)
        f = an["regression"][key]
        ax.plot(
            ns[sel],
            f["slope"] * ns[sel] + f["intercept"],
            ls="--",
            color=line.get_color(),
            label=f"fit: slope {f['slope']:.2e}/token, R² {f['r2']:.3f}",
        )
    style(ax, "n", "raw K cosine (last position)", "Linear regression")
    ax = axes[0, 1]
    for key, label in (("autocorrelation_roll", "roll"), ("autocorrelation_difference", "roll - truncate")):
        ax.plot(np.arange(an[key].size), an[key], marker="o", ms=3, label=label)
    ax.axhline(0, color="k", lw=0.6)
    style(
        ax,
        "lag (tokens)",
        "autocorrelation of the detrended curve",
        "Detrended autocorrelation (step-1 range)",
    )
    ax = axes[1, 0]
    for key, label in (("spectrum_roll", "roll"), ("spectrum_truncate", "truncate")):
        f, p = an[key]
        ax.semilogy(f[1:], p[1:], label=label)
    if rope is not None:
        _rope_lines(ax, rope)
    style(ax, "frequency (cycles per token)", "power", "FFT of the step-1 range with RoPE frequencies")
    ax = axes[1, 1]
    fine = sel & (ns <= plan.fine)
    fs, ts, sp = S.spectrogram(roll_m[fine], step=1.0, window=min(16, int(fine.sum()) // 2))
    mesh = ax.pcolormesh(ts + 1, fs, np.log10(sp + 1e-12), shading="auto")
    fig.colorbar(mesh, ax=ax, label="log10 power")
    if rope is not None:
        for f in rope.frequencies_cycles_per_token():
            if f <= 0.5:
                ax.axhline(f, color="w", lw=0.5, ls=":", alpha=0.7)
    style(ax, "tokens removed (n, window centre)", "frequency (cycles per token)", legend=None)
    ax.set_title("Spectrogram of the roll curve (dotted: RoPE frequencies)")
    fig.suptitle(f"{name}: curve analysis")
    return ctx.figure(
        "curve_analysis",
        fig,
        "Regression of roll, truncate and their difference; detrended "
        "autocorrelation; FFT against RoPE frequencies; spectrogram.",
    )


def _fig_terminal_derotation(ctx, data, plan, an, rope, name, conv, ref, ns, sel, T):
    fig, ax = subplots(figsize=(9, 4.2))
    for metric, kind, label in (
        ("k", "roll", "roll: raw"),
        ("kd", "roll", "roll: de-rotated"),
        ("k", "trunc", "truncate: raw"),
        ("kd", "trunc", "truncate: de-rotated"),
    ):
        plot_band(ax, ns[sel], curves(data, metric, kind)[:, sel], label, ls="-" if kind == "roll" else "--")
    ax.set_title("Terminal-position de-rotation (each key with its own position)")
    style(ax, "tokens removed (n)", "K cosine at the last position", legend=8)
    return ctx.figure(
        "terminal_derotation",
        fig,
        "De-rotating the last key with its own position removes "
        "the roll's drift; truncation's change is content and stays.",
    )


def _fig_conversations(ctx, data, plan, an, rope, name, conv, ref, ns, sel, T):
    fig, ax = subplots(figsize=(8, 4))
    x = np.asarray(CONV_ROLLS)
    for key, label in (
        ("roll_k_last", "roll: raw K (last)"),
        ("roll_kd_last", "roll: de-rotated K (last)"),
        ("trunc_k_last", "truncate: raw K (last)"),
        ("roll_v_last", "roll: V (last)"),
    ):
        samples = conv[key]
        if np.isfinite(samples).any():
            plot_band(ax, x, samples, label, marker="o", ms=4)
    ax.set_xscale("log")
    ax.set_title(f"Roll vs truncate on {conv['lengths'].size} UltraChat conversations")
    style(ax, "tokens removed (n)", "cosine at the last position", legend=8)
    return ctx.figure(
        "conversations",
        fig,
        "Same comparison over the ten conversations (bands: bootstrap 95% over conversations).",
    )


def _fig_thread_overlay(ctx, data, plan, an, rope, name, conv, ref, ns, sel, T):
    d = ref.get("results_rope_2000_roll_truncate_rope")
    d14 = ref.get("results_14b_base_roll_truncate")
    fig, ax = subplots(figsize=(9, 4.4))
    plot_band(ax, ns[sel] / T, curves(data, "k")[:, sel], f"{name} roll raw K", color="C0")
    plot_band(ax, ns[sel] / T, curves(data, "k", "trunc")[:, sel], f"{name} truncate raw K", color="C1")
    if "roll_kd_last" in data:
        plot_band(ax, ns[sel] / T, curves(data, "kd")[:, sel], f"{name} roll de-rotated K", color="C2")
    if d:
        x = np.asarray(d["ns"]) / d["seq_len"]
        ax.plot(x, d["roll_last_k_raw"], ":", color="C0", lw=1, label="Qwen2.5 roll raw K (thread)")
        ax.plot(x, d["trunc_last_k_raw"], ":", color="C1", lw=1, label="Qwen2.5 truncate raw K (thread)")
        ax.plot(x, d["roll_last_k_derot"], ":", color="C2", lw=1, label="Qwen2.5 roll de-rotated K (thread)")
    elif d14:
        x = np.asarray(d14["ns"]) / d14["seq_len"]
        ax.plot(x, d14["roll_last_k"], ":", color="C0", lw=1, label="Qwen2.5-14B roll raw K (thread)")
    ax.set_title(f"{name} (T={T}) vs the thread's Qwen2.5 (T=2000, step 5)")
    style(ax, "tokens removed as a fraction of the context (n / T)", "K cosine at the last position")
    return ctx.figure(
        "overlay_roll_truncate",
        fig,
        "This model's curves (bands) against the thread's "
        "single-run Qwen2.5 curves, on a normalised roll axis.",
    )


def run(ctx: ExperimentContext, *, text: str | None = None, context: int | None = None) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    handle = ctx.handle()
    data, plan, source = long_data(ctx, text, context)
    rope = handle.rope
    ns = data["ns"]
    roll_c, trunc_c = curves(data, "k"), curves(data, "k", "trunc")
    an = analysis(ns, roll_c.mean(0), trunc_c.mean(0), rope, fine_stop=plan.fine)
    ref = R.reference()
    conv = _conversations(ctx, result, handle)
    result.tables.append(_regression_table(an))
    result.tables.append(_last_position_table(data, ns, plan))
    _aliasing_notes(result, an, rope, ref)
    summary = _summary(data, plan, an, rope, conv, result)
    result.summary = summary
    result.arrays.update({k: np.asarray(v) for k, v in data.items()})
    result.arrays.update(
        {
            "autocorrelation_roll": an["autocorrelation_roll"],
            "spectrum_freq": an["spectrum_roll"][0],
            "spectrum_roll": an["spectrum_roll"][1],
            "spectrum_truncate": an["spectrum_truncate"][1],
        }
    )
    result.figures.extend(_figures(ctx, data, plan, an, rope, handle.name, conv, ref))
    if ref.root is None:
        result.notes.append(ref.note)
    result.data_sources.insert(
        0,
        f"{source}: window of {plan.context}..{plan.span} tokens, rolls n = "
        f"0..{plan.fine} step 1 then every "
        f"{plan.ns[-1] - plan.ns[-2]} up to {plan.ns[-1]}",
    )
    return result


def _conversations(ctx: ExperimentContext, result: ExperimentResult, handle) -> dict | None:
    """The same rolls over the UltraChat conversations, when present and the profile is not quick."""
    conv = None
    convs = shared_conversations()
    if convs and ctx.profile != "quick":
        conv = conversation_rolls(
            handle, convs, CONV_ROLLS, ctx.pick(quick=512, default=1024, full=4000), ctx.progress
        )
    elif not convs:
        result.notes.append(
            "UltraChat conversations not found (../shared/data absent): the book/docs window only."
        )
    else:
        result.notes.append("quick profile: the UltraChat conversations are skipped.")

    return conv


def _regression_table(an: dict) -> Table:
    """R4: linear fits of roll, truncate and their difference."""
    reg = an["regression"]
    return Table(
        "Linear regression of the last-position raw K cosine (n >= 1)",
        ["curve", "slope per token", "intercept", "R²", "points"],
        [[k, v["slope"], v["intercept"], v["r2"], v["n"]] for k, v in reg.items()],
        caption=f"Mean roll - truncate difference: {an['mean_difference']:.4f}. A constant offset shows as a slope near 0 "
        "with a low R² for the difference.",
    )


def _last_position_table(data: dict, ns: np.ndarray, plan: Any) -> Table:
    """Last-position cosine at selected rolls, with intervals over window ends."""
    rows = []
    for n in (1, 2, 3, 5, 10, 20, 64, 256, 1024):
        if n in set(ns.tolist()):
            j = int(np.where(ns == n)[0][0])
            row: list[int | str] = [n]
            for m, kind in (("k", "roll"), ("kd", "roll"), ("v", "roll"), ("k", "trunc"), ("kd", "trunc")):
                key = f"{kind}_{m}_last"
                if key in data:
                    c = curves(data, m, kind)[:, [j]]
                    mean, low, high = bootstrap_curve(c)
                    row.append(format_interval(mean[0], low[0], high[0], 4, n=c.shape[0]))
                else:
                    row.append("–")
            rows.append(row)
    return Table(
        f"Last-position cosine (mean [bootstrap 95%] over {len(plan.ends)} window ends)",
        ["n", "roll raw K", "roll de-rot. K", "roll V", "truncate raw K", "truncate de-rot. K"],
        rows,
        caption="Roll compares the same token after its position moved by n; truncate compares the last kept token "
        "with the original last token (a different token).",
    )


def _aliasing_notes(result: ExperimentResult, an: dict, rope: Any, ref: R.Reference) -> None:
    """Whether the sampled rolls can resolve the fastest RoPE period (ours and the thread's)."""
    if rope is None:
        return
    alias = an["aliasing"]
    result.notes.append(alias.message())
    ref14 = ref.get("results_14b_base_roll_truncate") if ref.root else None
    if ref14:
        result.notes.append(
            "thread's sampling (step 5): " + S.aliasing_check(np.asarray(ref14["ns"]), rope).message()
        )


def _summary(data: dict, plan: Any, an: dict, rope: Any, conv: dict | None, result: ExperimentResult) -> dict:
    """The summary (and the conversations' arrays and source, when measured)."""
    ns = data["ns"]
    reg = an["regression"]
    summary: dict[str, Any] = {
        "context_tokens": plan.context,
        "window_ends": list(plan.ends),
        "roll_amounts": ns.tolist(),
        "regression": reg,
        "mean_difference_roll_minus_truncate": an["mean_difference"],
        "difference_change_over_range": reg["difference"]["slope"] * float(ns.max() - 1),
        # The same mean gap, one value per window end (the samples: ends a few tokens apart, so correlated)
        "difference_by_window_end": bootstrap_ci(
            (curves(data, "k") - curves(data, "k", "trunc"))[:, ns >= 1].mean(axis=1)
        ).to_json(),
        "aliasing_ok": bool(an["aliasing"].ok) if rope is not None else None,
        "aliasing": an["aliasing"].message() if rope is not None else "model has no RoPE",
        "fastest_rope_period_tokens": float(min(rope.periods_tokens())) if rope is not None else None,
    }
    for n in R.SMALL_ROLLS:
        j = np.where(ns == n)[0]
        if j.size:
            summary.setdefault("roll_last", {})[str(n)] = {
                m: float(curves(data, m)[:, j[0]].mean())
                for m in ("k", "kd", "v")
                if f"roll_{m}_last" in data
            }
            summary.setdefault("roll_mean", {})[str(n)] = {
                m: float(data[f"roll_{m}_mean"][j[0]].mean())
                for m in ("k", "kd", "kb", "v")
                if f"roll_{m}_mean" in data
            }
    if conv is not None:
        summary["conversations"] = {
            "lengths": conv["lengths"].tolist(),
            "ns": list(CONV_ROLLS),
            "offset_roll_minus_truncate_last_k": float(
                np.nanmean(conv["roll_k_last"] - conv["trunc_k_last"])
            ),
        }
        result.arrays.update({f"conv_{k}": v for k, v in conv.items()})
        result.data_sources.append(
            f"UltraChat conversations (../shared/data/ultrachat_compaction.json), {conv['lengths'].size} "
            f"conversations, up to {int(conv['lengths'].max())} tokens"
        )
    return summary


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    gap = num(s, "mean_difference_roll_minus_truncate")
    change = num(s, "difference_change_over_range")
    text = (
        f"On a {s.get('context_tokens', '?')}-token context, rolled keys stay {format_number(gap)} above truncated "
        f"ones in raw K cosine at the last position, and the gap moves by {format_number(change)} over "
        "the whole range of roll sizes: "
        + (
            "a constant offset, not a trend."
            if gap and change is not None and abs(change) < abs(gap) / 4
            else "not a constant offset."
        )
    )
    rows = [
        ("roll minus truncate, mean (raw K cosine)", iv(s, "mean_difference_roll_minus_truncate")),
        ("change of the gap over the range", iv(s, "difference_change_over_range")),
        ("R² of the gap's linear trend", iv(s, "regression.difference.r2")),
        ("raw K cosine after a 1-token roll", iv(s, "roll_mean.1.k")),
        ("de-rotated K cosine after a 1-token roll", iv(s, "roll_mean.1.kd")),
    ]
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="where in the text the long context starts",
    describe=describe,
    name="roll_long",
    title="Roll vs truncate on a long context",
    run=run,
    order=32,
    description="Step-1 roll and truncate curves on a long context, their regression, "
    "autocorrelation, spectrum against RoPE, and terminal de-rotation.",
)
