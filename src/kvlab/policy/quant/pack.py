"""Bit packing: small integer codes stored densely in bytes, so a 3-bit cache really holds 3 bits.

Codes are packed in blocks of 8: eight ``b``-bit codes make exactly ``b`` bytes (little-endian,
code ``i`` of a block at bit ``b*i``). The last block is zero-padded, so ``n`` codes take
``ceil(n / 8) * b`` bytes; unpacking with the original count returns the codes exactly.
"""

from __future__ import annotations

import torch

from kvlab.errors import BadInputError

PACKABLE_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes :func:`pack_bits` uses for ``count`` codes of ``bits`` bits."""
    return -(-count // 8) * bits


def tensor_bytes(*ts: torch.Tensor | None) -> int:
    """Bytes the tensors hold (None holds none)."""
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` (any shape, values in ``[0, 2**bits)``) into a flat ``uint8`` tensor."""
    if bits not in PACKABLE_BITS:
        raise BadInputError(f"can pack 1..8-bit codes, got {bits} bits")
    flat = codes.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
        raise BadInputError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing")
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    if 8 % bits == 0:  # byte-aligned widths: the same layout, byte j holds codes (8/bits)*j + r at bit bits*r
        per = 8 // bits
        shifts = torch.arange(per, dtype=torch.int64, device=flat.device) * bits
        return (flat.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)
    blocks = flat.view(-1, 8)
    shifts = torch.arange(8, dtype=torch.int64, device=flat.device) * bits
    words = (blocks << shifts).sum(dim=1)  # [n_blocks], 8*bits <= 64 bits each
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=flat.device) * 8
    return ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes, as ``uint8`` ``[count]``."""
    if bits not in PACKABLE_BITS:
        raise BadInputError(f"can unpack 1..8-bit codes, got {bits} bits")
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(count, bits):
        raise BadInputError(
            f"{count} codes of {bits} bits need {packed_nbytes(count, bits)} packed bytes, "
            f"got {packed.numel()} of {packed.dtype}"
        )
    if 8 % bits == 0:  # byte-aligned fast path (uint8 shifts, no 64-bit words)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed[:, None] >> shifts) & ((1 << bits) - 1)
        return codes.reshape(-1)[:count]
    byte_blocks = packed.to(torch.int64).view(-1, bits)
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=packed.device) * 8
    words = (byte_blocks << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, dtype=torch.int64, device=packed.device) * bits
    codes = (words[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:count].to(torch.uint8)
