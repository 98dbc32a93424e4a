"""Perturbations of a context and the rules that align an original cache with a perturbed one.

The token-level operation (``scramble_tokens``) is a pure list function; cache-level ones return a new :class:`~kvlab.cache.KVSnapshot` and never touch the
original. Alignments say which slot of cache A is compared with which slot of cache B:

* roll by n  — original slots ``n..T-1`` with rolled slots ``0..T-n-1`` (same tokens, positions - n);
* truncate n — slots ``0..T-n-1`` on both sides (by causality the truncated cache *is* that slice);
* positions  — slot p with slot p (scrambled / unrelated controls: same positions, other tokens);
* tokens     — each token of B with an unused occurrence of the same token id in A (scrambled text:
  the same token seen in another order).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError
from kvlab.policy.window import roll_amount

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle


@dataclass(frozen=True)
class Alignment:
    """Pairs of slots to compare: slot ``idx_a[p]`` of cache A with slot ``idx_b[p]`` of cache B."""

    idx_a: np.ndarray
    idx_b: np.ndarray
    rule: str

    def __len__(self) -> int:
        return int(self.idx_a.shape[0])

    def drop_first(self, k: int) -> Alignment:
        """Without the first ``k`` pairs (e.g. the new attention sink a roll creates at slot 0)."""
        if not 0 <= k < len(self):
            raise BadInputError(f"can drop 0..{len(self) - 1} of {len(self)} aligned slots, not {k}")
        return Alignment(self.idx_a[k:], self.idx_b[k:], f"{self.rule}, first {k} dropped")


def check_tokens(ids: Sequence[int], what: str = "the text") -> list[int]:
    """The ids as a list; a perturbation study needs at least two tokens."""
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise BadInputError(f"{what} has {len(ids)} token(s); a roll or truncation needs at least 2")
    return ids


def scramble_tokens(ids: Sequence[int], seed: int = 0, keep_first: int = 0) -> list[int]:
    """A seeded permutation of the tokens (the first ``keep_first`` stay in place, e.g. the sink)."""
    ids = check_tokens(ids)
    if not 0 <= keep_first < len(ids):
        raise BadInputError(f"keep_first must lie in [0, {len(ids)}), got {keep_first}")
    rest = np.asarray(ids[keep_first:])
    perm = np.random.default_rng(seed).permutation(rest.shape[0])
    return ids[:keep_first] + rest[perm].tolist()


# -- caches -------------------------------------------------------------------------------------


def truncate(snapshot: KVSnapshot, n: int | float) -> KVSnapshot:
    """Drop the last ``n`` slots. By causality this equals re-prefilling the shorter text (no model needed)."""
    check_tokens(snapshot.token_list(), "the cache")
    snapshot.require_prefill("truncate (equal to re-prefilling the shorter text)")
    return snapshot.slice(0, snapshot.seq_len - roll_amount(n, snapshot.seq_len))


def scramble(model: ModelHandle, snapshot: KVSnapshot, seed: int = 0, keep_first: int = 0) -> KVSnapshot:
    """Re-prefill a seeded permutation of the snapshot's tokens (same bag of tokens, no order)."""
    return model.prefill(scramble_tokens(snapshot.token_list(), seed, keep_first), all_logits=False).snapshot


def unrelated(model: ModelHandle, ids: Sequence[int]) -> KVSnapshot:
    """Prefill a control text (the caller picks one unrelated to the original)."""
    return model.prefill(check_tokens(ids, "the control text"), all_logits=False).snapshot


# -- alignments ---------------------------------------------------------------------------------


def align_roll(length: int, n: int | float) -> Alignment:
    """Original slots ``n..T-1`` with rolled slots ``0..T-n-1`` (T = original length)."""
    k = roll_amount(n, length)
    return Alignment(np.arange(k, length), np.arange(0, length - k), f"roll {k}")


def align_truncate(length: int, n: int | float) -> Alignment:
    """Slots ``0..T-n-1`` of the original with the same slots of the truncated cache."""
    k = roll_amount(n, length)
    return Alignment(np.arange(length - k), np.arange(length - k), f"truncate {k}")


def align_positions(length_a: int, length_b: int) -> Alignment:
    """Slot p with slot p, over the shorter length (controls: same positions, other tokens)."""
    m = min(length_a, length_b)
    if m < 1:
        raise BadInputError("both caches need at least one slot to align by position")
    return Alignment(np.arange(m), np.arange(m), "same positions")


def align_tokens(ids_a: Sequence[int], ids_b: Sequence[int]) -> Alignment:
    """Each token of B with the earliest unused occurrence of the same id in A; unmatched tokens dropped.

    For a roll this reproduces :func:`align_roll` when the dropped prefix shares no token with the
    rest only; prefer the explicit rules when the perturbation is known.
    """
    free: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(ids_a):
        free[int(t)].append(i)
    for v in free.values():
        v.reverse()  # pop() takes the earliest
    pairs = [(free[int(t)].pop(), j) for j, t in enumerate(ids_b) if free.get(int(t))]
    if not pairs:
        raise BadInputError("the two texts share no token; align them by position instead")
    a, b = zip(*pairs, strict=True)
    return Alignment(np.asarray(a), np.asarray(b), "same token id")
