"""Injecting cache(A) and feeding B is prefill(A + B): the check behind the original Phase 2a "negative transfer".

For text pairs (A, B) three set-ups are run both ways, as cache(A') then B' and as one prefill of
A' + B': plain (A' = A, B' = B); a special token in the middle (B' = [BOS] + B, as the original
run did); and the original run's source cache (A' = A + its greedy continuation, B' = [BOS] + B).
Each must agree within dtype noise. What the original run then reported as a transfer effect is the
distance between "B with A's context" and "B alone", shown here as KL and top-1 agreement.
"""

from __future__ import annotations

import numpy as np

from kvlab.data import python_docs, token_samples
from kvlab.metrics import bootstrap_ci, kl_divergence, wilson_ci
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import each, format_interval, format_number, iv, num
from kvlab.study.report.plots import style, subplots

VARIANTS = ("plain", "special token in the middle", "generated tokens kept + special token")


def _special_token(model) -> int:
    tok = model.tokenizer
    for cand in (
        getattr(tok, "bos_token_id", None),
        getattr(model.config, "bos_token_id", None),
        getattr(tok, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        if isinstance(cand, int):
            return cand
    return 0


def run(
    ctx: ExperimentContext,
    *,
    pairs: int | None = None,
    a_tokens: int = 48,
    b_tokens: int = 16,
    kept_generated: int | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    handle = ctx.handle()
    n = ctx.count("pairs", pairs, quick=3, default=8, full=24)
    kept = kept_generated if kept_generated is not None else ctx.pick(quick=4, default=29)
    special = _special_token(handle)
    text = seeded_text(python_docs(), ctx.seed)
    ids = handle.encode(text.text[: n * (a_tokens + b_tokens) * 10])
    wins = token_samples(ids, a_tokens + b_tokens, n, seed=ctx.seed)
    maxdiff, scale, kl_alone, top1_alone = _measure(ctx, handle, wins, a_tokens, kept, special)
    tol = _tolerance(handle, scale)
    rows = []
    for j, v in enumerate(VARIANTS):
        kl = bootstrap_ci(kl_alone[:, j], seed=ctx.seed)
        t1 = wilson_ci(top1_alone[:, j])  # a proportion
        ok = bool(maxdiff[:, j].max() <= tol)
        rows.append([v, float(maxdiff[:, j].max()), ok, format_interval(kl), format_interval(t1)])
    result.table(
        "Cache injection vs concatenated prefill",
        Table.header(
            "set-up | max |Δlogit| injected vs prefill | equal within tolerance | "
            "last-token KL vs B alone (nats) | top-1 agreement with B alone"
        ),
        rows,
        caption=f"{n} pairs: A = {a_tokens} tokens, B = {b_tokens} tokens of {text.source}; special token id {special} "
        f"({handle.decode([special])!r}); {kept} generated tokens kept in the third set-up. Tolerance "
        f"{tol:.2g} for {str(handle.dtype).replace('torch.', '')}. The KL column is what an injection "
        "'effect' measures: the effect of having A as context at all.",
    )
    result.summary.update(
        {
            "pairs": n,
            "special_token_id": special,
            "kept_generated": kept,
            "tolerance": tol,
            "max_abs_logit_diff": {v: float(maxdiff[:, j].max()) for j, v in enumerate(VARIANTS)},
            "all_equal": bool(maxdiff.max() <= tol),
            "kl_vs_b_alone": {
                v: bootstrap_ci(kl_alone[:, j], seed=ctx.seed).to_json() for j, v in enumerate(VARIANTS)
            },
        }
    )
    result.arrays.update(
        {"max_abs_logit_diff": maxdiff, "kl_vs_b_alone": kl_alone, "top1_vs_b_alone": top1_alone}
    )
    ctx.figure(
        "equivalence",
        _figure(maxdiff, kl_alone, handle.name, tol),
        "Left: injected vs prefill logit difference per pair (dtype noise). Right: the "
        "'transfer effect' the original run measured, KL against B without A.",
        into=result.figures,
    )
    result.data_sources.append(f"{text.source}: {n} text samples of {a_tokens + b_tokens} tokens")
    return result


def _measure(ctx: ExperimentContext, handle, wins: list, a_tokens: int, kept: int, special: int):
    """Per pair and set-up: injected vs joint prefill logit gap, and KL / top-1 against B alone."""
    n = len(wins)
    maxdiff = np.zeros((n, len(VARIANTS)))
    scale = 0.0  # largest |logit| of the reference prefills: the tolerance scales with it
    kl_alone = np.zeros_like(maxdiff)
    top1_alone = np.zeros_like(maxdiff)
    with ctx.progress.task("equivalence: pairs", total=n) as advance:
        for i, w in enumerate(wins):
            a, b = w[:a_tokens], w[a_tokens:]
            first = handle.prefill(a)
            gen = (
                handle.generate(first.snapshot, first.logits[-1], kept, stop_at_eos=False).token_ids
                if kept
                else []
            )
            setups = ((a, b), (a, [special, *b]), (a + gen, [special, *b]))
            for j, (ctx_ids, feed) in enumerate(setups):
                injected = handle.extend(handle.prefill(ctx_ids).snapshot, feed).logits
                joint = handle.prefill(ctx_ids + feed).logits[len(ctx_ids) :]
                alone = handle.prefill(feed).logits
                maxdiff[i, j] = float((injected - joint).abs().max())
                scale = max(scale, float(joint.abs().max()))
                kl_alone[i, j] = float(kl_divergence(alone[-1], injected[-1]))
                top1_alone[i, j] = float((alone.argmax(-1) == injected.argmax(-1)).double().mean())
            advance(1)
    return maxdiff, scale, kl_alone, top1_alone


def _tolerance(model, scale: float) -> float:
    """Rounding bound for a chunked vs one-shot prefill: the model's dtype, depth and logit scale."""
    from kvlab.metrics.tolerance import forward_tolerance

    return forward_tolerance(model.dtype, num_layers=model.facts.num_layers, scale=scale)


def _figure(maxdiff, kl, name, tol):
    fig, axes = subplots(1, 2, figsize=(12, 4))
    x = np.arange(maxdiff.shape[0])
    for j, v in enumerate(VARIANTS):
        axes[0].plot(x, np.maximum(maxdiff[:, j], 1e-12), marker="o", ls="", label=v)
        axes[1].plot(x, kl[:, j], marker="s", ls="", label=v)
    axes[0].axhline(tol, color="r", lw=1, ls="--", label=f"tolerance {tol:g}")
    axes[0].set_yscale("log")
    style(axes[0], "text pair", "max |logit difference|", "cache(A) + B vs prefill(A + B)")
    style(axes[1], "text pair", "KL(B alone || B after A) (nats)", "What the injection 'effect' measured")
    fig.suptitle(f"{name}: cache injection is a concatenated context")
    return fig


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    worst = max((float(v) for v in (s.get("max_abs_logit_diff") or {}).values()), default=float("nan"))
    verdict = "equals" if s.get("all_equal") else "does NOT equal"
    text = (
        f"Injecting the cache of A and then feeding B {verdict} prefilling A+B: the largest logit difference is "
        f"{format_number(worst)}, within the rounding bound {format_number(num(s, 'tolerance'))} derived from the dtype and depth."
    )
    rows = each(s, "max_abs_logit_diff", "largest |logit difference|, {}")
    rows.append(("rounding bound", iv(s, "tolerance")))
    rows += each(s, "kl_vs_b_alone", "KL vs B without A, {}")
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="where in the Python docs the A/B pairs are cut",
    describe=describe,
    name="transfer_equivalence",
    title="Cache injection equals a concatenated prefill",
    run=run,
    order=69,
    description="cache(A) + B vs prefill(A + B), with and without a special token in "
    "the middle, and what Phase 2a's 'negative transfer' measured.",
)
