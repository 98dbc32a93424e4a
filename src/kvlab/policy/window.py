"""Attention sinks + a recent window: kvlab's one implementation of "which slots a roll keeps".

StreamingLLM's layout (Xiao et al. 2023): the first ``sinks`` slots stay forever, then the last
``window`` slots; everything between is dropped. Every place kvlab keeps sinks + a window uses
:class:`SinksWindow`: the offline roll of a snapshot (:func:`kvlab.ops.suffix.roll`,
:func:`kvlab.ops.transfer.drop_prefix`), the online :class:`~kvlab.hf.RollingCache` (how much to
evict), the eviction policies' protected slots (:func:`kvlab.policy.evict.keep_indices`) and the
quantizers' full-precision sinks and recent tail (:func:`kvlab.policy.quant.split_plan`).

Invariants: the kept slots are ``[0, sink_end)`` then ``[window_start, T)``, in order, with
``sink_end = min(sinks, T)`` and ``window_start = max(sink_end, T - window)``; nothing is kept twice;
a roll keeps at least one slot after the sinks. ``apply`` re-positions the kept keys contiguously
(an exact RoPE shift from their stored positions, never incremental) and returns a new snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.errors import BadInputError

if TYPE_CHECKING:  # torch only where a snapshot is cut: reading a --cache spec needs default_chunk alone
    from kvlab.cache.snapshot import KVSnapshot


@dataclass(frozen=True)
class SinksWindow:
    """Keep the first ``sinks`` slots and the last ``window`` slots (``window=None``: all of them)."""

    sinks: int = 4
    window: int | None = None

    def __post_init__(self) -> None:
        if self.sinks < 0 or (self.window is not None and self.window < 0):
            raise BadInputError(
                f"sinks and window must be >= 0, got sinks={self.sinks}, window={self.window}"
            )

    @classmethod
    def dropping(cls, seq_len: int, drop: int, sinks: int = 0) -> SinksWindow:
        """The policy that drops ``drop`` slots right after ``sinks`` of a ``seq_len``-slot cache (a roll)."""
        if drop < 0 or sinks < 0:
            raise BadInputError(f"drop and sinks must be >= 0, got drop={drop}, sinks={sinks}")
        if sinks + drop >= seq_len:
            raise BadInputError(
                f"dropping {drop} tokens after {sinks} sinks leaves nothing of a {seq_len}-token context; "
                f"drop at most {seq_len - sinks - 1}"
            )
        return cls(sinks=sinks, window=seq_len - sinks - drop)

    @property
    def capacity(self) -> int | None:
        """Most slots kept at once (None: unbounded)."""
        return None if self.window is None else self.sinks + self.window

    def bounds(self, seq_len: int) -> tuple[int, int]:
        """``(sink_end, window_start)``: slots ``[0, sink_end)`` and ``[window_start, seq_len)`` stay."""
        sink_end = min(self.sinks, seq_len)
        window_start = sink_end if self.window is None else max(sink_end, seq_len - self.window)
        return sink_end, window_start

    def kept(self, seq_len: int) -> list[int]:
        """Slot indices kept out of ``seq_len``, in order."""
        sink_end, window_start = self.bounds(seq_len)
        return [*range(sink_end), *range(window_start, seq_len)]

    def overflow(self, held: int, chunk: int = 1) -> int:
        """Window slots to evict from a cache holding ``held`` slots: enough to fit, rounded up to ``chunk``.

        Evicting in chunks amortizes the roll; the sinks are never evicted.
        """
        if self.capacity is None or held <= self.capacity:
            return 0
        over = held - self.capacity
        return min(held - min(self.sinks, held), math.ceil(over / max(1, chunk)) * max(1, chunk))

    def apply(self, snapshot: KVSnapshot, *, start: int | None = None, reposition: bool = True) -> KVSnapshot:
        """The kept slots of ``snapshot`` as a new snapshot (``snapshot`` is not modified).

        With ``reposition`` (default) the kept keys are re-rotated to contiguous positions from
        ``start`` (default: the first slot's position), so the result looks like a prefill of the
        kept text; without it they keep their positions (queries continue at the old ones).
        """
        if snapshot.batch_size != 1:
            raise BadInputError(f"rolls work on one sequence (batch 1), got batch {snapshot.batch_size}")
        kept = snapshot.select(self.kept(snapshot.seq_len))
        if not reposition:
            return kept.replace(provenance="rolled")
        rope = snapshot.require_rope("re-positioning a rolled cache")
        rope.require_shift_exact("re-positioning a rolled cache")
        first = int(snapshot.positions[0]) if start is None else int(start)
        if first < 0:
            raise BadInputError(f"start position must be >= 0, got {first}")
        import torch

        return kept.with_positions(torch.arange(first, first + kept.seq_len, device="cpu")).replace(
            provenance="rolled"
        )


def default_chunk(window: int) -> int:
    """Tokens a full window evicts at once by default: 64 (a roll every 64 tokens amortizes its cost), at
    most half the window so that a small window still keeps half its tokens after a roll."""
    return max(1, min(64, int(window) // 2))


def roll_amount(spec: int | float | str, seq_len: int, *, sinks: int = 0) -> int:
    """Tokens a roll drops: ``20`` or ``"20"`` -> 20; ``0.25`` or ``"25%"`` -> that share of ``seq_len``.

    kvlab's one reader of roll amounts (command line, experiments, library). A fraction must lie in
    (0, 1) and rounds to at least one token; the result must leave at least one token after the
    ``sinks``, else a :class:`BadInputError` says the largest roll allowed.
    """
    if isinstance(spec, bool):
        raise BadInputError("a roll amount is a token count or a fraction, not a bool")
    if isinstance(spec, str):
        text = spec.strip()
        try:
            spec = float(text[:-1]) / 100 if text.endswith("%") else int(text)
        except ValueError:
            raise BadInputError(
                f"cannot read roll amount {spec!r}; use a count like 20 or a share like 25%"
            ) from None
    most = seq_len - sinks - 1
    if most < 1:
        raise BadInputError(f"a context of {seq_len} token(s) with {sinks} sinks cannot be rolled")
    if isinstance(spec, float) or type(spec).__name__.startswith("float"):
        if not 0.0 < float(spec) < 1.0:
            raise BadInputError(
                f"a roll fraction must lie in (0, 1), got {spec}; pass an int for a token count"
            )
        return min(max(1, round(float(spec) * seq_len)), most)
    count = int(spec)
    if not 1 <= count <= most:
        raise BadInputError(
            f"a roll of {count} tokens is outside 1..{most} for a context of {seq_len} tokens"
            + (f" with {sinks} sinks" if sinks else "")
        )
    return count
