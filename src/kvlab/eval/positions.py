"""Which RoPE positions an offline eviction's kept keys carry, and where the question starts.

An eviction keeps some slots of a context of ``T`` tokens (``k`` per KV head); three conventions place them:

* ``original`` (the default; mlx's SnapKV-D, TensorRT-LLM's TriAttention): the kept keys stay at their
  original positions, with gaps; the question starts at ``T``. The evicted cache is the masked snapshot
  the layout made, untouched.
* ``contiguous`` (OpenVINO Model Server after eviction): the kept keys are re-rotated to ``0..k-1``
  per KV head (an exact RoPE shift: :func:`kvlab.policy.evict.repack`); the question still starts at
  ``T``, so the question sees the context as far away as it was.
* ``cache`` (StreamingLLM: positions within the cache): the same re-rotated keys, and the question
  starts at ``k``, right after them.

With no slot evicted nothing moves: all three are the full cache. Only masked snapshots (offline
evictions: scored and strided layouts) are placed; a cache that holds every slot it attends over
(full, codecs, sinks + window with its own rolling positions) is left as it is, the question at its
``next_position``. A shared budget (``heads=``, ``layers=``) keeps different counts per head, which
have no common contiguous positions: only ``original`` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvlab.errors import BadInputError

if TYPE_CHECKING:
    from kvlab.cache.snapshot import KVSnapshot
    from kvlab.eval.specs import CacheSpec

#: the conventions, the default (today's behaviour) first
CONVENTIONS = ("original", "contiguous", "cache")
DEFAULT = CONVENTIONS[0]


def check_positions(conventions: Sequence[str], specs: Sequence[CacheSpec] = ()) -> None:
    """Refuse an unknown convention, or one that moves keys for a shared budget (no torch)."""
    unknown = [c for c in conventions if c not in CONVENTIONS]
    if unknown or not conventions:
        raise BadInputError(
            f"unknown positions convention(s) {', '.join(map(repr, unknown))}; choose from {', '.join(CONVENTIONS)}"
        )
    moved = [c for c in conventions if c != DEFAULT]
    shared = [s.spec for s in specs if getattr(s.policy.layout, "shared", False)]
    if moved and shared:
        raise BadInputError(
            f"positions {moved[0]}: a shared budget ({shared[0]}) keeps different counts per head, which "
            "have no common contiguous positions; run it with positions original"
        )


def place(snap: KVSnapshot, convention: str) -> tuple[KVSnapshot, int]:
    """The evicted cache ``snap`` under ``convention`` and the position the question starts at.

    ``snap`` is what a layout's ``apply`` made; a masked one (an eviction at its original positions) is
    re-packed for ``contiguous`` and ``cache``; any other is returned as it is."""
    check_positions([convention])
    if convention == DEFAULT or not snap.is_masked:
        return snap, snap.next_position
    from kvlab.policy.evict import repack

    packed = repack(snap)
    return packed, snap.next_position if convention == "contiguous" else packed.next_position
