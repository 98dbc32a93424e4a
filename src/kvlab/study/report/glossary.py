"""Every label the report uses that a newcomer would have to guess, defined once (shown at the top)."""

from __future__ import annotations

import html

#: (term, definition). Labels R1–R13 and B1–B7 number the experiments of the research brief that
#: started kvlab; "the thread" and "Phase 1/2" are the two seed documents whose claims the study re-tests.
GLOSSARY: tuple[tuple[str, str], ...] = (
    (
        "the thread",
        "the April 2026 discussion on X/Twitter (@mlegls and others) that compared a model's "
        "internals under rolled context windows with scrambled and unrelated prompts; its claims are "
        "re-tested here with statistics",
    ),
    (
        "Phase 1 / Phase 2",
        "the two phases of the KV-cache communication log (TinyLlama 1.1B, Nov 2025): "
        "Phase 1 inspected the cache's structure and size, Phase 2 injected one prompt's cache into another",
    ),
    (
        "R1–R13",
        "the experiments of the research brief: R1 roll sweep, R2 controls, R3 roll vs truncate on a "
        "long context, R4 curve analysis, R5 RoPE de-rotation, R6 terminal-position de-rotation, R7 attention "
        "and logits, R8 K/V swaps, R9 the thread's suffix caching, R10 transplants, R11 compaction, R12 Phase 1 "
        "inspection, R13 Phase 2 injection",
    ),
    (
        "B1–B7",
        "experiments beyond the seeds: B1 sink-preserving suffix caching, B2 sink-aware similarity, "
        "B3 predicting K cosine curves from RoPE frequencies alone, B4 sink-only K/V swaps, B5 compaction with "
        "centring and lexical controls, B6 learned cross-model maps, B7 probes for evicted information",
    ),
    (
        "roll",
        "drop the oldest n tokens of a context window and keep the rest (by re-prefilling, or by "
        "re-rotating the cached keys: suffix caching)",
    ),
    (
        "re-prefill",
        "recompute the cache of the kept tokens from scratch: the exact answer a roll is compared with",
    ),
    (
        "attention sink",
        "the first token(s) of a sequence, which receive a large share of attention whatever "
        "they say; keeping them when rolling (sinks + window) keeps the model stable",
    ),
    (
        "RoPE / de-rotation",
        "rotary position embeddings rotate each key by its position; de-rotating removes "
        "that rotation so keys cached at different positions can be compared",
    ),
    ("K / V cosine", "cosine similarity of cached keys or values, slot by slot, between two caches"),
    ("KL", "Kullback–Leibler divergence between two next-token distributions, in nats (0 = identical)"),
    ("top-1", "share of positions where two caches lead to the same most likely next token"),
    (
        "interval",
        "a 95% bootstrap confidence interval over the samples (texts or windows), written value [low, high]",
    ),
    (
        "provenance",
        "how a cache was made: prefill (exact), rolled, repositioned, quantized, transplanted, edited",
    ),
)


def glossary_html() -> str:
    items = "".join(f"<dt>{html.escape(t)}</dt><dd>{html.escape(d)}</dd>" for t, d in GLOSSARY)
    return (
        '<section id="glossary" class="glossary"><details open><summary><b>Glossary</b> — the labels this '
        f"report uses</summary><dl>{items}</dl></details></section>"
    )
