"""Int4 rows: 4-bit codes with an fp16 scale and minimum per group, one self-contained row per token and head.

The storage of :class:`~kvlab.hf.static_rolling.StaticRollingCache` (its ``codec="int4"`` resolves to this
codec) and what the Triton split-KV kernel reads and writes (:mod:`kvlab.kernels.split_attention`). A row of
``D`` elements is ``D/2 + 4 * D/group`` bytes: the codes (element ``2i`` in the low nibble of byte ``i``, as
:func:`~kvlab.policy.quant.pack.pack_bits` lays them out), the groups' fp16 scales, their fp16 minimums.

One core (:func:`encode4`), two thin layouts: the rows, and for a cache's segments ``pertoken4``'s layout
(:class:`~kvlab.policy.quant.scalar.QuantizedTensor`: the same grid, decoded to the same numbers, read by
the packed-code attention). The codecs stay two: the stored minimum and scale are rounded to fp16 here by
plain arithmetic, not ``nextafter`` (which inductor mis-lowers; ``pertoken``'s published codes depend on it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.errors import BadInputError
from kvlab.kernels.split_attention import int4_rows
from kvlab.policy.quant.methods import Quantizer, Segment, TokenCode
from kvlab.policy.quant.scalar import QuantizedTensor
from kvlab.rope.spec import RopeSpec


def encode4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` as 4-bit codes ``[..., D/2]`` and fp16 ``scale``, ``low`` ``[..., D/group]``. The minimum
    is pushed down and the scale up by more than fp16's rounding before they are stored, and the codes are
    made from the stored values: every element decodes within half a step of itself. Plain arithmetic (no
    ``nextafter``), so a captured or compiled step encodes as the eager one does."""
    g = x.float().unflatten(-1, (-1, group))
    lo = g.amin(-1)
    low = (lo - lo.abs() * 2.0**-10 - 2.0**-24).to(torch.float16)
    span = (g.amax(-1) - low.float()) * (1 / 15)  # a multiply (torch divides by a scalar so on CUDA)
    scale = (span * (1 + 2.0**-10) + 2.0**-24).clamp_min(2.0**-14).to(torch.float16)
    codes = torch.round((g - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    codes = codes.flatten(-2).unflatten(-1, (-1, 2))
    return codes[..., 0] | (codes[..., 1] << 4), scale, low


def decode_rows(packed: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Int4 rows (:func:`pack_rows`) decoded to ``[..., head_dim]`` in ``dtype``."""
    codes, scale, low = int4_rows(packed, head_dim)
    pairs = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
    g = pairs.unflatten(-1, (scale.shape[-1], -1)).float()
    return (g * scale.float()[..., None] + low.float()[..., None]).flatten(-2).to(dtype)


def pack_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x [..., D]`` as int4 rows (uint8), written as bytes only (a captured or compiled step mutates one
    uint8 buffer, never an fp16 view of it)."""
    codes, scale, low = encode4(x, group)
    return torch.cat([codes, scale.view(torch.uint8), low.view(torch.uint8)], dim=-1)


@dataclass(frozen=True)
class Int4RowsQuantizer(Quantizer):
    """Keys and values per token as int4 rows: fp16 scale and minimum per ``group_size`` (even) channels."""

    group_size: int = 32
    kind = "int4rows"
    fixed_bits = 4

    def check(self, head_dim: int, rope: RopeSpec | None) -> None:
        g = self.group_size
        if g < 2 or head_dim % g or g % 2:
            raise BadInputError(f"int4 group {g} must be even and divide head_dim {head_dim}")

    def row_bytes(self, head_dim: int) -> int:
        return head_dim // 2 + 4 * (head_dim // self.group_size)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return pack_rows(x, self.group_size)

    def encode(self, keys, values, positions, rope) -> Segment:
        return Segment(self._code(keys), self._code(values), keys.shape[-2])

    def _code(self, x: torch.Tensor) -> TokenCode:
        """The rows' codes, scales and minimums in ``pertoken``'s layout (a :class:`QuantizedTensor`, which
        decodes them to the same numbers, and which the packed-code attention reads and gathers)."""
        codes, scale, low = encode4(x, self.group_size)
        q = QuantizedTensor(codes.reshape(-1), scale, low, 4, tuple(x.shape), self.group_size, x.dtype)
        return TokenCode(q)
