"""The quantizers: each a small dataclass that turns one span of a layer's K/V into real packed bytes.

Shapes: ``keys``/``values`` are ``[batch, kv_heads, n, head_dim]`` (keys post-RoPE, as cached);
``positions`` is ``[n]``. A quantizer's :meth:`Quantizer.encode` returns a :class:`Segment` whose
``decode()`` gives the approximate K/V back and whose ``nbytes`` counts every byte it holds (codes,
scales, zero points, sketch bits). Sinks (the first ``sinks`` slots) and a recent ``window`` stay in
full precision; :func:`split_plan` decides which slots are quantized, for snapshots and the HF cache alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from kvlab.compress.quant.pack import pack_bits, unpack_bits
from kvlab.compress.quant.rotation import (
    rotate_heads,
    rotation_matrix,
    sketch_estimate,
    sketch_matrix,
    unrotate_heads,
)
from kvlab.compress.quant.scalar import QuantizedTensor, check_bits, check_group, quantize
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.rope.ops import apply_rope, remove_rope
from kvlab.rope.spec import RopeSpec


class Code(Protocol):
    nbytes: int

    def decode(self) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class TokenCode:
    """Per-token groups along head_dim."""

    q: QuantizedTensor

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def decode(self) -> torch.Tensor:
        return self.q.dequantize()


@dataclass(frozen=True, eq=False)
class ChannelCode:
    """Per-channel groups along tokens (stored transposed, ``[B, H, D, n]``)."""

    q: QuantizedTensor

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def decode(self) -> torch.Tensor:
        return self.q.dequantize().transpose(-1, -2)


@dataclass(frozen=True, eq=False)
class PreRopeCode:
    """Keys quantized before RoPE; decoding re-applies RoPE at their positions (positions are metadata)."""

    inner: Code
    positions: torch.Tensor
    rope: RopeSpec

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def decode(self) -> torch.Tensor:
        pre = self.inner.decode()
        return apply_rope(pre, self.positions.to(pre.device), self.rope).to(pre.dtype)


@dataclass(frozen=True, eq=False)
class RotatedCode:
    """Codes of ``x R^T`` per head; optional 1-bit sketch of the rotated residual (signs + fp16 norm)."""

    inner: TokenCode
    rot: torch.Tensor
    signs: torch.Tensor | None = None  # packed 1-bit, [B, H, n, m] before packing
    norms: torch.Tensor | None = None  # fp16 [B, H, n]
    sketch_dim: int = 0
    mean: torch.Tensor | None = None  # fp16 [B, H, 1, D] pre-RoPE key mean, added back at its positions
    positions: torch.Tensor | None = None
    rope: RopeSpec | None = None

    @property
    def nbytes(self) -> int:
        n = self.inner.nbytes + (self.mean.numel() * self.mean.element_size() if self.mean is not None else 0)
        if self.signs is not None and self.norms is not None:
            n += self.signs.numel() + self.norms.numel() * self.norms.element_size()
        return n

    def decode(self) -> torch.Tensor:
        y = self.inner.q.dequantize().float()
        if self.signs is not None and self.norms is not None:
            b, h, n, d = y.shape
            bits = unpack_bits(self.signs, 1, b * h * n * self.sketch_dim).view(b, h, n, self.sketch_dim)
            proj = sketch_matrix(d, self.sketch_dim)
            y = y + sketch_estimate(bits.float() * 2 - 1, self.norms.float(), proj)
        out = unrotate_heads(y, self.rot)
        if self.mean is not None:
            out = out + _rotated_mean(self.mean, self.positions, self.rope, out.shape)
        return out.to(self.inner.q.dtype)


def _rotated_mean(
    mean: torch.Tensor, positions: torch.Tensor | None, rope: RopeSpec | None, shape: torch.Size
) -> torch.Tensor:
    """The pre-RoPE mean key ``[B, H, 1, D]`` placed at every slot's position: ``[B, H, n, D]`` float32."""
    m = mean.float().expand(shape)
    return apply_rope(m, positions.to(m.device), rope).float() if rope is not None else m


@dataclass(frozen=True, eq=False)
class Segment:
    """One quantized span of a layer: ``n`` slots of keys and values."""

    keys: Code
    values: Code
    length: int

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.decode(), self.values.decode()


def _per_token(x: torch.Tensor, bits: int, group: int, symmetric: bool) -> TokenCode:
    return TokenCode(quantize(x, bits, group, symmetric=symmetric))


def _per_channel(x: torch.Tensor, bits: int, group: int, symmetric: bool) -> ChannelCode:
    return ChannelCode(quantize(x.transpose(-1, -2).contiguous(), bits, group, symmetric=symmetric))


@dataclass(frozen=True)
class Quantizer:
    """Base: ``bits`` per element, ``group_size`` elements per scale, full-precision ``sinks`` and ``window``."""

    bits: int = 4
    group_size: int = 64
    sinks: int = 0
    window: int = 0
    symmetric: bool = False

    kind = "base"

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.group_size < 1:
            raise BadInputError(f"group size must be >= 1, got {self.group_size}")
        if self.sinks < 0 or self.window < 0:
            raise BadInputError("sinks and window must be >= 0")

    @property
    def name(self) -> str:
        extra = (f"+{self.sinks}sink" if self.sinks else "") + (f"+w{self.window}" if self.window else "")
        return f"{self.kind}-int{self.bits}{extra}"

    def token_multiple(self) -> int:
        """Quantized spans must hold a multiple of this many slots (per-channel groups run along tokens)."""
        return 1

    def check(self, head_dim: int, rope: RopeSpec | None) -> None:
        """Raise a clear error if this quantizer cannot encode a cache of this geometry."""
        check_group(head_dim, self.group_size)

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope: RopeSpec | None
    ) -> Segment:
        raise NotImplementedError


@dataclass(frozen=True)
class PerTokenQuantizer(Quantizer):
    """Naive baseline: keys and values per token, groups along head_dim (what most int4 caches do)."""

    kind = "pertoken"

    def encode(self, keys, values, positions, rope) -> Segment:
        return Segment(
            _per_token(keys, self.bits, self.group_size, self.symmetric),
            _per_token(values, self.bits, self.group_size, self.symmetric),
            keys.shape[-2],
        )


@dataclass(frozen=True)
class KIVIQuantizer(Quantizer):
    """KIVI: keys per channel (groups of ``group_size`` tokens), values per token, recent window in fp."""

    bits: int = 2
    group_size: int = 32
    window: int = 32
    kind = "kivi"

    def token_multiple(self) -> int:
        return self.group_size

    def encode(self, keys, values, positions, rope) -> Segment:
        return Segment(
            _per_channel(keys, self.bits, self.group_size, self.symmetric),
            _per_token(values, self.bits, self.group_size, self.symmetric),
            keys.shape[-2],
        )


@dataclass(frozen=True)
class PreRopeQuantizer(Quantizer):
    """KVQuant-style: keys de-rotated to pre-RoPE, quantized per channel; values per token."""

    group_size: int = 32
    kind = "prerope"

    def token_multiple(self) -> int:
        return self.group_size

    def check(self, head_dim: int, rope: RopeSpec | None) -> None:
        super().check(head_dim, rope)
        if rope is None:
            raise UnsupportedModelError(
                "pre-RoPE key quantization needs a model with rotary position embeddings"
            )
        rope.require_shift_exact("pre-RoPE key quantization")

    def encode(self, keys, values, positions, rope) -> Segment:
        pre = remove_rope(keys, positions.to(keys.device), rope)
        k = PreRopeCode(_per_channel(pre, self.bits, self.group_size, self.symmetric), positions, rope)
        return Segment(k, _per_token(values, self.bits, self.group_size, self.symmetric), keys.shape[-2])


@dataclass(frozen=True)
class RotatedQuantizer(Quantizer):
    """Rotate each head (Hadamard x random signs, or Haar-random), then quantize per token.

    With ``sketch=True`` keys use ``bits - 1`` bits plus a 1-bit sign sketch of the residual
    (``head_dim`` sketch rows, one bit per element), so the bit budget is unchanged (TurboQuant-style).
    With ``center=True`` (default) the per-channel mean of the pre-RoPE keys (fp16, ``D`` numbers per
    head and segment) is subtracted first: ``q·mean`` is the same for every key, so it carries no
    attention information, yet it would otherwise set most of each token's quantization range.
    """

    rotation: str = "hadamard"
    sketch: bool = False
    center: bool = True
    seed: int = 0
    kind = "rotation"

    @property
    def name(self) -> str:
        base = super().name
        return base.replace("rotation", "rotation+qjl" if self.sketch else "rotation", 1)

    def check(self, head_dim: int, rope: RopeSpec | None) -> None:
        super().check(head_dim, rope)
        if self.rotation == "hadamard" and head_dim & (head_dim - 1):
            raise UnsupportedModelError(
                f"a Hadamard rotation needs a power-of-two head_dim, this model has {head_dim}; use rotation='random'"
            )
        if self.sketch and self.bits < 2:
            raise BadInputError("the residual sketch needs at least 2 bits (bits - 1 for the codes)")

    def encode(self, keys, values, positions, rope) -> Segment:
        h, d = keys.shape[1], keys.shape[-1]
        rot = rotation_matrix(d, self.rotation, self.seed, h)
        mean, k = None, keys.float()
        if self.center:
            pre = remove_rope(k, positions.to(k.device), rope) if rope is not None else k
            mean = pre.mean(dim=2, keepdim=True).to(torch.float16)
            k = k - _rotated_mean(mean, positions, rope, k.shape)
        extra = {"mean": mean, "positions": positions, "rope": rope}
        rk, rv = rotate_heads(k, rot), rotate_heads(values, rot).to(values.dtype)
        if not self.sketch:
            kcode = RotatedCode(_per_token(rk, self.bits, self.group_size, self.symmetric), rot, **extra)
        else:
            inner = _per_token(rk, self.bits - 1, self.group_size, False)
            resid = rk.float() - inner.decode().float()
            proj = sketch_matrix(d, d)
            signs = (resid @ proj.T) >= 0
            kcode = RotatedCode(
                inner,
                rot,
                pack_bits(signs.to(torch.uint8), 1),
                resid.norm(dim=-1).to(torch.float16),
                d,
                **extra,
            )
        vcode = RotatedCode(_per_token(rv, self.bits, self.group_size, self.symmetric), rot)
        return Segment(kcode, vcode, keys.shape[-2])


def split_plan(length: int, sinks: int, window: int, multiple: int) -> tuple[int, int]:
    """``(start, stop)`` of the quantized slots of a ``length``-slot layer.

    Slots ``[0, start)`` are full-precision sinks, ``[stop, length)`` the full-precision recent window
    (plus up to ``multiple - 1`` slots that do not fill a token group).
    """
    start = min(sinks, length)
    span = max(length - start - window, 0)
    stop = start + (span // multiple) * multiple
    return start, stop


QUANTIZERS = {
    "pertoken": PerTokenQuantizer,
    "kivi": KIVIQuantizer,
    "prerope": PreRopeQuantizer,
    "rotation": RotatedQuantizer,
}


def make_quantizer(method: str, bits: int, **options) -> Quantizer:
    """``make_quantizer("rotation", 4, sinks=4)``; methods: pertoken, kivi, prerope, rotation, rotation+qjl."""
    if method == "rotation+qjl":
        method, options = "rotation", {**options, "sketch": True}
    if method not in QUANTIZERS:
        raise BadInputError(
            f"unknown quantizer '{method}'; choose one of {', '.join([*QUANTIZERS, 'rotation+qjl'])}"
        )
    return QUANTIZERS[method](bits=bits, **options)


def bits_per_element(nbytes: int, numel: int) -> float:
    return 8.0 * nbytes / numel if numel else math.nan
