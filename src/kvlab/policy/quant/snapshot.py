"""Quantized snapshots: a :class:`~kvlab.cache.KVSnapshot` held as packed codes, with ``decompress()``.

Invariant: ``quantize_snapshot(s, q).decompress()`` has the geometry, token ids and positions of
``s``; only K/V values change, and only in the quantized span of each layer (sinks and the recent
window come back bit-identical). ``nbytes`` counts the bytes really held for K/V: packed codes, fp16
scales/zero points, sketch bits and the full-precision slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import UnsupportedModelError
from kvlab.policy.quant.methods import Quantizer, Segment, decode_between, split_plan
from kvlab.policy.quant.pack import tensor_bytes
from kvlab.rope.spec import Rope, rope_for_layer


@dataclass(frozen=True, eq=False)
class LayerCode:
    """One layer: full-precision sinks, quantized segments, full-precision tail (each ``[B, H, n, D]``)."""

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    segments: tuple[Segment, ...]
    tail_keys: torch.Tensor
    tail_values: torch.Tensor

    @property
    def nbytes(self) -> int:
        fp = tensor_bytes(self.sink_keys, self.sink_values, self.tail_keys, self.tail_values)
        return fp + sum(s.nbytes for s in self.segments)

    @property
    def length(self) -> int:
        return self.sink_keys.shape[-2] + sum(s.length for s in self.segments) + self.tail_keys.shape[-2]

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        sinks, tail = (self.sink_keys, self.sink_values), (self.tail_keys, self.tail_values)
        return decode_between(sinks, self.segments, tail, self.sink_keys.dtype)


def encode_layer(
    quantizer: Quantizer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope
) -> LayerCode:
    """Encode one layer's ``[B, H, T, D]`` K/V (inputs are read, never written)."""
    if not torch.is_floating_point(keys):
        raise UnsupportedModelError(f"kvlab quantizes floating-point caches, this one holds {keys.dtype}")
    quantizer.check(keys.shape[-1], rope)
    start, stop = split_plan(keys.shape[-2], quantizer.sinks, quantizer.window, quantizer.token_multiple())
    segments: tuple[Segment, ...] = ()
    if stop > start:
        segments = (
            quantizer.encode(keys[:, :, start:stop], values[:, :, start:stop], positions[start:stop], rope),
        )
    return LayerCode(
        keys[:, :, :start].clone(),
        values[:, :, :start].clone(),
        segments,
        keys[:, :, stop:].clone(),
        values[:, :, stop:].clone(),
    )


@dataclass(frozen=True, eq=False)
class QuantizedSnapshot:
    """A snapshot whose K/V are held by ``layers`` (one :class:`LayerCode` each) plus its metadata.

    ``token_ids [B, T]`` and ``positions [T]`` are those of the source snapshot; no full-precision copy
    of the K/V is kept, so ``nbytes`` is what holding this object costs for K/V.
    """

    layers: tuple[LayerCode, ...]
    token_ids: torch.Tensor
    positions: torch.Tensor
    rope: Rope | None
    fingerprint: str
    model_name: str
    method: str
    original_nbytes: int

    @property
    def seq_len(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / max(self.token_ids.numel(), 1)

    @property
    def compression_ratio(self) -> float:
        return self.original_nbytes / self.nbytes

    def decompress(self) -> KVSnapshot:
        """A new full-precision snapshot with the dequantized K/V (same ids, positions, fingerprint)."""
        pairs = [layer.decode() for layer in self.layers]
        return KVSnapshot(
            keys=tuple(k for k, _ in pairs),
            values=tuple(v for _, v in pairs),
            token_ids=self.token_ids,
            positions=self.positions,
            rope=self.rope,
            fingerprint=self.fingerprint,
            model_name=self.model_name,
            provenance="quantized",
        )


def quantize_snapshot(snapshot: KVSnapshot, quantizer: Quantizer) -> QuantizedSnapshot:
    """Quantize every layer of ``snapshot`` (which is not modified)."""
    layers = tuple(
        encode_layer(quantizer, k, v, snapshot.positions, rope_for_layer(snapshot.rope, i))
        for i, (k, v) in enumerate(zip(snapshot.keys, snapshot.values, strict=True))
    )
    return QuantizedSnapshot(
        layers,
        snapshot.token_ids,
        snapshot.positions,
        snapshot.rope,
        snapshot.fingerprint,
        snapshot.model_name,
        quantizer.name,
        snapshot.nbytes,
    )
