"""FP8 (E4M3) keys and values with one fp16 scale per token and group: the codec GPUs decode natively.

Each group of ``group_size`` elements along ``head_dim`` is divided by its scale (the group's largest
magnitude over 448, E4M3's largest finite value, stored fp16 and rounded up so no code overflows) and
rounded to the nearest E4M3 value (3 mantissa bits: a relative error of at most 2^-4 per element,
plus E4M3's subnormal step near zero). Codes are stored as bytes: 8 bits per element plus 16 per group.
This file is the whole codec: defining the class registers ``fp8`` for cache specs
(``codec=fp8``), the command line and the study; its entry in :data:`kvlab.policy.catalogue.CODECS`
lets a spec name it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policy.quant.methods import Quantizer, Segment
from kvlab.policy.quant.pack import tensor_bytes
from kvlab.policy.quant.scalar import SCALE_DTYPE, check_group

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


@dataclass(frozen=True, eq=False)
class FP8Code:
    """``codes`` uint8 ``[..., n, D]`` (E4M3 bit patterns) and ``scales`` fp16 ``[..., n, D // group]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.codes, self.scales)

    def decode(self) -> torch.Tensor:
        *lead, d = self.codes.shape
        x = self.codes.view(E4M3).float().view(*lead, d // self.group_size, self.group_size)
        return (x * self.scales.float()[..., None]).view(*lead, d).to(self.dtype)


def encode_fp8(x: torch.Tensor, group_size: int) -> FP8Code:
    """``x [..., D]`` as E4M3 codes with one fp16 scale per ``group_size`` elements."""
    *lead, d = x.shape
    check_group(d, group_size)
    g = x.float().reshape(*lead, d // group_size, group_size)
    amax = g.abs().amax(dim=-1)
    scale = (amax / E4M3_MAX).clamp_min(2.0**-24).to(SCALE_DTYPE)
    # rounded up to fp16: the largest element divided by the stored scale stays within E4M3's range
    scale = torch.where(scale.float() * E4M3_MAX < amax, torch.nextafter(scale, scale.new_tensor(1e4)), scale)
    codes = (g / scale.float()[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return FP8Code(codes.view(*lead, d).view(torch.uint8), scale, group_size, x.dtype)


@dataclass(frozen=True)
class FP8Quantizer(Quantizer):
    """Keys and values per token in E4M3 with an fp16 scale per group (``group_size`` defaults to 64)."""

    bits: int = 8
    kind = "fp8"
    fixed_bits = 8

    def encode(self, keys, values, positions, rope) -> Segment:
        return Segment(encode_fp8(keys, self.group_size), encode_fp8(values, self.group_size), keys.shape[-2])
