"""Caching is not numerically neutral: cached decoding vs full recomputation, in fp32/bf16/fp16, against fp64.

The fp64 model decodes a prompt greedily (with its cache); that token path is the reference, and
the fp64 model recomputes the full prefix at every step to give reference logits. Each low
precision model then follows the same token path twice, step by step: once with its KV cache
(one new token per forward) and once recomputing the whole prefix every step. Per step we record
the max |logit difference| and KL(fp64 || model). The first step where a model's argmax leaves
the reference path is exactly where its own free-running greedy decoding would first diverge
(before that step both see identical prefixes).
"""

from __future__ import annotations

import numpy as np
import torch

from kvlab.data import python_docs
from kvlab.errors import BadInputError
from kvlab.metrics import bootstrap_ci, kl_divergence
from kvlab.metrics.stats import MIN_SAMPLES
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import format_interval, format_number, iv, num, says, side_of_zero
from kvlab.study.report.plots import style, subplots

DTYPES = ("float32", "bfloat16", "float16")


def cached_path(model, prompt: list[int], path: list[int]) -> torch.Tensor:
    """``[len(path), vocab]`` logits predicting each path token, decoding one token at a time with the cache."""
    out = model.prefill(prompt, all_logits=False)
    logits, snap = [out.logits[-1]], out.snapshot
    for tok in path[:-1]:
        step = model.decode_step(snap, tok)
        logits.append(step.logits[-1])
        snap = step.snapshot
    return torch.stack(logits)


def recomputed_path(model, prompt: list[int], path: list[int]) -> torch.Tensor:
    """The same logits, recomputing the whole prefix from scratch at every step (no cache reuse)."""
    return torch.stack(
        [model.prefill(prompt + path[:i], all_logits=False).logits[-1] for i in range(len(path))]
    )


def first_divergence(logits: torch.Tensor, path: list[int]) -> int:
    """First step whose argmax differs from the path (``len(path)`` if none does)."""
    miss = (logits.argmax(-1) != torch.tensor(path, device=logits.device)).nonzero()
    return int(miss[0]) if miss.numel() else len(path)


def run(
    ctx: ExperimentContext,
    *,
    steps: int | None = None,
    prompt_tokens: int = 32,
    dtypes: tuple[str, ...] = DTYPES,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    steps = ctx.count("steps", steps, quick=8, default=64, full=200)
    if steps < 2 or prompt_tokens < 1:
        raise BadInputError(f"need steps >= 2 and prompt_tokens >= 1, got {steps} and {prompt_tokens}")
    base = ctx.handle()
    ref_model = ctx.load_model(ctx.model_spec, dtype="float64")  # on the study's device
    text = seeded_text(python_docs(), ctx.seed)
    prompt = base.encode(text.text[: prompt_tokens * 8])[:prompt_tokens]
    first = ref_model.prefill(prompt, all_logits=False)
    path = ref_model.generate(first.snapshot, first.logits[-1], steps, stop_at_eos=False).token_ids
    with ctx.progress.task("numerics: fp64 reference", total=1) as advance:
        ref = recomputed_path(ref_model, prompt, path)
        ref_cached = cached_path(ref_model, prompt, path)
        advance(1)
    runs = _runs(ctx, base, prompt, path, dtypes, ref_cached)
    names = list(runs)
    kl = np.stack([kl_divergence(ref, runs[n]).numpy() for n in names])  # [runs, steps]
    maxabs = np.stack([(runs[n].double() - ref.double()).abs().amax(-1).numpy() for n in names])
    div = {n: first_divergence(runs[n], path) for n in names}
    closer = _closer(kl, names, dtypes, ctx.seed)
    result.tables.extend(_tables(names, kl, maxabs, div, closer, steps, len(prompt), ctx.seed))
    result.summary.update(
        {
            "steps": steps,
            "prompt_tokens": len(prompt),
            "first_divergence_step": div,
            "cached_vs_recomputed": closer,
            "max_abs_logit_diff": {n: float(maxabs[i].max()) for i, n in enumerate(names)},
            "mean_kl": {n: float(kl[i].mean()) for i, n in enumerate(names)},
            "fp64_reference_path_self_consistent": first_divergence(ref, path) == steps,
        }
    )
    result.arrays.update(
        {
            "kl_per_step": kl,
            "max_abs_logit_diff_per_step": maxabs,
            "run_names": np.array(names),
            "path_tokens": np.array(path),
            "prompt_tokens": np.array(prompt),
        }
    )
    ctx.figure(
        "numerics",
        _figure(names, kl, maxabs, div, base.name, steps),
        "Per-step KL and max |logit difference| from the fp64 reference; dotted lines "
        "mark each run's first divergent step; exact zeros are drawn at 1e-16.",
        into=result.figures,
    )
    result.notes.append(f"Reference path text: {ref_model.decode(path)!r}")
    result.data_sources.append(f"{text.source}: first {len(prompt)} tokens as the prompt")
    return result


def _runs(ctx: ExperimentContext, base, prompt: list[int], path: list[int], dtypes, ref_cached) -> dict:
    """Logits along the reference path, cached and recomputed, in every dtype."""
    runs: dict[str, torch.Tensor] = {"float64/cached": ref_cached}
    with ctx.progress.task("numerics: dtypes", total=len(dtypes)) as advance:
        for dt in dtypes:
            m = base if str(base.dtype) == f"torch.{dt}" else ctx.load_model(ctx.model_spec, dtype=dt)
            runs[f"{dt}/cached"] = cached_path(m, prompt, path)
            runs[f"{dt}/recomputed"] = recomputed_path(m, prompt, path)
            advance(1)
    return runs


def _closer(kl: np.ndarray, names: list[str], dtypes, seed: int = 0) -> dict:
    """Per dtype: is the cached or the recomputed run closer to the fp64 reference? By the paired per-step
    difference of KL (cached minus recomputed, the same step of the same path), its 95% bootstrap interval
    over steps: "cached" below 0, "recomputed" above 0, else "neither (the paired interval contains 0)"."""
    closer = {}
    for dt in dtypes:
        c, r = kl[names.index(f"{dt}/cached")], kl[names.index(f"{dt}/recomputed")]
        diff = bootstrap_ci(c - r, seed=seed).to_json()
        where = side_of_zero(diff)
        closer[dt] = {
            "cached_closer_fraction": float((c < r).mean()),
            "mean_kl_cached": float(c.mean()),
            "mean_kl_recomputed": float(r.mean()),
            "cached_minus_recomputed_kl": diff,
            "closer": says(diff, "cached", "recomputed", "neither (contains 0)", f"cannot tell ({where})"),
        }
    return closer


def _tables(names, kl, maxabs, div, closer, steps: int, prompt_tokens: int, seed: int) -> list[Table]:
    """Distance from the fp64 reference per run, and cached vs recomputed per dtype."""
    rows = []
    for i, n in enumerate(names):
        ci = bootstrap_ci(kl[i], seed=seed)
        rows.append(
            [n, div[n], float(maxabs[i].max()), float(np.median(maxabs[i])), ci.value, ci.bracket(".3g")]
        )
    return [
        Table(
            "Distance from the fp64 recomputed reference",
            Table.header(
                "run | first divergent step | max |Δlogit| | median max |Δlogit| | mean KL (nats) | 95% CI"
            ),
            rows,
            caption=f"{steps} greedy steps after a {prompt_tokens}-token prompt; steps = {steps} means the path was never left. "
            "KL intervals bootstrap over steps (steps are correlated: read them as spread, not independent samples). "
            "float64/cached is the floor: the same maths in fp64, with logits stored in fp32.",
        ),
        Table(
            "Cached or recomputed: which is closer to fp64?",
            Table.header(
                "dtype | closer (paired) | cached − recomputed KL [95% CI] | "
                "share of steps cached is closer | mean KL cached | mean KL recomputed"
            ),
            [
                [
                    dt,
                    v["closer"],
                    format_interval(v["cached_minus_recomputed_kl"], signed=True),
                    v["cached_closer_fraction"],
                    v["mean_kl_cached"],
                    v["mean_kl_recomputed"],
                ]
                for dt, v in closer.items()
            ],
            caption="Paired per step: cached minus recomputed KL to the fp64 reference at the same step of the "
            "same path, mean with a 95% bootstrap interval over steps (correlated: read it as spread); "
            f"'cached' when it lies below 0, 'recomputed' above 0; fewer than {MIN_SAMPLES} steps: no interval.",
        ),
    ]


def _figure(names, kl, maxabs, div, model_name, steps):
    fig, axes = subplots(1, 2, figsize=(13, 4.2))
    colors = {"float64": "k", "float32": "#4c72b0", "bfloat16": "#dd8452", "float16": "#55a868"}
    x = np.arange(steps)
    for i, n in enumerate(names):
        dt, mode = n.split("/")
        fmt = "-" if mode == "cached" else "--"
        for ax, data in ((axes[0], kl[i]), (axes[1], maxabs[i])):
            ax.plot(x, np.maximum(data, 1e-16), fmt, color=colors[dt], lw=1, label=n)
        if div[n] < steps:
            axes[0].axvline(div[n], ls=":", color=colors[dt], lw=1)
    for ax, ylab in ((axes[0], "KL(fp64 || run) (nats)"), (axes[1], "max |logit difference|")):
        ax.set_yscale("log")
        style(ax, "decoding step", ylab, which="both")
    axes[0].set_title("Divergence from fp64 per step")
    axes[1].set_title("Largest logit error per step")
    fig.suptitle(f"{model_name}: cached (solid) vs recomputed (dashed) decoding along the fp64 greedy path")
    return fig


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    diffs = s.get("max_abs_logit_diff") or {}
    text = (
        f"Over {s.get('steps', '?')} greedy steps, cached decoding matches a float64 reference to "
        f"{format_number(num(diffs, 'float32/cached'))} in float32 and {format_number(num(diffs, 'bfloat16/cached'))} in "
        f"bfloat16 (largest logit difference); re-computing instead of caching gives "
        f"{format_number(num(diffs, 'bfloat16/recomputed'))} in bfloat16."
    )
    rows = [(f"largest |logit difference| vs float64, {k}", iv(diffs, k)) for k in diffs]
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="the prompt: a Python-docs passage starting at a paragraph the seed picks",
    describe=describe,
    name="caching_numerics",
    title="Numerics of caching vs recomputation",
    run=run,
    order=75,
    description="Cached vs recomputed greedy decoding in fp32, bf16 and fp16, each against a "
    "computed fp64 reference: per-step KL, max logit error, first divergence.",
)
