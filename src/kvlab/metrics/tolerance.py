"""How far apart two mathematically equal computations may land in floating point.

Chunked and one-shot prefills, another thread count or another BLAS path sum the same terms in a
different order; each layer adds rounding of the order of the dtype's epsilon times the size of the
values, and the errors grow about linearly with depth. A tolerance is therefore derived from the dtype,
the depth and the magnitude compared, times a headroom factor, never read off one machine's last digit.
A wrong cache (a dropped token, a shifted position, another model) moves logits by O(1), orders of
magnitude above these bounds for float32 and float64.
"""

from __future__ import annotations

import torch

#: Headroom over the first-order estimate, for other machines' summation orders and thread counts.
HEADROOM = 10.0


def forward_tolerance(
    dtype: torch.dtype, *, num_layers: int, scale: float, headroom: float = HEADROOM
) -> float:
    """Largest expected ``|a - b|`` between two equal forward passes through ``num_layers`` layers whose
    outputs have magnitude ``scale`` (e.g. the largest absolute logit), computed in ``dtype``."""
    if not dtype.is_floating_point:
        raise ValueError(f"a rounding tolerance needs a floating dtype, not {dtype}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return headroom * torch.finfo(dtype).eps * num_layers * max(float(scale), 1.0)


def elementwise_tolerance(
    dtype: torch.dtype, *, ops: int = 1, scale: float = 1.0, headroom: float = HEADROOM
) -> float:
    """Expected ``|a - b|`` after ``ops`` rounded elementwise operations on values of magnitude ``scale``
    (e.g. a RoPE rotation: a few multiply-adds per element)."""
    if not dtype.is_floating_point:
        raise ValueError(f"a rounding tolerance needs a floating dtype, not {dtype}")
    return headroom * torch.finfo(dtype).eps * max(ops, 1) * max(float(scale), 1.0)
