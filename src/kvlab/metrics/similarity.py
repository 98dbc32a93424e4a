"""Comparing two caches slot by slot: cosine and normalised L2 per (layer, KV head, position).

The unit of comparison is one cached vector (head_dim numbers) of one KV head in one layer, for a
pair of aligned slots (slot ``idx_a[p]`` of cache A against slot ``idx_b[p]`` of cache B). Alignment
is the caller's choice (a roll by n pairs original slots n..T-1 with rolled slots 0..T-n-1).

Keys can be compared raw (post-RoPE, what the model caches) or de-rotated: each cache's keys are
un-rotated with *its own* positions, which removes the position part of the difference. The
thread's "null" came from de-rotating both caches with the same positions 0..P-1 (plus the wrong,
interleaved pairing): the same rotation on both sides leaves every cosine unchanged. That mode is
kept as ``derotate="buggy"`` to reproduce it.

Normalised L2 is ``||a - b|| / (||a|| + ||b||)``, in [0, 1] (0 = identical, 1 = opposite).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError
from kvlab.rope.ops import remove_rope_stacked
from kvlab.rope.spec import map_rope

Derotate = Literal["none", "correct", "buggy"]


@dataclass(frozen=True)
class CacheComparison:
    """Per-slot similarities, each ``[layers, kv_heads, positions]`` (float64), for batch row 0.

    ``cos_k_derotated`` is None when the model has no RoPE or de-rotation was not asked for; ``l2_*``
    are None when ``l2=False`` was passed.
    ``positions_a`` / ``positions_b`` are the RoPE positions of the compared slots.
    """

    cos_k: np.ndarray
    cos_v: np.ndarray
    l2_k: np.ndarray | None
    l2_v: np.ndarray | None
    cos_k_derotated: np.ndarray | None
    positions_a: np.ndarray
    positions_b: np.ndarray

    def arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        """Every field as a named array (for ``ExperimentResult.arrays``)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f"{prefix}{f.name}"] = value
        return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Cosine over the last axis, in float64 (inputs are converted once by the caller)."""
    a, b = a.double(), b.double()
    dot = torch.linalg.vecdot(a, b)
    norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    return (dot / norms.clamp_min(1e-12)).numpy()


def _l2(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    a, b = a.double(), b.double()
    den = torch.linalg.vector_norm(a, dim=-1) + torch.linalg.vector_norm(b, dim=-1)
    return (torch.linalg.vector_norm(a - b, dim=-1) / den.clamp_min(1e-12)).numpy()


def select_along(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """``t.index_select(dim, idx)``, but a view (no copy) when ``idx`` is one contiguous ascending run.

    Aligned slots are almost always such a run (a roll pairs n..T-1 with 0..T-n-1), and gathering
    them is most of a comparison's memory traffic. ``idx`` may live on the host (slot indices do):
    it is moved to ``t``'s device.
    """
    n = idx.numel()
    if n and int(idx[-1]) - int(idx[0]) == n - 1 and bool((idx.diff() == 1).all()):
        return t.narrow(dim, int(idx[0]), n)
    return t.index_select(dim, idx.to(t.device))


def _slots(idx: torch.Tensor | np.ndarray | list[int] | None, length: int) -> torch.Tensor:
    """Aligned slot indices on the host (all of ``0..length-1`` by default), like snapshot positions."""
    if idx is None:
        return torch.arange(length, device="cpu")
    raw = idx if isinstance(idx, torch.Tensor) else np.asarray(idx)
    return torch.as_tensor(raw, dtype=torch.long, device="cpu")


class PreparedCache:
    """A snapshot's batch-row-0 keys, values and correctly de-rotated keys as float64 ``[L, H, T, D]``.

    Comparing one cache against many others (a roll sweep) converts and de-rotates it once instead of
    once per comparison. Pass it to :func:`compare_caches` wherever a snapshot is accepted. It is a
    read-only view of the snapshot: nothing here mutates it.
    """

    def __init__(self, snapshot: KVSnapshot) -> None:
        self.snapshot = snapshot
        self.keys = torch.stack([t[0] for t in snapshot.keys]).double()
        self.values = torch.stack([t[0] for t in snapshot.values]).double()
        self._derotated: torch.Tensor | None = None

    @property
    def derotated_keys(self) -> torch.Tensor:
        if self._derotated is None:
            rope = self.snapshot.require_rope("de-rotating keys")
            self._derotated = remove_rope_stacked(self.keys, self.snapshot.positions, rope)
        return self._derotated


def _side(
    c: KVSnapshot | PreparedCache, idx: torch.Tensor, derotate: Derotate
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(K, V, de-rotated K or None)`` of the given slots, float64 ``[L, H, P, D]``."""
    if isinstance(c, PreparedCache):
        k, v = select_along(c.keys, 2, idx), select_along(c.values, 2, idx)
        kd = select_along(c.derotated_keys, 2, idx) if derotate == "correct" else None
        return k, v, kd
    k = torch.stack([select_along(t[0], 1, idx) for t in c.keys]).double()
    v = torch.stack([select_along(t[0], 1, idx) for t in c.values]).double()
    kd = (
        remove_rope_stacked(k, c.positions.index_select(0, idx), c.require_rope("de-rotating keys"))
        if derotate == "correct"
        else None
    )
    return k, v, kd


def _interleaved_buggy_derotate(
    keys: torch.Tensor, positions: torch.Tensor, snap: KVSnapshot
) -> torch.Tensor:
    """The thread's de-rotation: GPT-J (interleaved) pairing and positions 0..P-1 for both caches."""
    rope = map_rope(
        snap.require_rope("de-rotating keys"), lambda s: dataclasses.replace(s, pairing="interleaved")
    )
    return remove_rope_stacked(keys, positions, rope)


def compare_caches(
    a: KVSnapshot | PreparedCache,
    b: KVSnapshot | PreparedCache,
    idx_a: torch.Tensor | np.ndarray | list[int] | None = None,
    idx_b: torch.Tensor | np.ndarray | list[int] | None = None,
    *,
    derotate: Derotate = "correct",
    center: bool = False,
    l2: bool = True,
) -> CacheComparison:
    """Similarity of aligned slots of two caches (same geometry; models may differ for transplants).

    ``idx_a`` / ``idx_b`` are slot indices of equal length (default: all slots, equal lengths).
    ``center`` subtracts each cache's own mean vector (over the compared slots, per layer and head)
    before comparing, which removes the shared direction that keeps raw K cosine near 0.6 even for
    unrelated text. Either side may be a :class:`PreparedCache` (same results, less repeated work);
    ``l2=False`` skips the normalised L2 arrays when only cosines are needed.
    """
    pa_, pb_ = a, b
    a = a.snapshot if isinstance(a, PreparedCache) else a
    b = b.snapshot if isinstance(b, PreparedCache) else b
    if (a.num_layers, a.num_kv_heads, a.head_dim) != (b.num_layers, b.num_kv_heads, b.head_dim):
        raise BadInputError(
            f"cache geometries differ: {a.num_layers}x{a.num_kv_heads}x{a.head_dim} vs "
            f"{b.num_layers}x{b.num_kv_heads}x{b.head_dim}"
        )
    if derotate not in ("none", "correct", "buggy"):
        raise BadInputError(f"derotate must be 'none', 'correct' or 'buggy', got {derotate!r}")
    ia, ib = _slots(idx_a, a.seq_len), _slots(idx_b, b.seq_len)
    if ia.numel() != ib.numel() or ia.numel() == 0:
        raise BadInputError(
            f"need the same non-zero number of aligned slots on both sides, got {ia.numel()} and {ib.numel()}; "
            "pass idx_a/idx_b to align caches of different lengths"
        )
    ia, ib = ia.reshape(-1), ib.reshape(-1)
    for name, idx, snap in (("idx_a", ia, a), ("idx_b", ib, b)):
        if int(idx.min()) < 0 or int(idx.max()) >= snap.seq_len:
            raise BadInputError(f"{name} must lie in [0, {snap.seq_len})")
    with_rope = derotate != "none" and a.rope is not None and b.rope is not None
    mode = derotate if with_rope else "none"
    ka, va, ra = _side(pa_, ia, mode)
    kb, vb, rb = _side(pb_, ib, mode)
    pa, pb = a.positions.index_select(0, ia), b.positions.index_select(0, ib)
    dk = None
    if mode == "buggy":
        same = torch.arange(ia.numel(), device="cpu")
        ra = _interleaved_buggy_derotate(ka, same, a)
        rb = _interleaved_buggy_derotate(kb, same, b)
    if mode != "none":
        # "correct": _side de-rotated both; "buggy": de-rotated just above
        assert ra is not None and rb is not None
        if center:
            ra, rb = ra - ra.mean(dim=-2, keepdim=True), rb - rb.mean(dim=-2, keepdim=True)
        dk = _cos(ra, rb)
    if center:
        ka, kb = ka - ka.mean(dim=-2, keepdim=True), kb - kb.mean(dim=-2, keepdim=True)
        va, vb = va - va.mean(dim=-2, keepdim=True), vb - vb.mean(dim=-2, keepdim=True)
    return CacheComparison(
        cos_k=_cos(ka, kb),
        cos_v=_cos(va, vb),
        l2_k=_l2(ka, kb) if l2 else None,
        l2_v=_l2(va, vb) if l2 else None,
        cos_k_derotated=dk,
        positions_a=pa.numpy(),
        positions_b=pb.numpy(),
    )


def summarize(values: np.ndarray, exclude_first: int = 0) -> dict[str, float | list[float]]:
    """Summaries of a ``[layers, heads, positions]`` array: mean, per layer, per position, last position.

    ``exclude_first`` drops the first k aligned positions (e.g. a new attention sink) from the mean
    and per-layer summaries; per-position curves always keep every position.
    """
    if values.ndim != 3:
        raise BadInputError(f"expected [layers, heads, positions], got shape {values.shape}")
    if not 0 <= exclude_first < values.shape[-1]:
        raise BadInputError(f"exclude_first must lie in [0, {values.shape[-1]}), got {exclude_first}")
    kept = values[..., exclude_first:]
    return {
        "mean": float(np.nanmean(kept)),
        "last_position": float(np.nanmean(values[..., -1])),
        "per_layer": np.nanmean(kept, axis=(1, 2)).tolist(),
        "per_position": np.nanmean(values, axis=(0, 1)).tolist(),
        "exclude_first": exclude_first,
    }


def centroid_cosine(a: KVSnapshot, b: KVSnapshot, which: Literal["k", "v"] = "v") -> np.ndarray:
    """Cosine between the mean vectors of two caches, ``[layers, kv_heads]``; lengths may differ.

    Keys are de-rotated with each cache's own positions first (when the model has RoPE), so the
    centroid is not dominated by where the tokens sat.
    """
    if (a.num_layers, a.num_kv_heads, a.head_dim) != (b.num_layers, b.num_kv_heads, b.head_dim):
        raise BadInputError("cache geometries differ")

    def centroid(s: KVSnapshot) -> torch.Tensor:
        t = torch.stack([x[0] for x in (s.keys if which == "k" else s.values)]).double()
        if which == "k" and s.rope is not None:
            t = remove_rope_stacked(t, s.positions, s.rope)
        return t.mean(dim=-2)

    return _cos(centroid(a), centroid(b))


def normalise_against_baseline(c: np.ndarray | float, c_unrelated: np.ndarray | float) -> np.ndarray | float:
    """``(c - c_unrel) / (1 - c_unrel)``: 0 = no more similar than unrelated text, 1 = identical."""
    c = np.asarray(c, dtype=np.float64)
    u = np.asarray(c_unrelated, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(np.abs(1 - u) > 1e-12, (c - u) / (1 - u), np.nan)
    return float(out) if out.ndim == 0 else out
