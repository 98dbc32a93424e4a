"""Non-prefix reuse: place stored chunks (documents) anywhere in a new prompt, then correct them.

A chunk cached on its own (positions ``0..n-1``) is moved to its place in the new prompt by an
exact RoPE re-rotation of its keys (:meth:`KVSnapshot.with_positions`). That fixes positions but
not content: the chunk's K/V never attended to what now precedes it. A correction recomputes some
of its tokens with full attention to everything before them (other chunk tokens keep their cached
K/V), in one masked forward pass:

- :class:`RotateOnly` ("none"): recompute nothing.
- :class:`RecomputeFirst` ("epic", EPIC): the first ``k`` tokens of each chunk, where the missing
  cross-attention matters most.
- :class:`RecomputeDeviating` ("cacheblend", CacheBlend): the ``ratio`` of tokens whose K/V deviate
  most from a fresh computation at an early layer (the first ``probe_layers`` layers are run on the
  chunk in context to measure it). Simplification: CacheBlend narrows its selection layer by layer;
  here one selection, made at the probe layer, is recomputed through every layer.
- :class:`RecomputeAll` ("full"): every chunk token (equals a full prefill; a check, not a saving).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvlab.cache.snapshot import KVSnapshot, concat
from kvlab.errors import BadInputError
from kvlab.hf.masked import first_layers_kv
from kvlab.ops.recompute import recompute_slots

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle

Piece = KVSnapshot | Sequence[int]


class Correction(Protocol):
    @property
    def name(self) -> str: ...  # read-only: the corrections are frozen dataclasses

    def select(self, handle: ModelHandle, before: KVSnapshot | None, chunk: KVSnapshot) -> torch.Tensor:
        """Chunk-local slot indices (sorted, int64, on the host like every slot index) to recompute;
        ``chunk`` is already at its new positions."""
        ...


def _no_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.long, device="cpu")


@dataclass(frozen=True)
class RotateOnly:
    name: str = "none"

    def select(self, handle: ModelHandle, before: KVSnapshot | None, chunk: KVSnapshot) -> torch.Tensor:
        return _no_slots()


@dataclass(frozen=True)
class RecomputeFirst:
    """EPIC: recompute the first ``k`` tokens of each chunk."""

    k: int = 16
    name: str = "epic"

    def select(self, handle: ModelHandle, before: KVSnapshot | None, chunk: KVSnapshot) -> torch.Tensor:
        if self.k < 0:
            raise BadInputError(f"k must be >= 0, got {self.k}")
        return torch.arange(min(self.k, chunk.seq_len), device="cpu") if before is not None else _no_slots()


@dataclass(frozen=True)
class RecomputeDeviating:
    """CacheBlend: recompute the ``ratio`` of tokens with the largest K/V deviation at layer ``probe_layers - 1``."""

    ratio: float = 0.15
    probe_layers: int = 2
    name: str = "cacheblend"

    def scores(self, handle: ModelHandle, before: KVSnapshot | None, chunk: KVSnapshot) -> torch.Tensor:
        """``[n]`` squared L2 deviation of each token's K and V (all heads) from a fresh in-context pass."""
        fresh = first_layers_kv(handle, before, chunk.token_ids[0], chunk.positions, self.probe_layers)
        k, v = fresh[-1]
        layer = self.probe_layers - 1
        dk = (k.float() - chunk.keys[layer].float()).pow(2).sum(dim=(0, 1, 3))
        dv = (v.float() - chunk.values[layer].float()).pow(2).sum(dim=(0, 1, 3))
        return dk + dv

    def select(self, handle: ModelHandle, before: KVSnapshot | None, chunk: KVSnapshot) -> torch.Tensor:
        if not 0.0 <= self.ratio <= 1.0:
            raise BadInputError(f"ratio must lie in [0, 1], got {self.ratio}")
        if before is None:
            return _no_slots()  # nothing precedes the chunk: its cache is exact
        count = math.ceil(self.ratio * chunk.seq_len)
        if count == 0:
            return _no_slots()
        return torch.topk(self.scores(handle, before, chunk), count).indices.sort().values.cpu()


@dataclass(frozen=True)
class RecomputeAll:
    name: str = "full"

    def select(self, handle: ModelHandle, before: KVSnapshot | None, chunk: KVSnapshot) -> torch.Tensor:
        return torch.arange(chunk.seq_len, device="cpu") if before is not None else _no_slots()


CORRECTIONS = {
    "none": RotateOnly,
    "epic": RecomputeFirst,
    "cacheblend": RecomputeDeviating,
    "full": RecomputeAll,
}


def correction_by_name(name: str, **kw: Any) -> Correction:
    if name not in CORRECTIONS:
        raise BadInputError(f"unknown correction '{name}'; choose one of {', '.join(CORRECTIONS)}")
    return CORRECTIONS[name](**kw)


@dataclass(frozen=True)
class Blended:
    """A prompt assembled from fresh text and reused chunks.

    Attributes:
        snapshot: the cache of the whole assembled prompt (positions ``0..T-1``).
        chunk_tokens: tokens that came from reused chunks; recomputed_tokens: how many of them were recomputed.
        fresh_tokens: tokens of fresh text pieces (computed normally).
        blend_ms: wall time of the assembly (shifts, probes, recomputation, fresh pieces).
    """

    snapshot: KVSnapshot
    chunk_tokens: int
    recomputed_tokens: int
    fresh_tokens: int
    blend_ms: float


def blend(handle: ModelHandle, pieces: Sequence[Piece], correction: Correction | None = None) -> Blended:
    """Assemble a prompt's cache from ``pieces``: token-id lists are computed, snapshots are reused chunks.

    Each reused chunk (a batch-1 cache of the chunk alone, any positions) is re-rotated to where it
    lands and corrected by ``correction`` (default: :class:`RotateOnly`). Inputs are not modified.
    """
    if not pieces:
        raise BadInputError("blend needs at least one piece")
    correction = correction or RotateOnly()
    started = time.perf_counter()
    snap: KVSnapshot | None = None
    chunk_tokens = recomputed = fresh = 0
    for piece in pieces:
        pos = 0 if snap is None else snap.seq_len
        if isinstance(piece, KVSnapshot):
            if piece.fingerprint != handle.fingerprint:
                raise BadInputError("a reused chunk was cached by another model")
            if piece.batch_size != 1:
                raise BadInputError("reused chunks must have batch 1")
            moved = piece.with_positions(torch.arange(pos, pos + piece.seq_len, device="cpu"))
            slots = correction.select(handle, snap, moved)
            moved = recompute_slots(handle, moved, slots, before=snap)
            snap = moved if snap is None else concat(snap, moved)
            chunk_tokens += piece.seq_len
            recomputed += int(slots.numel())
        else:
            ids = [int(t) for t in piece]
            if not ids:
                continue
            snap = (handle.prefill(ids) if snap is None else handle.extend(snap, ids)).snapshot
            fresh += len(ids)
    if snap is None:
        raise BadInputError("every piece was empty")
    return Blended(snap, chunk_tokens, recomputed, fresh, (time.perf_counter() - started) * 1000)
