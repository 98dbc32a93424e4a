"""Split-KV attention on CUDA (Triton): a few query rows against a long masked cache, at full occupancy.

A decode step has one query per head; PyTorch's SDPA kernels give each (batch, head, query block)
one thread block, so a step over an 8B model's 8 KV heads runs 8 blocks on a 132-SM GPU and streams a
32k-token cache at a fraction of the memory bandwidth (measured on an H100: 28.8 ms a token at 32k
against a 6.6 ms floor). Flash-decoding fixes that by also splitting the keys: each program attends
its rows to one slice of the cache (online softmax, fp32 accumulation) and writes a partial output with
its running maximum and sum; one merge kernel combines the slices. Keys and values are read once and never
repeated per query head: the rows of one KV head are its query heads' rows stacked (``_grouped_attention``
in :mod:`kvlab.hf.graphs`).

``prepare(device)`` (outside any captured region) then ``attend(q, k, v, mask, scale)``:
``q [B, Hkv, R, D]`` with ``R = groups * n`` (row ``i * n + t`` is query head ``i`` of token ``t``),
``k, v [B, Hkv, C, D]``, ``mask [B or 1, 1, n, C]`` additive (0 or very negative), or the integer
positions that mask was made by (``visibility``: compared per block, the mask not read). Every query
must see at least one slot. ``k`` and ``v`` may be packed int4 rows (:func:`int4_rows`), decoded in
registers; :func:`write_int4` writes such rows in one kernel. The kernels live in ``_split_triton.py``. Triton is optional: :func:`prepare` says whether this path can
run (a CUDA device and Triton importable); the interpreter (``TRITON_INTERPRET=1``) runs it on the CPU
for tests (``tests/optional``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvlab.errors import BadInputError

_KERNELS: dict[str, Any] = {}  # the jitted kernels, made by prepare() (outside any graph or compile)
_SMS: dict[str, int] = {}  # multiprocessors per device, read by prepare()
# The launch by kind and codec: "few" rows (a decode step, <= 16 query rows per KV head) or "many" (a
# chunk feed). (rows per program, warps, pipeline stages, keys per block, programs per multiprocessor):
# the fastest of benchmarks/gpu.py's split_launch sweep on an H100 (benchmarks/results/gpu.md, run 4),
# which every figure there ran with. KVLAB_SPLIT_LAUNCH="many,int4=128x8x3x64x4;few,none=16x4x2"
# overrides them (the last two numbers optional), read by prepare().
LAUNCH: dict[tuple[str, bool], tuple[int, int, int, int, int]] = {
    ("few", False): (16, 4, 2, 64, 4),
    ("few", True): (16, 4, 4, 64, 4),
    ("many", False): (128, 8, 2, 64, 4),
    ("many", True): (128, 8, 3, 64, 4),
}


def prepare(device: torch.device) -> bool:
    """Make the kernels ready for ``device``; False when they cannot run there (no CUDA device, no Triton,
    or ``KVLAB_SPLIT_ATTENTION=0``). Call it before capturing or compiling a step that uses
    :func:`attend`: nothing inside :func:`attend` imports, queries the device or reads the environment."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if os.environ.get("KVLAB_SPLIT_ATTENTION", "1") == "0" or not (device.type == "cuda" or interpret):
        return False
    try:
        import triton  # noqa: F401  (present: the kernels below import it)
    except ImportError:
        return False
    if not _KERNELS:
        from kvlab.kernels._split_triton import encode_kernel, merge_kernel, split_kernel

        _KERNELS.update(split=split_kernel, merge=merge_kernel, encode=encode_kernel)
    LAUNCH.update(parse_launches(os.environ.get("KVLAB_SPLIT_LAUNCH", "")))
    _SMS[str(device)] = (
        torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    )
    return True


def parse_launches(text: str) -> dict[tuple[str, bool], tuple[int, int, int, int, int]]:
    """``"many,int4=128x8x3x64x4;few,none=16x4x2"`` as :data:`LAUNCH` entries (keys per block and programs
    per multiprocessor default to 64 and 4); a malformed item is refused in one line naming it."""
    out: dict[tuple[str, bool], tuple[int, int, int, int, int]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, _, shape = item.partition("=")
        kind, _, codec = (x.strip() for x in key.partition(","))
        try:
            numbers = [int(x) for x in shape.lower().split("x")]
        except ValueError:
            numbers = []
        if len(numbers) == 3:
            numbers += [64, 4]
        ok = kind in ("few", "many") and codec in ("none", "int4") and len(numbers) == 5
        if not ok or min(numbers) < 1 or any(n & (n - 1) for n in numbers[:2] + numbers[3:4]):
            raise BadInputError(
                f"KVLAB_SPLIT_LAUNCH item {item!r}: expected KIND,CODEC=ROWSxWARPSxSTAGES[xKEYSxPER_SM] with KIND "
                "few or many, CODEC none or int4, and rows, warps and keys powers of two"
            )
        out[(kind, codec == "int4")] = (numbers[0], numbers[1], numbers[2], numbers[3], numbers[4])
    return out


def _splits(programs: int, c: int, device: torch.device, per_sm: int, block_n: int) -> int:
    """Slices of the cache: about ``per_sm`` programs per multiprocessor, slices of >= ``block_n`` keys."""
    sms = _SMS.get(str(device), 132)
    want = max(1, -(-per_sm * sms // max(1, programs)))
    return max(1, min(want, -(-c // block_n)))


def int4_rows(packed: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of int4-packed rows ``[..., head_dim/2 + 4 * groups]`` bytes: the codes ``[..., head_dim/2]``
    (uint8, element ``2i`` in the low nibble), then the fp16 scales and the fp16 minimums
    ``[..., groups]``. One buffer per K or V keeps a slot's bytes together (one row per token and head)."""
    half = head_dim // 2
    groups = (packed.shape[-1] - half) // 4
    if half * 2 != head_dim or packed.shape[-1] != half + 4 * groups or groups < 1:
        raise ValueError(f"{packed.shape[-1]} bytes per row is no int4 packing of head_dim {head_dim}")
    return (
        packed[..., :half],
        packed[..., half : half + 2 * groups].view(torch.float16),
        packed[..., half + 2 * groups :].view(torch.float16),
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    visibility: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Masked attention of ``q [B, Hkv, R, D]`` over ``k, v [B, Hkv, C, D]``; returns ``[B, Hkv, R, D]``.

    ``k`` and ``v`` may also be uint8 int4-packed rows (:func:`int4_rows`): the kernel then reads the
    codes and decodes them in registers, so a step streams 0.31x the bytes and no decoded copy exists.

    ``visibility = (slot_pos [C], query_pos [B or 1, n])`` (integers): the rule ``mask`` was made by
    (slot ``c`` visible to token ``t`` iff ``slot_pos[c] <= query_pos[t]``, as
    :meth:`~kvlab.hf.static_rolling.StaticRollingCache.attention_mask` builds it). Given, the kernel
    tests that rule per block instead of reading the mask (whose tiles are as many bytes as the keys'),
    and ``mask`` only gives ``n``. The caller vouches that the two agree."""
    b, h, r, d = q.shape
    c = k.shape[2]
    n_tok = mask.shape[2]
    if visibility is not None:
        slot_pos, query_pos = visibility
        if slot_pos.shape != (c,) or query_pos.ndim != 2 or query_pos.shape[1] != n_tok:
            raise ValueError(
                f"visibility: slot positions {tuple(slot_pos.shape)} and query positions "
                f"{tuple(query_pos.shape)} do not fit {c} slots and {n_tok} tokens"
            )
        if (
            query_pos.shape[0] not in (1, b)
            or slot_pos.dtype != query_pos.dtype
            or slot_pos.is_floating_point()
        ):
            raise ValueError("visibility: integer positions of one dtype, one row or one per batch row")
        slot_pos = slot_pos if slot_pos.stride(0) == 1 else slot_pos.contiguous()
        query_pos = query_pos if query_pos.stride(-1) == 1 else query_pos.contiguous()
    int4 = k.dtype == torch.uint8
    block_d = max(16, 1 << (d - 1).bit_length())
    q = q if q.stride(-1) == 1 else q.contiguous()
    if int4:
        (k, ks, kl), (v, vs, vl) = int4_rows(k, d), int4_rows(v, d)
        if ks.stride() != vs.stride() or k.stride() != v.stride():
            raise ValueError("int4 keys and values must share one layout")
        group = d // ks.shape[-1]
    else:
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        ks = kl = vs = vl = k
        group = d
    if visibility is None:
        mask = mask.to(q.dtype) if mask.dtype != q.dtype else mask
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        slot_pos = query_pos = mask  # not read (POSITIONS off): any pointer
    rows_per_program, warps, stages, block_n, per_sm = LAUNCH[("few" if r <= 16 else "many", int4)]
    s = _splits(b * h * -(-r // rows_per_program), c, q.device, per_sm, block_n)
    per = -(-c // s)  # keys per slice, rounded up to whole blocks
    chunk = -(-per // block_n) * block_n
    s = -(-c // chunk)
    acc = torch.empty((b * h, s, r, block_d), dtype=torch.float32, device=q.device)
    m = torch.empty((b * h, s, r), dtype=torch.float32, device=q.device)
    lsum = torch.empty((b * h, s, r), dtype=torch.float32, device=q.device)
    groups = ks.shape[-1] if int4 else 1
    _KERNELS["split"][(-(-r // rows_per_program), b * h, s)](
        q, k, v, ks, kl, vs, vl, mask, slot_pos, query_pos, acc, m, lsum,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2),
        query_pos.stride(0) if visibility is not None and query_pos.shape[0] > 1 else 0,
        h, r, n_tok, c, chunk, s, float(scale),
        BLOCK_R=rows_per_program, BLOCK_N=block_n, BLOCK_D=block_d, D=d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INT4=int4, GROUP=group,
        # whole groups broadcast in registers when they tile the block (else one gather per element)
        BROADCAST=int4 and block_d == d and groups & (groups - 1) == 0,
        G=groups, POSITIONS=visibility is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    out = torch.empty((b * h, r, d), dtype=q.dtype, device=q.device)
    _KERNELS["merge"][(r, b * h)](
        acc, m, lsum, out, s, r, out.stride(0), out.stride(1), BLOCK_S=32, BLOCK_D=block_d, D=d
    )
    return out.reshape(b, h, r, d)


def can_write_int4(group: int) -> bool:
    """Whether :func:`write_int4` takes this group size (a power of two; the kernels must be prepared)."""
    return "encode" in _KERNELS and group >= 2 and group & (group - 1) == 0


def write_int4(packed: torch.Tensor, index: torch.Tensor, x: torch.Tensor, group: int) -> None:
    """Encode ``x [B, H, n, D]`` into the int4 rows (:func:`int4_rows`) of ``packed [B, H, C, row]`` at the
    ``[n]`` slots ``index``, in one kernel, byte for byte as :func:`kvlab.policy.quant.codecs.int4rows.pack_rows` writes
    them (the torch version is ~20 small kernels per call). In place; ``x`` may be any float dtype."""
    b, h, n, d = x.shape
    codes, scales, lows = int4_rows(packed, d)
    x = x if x.stride(-1) == 1 else x.contiguous()
    groups = d // group
    _KERNELS["encode"][(n, b * h)](
        x, codes, scales, lows, index,
        x.stride(0), x.stride(1), x.stride(2), codes.stride(0), codes.stride(1), codes.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2), h,
        GROUP=group, G=groups, BLOCK_G=max(2, 1 << (groups - 1).bit_length()), enable_fp_fusion=False,
    )  # fmt: skip
