"""One decode query per head attending over packed codes, without expanding them (issue 15).

A :class:`~kvlab.compress.quant.RotatedQuantizer` segment holds per slot the codes of
``y = R (k - c m_t)`` (``R`` the head's rotation, ``m_t`` the segment's mean key rotated to the slot's
position, ``c`` the slot's coefficient on it). Attention needs only ``q . k`` and ``sum_t w_t v_t``, and

* ``q . k_t = (R q) . y_t + c_t (q . RoPE(m, p_t))``: rotate the query once, not every key;
* ``q . RoPE(m, p) = C + sum_i cos(p w_i) A_i + sin(p w_i) B_i`` with ``A, B, C`` from ``q`` and ``m``
  (one small product per segment), so the mean never has to be placed at every slot;
* ``sum_t w_t v_t = R^T (sum_t w_t y_t) + (sum_t w_t c_t) m_v``: un-rotate one vector per query.

Plain per-token codes (``pertoken``, KIVI's values) are the same with ``R = I``, no mean and a zero
point per group (``q . zero`` is the group's query sum times the zero). KIVI's keys are coded per
channel along tokens: ``q . k_t = sum_d (q_d scale_dg) level[code_dt] + q . zero_g``, a scaled query
per token group. Pre-RoPE keys (KVQuant-style) and the residual sketch keep the reference path.

The C kernel (``kvlab/kernels/quant_attention.c``) reads each slot's bytes once per step and keeps one
decoded row (or token group) on its stack; full-precision parts (sinks, the recent tail, the new token)
go through plain matmuls. :func:`segment_plan` says whether a layer's segments can take this path
(None: use the reference, which decodes and runs SDPA); the two agree within float32 rounding
(``tests/test_quant_attention.py``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kvlab import kernels
from kvlab.compress.quant.methods import ChannelCode, RotatedCode, Segment, TokenCode
from kvlab.compress.quant.scalar import QuantizedTensor, grid_levels
from kvlab.rope.spec import RopeSpec

KERNEL = "quant_attention"
MAX_D = 512  # the kernel's longest decoded row: head_dim, or tokens per group of a per-channel code
_P = ctypes.c_void_p
_I64P = ctypes.POINTER(ctypes.c_int64)
_I32P = ctypes.POINTER(ctypes.c_int32)


def library() -> Any:
    """The compiled kernel with its signatures declared, or None (no compiler: see ``kernels.why_not``)."""
    lib = kernels.load(KERNEL)
    if lib is not None and not getattr(lib, "_kvlab_typed", False):
        c_int = ctypes.c_int
        lib.kvq_scores.argtypes = [c_int, _P, _P, _P, _P, _I64P, _I64P, _I32P, c_int, c_int, c_int, c_int, c_int, _P, _P, _P, _P, _P, _P, c_int, _P, _P, _P, ctypes.c_int64]  # fmt: skip
        lib.kvq_scores.restype = c_int
        lib.kvq_values.argtypes = [c_int, _P, _P, _P, _P, _I64P, _I32P, c_int, c_int, c_int, c_int, c_int, _P, _P, ctypes.c_int64, _P, _P]  # fmt: skip
        lib.kvq_values.restype = c_int
        lib.kvq_scores_channel.argtypes = [c_int, _P, _P, _P, _I64P, c_int, c_int, c_int, c_int, c_int, _P, _P, _P, ctypes.c_int64]  # fmt: skip
        lib.kvq_scores_channel.restype = c_int
        setattr(lib, "_kvlab_typed", True)  # noqa: B010 (a CDLL takes any attribute)
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ptrs(ts: list[torch.Tensor | None]) -> Any:
    return (_P * len(ts))(*[_ptr(t) for t in ts])


@dataclass(eq=False)
class _Side:
    """One side (keys or values) of every segment of a layer, as the kernel reads it."""

    layout: str  # "token": codes per slot, groups along head_dim; "channel": per channel along tokens
    bits: int
    group: int  # elements per scale: channels ("token") or tokens ("channel")
    levels: torch.Tensor  # float32 [2**bits]: what each code stands for, before its scale (and zero)
    codes: Any  # ctypes arrays of pointers
    scales: Any
    zeros: Any  # a NULL pointer where a segment's codes are symmetric
    coef: Any
    has_mean: Any
    means: torch.Tensor  # [S, H, D] float32 (zero where a segment has none)
    keep: list[torch.Tensor]  # the tensors the pointers point into (kept alive here)

    @property
    def has_zeros(self) -> bool:
        return any(self.zeros[i] is not None for i in range(len(self.zeros)))


@dataclass(eq=False)
class SegmentPlan:
    """A layer's quantized segments, laid out for :func:`decode_attention` (built once per new segment)."""

    segments: tuple[Segment, ...]
    heads: int
    dim: int
    rot: torch.Tensor | None  # [H, D, D] float32 (rotated codes), None for plain codes
    rope: RopeSpec | None
    n: Any  # ctypes int64 arrays
    pos0: Any
    total: int
    last_position: int
    keys: _Side
    values: _Side


def _levels(q: QuantizedTensor) -> torch.Tensor:
    """The value of each code before its scale (and zero point): how ``q.dequantize()`` reads it."""
    if q.grid == "lloyd":
        return grid_levels(q.bits).float().contiguous()
    levels = torch.arange(2**q.bits, dtype=torch.float32)
    return levels if q.zero is not None else levels - (2 ** (q.bits - 1) - 1)


def _parts(code: Any) -> tuple[str, QuantizedTensor, RotatedCode | None] | None:
    """``(layout, codes, rotated wrapper or None)`` of a code the kernel reads, else None."""
    if isinstance(code, RotatedCode):
        if code.signs is not None:
            return None
        layout, q, rot = "token", code.inner.q, code
        if code.coef is not None and not (code.coef.dtype == torch.float16 and code.coef.is_contiguous()):
            return None
    elif isinstance(code, TokenCode):
        layout, q, rot = "token", code.q, None
    elif isinstance(code, ChannelCode):
        layout, q, rot = "channel", code.q, None
    else:
        return None
    ok = (
        q.bits in (2, 4, 8)
        and (q.grid == "uniform" or (q.grid == "lloyd" and q.zero is None))  # lloyd reads no zero point
        and len(q.shape) == 4
        and q.shape[0] == 1
        and q.packed.is_contiguous()
        and q.scale.dtype == torch.float16
        and q.scale.is_contiguous()
        and (q.zero is None or (q.zero.dtype == torch.float16 and q.zero.is_contiguous()))
        and (q.shape[3] if layout == "token" else q.shape[2]) <= MAX_D
        and (layout == "token" or (q.group_size <= MAX_D and (q.group_size * q.bits) % 8 == 0))
    )
    return (layout, q, rot) if ok else None


def _side(parts: list[tuple[str, QuantizedTensor, RotatedCode | None]], heads: int, dim: int) -> _Side | None:
    """The kernel's view of one side, or None if the segments disagree on layout, bits, groups or levels."""
    layout, q0, _ = parts[0]
    levels = _levels(q0)
    means = torch.zeros(len(parts), heads, dim)
    keep: list[torch.Tensor] = []
    for i, (lay, q, rc) in enumerate(parts):
        width = q.shape[3] if lay == "token" else q.shape[2]
        if (lay, q.bits, q.group_size, q.shape[1], width) != (layout, q0.bits, q0.group_size, heads, dim):
            return None
        if (q.zero is None) != (q0.zero is None) or not torch.equal(_levels(q), levels):
            return None
        keep += [q.packed, q.scale] + [t for t in (q.zero, rc.coef if rc else None) if t is not None]
        if rc is not None and rc.mean is not None:
            means[i] = rc.mean.float().reshape(heads, dim)
    rcs = [rc for _, _, rc in parts]
    return _Side(
        layout=layout,
        bits=q0.bits,
        group=q0.group_size,
        levels=levels,
        codes=_ptrs([q.packed for _, q, _ in parts]),
        scales=_ptrs([q.scale for _, q, _ in parts]),
        zeros=_ptrs([q.zero for _, q, _ in parts]),
        coef=_ptrs([rc.coef if rc is not None and rc.mean is not None else None for rc in rcs]),
        has_mean=(ctypes.c_int32 * len(parts))(*[int(rc is not None and rc.mean is not None) for rc in rcs]),
        means=means,
        keep=keep,
    )


def segment_plan(segments: list[Segment]) -> SegmentPlan | None:
    """The kernel's view of ``segments`` (one layer, batch 1), or None if any segment needs the
    reference path (pre-RoPE keys, the residual sketch, 3 bits, several rows, segments that disagree,
    non-contiguous positions) or the kernel could not be built here. Rotated codes (with their means),
    per-token codes and KIVI's per-channel keys are read as they are stored."""
    if not segments or library() is None:
        return None
    kparts, vparts = [], []
    for seg in segments:
        kp, vp = _parts(seg.keys), _parts(seg.values)
        if kp is None or vp is None or vp[0] != "token":
            return None
        # the kernel reads seg.length slots of every code: a code of another length is refused, not read
        if any((q.shape[2] if lay == "token" else q.shape[3]) != seg.length for lay, q, _ in (kp, vp)):
            return None
        kparts.append(kp)
        vparts.append(vp)
    rotated = [p[2] for p in kparts + vparts]
    first = rotated[0]
    if first is None:
        if any(r is not None for r in rotated):
            return None
    elif any(r is None or (r.rot is not first.rot and not torch.equal(r.rot, first.rot)) for r in rotated):
        return None
    q0 = kparts[0][1]
    heads, dim = q0.shape[1], (q0.shape[3] if kparts[0][0] == "token" else q0.shape[2])
    keys, values = _side(kparts, heads, dim), _side(vparts, heads, dim)
    if keys is None or values is None:
        return None
    kcodes = [p[2] for p in kparts]
    rope = next((k.rope for k in kcodes if k is not None and k.mean is not None), None)
    pos0 = []
    for seg, k in zip(segments, kcodes, strict=True):
        if k is None or k.mean is None:
            pos0.append(0)
            continue
        p = k.positions
        if p is None or p.numel() != seg.length or (p.numel() > 1 and not bool((p.diff() == 1).all())):
            return None
        if k.rope is not rope and k.rope != rope:
            return None
        pos0.append(int(p[0]))
    ns = [s.length for s in segments]
    if keys.layout == "channel" and any(n % keys.group for n in ns):
        return None
    return SegmentPlan(
        segments=tuple(segments),
        heads=heads,
        dim=dim,
        rot=None if first is None else first.rot.float().contiguous(),
        rope=rope,
        n=(ctypes.c_int64 * len(ns))(*ns),
        pos0=(ctypes.c_int64 * len(ns))(*pos0),
        total=sum(ns),
        last_position=max((p + n for p, n in zip(pos0, ns, strict=True)), default=0),
        keys=keys,
        values=values,
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
    qg = q.float().reshape(h, g, d).contiguous()
    # R q per kv head (the codes live in the rotated frame); plain codes read the query as it is
    qrot = qg if plan.rot is None else torch.matmul(qg, plan.rot.transpose(-1, -2)).contiguous()
    s_count = len(plan.segments)
    m = fp_keys.shape[-2]
    stride = plan.total + m
    logits = torch.empty(h, g, stride)
    keys, values = plan.keys, plan.values
    if keys.layout == "channel":
        rc = lib.kvq_scores_channel(
            s_count, keys.codes, keys.scales, keys.zeros, plan.n, h, g, d, keys.bits, keys.group,
            _ptr(keys.levels), _ptr(qrot), _ptr(logits), stride,
        )  # fmt: skip
    else:
        a, b, c = _mean_terms(qg, keys.means, plan.rope)
        half = a.shape[-1]
        if plan.rope is not None:
            cos, sin = _cos_sin(plan.rope, plan.last_position)
        else:
            cos = sin = torch.zeros(1)
        # the query's sum over each group of channels: what a group's zero point adds to its score
        qsum = (
            qrot.reshape(h, g, d // keys.group, keys.group).sum(-1).contiguous() if keys.has_zeros else None
        )
        rc = lib.kvq_scores(
            s_count, keys.codes, keys.scales, keys.zeros, keys.coef, plan.n, plan.pos0, keys.has_mean,
            h, g, d, keys.bits, keys.group, _ptr(keys.levels), _ptr(qrot), _ptr(qsum), _ptr(a), _ptr(b),
            _ptr(c), half, _ptr(cos), _ptr(sin), _ptr(logits), stride,
        )  # fmt: skip
    if rc != 0:
        raise RuntimeError("quant_attention refused the key segments' arguments")
    if m:
        logits[..., plan.total :] = torch.matmul(qg, fp_keys.float().transpose(-1, -2))
    w = torch.softmax(logits * scaling, dim=-1)
    acc = torch.empty(h, g, d)
    wmean = torch.empty(s_count, h, g)
    rc = lib.kvq_values(
        s_count, values.codes, values.scales, values.zeros, values.coef, plan.n, values.has_mean,
        h, g, d, values.bits, values.group, _ptr(values.levels), _ptr(w), stride, _ptr(acc), _ptr(wmean),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError("quant_attention.kvq_values refused its arguments")
    out = acc if plan.rot is None else torch.matmul(acc, plan.rot)  # R^T y as rows: y @ R
    out += torch.einsum("shg,shd->hgd", wmean, values.means)
    if m:
        out += torch.matmul(w[..., plan.total :], fp_values.float())
    return out.reshape(h * g, d)
