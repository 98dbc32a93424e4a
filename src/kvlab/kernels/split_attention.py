"""Split-KV attention on CUDA (Triton): a few query rows against a long masked cache, at full occupancy.

A decode step has one query per head; PyTorch's SDPA kernels give each (batch, head, query block)
one thread block, so a step over an 8B model's 8 KV heads runs 8 blocks on a 132-SM GPU and streams a
32k-token cache at a fraction of the memory bandwidth (measured on an H100: 28.8 ms a token at 32k
against a 6.6 ms floor). Flash-decoding fixes that by also splitting the keys: each program attends
its rows to one slice of the cache (online softmax, fp32 accumulation) and writes a partial output with
its running maximum and sum; a few tensor ops merge the slices. Keys and values are read once and never
repeated per query head: the rows of one KV head are its query heads' rows stacked (``_grouped_attention``
in :mod:`kvlab.hf.graphs`).

``prepare(device)`` (outside any captured region) then ``attend(q, k, v, mask, scale)``: ``q [B, Hkv, R, D]`` with ``R = groups * n`` (row ``i * n + t`` is
query head ``i`` of token ``t``), ``k, v [B, Hkv, C, D]``, ``mask [B or 1, 1, n, C]`` additive
(0 or very negative). Every query must see at least one slot. Triton is optional: :func:`prepare`
says whether this path can run (a CUDA device and Triton importable); the interpreter
(``TRITON_INTERPRET=1``) runs it on the CPU for tests.
"""

from __future__ import annotations

import os
from typing import Any

import torch

BLOCK_N = 64
_KERNEL: Any = None  # the jitted kernel, made by prepare() (outside any graph or compile)
_SMS: dict[str, int] = {}  # multiprocessors per device, read by prepare()


def prepare(device: torch.device) -> bool:
    """Make the kernel ready for ``device``; False when it cannot run there (no CUDA device, no Triton,
    or ``KVLAB_SPLIT_ATTENTION=0``). Call it before capturing or compiling a step that uses
    :func:`attend`: nothing inside :func:`attend` imports, queries the device or reads the environment."""
    global _KERNEL
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if os.environ.get("KVLAB_SPLIT_ATTENTION", "1") == "0" or not (device.type == "cuda" or interpret):
        return False
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return False
    if _KERNEL is None:
        _KERNEL = _build(triton, tl)
    _SMS[str(device)] = (
        torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    )
    return True


def _build(triton: Any, tl: Any) -> Any:
    @triton.jit
    def split_kernel(
        Q, K, V, MASK, ACC, M, L,
        sqb, sqh, sqr, skb, skh, skc, svb, svh, svc, smb, smr,
        H, R, N_TOK, C, CHUNK, S, scale,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        rblock = tl.program_id(0)  # fastest axis: the row blocks of one slice run side by side (L2 reuse)
        bh = tl.program_id(1)
        split = tl.program_id(2)
        b = bh // H
        h = bh % H
        rows = rblock * BLOCK_R + tl.arange(0, BLOCK_R)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < R
        dim_ok = dims < D
        q = tl.load(
            Q + b * sqb + h * sqh + rows[:, None] * sqr + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        mask_rows = MASK + b * smb + (rows % N_TOK) * smr
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        start = split * CHUNK
        for n0 in range(0, CHUNK, BLOCK_N):
            cols = start + n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < C
            kv_ok = col_ok[:, None] & dim_ok[None, :]
            k = tl.load(K + b * skb + h * skh + cols[:, None] * skc + dims[None, :], mask=kv_ok, other=0.0)
            # scale.to: torch.compile passes a Python float as fp64, which would make the running max fp64
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale.to(tl.float32)
            bias = tl.load(
                mask_rows[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
            )
            visible = (bias.to(tl.float32) > -1.0e30) & col_ok[None, :]
            s = tl.where(visible, s + bias.to(tl.float32), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + h * svh + cols[:, None] * svc + dims[None, :], mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = (bh * S + split) * R + rows
        tl.store(ACC + out[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(M + out, m_i, mask=row_ok)
        tl.store(L + out, l_i, mask=row_ok)

    return split_kernel


def _splits(programs: int, c: int, device: torch.device) -> int:
    """Slices of the cache: enough programs for about four per multiprocessor, slices of >= BLOCK_N."""
    sms = _SMS.get(str(device), 132)
    want = max(1, -(-4 * sms // max(1, programs)))
    return max(1, min(want, -(-c // BLOCK_N)))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention of ``q [B, Hkv, R, D]`` over ``k, v [B, Hkv, C, D]``; returns ``[B, Hkv, R, D]``."""
    b, h, r, d = q.shape
    c = k.shape[2]
    n_tok = mask.shape[2]
    block_r = 16 if r <= 16 else 64
    block_d = max(16, 1 << (d - 1).bit_length())
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = mask.to(q.dtype) if mask.dtype != q.dtype else mask
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    rblocks = -(-r // block_r)
    s = _splits(b * h * rblocks, c, q.device)
    per = -(-c // s)  # keys per slice, rounded up to whole blocks
    chunk = -(-per // BLOCK_N) * BLOCK_N
    s = -(-c // chunk)
    acc = torch.empty((b * h, s, r, block_d), dtype=torch.float32, device=q.device)
    m = torch.empty((b * h, s, r), dtype=torch.float32, device=q.device)
    lsum = torch.empty((b * h, s, r), dtype=torch.float32, device=q.device)
    _KERNEL[(rblocks, b * h, s)](
        q, k, v, mask, acc, m, lsum,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2),
        h, r, n_tok, c, chunk, s, float(scale),
        BLOCK_R=block_r, BLOCK_N=BLOCK_N, BLOCK_D=block_d, D=d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    top = m.amax(1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(m - top)  # a slice that saw nothing has m = -inf: weight 0
    out = (w[..., None] * acc).sum(1) / (w * lsum).sum(1)[..., None]
    return out[..., :d].reshape(b, h, r, d).to(q.dtype)
