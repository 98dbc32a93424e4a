"""Degeneration of generated text: distinct-n and the longest repeated n-gram (loops like "worked worked")."""

from __future__ import annotations

from collections.abc import Sequence


def distinct_n(tokens: Sequence[int], n: int = 2) -> float:
    """Distinct n-grams / all n-grams (1.0 = no repetition; near 0 = a loop)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def longest_repeated_ngram(tokens: Sequence[int]) -> int:
    """Length of the longest token n-gram that occurs at least twice (overlaps allowed)."""
    seq = list(tokens)
    lo, hi = 0, max(len(seq) - 1, 0)

    def repeats(n: int) -> bool:
        seen = set()
        for i in range(len(seq) - n + 1):
            g = tuple(seq[i : i + n])
            if g in seen:
                return True
            seen.add(g)
        return False

    while lo < hi:  # binary search: if an n-gram repeats, so does an (n-1)-gram
        mid = (lo + hi + 1) // 2
        if repeats(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def agreement_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens on which two generations agree."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
