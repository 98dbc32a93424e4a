"""Phase 1, reproduced and extended: what does this model's cache look like, and how big does it get?

Architecture and GQA, per-layer K/V shapes for the log's prompts, bytes per token for each dtype
(formula checked against the bytes a real snapshot holds), growth projections up to the model's
maximum and for larger batches, the context at which the cache outgrows the weights, and
attention-sink indicators per position (attention mass received, K and V norms).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvlab.data import PHASE1_PROMPTS, python_docs
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.metrics.stats import bootstrap_ci
from kvlab.model.facts import ModelFacts, dtype_bytes, facts_from_config, load_config_file
from kvlab.rope.layers import sliding_windows
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import format_number, iv, num
from kvlab.study.report.plots import style, subplots

PROJECTION_TOKENS = (100, 1_000, 4_000, 8_000, 32_000, 128_000)
CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8")
BATCHES = (1, 8, 32)
#: tokens of each attention-sink passage, in every profile
SINK_TOKENS = 256


def _mb(n: float) -> float:
    return n / 2**20


def architecture_table(facts: ModelFacts, rope_summary: str | None) -> Table:
    rows: list[list[Any]] = [
        ["architecture", facts.architecture],
        ["layers", facts.num_layers],
        ["query heads", facts.num_attention_heads],
        ["KV heads", facts.num_kv_heads],
        ["attention", facts.attention_kind],
        ["head dim", facts.head_dim],
        ["hidden size", facts.hidden_size],
        ["vocabulary", facts.vocab_size],
        ["max positions", facts.max_positions],
        ["parameters", facts.num_parameters],
        ["weights dtype", facts.weights_dtype],
        ["RoPE", rope_summary or "none (no rotary embedding found)"],
    ]
    if facts.sliding_window:
        rows.append(["sliding window", f"{facts.sliding_window} ({facts.num_sliding_layers} layers)"])
    return Table("Architecture", ["property", "value"], rows)


def projections(facts: ModelFacts, weights_dtype: str | None = None) -> dict[str, Any]:
    """Cache bytes at the standard lengths and the model maximum, per dtype and batch, plus crossovers."""
    lengths = sorted({*PROJECTION_TOKENS, facts.max_positions} - {0})
    out: dict[str, Any] = {
        "tokens": lengths,
        "bytes": {},
        "beyond_max": [n > facts.max_positions for n in lengths],
    }
    for dt in CACHE_DTYPES:
        for b in BATCHES:
            out["bytes"][f"{dt}/batch{b}"] = [facts.kv_bytes(n, dt) * b for n in lengths]
    wd = weights_dtype or facts.weights_dtype
    out["weights_bytes"] = facts.weights_bytes(wd)
    out["weights_dtype"] = wd
    out["crossover_tokens"] = {
        f"{dt}/batch{b}": facts.crossover_tokens(dt, wd, b) for dt in CACHE_DTYPES for b in BATCHES
    }
    return out


def _projection_figure(ctx: ExperimentContext, facts: ModelFacts, proj: dict) -> Any:
    fig, ax = subplots(figsize=(7.5, 4.2))
    xs = np.logspace(2, np.log10(max(proj["tokens"]) * 1.2), 200)
    for dt, fmt in zip(("float32", "bfloat16", "int8"), ("-", "--", ":"), strict=True):
        ax.plot(xs, [facts.kv_bytes(int(x), dt) / 2**30 for x in xs], fmt, label=f"KV cache, {dt}, batch 1")
    ax.plot(
        xs,
        [facts.kv_bytes(int(x), "bfloat16") * 8 / 2**30 for x in xs],
        "-.",
        label="KV cache, bfloat16, batch 8",
    )
    ax.axhline(proj["weights_bytes"] / 2**30, color="k", lw=1.2, label=f"weights ({proj['weights_dtype']})")
    if facts.max_positions:
        ax.axvline(
            facts.max_positions, color="grey", lw=0.8, ls="--", label=f"max positions {facts.max_positions:,}"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"{facts.name}: KV cache growth vs weights")
    style(ax, "context length (tokens)", "memory (GiB)", legend=8, which="both")
    return fig


def sink_indicators(model: Any, n_tokens: int, passages: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Attention mass each position receives and K/V norms per position, averaged over ``passages``
    prose passages of ``n_tokens`` tokens (where in the Python docs they come from follows ``seed``);
    ``pos0_over_median`` holds each passage's ratio of the attention position 0 receives to the median
    position's."""
    from kvlab.data import token_samples
    from kvlab.study.experiments._sampling import seeded_text

    text = seeded_text(python_docs(), seed).text
    ids_all = model.encode(text[: n_tokens * passages * 8])
    rows = token_samples(ids_all, n_tokens, passages, seed=seed)
    parts: dict[str, list[np.ndarray]] = {
        k: [] for k in ("received", "k_norm", "v_norm", "first_token_share")
    }
    ratios = []
    for ids in rows:
        fwd = model.prefill(ids, output_attentions=True, all_logits=False)
        att = np.stack([a[0].float().numpy() for a in fwd.attentions])  # [L, H, T, T]
        T = att.shape[-1]
        # Mass received by key j, averaged over the queries that can see it (i >= j).
        visible = np.arange(T, 0, -1, dtype=np.float64)
        received = att.sum(axis=2) / visible  # [L, H, T]
        snap = fwd.snapshot
        parts["received"].append(received)
        parts["k_norm"].append(
            np.stack([k[0].float().norm(dim=-1).numpy() for k in snap.keys])
        )  # [L, Hkv, T]
        parts["v_norm"].append(np.stack([v[0].float().norm(dim=-1).numpy() for v in snap.values]))
        parts["first_token_share"].append(att[:, :, 1:, 0].mean(axis=-1))  # [L, H]: share on position 0
        rec = received.mean(axis=(0, 1))
        ratios.append(rec[0] / np.median(rec[1:]))
    return {
        **{k: np.mean(v, axis=0) for k, v in parts.items()},
        "pos0_over_median": np.asarray(ratios, dtype=np.float64),
        "token_ids": np.array(rows),
    }


def _sink_figures(ctx: ExperimentContext, sinks: dict[str, np.ndarray], name: str) -> list:
    figs: list = []
    rec = sinks["received"].mean(axis=(0, 1))
    T = rec.shape[0]
    fig, axes = subplots(1, 2, figsize=(11, 3.8))
    axes[0].plot(np.arange(T), rec, lw=1)
    axes[0].set_yscale("log")
    style(axes[0], "key position", "mean attention received", "Attention mass received per position", None)
    kn, vn = sinks["k_norm"].mean(axis=(0, 1)), sinks["v_norm"].mean(axis=(0, 1))
    axes[1].plot(np.arange(T), kn / kn[1:].mean(), label=f"|K| / its mean over positions 1–{T - 1}", lw=1)
    axes[1].plot(
        np.arange(T), vn / vn[1:].mean(), label=f"|V| / its mean over positions 1–{T - 1}", lw=1, ls="--"
    )
    style(axes[1], "position", "relative norm", "K and V norms per position", legend=8)
    fig.suptitle(f"{name}: attention sinks over {T} tokens of prose")
    fig.tight_layout()  # the suptitle gets its own row instead of overlapping the axes titles
    ctx.figure(
        "sinks_per_position",
        fig,
        "Position 0 (the first text token, no BOS) draws most attention in most layers: the attention sink.",
        into=figs,
    )
    share = sinks["first_token_share"]
    fig, ax = subplots(figsize=(7.5, 3.6))
    ax.plot(np.arange(share.shape[0]), share.mean(axis=1), marker="o", ms=3, label="mean over heads")
    ax.fill_between(
        np.arange(share.shape[0]),
        share.min(axis=1),
        share.max(axis=1),
        alpha=0.25,
        label="min–max over heads",
    )
    ax.set_ylim(0, 1)
    style(ax, "layer", "share of attention on position 0", f"{name}: sink strength by layer", legend=8)
    ctx.figure(
        "sink_by_layer", fig, "Share of each query's attention that goes to position 0, per layer.", into=figs
    )
    return figs


def run(
    ctx: ExperimentContext,
    *,
    config: str | Path | None = None,
    prompts: list[str] | None = None,
    cache_dtype: str | None = None,
    generate_tokens: int | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    handle, rope_problem = None, None
    if config is not None:
        cfg = load_config_file(config)
        facts = facts_from_config(cfg, name=Path(config).stem)
        from kvlab.rope.spec import rope_spec_from_config

        try:
            rope = rope_spec_from_config(cfg)
        except UnsupportedModelError as exc:
            rope, rope_problem = None, str(exc)
        result.data_sources.append(f"config file {config} (no weights)")
    else:
        handle = ctx.handle()
        facts, rope = handle.facts, handle.rope
        rope_problem = handle.rope_problem
    cache_dtype = cache_dtype or (str(handle.dtype).replace("torch.", "") if handle else facts.weights_dtype)
    _architecture(result, facts, rope, cache_dtype, rope_problem)
    _projection(ctx, result, facts, cache_dtype)
    if handle is None:
        result.notes.append(
            "Config only: per-layer shapes, measured bytes and attention sinks need the model's weights."
        )
        return result
    prompts = list(prompts) if prompts else list(PHASE1_PROMPTS)
    n_gen = generate_tokens if generate_tokens is not None else ctx.pick(5, 20)
    rows, layers_meta = _measure_prompts(ctx, handle, prompts, n_gen)
    result.tables.extend(_prompt_tables(rows, layers_meta, n_gen))
    result.summary["measured_bytes_per_token"] = rows[0][6]
    result.summary["per_layer"] = layers_meta
    sinks = _sinks(ctx, result, handle)
    result.figures.extend(_sink_figures(ctx, sinks, facts.name))
    result.data_sources.append("Phase 1 prompts; Python documentation (pydoc_data) for the sink passage")
    return result


def _architecture(
    result: ExperimentResult, facts, rope, cache_dtype: str, rope_problem: str | None = None
) -> None:
    """The architecture table, bytes per token by dtype (formula and number) and the summary's facts."""
    dtype_bytes(cache_dtype)  # validates
    summary = rope.summary() if rope else (f"not supported: {rope_problem}" if rope_problem else None)
    result.tables.append(architecture_table(facts, summary))
    per_token = {dt: facts.kv_bytes_per_token(dt) for dt in ("float32", "bfloat16", "float16", "int8")}
    result.summary.update(
        {
            "model": facts.name,
            "cache_dtype": cache_dtype,
            "bytes_per_token": facts.kv_bytes_per_token(cache_dtype),
            "bytes_per_token_formula": facts.kv_bytes_formula(cache_dtype),
            "bytes_per_token_by_dtype": per_token,
            "gqa_ratio": facts.gqa_ratio,
            "num_parameters": facts.num_parameters,
        }
    )
    result.table(
        "Bytes per token",
        ["dtype", "bytes/token", "formula"],
        [[dt, b, facts.kv_bytes_formula(dt)] for dt, b in per_token.items()],
    )


def _tokens(n: Any) -> str:
    if n is None:
        return "no length (the sliding-window cache stops growing)"
    return f"{n:,} tokens" if isinstance(n, int) else f"{n} tokens"


def _projection(ctx: ExperimentContext, result: ExperimentResult, facts, cache_dtype: str) -> None:
    """Projected cache size against the weights, as a table and a figure."""
    proj = projections(facts)
    result.summary["weights_bytes"] = proj["weights_bytes"]
    result.summary["crossover_tokens"] = proj["crossover_tokens"]
    rows = []
    for i, n in enumerate(proj["tokens"]):
        tag = " (beyond max)" if proj["beyond_max"][i] else (" (max)" if n == facts.max_positions else "")
        rows.append(
            [f"{n:,}{tag}"]
            + [_mb(proj["bytes"][f"{dt}/batch{b}"][i]) for dt in ("float32", "bfloat16") for b in BATCHES]
        )
    result.table(
        "Projected cache size (MiB)",
        ["tokens"] + [f"{dt} b{b}" for dt in ("float32", "bfloat16") for b in BATCHES],
        rows,
        caption=f"Weights: {_mb(proj['weights_bytes']):,.0f} MiB in {proj['weights_dtype']}. The cache outgrows them at "
        f"{_tokens(proj['crossover_tokens'].get(f'{cache_dtype}/batch1', '?'))} "
        f"({cache_dtype}, batch 1) and at {_tokens(proj['crossover_tokens']['bfloat16/batch8'])} (bfloat16, batch 8)."
        + (
            f" Sliding-window layers ({facts.num_sliding_layers} of {facts.num_layers}) hold at most "
            f"{facts.sliding_window} tokens."
            if facts.sliding_window
            else ""
        ),
    )
    result.arrays["projection_tokens"] = np.array(proj["tokens"])
    ctx.figure(
        "growth",
        _projection_figure(ctx, facts, proj),
        "KV cache memory vs context length, per dtype and batch, against the weights.",
        into=result.figures,
    )


def _measure_prompts(ctx: ExperimentContext, handle, prompts: list[str], n_gen: int) -> tuple[list, list]:
    """Prefill (and greedily continue) each Phase 1 prompt; one table row and per-layer shapes each."""
    rows, layers_meta = [], []
    with ctx.progress.task("inspect: prompts", total=len(prompts)) as advance:
        for prompt in prompts:
            ids = handle.encode(prompt)
            if len(ids) >= handle.max_positions:
                raise BadInputError(
                    f"prompt has {len(ids)} tokens, the model's maximum is {handle.max_positions}"
                )
            first = handle.prefill(ids, all_logits=False)
            gen = (
                handle.generate(first.snapshot, first.logits[-1], n_gen, stop_at_eos=False) if n_gen else None
            )
            snap = gen.snapshot if gen else first.snapshot
            # generate() stops caching the last emitted token; the cache holds prompt + (n_gen - 1) tokens.
            k_shape = list(snap.keys[0].shape)
            rows.append(
                [
                    prompt,
                    len(ids),
                    snap.seq_len,
                    str(k_shape),
                    str(list(snap.values[0].shape)),
                    _mb(snap.nbytes),
                    snap.bytes_per_token,
                    gen.text.strip() if gen else "",
                ]
            )
            layers_meta.append(
                {
                    "prompt": prompt,
                    "layers": [
                        {
                            "layer_idx": i,
                            "key_shape": list(k.shape),
                            "value_shape": list(v.shape),
                            "key_dtype": str(k.dtype).removeprefix("torch."),
                            "value_dtype": str(v.dtype).removeprefix("torch."),
                        }
                        for i, (k, v) in enumerate(zip(snap.keys, snap.values, strict=True))
                    ],
                }
            )
            advance(1)
    return rows, layers_meta


def _prompt_tables(rows: list, layers_meta: list, n_gen: int) -> list[Table]:
    """The prompts' cache table and the first prompt's per-layer tensors."""
    first = layers_meta[0]
    return [
        Table(
            "Cache for the Phase 1 prompts",
            Table.header(
                "prompt | prompt tokens | cached tokens | key shape | value shape | cache MiB | "
                f"bytes/token (measured) | greedy continuation ({n_gen} tokens)"
            ),
            rows,
            caption="Measured bytes/token come from the snapshot's tensors and must equal the formula.",
        ),
        Table(
            f"Per-layer cache tensors for {first['prompt']!r}",
            ["layer", "key shape", "value shape", "key dtype", "value dtype"],
            [
                [m["layer_idx"], str(m["key_shape"]), str(m["value_shape"]), m["key_dtype"], m["value_dtype"]]
                for m in first["layers"]
            ],
            caption="[batch, kv_heads, cached tokens, head_dim]; every prompt's layers are in result.json.",
        ),
    ]


def _sinks(ctx: ExperimentContext, result: ExperimentResult, handle) -> dict:
    """Attention-sink indicators on a passage of the Python docs (arrays and summary)."""
    # The same passage length in every profile (the ratio to the median position depends on it:
    # 64 tokens gave 35x where 256 gave 92x); the profile changes only how many passages.
    n_sink = min(SINK_TOKENS, handle.max_positions - 1)
    windows = [w for w in sliding_windows(handle.config) if w is not None]
    if windows and n_sink >= min(windows):  # a snapshot must hold every token: stay inside the window
        n_sink = min(windows) - 1
        result.notes.append(
            f"the sink probe uses {n_sink} tokens: the model's sliding-window layers see {min(windows)} at most"
        )
    sinks = sink_indicators(handle, n_sink, passages=ctx.pick(3, 8), seed=ctx.seed)
    result.arrays.update({f"sink_{k}": v for k, v in sinks.items()})
    rec = sinks["received"].mean(axis=(0, 1))
    result.summary["sinks"] = {
        "tokens": int(rec.shape[0]),
        "attention_received_pos0": float(rec[0]),
        "attention_received_median_other": float(np.median(rec[1:])),
        "pos0_over_median": float(sinks["pos0_over_median"].mean()),
        "pos0_over_median_interval": bootstrap_ci(sinks["pos0_over_median"], seed=ctx.seed).to_json(),
        "passages": int(sinks["pos0_over_median"].size),
        "mean_first_token_share": float(sinks["first_token_share"].mean()),
        "k_norm_pos0_over_mean": float(
            sinks["k_norm"].mean(axis=(0, 1))[0] / sinks["k_norm"].mean(axis=(0, 1))[1:].mean()
        ),
        "v_norm_pos0_over_mean": float(
            sinks["v_norm"].mean(axis=(0, 1))[0] / sinks["v_norm"].mean(axis=(0, 1))[1:].mean()
        ),
    }
    return sinks


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    dt = s.get("cache_dtype", "float32")
    cross = num(s, f"crossover_tokens.{dt}/batch1")
    sink = num(s, "sinks.pos0_over_median")
    text = f"{s.get('model', 'This model')} caches {format_number(num(s, 'bytes_per_token'))} bytes per token in {dt}"
    if cross is not None:
        text += f"; at batch 1 the cache outgrows the weights after {format_number(int(cross))} tokens"
    if sink is not None:
        text += f"; position 0 receives {sink:.0f}x the median attention (an attention sink)"
    rows = [
        ("bytes per token", iv(s, "bytes_per_token")),
        ("query heads per KV head (GQA)", iv(s, "gqa_ratio")),
        (f"tokens until cache = weights ({dt}, batch 1)", iv(s, f"crossover_tokens.{dt}/batch1")),
        (
            f"attention to position 0 / median position ({format_number(num(s, 'sinks.tokens'))}-token passages)",
            iv(s, "sinks.pos0_over_median_interval"),
        ),
    ]
    return text + ".", rows


EXPERIMENT = Experiment(
    seed_changes="the attention-sink passages; the architecture, shapes and bytes per token are facts of the model",
    describe=describe,
    name="inspect",
    title="Cache inspection (Phase 1)",
    run=run,
    order=10,
    description="Structure, bytes per token, growth and attention sinks of the model's KV cache.",
)
