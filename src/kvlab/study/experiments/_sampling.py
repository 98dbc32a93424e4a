"""What a study's seed changes: where in a text the samples come from, and which items are drawn.

Seed 0 is the study's reference draw: the text from its start and the first items, as every
published number was measured. Any other seed is another draw from the same text: the text is
rotated to start at a paragraph chosen by the seed (the end joins the old start at a paragraph
break), and item lists are shuffled by the seed before the first ``n`` are taken. Every sample an
experiment cuts from the text (windows, prompts, contexts) therefore moves with the seed, so a sweep's
spread across seeds is a spread over samples, not only over bootstrap resamples. docs/sweeps.md lists
what the seed changes in each experiment.
"""

from __future__ import annotations

import random
import re

from kvlab.data import Text


def _paragraph_starts(text: str) -> list[int]:
    starts = [m.end() for m in re.finditer(r"\n\s*\n", text)]
    if len(starts) < 8:  # a text without paragraphs: sentence starts
        starts = [m.end() for m in re.finditer(r"[.!?]\s+", text)]
    return [s for s in starts if 0 < s < len(text)]


def seeded_text(text: Text, seed: int) -> Text:
    """``text`` as seed ``seed`` reads it: unchanged for seed 0, else rotated to start at a paragraph
    (or sentence) chosen by the seed, spread over the whole text; the source says where it starts."""
    if seed == 0:
        return text
    starts = _paragraph_starts(text.text)
    if not starts:
        return text
    at = random.Random(f"kvlab-text-{seed}").choice(starts)
    rotated = text.text[at:].strip() + "\n\n" + text.text[:at].strip()
    share = at / max(len(text.text), 1)
    return Text(text=rotated, source=f"{text.source}; seed {seed} starts {share:.0%} into it")


def seeded_order(count: int, seed: int) -> list[int]:
    """Indices ``0..count-1`` in the order seed ``seed`` draws them (seed 0: as listed)."""
    order = list(range(count))
    if seed != 0:
        random.Random(f"kvlab-items-{seed}").shuffle(order)
    return order
