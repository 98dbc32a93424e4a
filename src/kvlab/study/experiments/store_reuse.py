"""KV store reuse: time to first token from stored prefixes, and the quality of non-prefix reuse.

Part 1 (prefix reuse): a long shared prefix (a book or Python's docs) is stored once; later prompts
share it and differ in a short question. Time to first token when the prefix comes from the memory
tier, the disk tier, or Redis (when reachable) is compared with a full prefill at several prefix
lengths, side by side in one run; the logits are checked against the full prefill's.

Part 2 (non-prefix reuse): small documents written for kvlab are cached on their own, then placed
in the middle of a new prompt (after an instruction and other documents). Each correction mode
(rotation only, EPIC, CacheBlend, full recompute) is scored against a full prefill of the same
tokens: next-token KL, perplexity of the reference answer, answer accuracy, agreement with the full
prefill's answer, and time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvlab.data import default_long_text
from kvlab.metrics import bootstrap_ci, kl_divergence, nll
from kvlab.store import DiskTier, KVStore, MemoryTier, StoreUnavailableError, prefill_with_store
from kvlab.store.blend import blend, correction_by_name
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import each, format_number, iv, num, side_of_zero
from kvlab.study.report.plots import subplots

if TYPE_CHECKING:
    from kvlab.store.redis_tier import RedisTier

QUESTIONS_FOR_PREFIX = (
    "\n\nQuestion: What is the main subject of the text above?\nAnswer:",
    "\n\nSummarise the passage above in one sentence:",
    "\n\nQuestion: Who is speaking in the last paragraph?\nAnswer:",
    "\n\nList three words that describe the tone of the text:",
    "\n\nQuestion: Where does the passage take place?\nAnswer:",
)

# Small documents written for kvlab: (document, [(question, answer), ...]).
DOCUMENTS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "The lighthouse on Varn Island was kept by Edda Holm for thirty years. Every evening she climbed "
        "the one hundred and twelve steps to light the lamp, and her grey cat, Pepper, followed her up.",
        (
            ("What was the name of Edda Holm's cat?", "Pepper"),
            ("Who kept the lighthouse on Varn Island?", "Edda Holm"),
        ),
    ),
    (
        "The village of Kellmoor is known for its quince cider. Each October the brewers press the fruit "
        "in the old mill by the river Tarn, and the first barrel is opened on the night of the harvest fair.",
        (
            ("What fruit is Kellmoor's cider made from?", "quince"),
            ("Which river runs by the old mill?", "Tarn"),
        ),
    ),
    (
        "Dr. Amara Osei designed the Solvik bridge, a steel arch that opened in 1987. It carries two rail "
        "lines across the fjord and was painted bright orange so that ships could see it in fog.",
        (("Who designed the Solvik bridge?", "Amara Osei"), ("What colour is the Solvik bridge?", "orange")),
    ),
    (
        "In the board game Tidewater, each player controls a fleet of six barges. A barge that reaches the "
        "harbour of Lune scores three points, and the first player to reach twenty points wins.",
        (
            ("How many barges does each player control?", "six"),
            ("Which harbour scores points in Tidewater?", "Lune"),
        ),
    ),
    (
        "The cellist Ilse Marek recorded the Brennan suites in a church in Graz during the winter of 1962. "
        "She played an instrument made in 1740 by the luthier Paolo Venn.",
        (
            ("In which city were the Brennan suites recorded?", "Graz"),
            ("Who made Ilse Marek's cello?", "Paolo Venn"),
        ),
    ),
    (
        "The Orrin Valley railway climbs from Castor to the mining town of Dunhale. Its steam engine, "
        "named Bramble, pulls four green carriages and stops at the halt of Fennick Cross on request.",
        (
            ("What is the name of the steam engine?", "Bramble"),
            ("Which mining town does the railway reach?", "Dunhale"),
        ),
    ),
)

INSTRUCTION = "Read the documents below and answer the question with a few words.\n\n"
MODES = ("none", "epic", "cacheblend", "full")


def document_prompt(
    handle: Any, doc: tuple, documents: tuple = DOCUMENTS, question_index: int = 0, distractors: int = 2
) -> tuple[list[int], list[list[int]], list[int], str]:
    """``(instruction ids, [chunk ids], question ids, answer)``: the target document sits after distractors.

    Chunks are tokenised on their own, so a full prefill of the concatenation has the same token ids
    as the blended prompt.
    """
    i = documents.index(doc)
    others = [documents[(i + j) % len(documents)][0] for j in range(1, distractors + 1)]
    chunks = [handle.encode(f"Document: {text}\n\n") for text in (*others, doc[0])]
    question, answer = doc[1][question_index]
    return handle.encode(INSTRUCTION), chunks, handle.encode(f"Question: {question}\nAnswer:"), answer


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def _tier_stores(
    tmp: Path, redis_url: str | None, block_tokens: int
) -> tuple[dict[str, KVStore], RedisTier | None, list[str]]:
    """A store per tier (Redis when ``redis_url`` answers), the Redis tier (to clear), and notes."""
    stores = {
        "memory": KVStore([MemoryTier()], block_tokens=block_tokens),
        "disk": KVStore([DiskTier(tmp / "disk")], block_tokens=block_tokens),
    }
    notes = []
    redis = None
    if redis_url:
        from kvlab.store.redis_tier import RedisTier

        try:
            tier = RedisTier(redis_url, prefix=f"kvlab-exp-{os.getpid()}")
            stores["redis"] = KVStore([tier], block_tokens=block_tokens)
            redis = tier
        except StoreUnavailableError as exc:
            notes.append(f"Redis tier not measured: {exc}")
    else:
        notes.append(
            "Redis tier not measured: no server given (pass --redis redis://host:port/db or set KVLAB_REDIS_URL)."
        )
    return stores, redis, notes


def prefix_reuse(
    ctx: ExperimentContext,
    handle: Any,
    lengths: list[int],
    reps: int,
    redis_url: str | None,
    block_tokens: int,
) -> dict[str, Any]:
    text = seeded_text(default_long_text(), ctx.seed)
    ids_all = handle.encode(text.text[: max(lengths) * 8])
    if len(ids_all) < max(lengths):
        lengths = [n for n in lengths if n <= len(ids_all)]
    tmp = Path(tempfile.mkdtemp(prefix="kvlab-store-exp-", dir=ctx.out_dir))
    stores, redis, notes = _tier_stores(tmp, redis_url, block_tokens)
    tiers = ["full", *stores]
    ttft = {t: np.full((len(lengths), reps), np.nan) for t in tiers}
    max_err = {t: 0.0 for t in stores}
    questions = [handle.encode(q) for q in QUESTIONS_FOR_PREFIX]
    handle.prefill(ids_all[:16], all_logits=False)  # warm-up
    try:
        with ctx.progress.task("prefix reuse", total=len(lengths) * reps) as advance:
            for li, n in enumerate(lengths):
                prefix = ids_all[:n]
                for r in range(reps):
                    prompt = prefix + questions[r % len(questions)]
                    t0 = time.perf_counter()
                    full = handle.prefill(prompt, all_logits=False)
                    ttft["full"][li, r] = _ms(t0)
                    if r == 0:
                        for st in stores.values():
                            st.put(full.snapshot.slice(0, n))
                    for name, st in stores.items():
                        pre = prefill_with_store(handle, st, prompt, store_prompt=False)
                        if pre.cached_tokens != n:
                            raise RuntimeError(
                                f"{name} tier returned {pre.cached_tokens} of {n} stored tokens"
                            )
                        ttft[name][li, r] = pre.ttft_ms
                        max_err[name] = max(
                            max_err[name], float((pre.last_logits - full.logits[-1]).abs().max())
                        )
                    advance(1)
    finally:
        if redis is not None:
            keys = list(redis.client.scan_iter(f"{redis.prefix}:*"))
            if keys:
                redis.client.delete(*keys)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "lengths": lengths,
        "ttft_ms": ttft,
        "max_abs_logit_error": max_err,
        "notes": notes,
        "source": text.source,
        "bytes_per_token": handle.facts.kv_bytes_per_token(str(handle.dtype).replace("torch.", "")),
    }


# -- part 2 ------------------------------------------------------------------------------------------
def nonprefix_reuse(
    ctx: ExperimentContext,
    handle: Any,
    n_questions: int,
    epic_k: int,
    ratio: float,
    answer_tokens: int,
    modes: tuple[str, ...] = MODES,
) -> dict[str, Any]:
    from kvlab.study.experiments._sampling import seeded_order

    every = [(d, qi) for qi in range(2) for d in DOCUMENTS]
    items = [every[i] for i in seeded_order(len(every), ctx.seed)[:n_questions]]  # seed 0: as listed
    metrics = {
        m: {k: np.zeros(len(items)) for k in ("kl", "nll", "correct", "agree", "ms", "recomputed")}
        for m in modes
    }
    ref = {k: np.zeros(len(items)) for k in ("nll", "correct", "ms")}
    options: dict[str, dict[str, float]] = {"epic": {"k": epic_k}, "cacheblend": {"ratio": ratio}}
    corrections = {m: correction_by_name(m, **options.get(m, {})) for m in modes}
    with ctx.progress.task("non-prefix reuse", total=len(items)) as advance:
        for i, (doc, qi) in enumerate(items):
            instr, chunks, question, answer = document_prompt(handle, doc, question_index=qi)
            target = handle.encode(f" {answer}")
            t0 = time.perf_counter()
            full = handle.prefill(instr + sum(chunks, []) + question, all_logits=False)
            ref["ms"][i] = _ms(t0)
            ref_nll = nll(
                handle.extend(full.snapshot, target[:-1]).logits
                if len(target) > 1
                else torch.empty(0, full.logits.shape[-1], device=full.logits.device),
                torch.tensor(target[1:], device=full.logits.device),
            )
            ref["nll"][i] = float(
                torch.cat(
                    [nll(full.logits[-1:], torch.tensor(target[:1], device=full.logits.device)), ref_nll]
                ).mean()
            )
            ref_gen = handle.generate(full.snapshot, full.logits[-1], answer_tokens)
            ref["correct"][i] = float(answer.lower() in ref_gen.text.lower())
            cached = [
                handle.prefill(c, all_logits=False).snapshot for c in chunks
            ]  # what the store would hold
            for mode, corr in corrections.items():
                t0 = time.perf_counter()
                b = blend(handle, [instr, *cached], corr)
                out = handle.extend(b.snapshot, question, all_logits=False)
                ms = _ms(t0)
                m = metrics[mode]
                m["ms"][i] = ms
                m["recomputed"][i] = b.recomputed_tokens / max(b.chunk_tokens, 1)
                m["kl"][i] = float(kl_divergence(full.logits[-1], out.logits[-1]))
                rest = handle.extend(out.snapshot, target[:-1]).logits if len(target) > 1 else None
                tok_nll = nll(out.logits[-1:], torch.tensor(target[:1], device=out.logits.device))
                if rest is not None:
                    tok_nll = torch.cat([tok_nll, nll(rest, torch.tensor(target[1:], device=rest.device))])
                m["nll"][i] = float(tok_nll.mean())
                gen = handle.generate(out.snapshot, out.logits[-1], answer_tokens)
                m["correct"][i] = float(answer.lower() in gen.text.lower())
                m["agree"][i] = float(gen.token_ids == ref_gen.token_ids)
            advance(1)
    return {
        "metrics": metrics,
        "reference": ref,
        "items": [f"{d[1][qi][0]} -> {d[1][qi][1]}" for d, qi in items],
    }


# -- figures -----------------------------------------------------------------------------------------
def _ttft_figure(ctx: ExperimentContext, p1: dict) -> Any:
    x = np.asarray(p1["lengths"])
    colors = {"full": "#444444", "memory": "#4c72b0", "disk": "#dd8452", "redis": "#c44e52"}
    fig, (ax, ax2) = subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for name, arr in p1["ttft_ms"].items():
        cis = [bootstrap_ci(row) for row in arr]
        mean = np.array([ci.value for ci in cis])
        color = colors.get(name)
        ax.plot(x, mean, "o-", color=color, label="full prefill" if name == "full" else f"{name} hit")
        ax.fill_between(x, [ci.low for ci in cis], [ci.high for ci in cis], color=color, alpha=0.2)
        if name != "full":
            ratio = p1["ttft_ms"]["full"] / arr
            rc = [bootstrap_ci(row) for row in ratio]
            ax2.plot(x, [r.value for r in rc], "o-", color=color, label=f"{name} hit")
            ax2.fill_between(x, [r.low for r in rc], [r.high for r in rc], color=color, alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("shared prefix length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("Time to first token: stored prefix vs full prefill")
    ax.legend(fontsize=8)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xlabel("shared prefix length (tokens)")
    ax2.set_ylabel("speed-up (full prefill TTFT / hit TTFT)")
    ax2.set_title("Speed-up from reuse")
    ax2.legend(fontsize=8)
    return ctx.figure(
        "ttft_by_tier",
        fig,
        "Time to first token with the shared prefix loaded from each tier vs a full prefill; bands are 95% "
        "bootstrap intervals over prompts (none from fewer than 5 prompts).",
    )


def _quality_figure(ctx: ExperimentContext, p2: dict) -> Any:
    modes = list(p2["metrics"])
    fig, axes = subplots(1, 3, figsize=(14, 4.2), layout="constrained")
    xs = np.arange(len(modes))
    for ax, key, label in zip(
        axes,
        ("kl", "nll", "ms"),
        ("next-token KL vs full prefill (nats)", "answer NLL (nats/token)", "assembly + question time (ms)"),
        strict=True,
    ):
        cis = [bootstrap_ci(p2["metrics"][m][key]) for m in modes]
        vals = np.array([c.value for c in cis])
        err = np.array([[c.value - c.low for c in cis], [c.high - c.value for c in cis]])
        ax.bar(
            xs,
            vals,
            yerr=err,
            capsize=4,
            color=["#999", "#4c72b0", "#dd8452", "#55a868"][: len(modes)],
            label="reuse mode",
        )
        if key in ("nll", "ms"):
            ref = bootstrap_ci(p2["reference"][key])
            ax.axhline(ref.value, color="k", ls="--", lw=1, label="full prefill")
            ax.axhspan(ref.low, ref.high, color="k", alpha=0.1)
        ax.set_xticks(xs, modes)
        ax.set_ylabel(label)
        ax.set_xlabel("correction mode")
        ax.legend(fontsize=8)
    axes[0].set_title("Distance from full prefill")
    axes[1].set_title("Reference answer likelihood")
    axes[2].set_title("Cost")
    return ctx.figure(
        "nonprefix_quality",
        fig,
        "Non-prefix reuse of stored documents: quality and time per correction mode (error bars: 95% bootstrap CI over questions).",
    )


# -- run ---------------------------------------------------------------------------------------------
def run(
    ctx: ExperimentContext,
    *,
    redis_url: str | None = None,
    lengths: list[int] | None = None,
    reps: int | None = None,
    questions: int | None = None,
    block_tokens: int = 64,
    epic_k: int = 16,
    ratio: float = 0.15,
    answer_tokens: int = 6,
) -> ExperimentResult:
    handle = ctx.handle()
    redis_url = redis_url or os.environ.get("KVLAB_REDIS_URL") or None
    lengths = lengths or ctx.pick(quick=[128, 512], default=[256, 768], full=[256, 1024, 2048])
    reps = ctx.count("reps", reps, quick=2, default=3, full=5)
    n_q = ctx.count("questions", questions, quick=2, default=6, full=12)
    # "full" (recompute every chunk token) is a correctness check that costs a prefill; only in --full.
    modes = MODES if ctx.profile == "full" else MODES[:3]
    p1 = prefix_reuse(ctx, handle, lengths, reps, redis_url, block_tokens)
    p2 = nonprefix_reuse(ctx, handle, n_q, epic_k, ratio, answer_tokens, modes)

    ttft_rows = _ttft_rows(p1)
    qual_rows = _quality_rows(p2, modes)
    summary = _summary(p1, p2, modes)
    arrays = _arrays(p1, p2, modes)
    notes = _notes(p1, epic_k, ratio)
    return ExperimentResult(
        name="store_reuse",
        title=EXPERIMENT.title,
        summary=summary,
        tables=[
            Table(
                "Time to first token by tier",
                ["prefix tokens", "source", "TTFT ms", "low", "high", "speed-up vs full"],
                ttft_rows,
                caption="Mean and 95% bootstrap interval over prompts that share the prefix and differ in the "
                "question ('–': fewer than 5 prompts, no interval).",
            ),
            Table(
                "Non-prefix reuse vs full prefill",
                Table.header(
                    "mode | recomputed fraction | KL mean | KL low | KL high | answer perplexity | "
                    "accuracy | same answer as full | ms"
                ),
                qual_rows,
                caption=f"{len(p2['items'])} questions about documents written for kvlab; the target document sits after two others.",
            ),
        ],
        figures=[_ttft_figure(ctx, p1), _quality_figure(ctx, p2)],
        arrays=arrays,
        notes=notes,
        data_sources=[
            p1["source"],
            "kvlab's own small documents and questions (kvlab.study.experiments.store_reuse.DOCUMENTS)",
        ],
        description=EXPERIMENT.description,
    )


def _ttft_rows(p1: dict) -> list[list]:
    """Time to first token per prefix length and source, with its speed-up over a full prefill."""
    ttft_rows = []
    for li, n in enumerate(p1["lengths"]):
        full_ci = bootstrap_ci(p1["ttft_ms"]["full"][li])
        for name, arr in p1["ttft_ms"].items():
            ci = bootstrap_ci(arr[li])
            ttft_rows.append([n, name, ci.value, ci.low, ci.high, full_ci.value / ci.value])
    return ttft_rows


def _quality_rows(p2: dict, modes) -> list[list]:
    """Non-prefix reuse per correction mode, then the full-prefill reference."""

    def answers(d: dict, agree: float) -> list[float]:  # perplexity, accuracy, same answer, ms
        return [float(np.exp(d["nll"].mean())), float(d["correct"].mean()), agree, float(d["ms"].mean())]

    qual_rows = []
    for m in modes:
        d = p2["metrics"][m]
        kl = bootstrap_ci(d["kl"])
        recomputed = float(d["recomputed"].mean())
        qual_rows.append([m, recomputed, kl.value, kl.low, kl.high, *answers(d, float(d["agree"].mean()))])
    qual_rows.append(["full prefill (reference)", 1.0, 0.0, 0.0, 0.0, *answers(p2["reference"], 1.0)])
    return qual_rows


def _summary(p1: dict, p2: dict, modes) -> dict:
    """Speed-ups at the longest prefix, logit errors, KL and accuracy per mode."""
    ref = p2["reference"]
    longest = len(p1["lengths"]) - 1
    summary = {
        "prefix_lengths": p1["lengths"],
        "speedup_at_longest": {
            t: float(np.nanmean(p1["ttft_ms"]["full"][longest] / p1["ttft_ms"][t][longest]))
            for t in p1["ttft_ms"]
            if t != "full"
        },
        "max_abs_logit_error_vs_full": p1["max_abs_logit_error"],
        "kl_mean": {m: float(p2["metrics"][m]["kl"].mean()) for m in modes},
        "accuracy": {m: float(p2["metrics"][m]["correct"].mean()) for m in modes}
        | {"full_prefill": float(ref["correct"].mean())},
        "questions": len(p2["items"]),
    }
    # the same question answered both ways: a paired difference, and a verdict only from its interval
    diff = bootstrap_ci(p2["metrics"]["cacheblend"]["kl"] - p2["metrics"]["none"]["kl"]).to_json()
    where = side_of_zero(diff)
    summary["cacheblend_minus_rotation_only_kl"] = diff
    summary["cacheblend_closer_than_rotation_only"] = (
        where == "below 0" if where in ("below 0", "above 0", "contains 0") else None
    )  # None: too few questions for an interval
    return summary


def _arrays(p1: dict, p2: dict, modes) -> dict:
    """Every raw array behind the tables."""
    ref = p2["reference"]
    arrays = {f"ttft_ms_{t}": a for t, a in p1["ttft_ms"].items()} | {
        "prefix_lengths": np.asarray(p1["lengths"])
    }
    for m in modes:
        arrays |= {f"{m}_{k}": v for k, v in p2["metrics"][m].items()}
    arrays |= {f"reference_{k}": v for k, v in ref.items()}
    return arrays


def _notes(p1: dict, epic_k: int, ratio: float) -> list[str]:
    """What the numbers mean and do not mean."""
    notes = list(p1["notes"]) + [
        "Disk-tier reads were served from the OS page cache (the blocks had just been written); a cold read "
        "from the device adds its transfer time.",
        f"Reused logits matched the full prefill to within {max(p1['max_abs_logit_error'].values()):.2e} (max abs).",
        f"Corrections: EPIC recomputes the first {epic_k} tokens of each document; CacheBlend recomputes the "
        f"{ratio:.0%} of each document's tokens whose layer-1 K/V deviate most (one selection, not per-layer).",
        "Timings are wall-clock on a shared CPU; compare the series measured side by side, not across runs.",
        "Non-prefix timings: these prompts are short (a few hundred tokens), so each extra forward pass's fixed "
        "cost (30 layers) dominates and recomputation can take as long as a full prefill; the saving needs long chunks.",
    ]
    return notes


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    text = (
        f"A stored prefix cuts time to first token {format_number(num(s, 'speedup_at_longest.memory'))}x from memory and "
        f"{format_number(num(s, 'speedup_at_longest.disk'))}x from disk at the longest prefix, with logits equal to a full "
        f"prefill (largest difference {format_number(num(s, 'max_abs_logit_error_vs_full.disk'))}); reusing non-prefix "
        f"chunks costs KL {format_number(num(s, 'kl_mean.cacheblend'))} nats with CacheBlend's correction"
        + (
            f" (minus rotation only, paired per question: {iv(s, 'cacheblend_minus_rotation_only_kl', signed=True)})."
            if s.get("cacheblend_minus_rotation_only_kl")
            else "."
        )
    )
    rows = each(s, "speedup_at_longest", "time-to-first-token speed-up, {}")
    rows += each(s, "max_abs_logit_error_vs_full", "largest |logit error| vs full prefill, {}")
    rows += each(s, "kl_mean", "non-prefix reuse KL (nats), {}")
    if s.get("cacheblend_minus_rotation_only_kl"):
        rows.append(
            (
                "non-prefix reuse KL, CacheBlend minus rotation only (paired per question)",
                iv(s, "cacheblend_minus_rotation_only_kl", signed=True),
            )
        )
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="the document whose prefixes are stored (where in the text it starts) and which questions the "
    "non-prefix reuse asks (quick profile: 2 drawn by the seed)",
    describe=describe,
    name="store_reuse",
    title="KV store: prefix reuse across tiers and non-prefix reuse",
    run=run,
    order=60,
    description=__doc__.split("\n\n")[0],
)
