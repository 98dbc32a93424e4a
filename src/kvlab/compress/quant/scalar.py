"""Group-wise scalar quantization with real storage: packed codes plus fp16 scales (and zero points).

A tensor ``x [..., N]`` is split into groups of ``group_size`` consecutive elements of the last axis;
each group gets one fp16 scale (symmetric) or an fp16 scale and an fp16 minimum (asymmetric). The
stored scale is rounded *up* and the stored minimum *down* to fp16, and codes are computed from the
stored values, so every element is reconstructed within half a step of its group:
``|x - dequantize(x)| <= scale / 2`` (plus float32 rounding). That bound is what the tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compress.quant.pack import pack_bits, packed_nbytes, unpack_bits
from kvlab.errors import BadInputError

SUPPORTED_BITS = (2, 3, 4, 8)
SCALE_DTYPE = torch.float16
_TINY = 2.0**-14  # smallest normal fp16: a floor for scales of all-zero groups


def check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise BadInputError(
            f"unsupported bit width {bits}; choose one of {', '.join(map(str, SUPPORTED_BITS))}"
        )
    return int(bits)


def check_group(size: int, group_size: int, what: str = "head_dim") -> None:
    if group_size < 1 or size % group_size:
        raise BadInputError(f"group size {group_size} does not divide {what} {size}; use a divisor of {size}")


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    h = x.to(SCALE_DTYPE)
    low = h.float() < x
    return torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _round_down_fp16(x: torch.Tensor) -> torch.Tensor:
    h = x.to(SCALE_DTYPE)
    high = h.float() > x
    return torch.where(high, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """Packed ``bits``-bit codes of a tensor of ``shape``, grouped along the last axis.

    ``scale`` and ``zero`` are fp16 ``[..., N / group_size]``; ``zero`` is None for symmetric codes.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    shape: tuple[int, ...]
    group_size: int
    dtype: torch.dtype

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def nbytes(self) -> int:
        """Bytes really held: packed codes + scales (+ zero points)."""
        n = self.packed.numel() + self.scale.numel() * self.scale.element_size()
        return n + (self.zero.numel() * self.zero.element_size() if self.zero is not None else 0)

    def dequantize(self) -> torch.Tensor:
        count = 1
        for s in self.shape:
            count *= s
        codes = unpack_bits(self.packed, self.bits, count).float().view(*self.shape[:-1], -1, self.group_size)
        scale = self.scale.float()[..., None]
        if self.zero is None:
            out = (codes - (2 ** (self.bits - 1) - 1)) * scale
        else:
            out = codes * scale + self.zero.float()[..., None]
        return out.reshape(self.shape).to(self.dtype)


def quantize(x: torch.Tensor, bits: int, group_size: int, *, symmetric: bool = False) -> QuantizedTensor:
    """Quantize ``x [..., N]`` in groups of ``group_size`` along the last axis (``N % group_size == 0``)."""
    if not 1 <= bits <= 8:
        raise BadInputError(f"quantize stores 1..8-bit codes, got {bits} bits")
    if x.ndim == 0 or not torch.is_floating_point(x):
        raise BadInputError("quantize needs a floating-point tensor with at least one axis")
    check_group(x.shape[-1], group_size, "the last axis")
    g = x.float().reshape(*x.shape[:-1], -1, group_size)
    if symmetric and bits < 2:
        raise BadInputError("symmetric codes need at least 2 bits")
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = _round_up_fp16((g.abs().amax(-1) / qmax).clamp_min(_TINY))
        s = scale.float()[..., None]
        codes = (torch.round(g / s) + qmax).clamp(0, 2 * qmax)
        zero = None
    else:
        levels = 2**bits - 1
        zero = _round_down_fp16(g.amin(-1))
        z = zero.float()[..., None]
        scale = _round_up_fp16(((g.amax(-1) - z[..., 0]) / levels).clamp_min(_TINY))
        codes = torch.round((g - z) / scale.float()[..., None]).clamp(0, levels)
    return QuantizedTensor(
        packed=pack_bits(codes.to(torch.uint8), bits),
        scale=scale,
        zero=zero,
        bits=bits,
        shape=tuple(x.shape),
        group_size=group_size,
        dtype=x.dtype,
    )


def quantized_nbytes(numel: int, bits: int, group_size: int, symmetric: bool) -> int:
    """What :func:`quantize` stores for ``numel`` elements (for budgets and docs)."""
    groups = numel // group_size
    return packed_nbytes(numel, bits) + groups * 2 * (1 if symmetric else 2)
