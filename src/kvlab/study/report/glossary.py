"""Every label the report uses that a newcomer would have to guess, defined once (shown at the top)."""

from __future__ import annotations

import html

#: (term, definition). "the thread" and "Phase 1/2" are the two seed documents whose claims the study
#: re-tests; experiments are named by what they measure (the brief's codes are not used in the report).
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
        "a 95% confidence interval over the samples (text samples, prompts, facts or trials), written "
        "value [low, high] (n = number of samples): a bootstrap for means and medians, a Wilson interval for "
        "proportions (accuracy, top-1 agreement); a value from fewer than 5 samples has no interval "
        "(n = 2, no interval)",
    ),
    (
        "paired difference",
        "how two caches are compared: on each sample both ran (the same trial, text sample, fact or "
        "step), one's number minus the other's, then the mean of those differences with its interval; a "
        "verdict follows where that interval lies (above 0, below 0, or across 0)",
    ),
    (
        "cannot decide",
        "a verdict that needs a paired difference's interval, from a run with fewer than 5 paired samples "
        "(so no interval): neither holds nor does not hold",
    ),
    (
        "smoke run",
        "a run of the quick profile: few samples, to show that every experiment runs; its numbers are "
        "not findings and its verdicts are marked (smoke)",
    ),
    (
        "seed",
        "chooses which samples are drawn (where in the text the samples and prompts come from, which facts); "
        "seed 0 is the reference draw, and other seeds are replicates",
    ),
    (
        "provenance",
        "how a cache was made: prefill (exact), rolled, repositioned, quantized, transplanted, edited",
    ),
)


def glossary_html() -> str:
    """The glossary as HTML (the report's pages render it from their template)."""
    items = "".join(f"<dt>{html.escape(t)}</dt><dd>{html.escape(d)}</dd>" for t, d in GLOSSARY)
    return (
        '<section id="glossary" class="glossary"><details><summary><b>Glossary</b>: the words this '
        f"report uses</summary><dl>{items}</dl></details></section>"
    )
