"""One decode query per head attending over packed rotated codes, without expanding them (issue 15).

A :class:`~kvlab.compress.quant.RotatedQuantizer` segment holds per slot the codes of
``y = R (k - c m_t)`` (``R`` the head's rotation, ``m_t`` the segment's mean key rotated to the slot's
position, ``c`` the slot's coefficient on it). Attention needs only ``q . k`` and ``sum_t w_t v_t``, and

* ``q . k_t = (R q) . y_t + c_t (q . RoPE(m, p_t))``: rotate the query once, not every key;
* ``q . RoPE(m, p) = C + sum_i cos(p w_i) A_i + sin(p w_i) B_i`` with ``A, B, C`` from ``q`` and ``m``
  (one small product per segment), so the mean never has to be placed at every slot;
* ``sum_t w_t v_t = R^T (sum_t w_t y_t) + (sum_t w_t c_t) m_v``: un-rotate one vector per query.

The C kernel (``kvlab/kernels/quant_attention.c``) reads each slot's bytes once per step and keeps one decoded row on
its stack; full-precision parts (sinks, the recent tail, the new token) go through plain matmuls.
:func:`segment_plan` says whether a layer's segments can take this path (None: use the reference,
which decodes and runs SDPA); the two agree within float32 rounding (``tests/test_quant_attention.py``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kvlab import kernels
from kvlab.compress.quant.methods import RotatedCode, Segment
from kvlab.compress.quant.scalar import grid_levels
from kvlab.rope.spec import RopeSpec

KERNEL = "quant_attention"
_P = ctypes.c_void_p
_I64P = ctypes.POINTER(ctypes.c_int64)
_I32P = ctypes.POINTER(ctypes.c_int32)


def library() -> Any:
    """The compiled kernel with its signatures declared, or None (no compiler: see ``kernels.why_not``)."""
    lib = kernels.load(KERNEL)
    if lib is not None and not getattr(lib, "_kvlab_typed", False):
        c_int = ctypes.c_int
        lib.kvq_scores.argtypes = [c_int, _P, _P, _P, _I64P, _I64P, _I32P, c_int, c_int, c_int, c_int, c_int, _P, _P, _P, _P, _P, c_int, _P, _P, _P, ctypes.c_int64]  # fmt: skip
        lib.kvq_scores.restype = c_int
        lib.kvq_values.argtypes = [c_int, _P, _P, _P, _I64P, _I32P, c_int, c_int, c_int, c_int, c_int, _P, _P, ctypes.c_int64, _P, _P]  # fmt: skip
        lib.kvq_values.restype = c_int
        setattr(lib, "_kvlab_typed", True)  # noqa: B010 (a CDLL takes any attribute)
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ptrs(ts: list[torch.Tensor | None]) -> Any:
    return (_P * len(ts))(*[_ptr(t) for t in ts])


@dataclass(eq=False)
class _Side:
    """One side (keys or values) of every segment of a layer, as the kernel reads it."""

    codes: Any  # ctypes arrays of pointers
    scales: Any
    coef: Any
    has_mean: Any
    means: torch.Tensor  # [S, H, D] float32 (zero where a segment has none)
    keep: list[torch.Tensor]  # the tensors the pointers point into (kept alive here)


@dataclass(eq=False)
class SegmentPlan:
    """A layer's quantized segments, laid out for :func:`decode_attention` (built once per new segment)."""

    segments: tuple[Segment, ...]
    heads: int
    dim: int
    bits: int
    group: int
    levels: torch.Tensor
    rot: torch.Tensor  # [H, D, D] float32
    rope: RopeSpec | None
    n: Any  # ctypes int64 arrays
    pos0: Any
    total: int
    last_position: int
    keys: _Side
    values: _Side


def _eligible(code: Any) -> bool:
    if not isinstance(code, RotatedCode) or code.signs is not None:
        return False
    q = code.inner.q
    return (
        q.grid == "lloyd"
        and q.bits in (2, 4, 8)
        and len(q.shape) == 4
        and q.shape[0] == 1
        and q.packed.is_contiguous()
        and q.scale.dtype == torch.float16
        and q.scale.is_contiguous()
        and (code.coef is None or (code.coef.dtype == torch.float16 and code.coef.is_contiguous()))
    )


def _side(codes: list[RotatedCode], heads: int, dim: int) -> _Side:
    means = torch.zeros(len(codes), heads, dim)
    keep: list[torch.Tensor] = []
    for i, c in enumerate(codes):
        keep += [c.inner.q.packed, c.inner.q.scale] + ([c.coef] if c.coef is not None else [])
        if c.mean is not None:
            means[i] = c.mean.float().reshape(heads, dim)
    return _Side(
        codes=_ptrs([c.inner.q.packed for c in codes]),
        scales=_ptrs([c.inner.q.scale for c in codes]),
        coef=_ptrs([c.coef if c.mean is not None else None for c in codes]),
        has_mean=(ctypes.c_int32 * len(codes))(*[int(c.mean is not None) for c in codes]),
        means=means,
        keep=keep,
    )


def segment_plan(segments: list[Segment]) -> SegmentPlan | None:
    """The kernel's view of ``segments`` (one layer, batch 1), or None if any segment needs the
    reference path (another quantizer, the residual sketch, a uniform grid, 3 bits, several rows,
    non-contiguous positions) or the kernel could not be built here."""
    if not segments or library() is None:
        return None
    keys: list[RotatedCode] = []
    values: list[RotatedCode] = []
    for seg in segments:
        if not (_eligible(seg.keys) and _eligible(seg.values)):
            return None
        keys.append(seg.keys)  # type: ignore[arg-type]
        values.append(seg.values)  # type: ignore[arg-type]
    first = keys[0]
    q0 = first.inner.q
    _, heads, _, dim = q0.shape
    rope = next((k.rope for k in keys if k.mean is not None), None)
    pos0 = []
    for seg, k, v in zip(segments, keys, values, strict=True):
        for code in (k, v):
            q = code.inner.q
            if (q.bits, q.group_size, q.shape[1], q.shape[3]) != (q0.bits, q0.group_size, heads, dim):
                return None
            if code.rot is not first.rot and not torch.equal(code.rot, first.rot):
                return None
        if k.mean is None:
            pos0.append(0)
            continue
        p = k.positions
        if p is None or p.numel() != seg.length or (p.numel() > 1 and not bool((p.diff() == 1).all())):
            return None
        if k.rope is not rope and k.rope != rope:
            return None
        pos0.append(int(p[0]))
    ns = [s.length for s in segments]
    return SegmentPlan(
        segments=tuple(segments),
        heads=heads,
        dim=dim,
        bits=q0.bits,
        group=q0.group_size,
        levels=grid_levels(q0.bits).float().contiguous(),
        rot=first.rot.float().contiguous(),
        rope=rope,
        n=(ctypes.c_int64 * len(ns))(*ns),
        pos0=(ctypes.c_int64 * len(ns))(*pos0),
        total=sum(ns),
        last_position=max((p + n for p, n in zip(pos0, ns, strict=True)), default=0),
        keys=_side(keys, heads, dim),
        values=_side(values, heads, dim),
    )


def _cos_sin(rope: RopeSpec, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin [P >= need, rotary_dim / 2]`` of ``position * inv_freq`` (as the encoder
    computed them: float32 angles), times the spec's attention scaling; grown by doubling, per spec."""
    key = "kvlab.quant_attention.cos_sin"
    have = rope._cache.get(key)
    if have is None or have[0].shape[0] < need:
        size = max(need, 2 * (have[0].shape[0] if have is not None else 1024))
        theta = torch.arange(size, dtype=torch.float32)[:, None] * rope.inv_freq_tensor(torch.float32)
        s = float(rope.attention_scaling)
        have = ((theta.cos() * s).contiguous(), (theta.sin() * s).contiguous())
        rope._cache[key] = have
    return have


def _mean_terms(q: torch.Tensor, means: torch.Tensor, rope: RopeSpec | None):
    """``A, B [S, H, G, r/2]`` and ``C [S, H, G]`` with ``q . RoPE(m, p) = C + cos(p w).A + sin(p w).B``
    for queries ``q [H, G, D]`` and pre-RoPE means ``m [S, H, D]``."""
    m = means[:, :, None, :]  # [S, H, 1, D]
    qq = q[None]  # [1, H, G, D]
    if rope is None:
        empty = q.new_zeros(means.shape[0], q.shape[0], q.shape[1], 0)
        return empty, empty, (qq * m).sum(-1)
    r = rope.rotary_dim
    if rope.pairing == "half":
        q1, q2, m1, m2 = qq[..., : r // 2], qq[..., r // 2 : r], m[..., : r // 2], m[..., r // 2 : r]
    else:
        q1, q2, m1, m2 = qq[..., 0:r:2], qq[..., 1:r:2], m[..., 0:r:2], m[..., 1:r:2]
    a = q1 * m1 + q2 * m2
    b = q2 * m1 - q1 * m2
    c = (qq[..., r:] * m[..., r:]).sum(-1)
    return a.contiguous(), b.contiguous(), c.contiguous()


def decode_attention(
    plan: SegmentPlan, q: torch.Tensor, fp_keys: torch.Tensor, fp_values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention output ``[Hq, D]`` (float32) of one query per head ``q [Hq, D]`` over the plan's
    segments plus full-precision ``fp_keys``/``fp_values [H, m, D]`` (sinks, tail, the new token)."""
    lib = library()
    h, d = plan.heads, plan.dim
    g = q.shape[0] // h
    qg = q.float().reshape(h, g, d)
    qrot = torch.matmul(qg, plan.rot.transpose(-1, -2)).contiguous()  # R q per kv head
    s_count = len(plan.segments)
    a, b, c = _mean_terms(qg, plan.keys.means, plan.rope)
    half = a.shape[-1]
    if plan.rope is not None:
        cos, sin = _cos_sin(plan.rope, plan.last_position)
    else:
        cos = sin = torch.zeros(1)
    m = fp_keys.shape[-2]
    stride = plan.total + m
    logits = torch.empty(h, g, stride)
    lv, keys, values = plan.levels, plan.keys, plan.values
    rc = lib.kvq_scores(
        s_count, keys.codes, keys.scales, keys.coef, plan.n, plan.pos0, keys.has_mean,
        h, g, d, plan.bits, plan.group, _ptr(lv), _ptr(qrot), _ptr(a), _ptr(b), _ptr(c), half,
        _ptr(cos), _ptr(sin), _ptr(logits), stride,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError("quant_attention.kvq_scores refused its arguments")
    if m:
        logits[..., plan.total :] = torch.matmul(qg, fp_keys.float().transpose(-1, -2))
    w = torch.softmax(logits * scaling, dim=-1)
    acc = torch.empty(h, g, d)
    wmean = torch.empty(s_count, h, g)
    rc = lib.kvq_values(
        s_count, values.codes, values.scales, values.coef, plan.n, values.has_mean,
        h, g, d, plan.bits, plan.group, _ptr(lv), _ptr(w), stride, _ptr(acc), _ptr(wmean),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError("quant_attention.kvq_values refused its arguments")
    out = torch.matmul(acc, plan.rot)  # R^T y as rows: y @ R
    out += torch.einsum("shg,shd->hgd", wmean, values.means)
    if m:
        out += torch.matmul(w[..., plan.total :], fp_values.float())
    return out.reshape(h * g, d)
