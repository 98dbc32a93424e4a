"""Keeping a budget: top-scored slots per KV head, sinks and recent window forced, and the result.

Invariants of :class:`EvictedCache`: every layer and head keeps exactly ``n_keep`` slots, listed in
their original order; the first ``sinks`` and last ``window`` slots of the policy are among them;
``positions[l][b, h, i]`` is the RoPE position the kept key ``i`` is rotated to. In ``keep`` mode
those are the original positions and the next query goes at the original ``next_position``; in
``repack`` mode kept keys are re-rotated to ``0..n_keep-1`` (an exact RoPE shift) and the next query
goes at ``n_keep``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.compress.evict.observe import Observation
from kvlab.compress.evict.policies import LayerView, Policy
from kvlab.errors import BadInputError
from kvlab.policy.window import SinksWindow
from kvlab.rope.ops import shift_keys
from kvlab.rope.spec import Rope


def budget_slots(length: int, keep: float | None = None, n_keep: int | None = None) -> int:
    """Slots to keep out of ``length``: a fraction ``keep`` in (0, 1] or an explicit count in [1, length]."""
    if (keep is None) == (n_keep is None):
        raise BadInputError("give exactly one budget: keep (a fraction in (0, 1]) or n_keep (a slot count)")
    if keep is not None:
        if not 0.0 < float(keep) <= 1.0:
            raise BadInputError(f"keep must be a fraction in (0, 1], got {keep}")
        return max(1, round(float(keep) * length))
    if not 1 <= int(n_keep) <= length:
        raise BadInputError(f"n_keep must lie in [1, {length}] for a cache of {length} slots, got {n_keep}")
    return int(n_keep)


def keep_indices(scores: torch.Tensor, n_keep: int, sinks: int = 0, window: int = 0) -> torch.Tensor:
    """``[B, H, n_keep]`` sorted slot indices: the top-``n_keep`` of ``scores [B, H, T]`` per head.

    The first ``sinks`` slots are always kept (a budget smaller than ``sinks`` is an error); the last
    ``window`` slots are kept as far as the budget left after the sinks allows.
    """
    t = scores.shape[-1]
    if not 1 <= n_keep <= t:
        raise BadInputError(f"cannot keep {n_keep} of {t} slots; the budget must lie in [1, {t}]")
    if sinks > n_keep:
        raise BadInputError(f"the budget of {n_keep} slots is smaller than the {sinks} sinks asked for")
    s = scores.float().clone()
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, -1e30))
    # the protected slots are a SinksWindow's, with the window cut to what the budget leaves
    sink_end, window_start = SinksWindow(sinks, max(0, min(window, n_keep - min(sinks, t)))).bounds(t)
    bonus = torch.zeros(t, device=s.device)
    bonus[window_start:] = 1e35  # below the sinks' bonus, above any score
    bonus[:sink_end] = 1e36
    idx = torch.topk(s + bonus, n_keep, dim=-1).indices
    return idx.sort(dim=-1).values


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))


@dataclass(frozen=True, eq=False)
class EvictedCache:
    """A compressed context: per layer ``keys``/``values`` ``[B, H, n_keep, D]``, ``positions``/``slots`` ``[B, H, n_keep]``."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    positions: tuple[torch.Tensor, ...]
    slots: tuple[torch.Tensor, ...]
    source_len: int
    next_position: int
    rope: Rope | None
    fingerprint: str
    method: str
    mode: str = "keep"

    @property
    def n_keep(self) -> int:
        return self.keys[0].shape[-2]

    @property
    def kept_fraction(self) -> float:
        return self.n_keep / self.source_len

    @property
    def nbytes(self) -> int:
        """K/V bytes held (positions are bookkeeping: keys already carry their rotation)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def repack(self) -> EvictedCache:
        """Kept keys re-rotated to positions ``0..n_keep-1`` per head (exact RoPE shift); a new object."""
        if self.mode == "repack":
            return self
        if self.rope is None:
            raise BadInputError("re-packing positions needs a model with RoPE")
        target = torch.arange(self.n_keep, device=self.positions[0].device)
        keys = tuple(
            k if (spec := self.rope.for_layer(i)) is None else shift_keys(k, (target - p).to(k.device), spec)
            for i, (k, p) in enumerate(zip(self.keys, self.positions, strict=True))
        )
        pos = tuple(target.expand_as(p).clone() for p in self.positions)
        return EvictedCache(
            keys,
            self.values,
            pos,
            self.slots,
            self.source_len,
            self.n_keep,
            self.rope,
            self.fingerprint,
            self.method,
            "repack",
        )

    def same_slots_everywhere(self) -> bool:
        first = self.slots[0][:1, :1]
        return all(bool((s == first).all()) for s in self.slots)


def layer_views(source: KVSnapshot | Observation) -> list[LayerView]:
    if isinstance(source, Observation):
        snap, queries, scaling = source.snapshot, source.queries, source.scaling
    elif isinstance(source, KVSnapshot):
        snap, queries, scaling = source, (None,) * source.num_layers, 1.0
    else:
        raise BadInputError(f"evict needs a KVSnapshot or an Observation, got {type(source).__name__}")
    return [
        LayerView(i, snap.num_layers, k, v, snap.positions, queries[i], scaling)
        for i, (k, v) in enumerate(zip(snap.keys, snap.values, strict=True))
    ]


def evict(
    source: KVSnapshot | Observation,
    policy: Policy,
    *,
    keep: float | None = None,
    n_keep: int | None = None,
    mode: str = "keep",
) -> EvictedCache:
    """Keep a budget of slots per layer and KV head, chosen by ``policy``; ``source`` is not modified.

    Attention-based policies need an :class:`Observation` (from :func:`observe`); key-only policies
    also accept a plain snapshot. ``mode`` is ``"keep"`` (original positions) or ``"repack"``.
    """
    if mode not in ("keep", "repack"):
        raise BadInputError(f"mode must be 'keep' or 'repack', got '{mode}'")
    views = layer_views(source)
    snap = source.snapshot if isinstance(source, Observation) else source
    n = budget_slots(snap.seq_len, keep, n_keep)
    keys, values, positions, slots = [], [], [], []
    for view in views:
        idx = keep_indices(policy.score(view), n, policy.sinks, policy.window)
        keys.append(_gather(view.keys, idx))
        values.append(_gather(view.values, idx))
        positions.append(snap.positions.to(idx.device)[idx])
        slots.append(idx)
    out = EvictedCache(
        tuple(keys),
        tuple(values),
        tuple(positions),
        tuple(slots),
        snap.seq_len,
        snap.next_position,
        snap.rope,
        snap.fingerprint,
        policy.name,
    )
    return out.repack() if mode == "repack" else out
