"""Cache compression: quantizers and eviction policies, measured on the same contexts side by side.

For every quantizer x bit width and every eviction policy x kept fraction: q·k distortion, attention
KL and attention-output error per layer (reference = the continuation's own queries), perplexity of
the continuation teacher-forced on the compressed context, the KL divergence and top-1 agreement of
those continuation logits to the full cache's (same forwards, no extra prefill), needle retrieval with
the context compressed before the question, bytes really held, and decode time per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.data import Text, default_long_text, python_docs, read_text_file, token_samples
from kvlab.errors import BadInputError
from kvlab.metrics import bootstrap_ci, bootstrap_curve
from kvlab.metrics.divergence import divergence_summary
from kvlab.metrics.stats import MIN_SAMPLES
from kvlab.policy.evict import POLICIES, Observation, evict, kept_per_head, make_policy, observe, repack
from kvlab.policy.evict.learned import DEFAULT_WEIGHTS
from kvlab.policy.evict.select import budget_slots
from kvlab.policy.measure import continuation_quality, distortion, reference, time_decode_ms
from kvlab.policy.quant import make_quantizer, quantize_snapshot
from kvlab.policy.quant.methods import QUANTIZERS, quantizer_names
from kvlab.policy.quant.scalar import check_bits
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import format_interval, format_number, iv, num
from kvlab.study.report.plots import style, subplots


def _quant_methods() -> dict[str, tuple[str, dict]]:
    """label -> (codec, options): every registered codec (:data:`~kvlab.policy.quant.methods.QUANTIZERS`,
    plus ``rotation+qjl``), alone and as ``+sinks`` (the first 4 slots kept in full precision)."""
    out: dict[str, tuple[str, dict]] = {}
    for name in quantizer_names():
        out[name] = (name, {})
        out[f"{name}+sinks"] = (name, {"sinks": 4})
    return out


#: read from the registries, so a codec or an eviction policy added in one file is measured here too
QUANT_METHODS: dict[str, tuple[str, dict]] = _quant_methods()
POLICY_NAMES = tuple(POLICIES)
REPACK_POLICIES = ("streaming_llm", "snapkv", "learned")
BITS = (8, 4, 3, 2)
KEEPS = (0.75, 0.5, 0.25, 0.1)
NEEDLE_WORDS = (
    "lighthouse",
    "pineapple",
    "saxophone",
    "glacier",
    "marigold",
    "telescope",
    "cinnamon",
    "harbour",
)
TRAIN_CHARS = 150_000  # the learned evictor trains on the first 150k characters of the Python docs


def evaluation_text(path: str | Path | None) -> Text:
    """``--text FILE``, else Frankenstein, else the Python docs past the evictor's training part."""
    if path:
        return read_text_file(path)
    text = default_long_text()
    if text.source == python_docs().source:
        return Text(
            text.text[TRAIN_CHARS + 50_000 :], text.source + " (after the learned evictor's training part)"
        )
    return text


def _ctx_observation(obs: Observation, n_ctx: int) -> Observation:
    return Observation(
        obs.snapshot.slice(0, n_ctx),
        tuple(q[:, :, :n_ctx] for q in obs.queries),
        obs.logits[:n_ctx],
        obs.scaling,
        handle=obs.handle,  # a score's extra pass after the context (kvzip) runs through it
    )


def needle_prompts(
    model: Any, filler_ids: list[int], length: int, depth: float, word: str
) -> tuple[list[int], list[int]]:
    """(context ids with the needle at ``depth``, question ids); the question is never compressed."""
    needle = model.encode(f" Remember this: the secret code word is {word}. ")
    body = filler_ids[: max(length - len(needle), 1)]
    cut = int(depth * len(body))
    context = body[:cut] + needle + body[cut:]
    question = model.encode(" Question: what is the secret code word? Answer: the secret code word is")
    return context, question


def evaluation_windows(
    model: Any, src: Text, n_ctx: int, n_cont: int, n_win: int, seed: int
) -> list[list[int]]:
    """``n_win`` text samples of ``n_ctx + n_cont`` tokens, evenly spread over ``src``."""
    ids = model.encode(src.text[: (n_ctx + n_cont) * n_win * 8 + 40_000])
    return token_samples(ids, n_ctx + n_cont, n_win, seed=seed)


def needle_trials(
    model: Any, src: Text, lengths: list[int], depths: list[float]
) -> list[tuple[list[int], list[int], str]]:
    """``(context, question, word)`` per length x depth; the filler is the end of ``src``."""
    filler = model.encode(src.text[-60_000:])
    out = []
    for i, (length, depth) in enumerate((L, d) for L in lengths for d in depths):
        word = NEEDLE_WORDS[i % len(NEEDLE_WORDS)]
        context, question = needle_prompts(model, filler, length, depth, word)
        out.append((context, question, word))
    return out


def run(
    ctx: ExperimentContext,
    *,
    text: str | Path | None = None,
    context_tokens: int | None = None,
    continuation_tokens: int | None = None,
    windows: int | None = None,
    bits: list[int] | None = None,
    keeps: list[float] | None = None,
    methods: list[str] | None = None,
    policies: list[str] | None = None,
    needle_lengths: list[int] | None = None,
    needle_depths: list[float] | None = None,
    needle_configs: list[str] | None = None,
    timing_steps: int | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    handle = ctx.handle()
    n_ctx = ctx.count("context_tokens", context_tokens, 256, 512, 1500)
    n_cont = ctx.count("continuation_tokens", continuation_tokens, 48, 128, 256)
    n_win = ctx.count("windows", windows, 1, 2, 8)
    bits, keeps, methods, policies = _choices(ctx, result, bits, keeps, methods, policies)
    src = seeded_text(evaluation_text(text), ctx.seed)
    wins = evaluation_windows(handle, src, n_ctx, n_cont, n_win, ctx.seed)
    result.arrays["window_token_ids"] = np.array(wins)
    result.data_sources.append(
        f"{src.source}: {n_win} text samples of {n_ctx} context + {n_cont} continuation tokens"
    )
    configs: list[tuple[str, str, float, str]] = [("full", "none", 0.0, "keep")]
    configs += [("quant", m, float(b), "keep") for m in methods for b in _widths(m, bits)]
    configs += [("evict", p, float(k), "keep") for p in policies for k in keeps]
    configs += [
        ("evict", p, float(k), "repack") for p in policies if p in REPACK_POLICIES for k in keeps if k == 0.5
    ]
    names = [_label(c) for c in configs]
    quality, layer_stats, nbytes, full_bytes = _measure(ctx, handle, wins, configs, names, n_ctx)
    needle = _needle(ctx, handle, src, configs, names, needle_lengths, needle_depths, needle_configs, result)
    timing = (
        _timing(ctx, handle, wins[0][:n_ctx], methods, policies, timing_steps) if timing_steps != 0 else {}
    )
    return _report(
        ctx, result, configs, names, quality, layer_stats, nbytes, full_bytes, needle, timing, n_ctx, handle
    )


def _widths(method: str, bits) -> list[int]:
    """The bit widths a codec is measured at: the profile's, or its own where the width is its kind (fp8)."""
    fixed = getattr(QUANTIZERS.get(QUANT_METHODS[method][0]), "fixed_bits", None)
    return [fixed] if fixed is not None else list(bits)


def _choices(ctx: ExperimentContext, result: ExperimentResult, bits, keeps, methods, policies):
    """Bit widths, budgets, quantizers and policies for this profile, validated before any work."""
    bits = list(bits or ctx.pick((4, 2), (4, 3, 2), BITS))
    keeps = list(keeps or ctx.pick((0.5, 0.25), (0.5, 0.25, 0.1), KEEPS))
    default_methods = ("pertoken", "pertoken+sinks", "kivi+sinks", "prerope+sinks", "rotation+sinks")
    methods = list(
        methods
        or ctx.pick(("pertoken", "kivi+sinks", "rotation+sinks"), default_methods, tuple(QUANT_METHODS))
    )
    policies = list(policies or ctx.pick(("streaming_llm", "snapkv", "learned"), POLICY_NAMES))
    unknown = [m for m in methods if m not in QUANT_METHODS] + [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise BadInputError(
            f"unknown method(s) {unknown}; quantizers: {list(QUANT_METHODS)}, policies: {POLICY_NAMES}"
        )
    for b in bits:
        check_bits(b)
    for k in keeps:
        budget_slots(1000, k)
    if "learned" in policies and not DEFAULT_WEIGHTS.is_file():
        policies.remove("learned")
        result.notes.append("learned policy skipped: no weights (run `kvlab train-evictor`)")
    return bits, keeps, methods, policies


def _measure(ctx: ExperimentContext, handle, wins: list, configs: list, names: list[str], n_ctx: int):
    """Continuation NLL, divergence to the full cache's continuation logits (``configs[0]`` is the full
    cache), bytes held and per-layer distortion of every configuration on every window."""
    nll: dict[str, list] = {n: [] for n in names}
    div: dict[str, list] = {n: [] for n in names}
    layer_stats: dict[str, dict[str, list]] = {
        n: {k: [] for k in ("qk_rel_error", "qk_corr", "attn_kl", "out_rel_error", "kept_mass")}
        for n in names
    }
    nbytes: dict[str, list] = {n: [] for n in names}
    full_bytes = []
    with ctx.progress.task("compression: text samples", total=len(wins) * len(configs)) as advance:
        for w in wins:
            obs = observe(handle, w)
            cobs = _ctx_observation(obs, n_ctx)
            snap = cobs.snapshot
            future_q = tuple(q[:, :, n_ctx:] for q in obs.queries)
            cont = w[n_ctx:]
            ref = reference(future_q, snap.keys, snap.values, obs.scaling)
            full_bytes.append(snap.nbytes)
            full_logits = None
            for cfg, name in zip(configs, names, strict=True):
                keys, values, held, slots, logits = _under(handle, cfg, cobs, cont)
                full_logits = logits if cfg[0] == "full" else full_logits
                if full_logits is None:
                    raise ValueError("the full cache must come first: the others compare to it")
                token_nll, to_full = continuation_quality(logits, cont, full_logits)
                nll[name].append(token_nll)
                div[name].append(to_full)
                nbytes[name].append(held)
                if cfg[3] == "keep":
                    d = distortion(future_q, snap.keys, snap.values, keys, values, obs.scaling, slots, ref)
                    for k in layer_stats[name]:
                        layer_stats[name][k].append(getattr(d, k))
                advance(1)
    return (nll, div), layer_stats, nbytes, full_bytes


def _under(handle, cfg: tuple[str, str, float, str], cobs, cont: list[int]):
    """The cache one configuration keeps of the context, and the continuation's logits on it."""
    kind, method, budget, mode = cfg
    snap = cobs.snapshot
    if kind == "full":
        return snap.keys, snap.values, snap.nbytes, None, handle.forward(cont, past=snap).logits
    if kind == "quant":
        label, opts = QUANT_METHODS[method]
        qs = quantize_snapshot(snap, make_quantizer(label, int(budget), **opts))
        dec = qs.decompress()
        return dec.keys, dec.values, qs.nbytes, None, handle.forward(cont, past=dec).logits
    past = _compress_context(cobs, cfg)
    logits = handle.forward(cont, past=past).logits
    if mode == "repack":
        return past.keys, past.values, past.nbytes, None, logits
    keys, values, slots = kept_per_head(past)
    return keys, values, past.held_nbytes, slots, logits


def _label(cfg: tuple[str, str, float, str]) -> str:
    kind, method, budget, mode = cfg
    if kind == "full":
        return "full precision"
    if kind == "quant":
        fixed = getattr(QUANTIZERS.get(QUANT_METHODS[method][0]), "fixed_bits", None)
        return method if fixed is not None else f"{method} int{int(budget)}"
    return f"{method} {int(round(budget * 100))}%" + (" repack" if mode == "repack" else "")


def _compress_context(obs: Observation, cfg: tuple[str, str, float, str]) -> KVSnapshot:
    """The snapshot a compressed context leaves (masked for an eviction, re-packed in ``repack`` mode),
    from its observation (one prefill for all configurations)."""
    kind, method, budget, mode = cfg
    if kind == "evict":
        ev = evict(obs, make_policy(method), keep=budget)
        return repack(ev) if mode == "repack" else ev
    snap = obs.snapshot
    if kind == "quant":
        label, opts = QUANT_METHODS[method]
        snap = quantize_snapshot(snap, make_quantizer(label, int(budget), **opts)).decompress()
    return snap


def _needle(ctx, model, src, configs, names, lengths, depths, wanted, result) -> dict[str, np.ndarray]:
    lengths = list(lengths or ctx.pick((200,), (384,), (512, 1024, 1536)))
    depths = list(depths or ctx.pick((0.5,), (0.1, 0.5, 0.9), (0.1, 0.3, 0.5, 0.7, 0.9)))
    if wanted is not None:
        chosen = [(c, n) for c, n in zip(configs, names, strict=True) if c[0] == "full" or n in wanted]
    else:
        chosen = [
            (c, n)
            for c, n in zip(configs, names, strict=True)
            if c[0] == "full"
            or c[3] == "keep"
            and c[2] in ctx.pick((4.0, 2.0, 0.5), (4.0, 0.5), (4.0, 2.0, 0.5))
        ]
    found: dict[str, list[float]] = {n: [] for _, n in chosen}
    trials = needle_trials(model, src, lengths, depths)
    with ctx.progress.task("compression: needle", total=len(trials) * len(chosen)) as advance:
        for context, question, word in trials:
            obs = observe(model, context)
            for cfg, name in chosen:
                past = _compress_context(obs, cfg)
                first = model.forward(question, past=past, all_logits=False)
                out = model.generate(first.snapshot, first.logits[-1], 4, stop_at_eos=False)
                found[name].append(float(word in out.text.lower()))
                advance(1)
    result.summary["needle_trials"] = [{"length": L, "depth": d} for L in lengths for d in depths]
    return {n: np.array(v) for n, v in found.items()}


def _timing(ctx, model, context, methods, policies, steps) -> dict[str, float]:
    from kvlab.hf.compressed_cache import CompressedCache

    steps = ctx.count("steps", steps, 3, 8, 16)
    setups: dict[str, dict] = {"full precision": {}}
    for m in ("pertoken", "kivi+sinks", "rotation+sinks"):
        if m in methods:
            label, opts = QUANT_METHODS[m]
            # bound to the model, as a user would run it: rotation codes then decode on packed codes
            setups[f"{m} int4"] = {"quantizer": make_quantizer(label, 4, **opts), "model": model.model}
    for p in ("streaming_llm", "snapkv"):
        if p in policies:
            setups[f"{p} 50%"] = {"policy": make_policy(p), "keep": 0.5, "model": model.model}
    out = {}
    ids = torch.tensor([context], device=model.device)
    for name, kw in setups.items():
        cache = CompressedCache(model.config, **kw)
        with torch.no_grad():
            first = model.run(ids, cache, logits_to_keep=1).logits
        out[name] = time_decode_ms(model, cache, int(first[0, -1].argmax()), len(context), steps)
        out[name + " bytes"] = cache.nbytes
        if "quantizer" in kw:  # which attention each step really took, counted by the cache
            out[name + " packed"] = cache.packed_steps / steps
    return out


def _report(
    ctx, result, configs, names, quality, layer_stats, nbytes, full_bytes, needle, timing, n_ctx, model
):
    """Summary, tables and figures from the measured arrays (measure -> records -> tables and figures)."""
    summary, rows_q, rows_e, points = _records(
        result, configs, names, quality, layer_stats, nbytes, full_bytes, needle, n_ctx, model
    )
    result.tables.extend(_tables(rows_q, rows_e, summary["full_bytes_per_token"]))
    if timing:
        result.tables.append(_timing_table(timing))
        summary["decode_ms"] = {k: v for k, v in timing.items() if not k.endswith((" bytes", " packed"))}
        # the share of each quantized cache's decode steps that attended on its packed codes
        summary["decode_packed_share"] = {
            k.removesuffix(" packed"): v for k, v in timing.items() if k.endswith(" packed")
        }
    _acceptance(summary)
    result.notes.extend(_kl_notes(summary["acceptance"]))
    result.summary.update(summary)
    result.figures.append(_pareto_figure(ctx, points, model, summary["windows"]))
    result.figures.append(_layer_figure(ctx, configs, names, layer_stats))
    result.notes.append(
        "Needle accuracy is weak on a 135M model; read it relative to the full-precision row."
    )
    result.notes.append(
        "Rotations and sketch matrices are regenerated from seeds (0 stored bytes); positions "
        "and slot indices are bookkeeping and not counted in bytes/token."
    )
    return result


def _records(result, configs, names, quality, layer_stats, nbytes, full_bytes, needle, n_ctx, model):
    """One summary entry and one table row per configuration (raw arrays go to ``result.arrays``)."""
    nll, div = quality
    base_ppl = np.array([np.exp(x.mean()) for x in nll["full precision"]])
    fp_bpt = float(np.mean(full_bytes)) / n_ctx
    rows_q, rows_e, points = [], [], []
    summary: dict[str, Any] = {
        "context_tokens": n_ctx,
        "windows": len(base_ppl),
        "full_precision_ppl": float(base_ppl.mean()),
        "full_bytes_per_token": fp_bpt,
        "configs": {},
    }
    base_needle = float(needle["full precision"].mean()) if "full precision" in needle else float("nan")
    for cfg, name in zip(configs, names, strict=True):
        ppl = np.array([np.exp(x.mean()) for x in nll[name]])
        inc = bootstrap_ci(100 * (ppl / base_ppl - 1), "mean")  # % over text samples; none from < 5
        bpt = float(np.mean(nbytes[name])) / n_ctx
        ls = {k: np.array(val) for k, val in layer_stats[name].items() if val}
        nd = float(needle[name].mean()) if name in needle else None
        ds = divergence_summary(div[name])  # one sample per window
        entry = {
            "kind": cfg[0],
            "method": cfg[1],
            "budget": cfg[2],
            "mode": cfg[3],
            "bytes_per_token": bpt,
            "ppl": float(ppl.mean()),
            "ppl_increase_pct": inc.value,
            "ppl_increase": inc.to_json(),  # the same value with its interval (None bounds: no interval)
            "needle_accuracy": nd,
            "needle_relative": (nd / base_needle) if nd is not None and base_needle else None,
            "kl_to_full": ds.kl.to_json(),
            "top1_to_full": ds.top1.to_json(),
        }
        for k, arr in ls.items():
            entry[k] = float(arr.mean())
            result.arrays[f"{name}/{k}"] = arr  # [windows, layers]
        result.arrays[f"{name}/nll"] = np.stack(nll[name])  # [windows, continuation - 1]
        result.arrays[f"{name}/kl_to_full"] = np.array([d.kl for d in div[name]])  # [windows]
        result.arrays[f"{name}/top1_to_full"] = np.array([d.top1 for d in div[name]])
        summary["configs"][name] = entry
        elems_per_token = 2 * model.facts.num_layers * model.facts.num_kv_heads * model.facts.head_dim
        row = [
            name,
            int(round(bpt)),
            round(8 * bpt / elems_per_token, 2) if cfg[0] != "evict" else None,
            float(ppl.mean()),
            format_interval(inc, signed=True),
            iv(entry, "kl_to_full"),
            iv(entry, "top1_to_full"),
            entry.get("out_rel_error"),
            entry.get("attn_kl") if cfg[0] != "evict" else entry.get("kept_mass"),
            entry.get("qk_corr") if cfg[0] != "evict" else None,
            "" if nd is None else f"{round(nd * len(needle[name]))}/{len(needle[name])}",
        ]
        (rows_e if cfg[0] == "evict" else rows_q).append(row)
        if cfg[0] != "full":
            points.append((cfg, bpt, inc))
    return summary, rows_q, rows_e, points


KL_CAPTION = (
    "KL to full: mean per-token KL(full cache || this cache) in nats of the continuation's next-token "
    "distributions, teacher-forced; top-1: share of those tokens whose argmax matches the full cache's "
    "(95% intervals over text samples: bootstrap for KL and Δ perplexity, Wilson for "
    "top-1; none from fewer than 5 text samples)."
)


#: the columns the quantization and eviction tables share, after the method
_QUALITY_COLUMNS = (
    "bytes/token",
    "bits/element",
    "perplexity",
    "Δ perplexity % [95% CI]",
    "KL to full (nats)",
    "top-1 agreement",
    "attn-output rel. error",
)


def _tables(rows_q: list, rows_e: list, fp_bpt: float) -> list[Table]:
    """The quantization and eviction tables."""
    return [
        Table(
            "Quantization",
            ["method", *_QUALITY_COLUMNS, "attention KL (nats)", "q·k correlation", "needle accuracy"],
            rows_q,
            caption=f"Bytes/token count packed codes, fp16 scales/zero points and full-precision slots "
            f"(fp32 cache: {fp_bpt:.0f}). Errors use the continuation's queries, averaged over layers. "
            + KL_CAPTION,
        ),
        Table(
            "Eviction",
            ["policy / kept", *_QUALITY_COLUMNS, "attention mass kept", "q·k correlation", "needle accuracy"],
            rows_e,
            caption="Per layer and KV head, the kept slots keep their original RoPE positions ('repack': "
            "re-rotated to 0..n-1, and the next query follows them); bytes/token per original token. "
            + KL_CAPTION,
        ),
    ]


def _timing_table(timing: dict) -> Table:
    """Decode time per token on each CompressedCache, measured in one run."""
    base = timing.get("full precision", float("nan"))

    def path(name: str) -> str:
        share = timing.get(name + " packed")
        if share is None:
            return "full-precision K/V" if name == "full precision" else "kept K/V (eviction)"
        if share >= 1:
            return "packed codes (C kernel)"
        return "dequantize + SDPA" if share == 0 else f"packed codes in {share:.0%} of steps"

    return Table(
        "Decode time on CompressedCache (one run, same machine load)",
        ["cache", "ms/token", "ratio to full", "bytes held", "attention read"],
        [
            [k, v, v / base, int(timing[k + " bytes"]), path(k)]
            for k, v in timing.items()
            if not k.endswith((" bytes", " packed"))
        ],
        caption="Median over decode steps with model(...) on kvlab.hf.CompressedCache bound to the model "
        "(model=). 'attention read' is counted by each cache: packed codes (a C kernel reads the codes, "
        "no full-precision copy of the history) or, where the kernel is absent (no C compiler, see "
        "kvlab.kernels.why_not) or cannot read the codes, the history dequantized at every step.",
    )


#: where the perplexity-ratio axis may put a labelled tick (x1.05 reads as "5% higher than full precision")
RATIO_TICKS = (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2, 3, 5, 10, 20, 50, 100)


def _ratio_ticks(lo: float, hi: float) -> list[float]:
    """Labelled ticks between ``lo`` and ``hi`` (ratios), at least 1/8 of the log span apart, from x1 out."""
    gap = max(np.log10(hi / lo), 1e-9) / 8
    kept = [1.0]
    for side in ([t for t in RATIO_TICKS if t > 1], [t for t in reversed(RATIO_TICKS) if t < 1]):
        last = 1.0
        for t in side:
            if lo <= t <= hi and abs(np.log10(t / last)) >= gap:
                kept.append(t)
                last = t
    return sorted(kept)


def _plain_log_axes(ax, ratios: list[float]) -> None:
    """A log y axis of perplexity ratios labelled x0.9, x1, x1.1, x2 and a log x axis labelled in plain
    byte counts (no powers of ten to decode)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    lo, hi = min([*ratios, 1.0]) / 1.03, max([*ratios, 1.0]) * 1.05
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ax.yaxis.set_major_locator(FixedLocator(_ratio_ticks(lo, hi)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"×{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(
        FuncFormatter(lambda v, _: f"{v:,.0f}" if f"{v:.0e}"[0] in "25" else "")  # 20, 50, 200, 500...
    )


def _pareto_figure(ctx, points: list, model, n_windows: int):
    """Perplexity relative to full precision vs bytes held per token, every method and budget, with the
    Pareto front; whiskers only where the interval rests on at least MIN_SAMPLES text samples."""
    fig, ax = subplots(figsize=(8, 5))
    kinds: dict[str, list] = {}
    for cfg, bpt, inc in points:
        key = (cfg[1] if cfg[0] == "quant" else f"evict: {cfg[1]}") + (
            " (repack)" if cfg[3] == "repack" else ""
        )
        kinds.setdefault(key, []).append((bpt, 1 + inc.value / 100, inc))
    shown = []  # every value and whisker end, so the axis holds them all
    for key, pts in kinds.items():
        pts.sort(key=lambda p: p[0])
        y = np.array([p[1] for p in pts])
        low = np.array([1 + p[2].low / 100 if p[2].has_interval else p[1] for p in pts])
        high = np.array([1 + p[2].high / 100 if p[2].has_interval else p[1] for p in pts])
        shown += [*low, *high]
        ax.errorbar(
            [p[0] for p in pts],
            y,
            yerr=[y - low, high - y],
            marker="o" if not key.startswith("evict") else "s",
            ms=4,
            capsize=2,
            lw=1,
            ls="-" if not key.startswith("evict") else "--",
            label=key,
        )
    front = _pareto([(bpt, 1 + inc.value / 100) for _, bpt, inc in points])
    if front:
        ax.plot(*zip(*front, strict=True), color="k", lw=2, alpha=0.35, label="Pareto front")
    ax.axhline(1, color="grey", lw=0.8)
    _plain_log_axes(ax, shown)
    samples = f"{n_windows} text sample{'s' if n_windows != 1 else ''}"
    spread = (
        ", 95% bootstrap intervals"
        if n_windows >= MIN_SAMPLES
        else f"; no intervals from fewer than {MIN_SAMPLES}"
    )
    ylabel = "perplexity ÷ full precision's (log scale; ×1.1 = 10% higher)"
    title = f"Quality vs bytes ({model.facts.name}, {samples}{spread})"
    style(ax, "bytes held per context token (log scale)", ylabel, title, ncol=2, which="both")
    return ctx.figure(
        "pareto",
        fig,
        "Continuation perplexity relative to full precision vs bytes held per token, every method and "
        "budget (both axes log scale, labelled in plain numbers); the black line is the Pareto front.",
    )


def _layer_figure(ctx, configs, names, layer_stats):
    """Per-layer distortion of the quantizers at one bit width (4 when measured)."""
    # Per-layer distortion at 4 bits (or the first bit width)
    fig, axes = subplots(1, 2, figsize=(12, 4.2))
    qnames = [
        n
        for c, n in zip(configs, names, strict=True)
        if c[0] == "quant"
        and c[2] == (4.0 if any(c2[2] == 4.0 for c2 in configs if c2[0] == "quant") else c[2])
    ]
    for n in qnames:
        for ax, key in zip(axes, ("out_rel_error", "attn_kl"), strict=True):
            arr = np.array(layer_stats[n][key])
            mean, lo, hi = bootstrap_curve(arr)
            xs = np.arange(arr.shape[1])
            ax.plot(xs, mean, lw=1.2, label=n)
            ax.fill_between(xs, lo, hi, alpha=0.2)
    for ax, ylab in zip(axes, ("attention-output relative error", "attention KL (nats)"), strict=True):
        ax.set_yscale("log")
        style(ax, "layer", ylab)
    axes[0].set_title("Per-layer attention-output error")
    axes[1].set_title("Per-layer attention KL")
    return ctx.figure(
        "per_layer_distortion",
        fig,
        "Per-layer distortion of the quantizers at the same bit width (mean over text samples; a 95% "
        "bootstrap band where there are at least 5).",
    )


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    front, best = [], float("inf")
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def _acceptance(summary: dict) -> None:
    c = summary["configs"]
    acc: dict[str, Any] = {}
    for sink in ("", "+sinks"):
        a, b = c.get(f"rotation{sink} int4"), c.get(f"pertoken{sink} int4")
        if a and b and "out_rel_error" in a:
            acc[f"rotation{sink}_vs_pertoken{sink}_int4_out_error_ratio"] = (
                a["out_rel_error"] / b["out_rel_error"]
            )
    for key, kind, budget in (("best_2bit", "quant", 2.0), ("best_evict_50", "evict", 0.5)):
        sel = {k: v for k, v in c.items() if v["kind"] == kind and v["budget"] == budget}
        if sel:
            ppl = {k: v["ppl_increase_pct"] for k, v in sel.items()}
            kl = {k: v["kl_to_full"]["value"] for k, v in sel.items()}
            acc[key] = min(ppl, key=ppl.__getitem__)
            acc[f"{key}_ppl_increase_pct"] = min(ppl.values())
            # the same ranking judged in KL to the full cache
            acc[f"{key}_by_kl"] = min(kl, key=kl.__getitem__)
            acc[f"{key}_kl"] = min(kl.values())
    summary["acceptance"] = acc


def _kl_notes(acc: dict) -> list[str]:
    """Whether KL to the full cache picks the same winner as perplexity (it can disagree)."""
    out = []
    for key, what in (("best_2bit", "2-bit quantizer"), ("best_evict_50", "policy keeping 50%")):
        if key in acc:
            same = acc[key] == acc[f"{key}_by_kl"]
            out.append(
                f"Best {what}: {acc[key]} by perplexity, {acc[f'{key}_by_kl']} by KL to the full cache "
                f"({format_number(acc[f'{key}_kl'])} nats) — " + ("the same." if same else "they disagree.")
            )
    return out


def _signed(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2g}"


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    acc = s.get("acceptance", {}) or {}
    b2, e50 = acc.get("best_2bit"), acc.get("best_evict_50")
    text = (
        f"The best 2-bit quantizer ({b2}) changes perplexity by {_signed(num(s, 'acceptance.best_2bit_ppl_increase_pct'))}% "
        f"and the best policy keeping half the tokens ({e50}) by {_signed(num(s, 'acceptance.best_evict_50_ppl_increase_pct'))}%, "
        f"against full precision at {format_number(num(s, 'full_bytes_per_token'))} bytes per token."
    )
    rows = [("full-precision perplexity", iv(s, "full_precision_ppl"))]
    for name in (b2, e50):
        if name:
            rows.append((f"{name}: perplexity change %", iv(s, f"configs.{name}.ppl_increase", signed=True)))
            rows.append((f"{name}: KL to full (nats)", iv(s, f"configs.{name}.kl_to_full")))
            rows.append((f"{name}: top-1 agreement", iv(s, f"configs.{name}.top1_to_full")))
            rows.append((f"{name}: bytes per token", iv(s, f"configs.{name}.bytes_per_token")))
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="where in the text the evaluation text samples are cut",
    describe=describe,
    name="compression",
    title="Cache compression: quantization and eviction",
    run=run,
    order=80,
    description="Quantizers (bit-packed) and eviction policies: distortion, "
    "perplexity, needle retrieval, bytes and time, side by side.",
)
