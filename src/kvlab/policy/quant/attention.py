"""One decode query per head attending over packed codes, without expanding them (issue 15).

A :class:`~kvlab.policy.quant.RotatedQuantizer` segment holds per slot the codes of
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

Two paths compute this (:func:`packed_path` picks one per device). The C kernel
(``kvlab/kernels/quant_attention.c``) reads each slot's bytes once per step and keeps one decoded row (or
token group) on its stack; it reads host memory only, and every pointer handed to it is checked to be
one. On other devices (CUDA) torch ops do the same on the packed codes, a chunk of slots at a time
(unpack, scale, attend: memory bounded by the chunk, never a decoded copy of the history). Full-precision
parts (sinks, the recent tail, the new token) go through plain matmuls. :func:`segment_plan` says
whether a layer's segments can take a packed path (None: use the reference, which decodes and runs
SDPA); all three agree within float32 rounding (``tests/test_quant_attention.py``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kvlab import kernels
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.policy.quant.methods import ChannelCode, RotatedCode, Segment, TokenCode
from kvlab.policy.quant.scalar import QuantizedTensor, grid_levels
from kvlab.rope.spec import RopeSpec

KERNEL = "quant_attention"
MAX_D = 512  # the kernel's longest decoded row: head_dim, or tokens per group of a per-channel code
PATHS = ("auto", "kernel", "torch")
# The torch path decodes at most this many elements of codes at a time (4 MiB of float32): memory stays
# bounded by a chunk of slots, never the whole history.
CHUNK_ELEMENTS = 1 << 20
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
    """The address the C kernel reads. Host memory only: the kernel would read a CUDA address as a host
    one (garbage or a crash), so every pointer handed to it passes this check."""
    if t is None:
        return None
    if t.device.type != "cpu":
        raise UnsupportedModelError(
            f"the packed-code C kernel reads host memory, got a tensor on {t.device}; "
            "tensors on another device take the torch path (segment_plan(..., path='torch'))"
        )
    return t.data_ptr()


def _ptrs(ts: list[torch.Tensor | None]) -> Any:
    return (_P * len(ts))(*[_ptr(t) for t in ts])


def packed_path(device: torch.device | str, path: str = "auto") -> str | None:
    """Which packed-code attention serves codes on ``device``: ``"kernel"`` (the C kernel, host memory
    only), ``"torch"`` (torch ops on the packed codes, any device) or None (the reference: decode, then
    SDPA). ``"auto"``: the kernel on the CPU where it builds (else the reference), torch ops elsewhere."""
    if path not in PATHS:
        raise BadInputError(f"packed-code path must be one of {', '.join(PATHS)}, got {path!r}")
    on_host = torch.device(device).type == "cpu"
    if path == "torch" or (path == "auto" and not on_host):
        return "torch"
    if not on_host:
        raise UnsupportedModelError(
            f"the packed-code C kernel reads host memory; these codes are on {device}"
        )
    return "kernel" if library() is not None else None


@dataclass(eq=False)
class _Side:
    """One side (keys or values) of every segment of a layer: the stored tensors, and (kernel path) the
    pointer arrays the C kernel reads them through."""

    layout: str  # "token": codes per slot, groups along head_dim; "channel": per channel along tokens
    bits: int
    group: int  # elements per scale: channels ("token") or tokens ("channel")
    levels: torch.Tensor  # float32 [2**bits]: what each code stands for, before its scale (and zero)
    packed: list[torch.Tensor]  # per segment: flat uint8 codes
    scales: list[torch.Tensor]  # per segment: fp16
    zeros: list[torch.Tensor | None]  # None where a segment's codes are symmetric
    coef: list[torch.Tensor | None]  # fp16 [1, H, n] coefficient on the mean (None: 1, or no mean)
    has_mean: list[bool]
    means: torch.Tensor  # [S, H, D] float32 (zero where a segment has none)
    c_args: Any = None  # kernel path: (codes, scales, zeros, coef, has_mean) as ctypes arrays

    @property
    def has_zeros(self) -> bool:
        return any(z is not None for z in self.zeros)


@dataclass(eq=False)
class SegmentPlan:
    """A layer's quantized segments, laid out for :func:`decode_attention` (built once per new segment)."""

    segments: tuple[Segment, ...]
    heads: int
    dim: int
    rot: torch.Tensor | None  # [H, D, D] float32 (rotated codes), None for plain codes
    rope: RopeSpec | None
    lengths: tuple[int, ...]
    starts: tuple[int, ...]  # each segment's first position (0 where its keys carry no mean)
    total: int
    last_position: int
    keys: _Side
    values: _Side
    path: str = "kernel"  # "kernel" (the C kernel) or "torch" (torch ops on the packed codes)
    n: Any = None  # kernel path: ctypes int64 arrays of lengths and starts
    pos0: Any = None
    # codes stored ``frame`` positions ahead of the keys they stand for (a rolling layer's re-bases,
    # kvlab.hf.coded_rolling): the query meets them turned by +frame, an exact RoPE shift
    frame: int = 0
    frame_rope: RopeSpec | None = None


def _levels(q: QuantizedTensor) -> torch.Tensor:
    """The value of each code before its scale (and zero point): how ``q.dequantize()`` reads it."""
    if q.grid == "lloyd":
        return grid_levels(q.bits).to(q.packed.device).float().contiguous()
    levels = torch.arange(2**q.bits, dtype=torch.float32, device=q.packed.device)
    return levels if q.zero is not None else levels - (2 ** (q.bits - 1) - 1)


def _parts(code: Any) -> tuple[str, QuantizedTensor, RotatedCode | None] | None:
    """``(layout, codes, rotated wrapper or None)`` of a code the packed paths read, else None."""
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


def _side(
    parts: list[tuple[str, QuantizedTensor, RotatedCode | None]], heads: int, dim: int, path: str
) -> _Side | None:
    """One side's view, or None if the segments disagree on layout, bits, groups or levels."""
    layout, q0, _ = parts[0]
    levels = _levels(q0)
    means = torch.zeros(len(parts), heads, dim, device=q0.packed.device)
    for i, (lay, q, rc) in enumerate(parts):
        width = q.shape[3] if lay == "token" else q.shape[2]
        if (lay, q.bits, q.group_size, q.shape[1], width) != (layout, q0.bits, q0.group_size, heads, dim):
            return None
        if (q.zero is None) != (q0.zero is None) or not torch.equal(_levels(q), levels):
            return None
        if rc is not None and rc.mean is not None:
            means[i] = rc.mean.float().reshape(heads, dim)
    rcs = [rc for _, _, rc in parts]
    has_mean = [rc is not None and rc.mean is not None for rc in rcs]
    side = _Side(
        layout=layout,
        bits=q0.bits,
        group=q0.group_size,
        levels=levels,
        packed=[q.packed for _, q, _ in parts],
        scales=[q.scale for _, q, _ in parts],
        zeros=[q.zero for _, q, _ in parts],
        coef=[rc.coef if rc is not None and m else None for rc, m in zip(rcs, has_mean, strict=True)],
        has_mean=has_mean,
        means=means,
    )
    if path == "kernel":
        side.c_args = (
            _ptrs(list(side.packed)),
            _ptrs(list(side.scales)),
            _ptrs(side.zeros),
            _ptrs(side.coef),
            (ctypes.c_int32 * len(parts))(*[int(m) for m in has_mean]),
        )
    return side


def segment_plan(segments: list[Segment], *, path: str = "auto") -> SegmentPlan | None:
    """The packed-code view of ``segments`` (one layer, batch 1), or None if any segment needs the
    reference path (pre-RoPE keys, the residual sketch, 3 bits, several rows, segments that disagree,
    non-contiguous positions) or, on the kernel path, the kernel could not be built here. Rotated codes
    (with their means), per-token codes and KIVI's per-channel keys are read as they are stored.
    ``path``: see :func:`packed_path` (``"torch"`` on the CPU checks the torch ops against the kernel)."""
    if not segments:
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
    devices = {q.packed.device for _, q, _ in kparts + vparts}
    path_taken = packed_path(next(iter(devices)), path) if len(devices) == 1 else None
    if path_taken is None:
        return None
    q0 = kparts[0][1]
    heads, dim = q0.shape[1], (q0.shape[3] if kparts[0][0] == "token" else q0.shape[2])
    keys, values = _side(kparts, heads, dim, path_taken), _side(vparts, heads, dim, path_taken)
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
    kernel = path_taken == "kernel"
    return SegmentPlan(
        segments=tuple(segments),
        heads=heads,
        dim=dim,
        rot=None if first is None else first.rot.float().contiguous(),
        rope=rope,
        lengths=tuple(ns),
        starts=tuple(pos0),
        total=sum(ns),
        last_position=max((p + n for p, n in zip(pos0, ns, strict=True)), default=0),
        keys=keys,
        values=values,
        path=path_taken,
        n=(ctypes.c_int64 * len(ns))(*ns) if kernel else None,
        pos0=(ctypes.c_int64 * len(ns))(*pos0) if kernel else None,
    )


def _cos_sin(rope: RopeSpec, need: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin [P >= need, rotary_dim / 2]`` of ``position * inv_freq`` (as the encoder
    computed them: float32 angles), times the spec's attention scaling, on ``device``; grown by
    doubling, per spec and device."""
    key = ("kvlab.quant_attention.cos_sin", str(device))
    have = rope._cache.get(key)
    if have is None or have[0].shape[0] < need:
        size = max(need, 2 * (have[0].shape[0] if have is not None else 1024))
        pos = torch.arange(size, dtype=torch.float32, device=device)
        theta = pos[:, None] * rope.inv_freq_tensor(torch.float32, device)
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
    segments plus full-precision ``fp_keys``/``fp_values [H, m, D]`` (sinks, tail, the new token), on
    the plan's path (the C kernel, or torch ops on the packed codes): the same math either way."""
    h, d = plan.heads, plan.dim
    g = q.shape[0] // h
    q_fp = qg = q.float().reshape(h, g, d).contiguous()
    if plan.frame and plan.frame_rope is not None:
        from kvlab.rope.fast import rotate_by

        qg = rotate_by(qg, plan.frame, plan.frame_rope).contiguous()
    # R q per kv head (the codes live in the rotated frame); plain codes read the query as it is
    qrot = qg if plan.rot is None else torch.matmul(qg, plan.rot.transpose(-1, -2)).contiguous()
    m = fp_keys.shape[-2]
    stride = plan.total + m
    logits = torch.empty(h, g, stride, device=qg.device)
    kernel = plan.path == "kernel"
    if plan.keys.layout == "channel":
        (_kernel_channel_scores if kernel else _torch_channel_scores)(plan, qrot, logits)
    else:
        terms = _mean_terms(qg, plan.keys.means, plan.rope)
        (_kernel_token_scores if kernel else _torch_token_scores)(plan, qrot, terms, logits)
    if m:
        logits[..., plan.total :] = torch.matmul(q_fp, fp_keys.float().transpose(-1, -2))
    w = torch.softmax(logits * scaling, dim=-1)
    acc, wmean = (_kernel_values if kernel else _torch_values)(plan, w)
    out = acc if plan.rot is None else torch.matmul(acc, plan.rot)  # R^T y as rows: y @ R
    out += torch.einsum("shg,shd->hgd", wmean, plan.values.means)
    if m:
        out += torch.matmul(w[..., plan.total :], fp_values.float())
    return out.reshape(h * g, d)


# -- the C kernel (host memory) --------------------------------------------------------------------------


def _kernel_channel_scores(plan: SegmentPlan, qrot: torch.Tensor, logits: torch.Tensor) -> None:
    h, g, d = qrot.shape
    keys = plan.keys
    codes, scales, zeros, _, _ = keys.c_args
    rc = library().kvq_scores_channel(
        len(plan.lengths), codes, scales, zeros, plan.n, h, g, d, keys.bits, keys.group,
        _ptr(keys.levels), _ptr(qrot), _ptr(logits), logits.shape[-1],
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError("quant_attention refused the key segments' arguments")


def _kernel_token_scores(plan: SegmentPlan, qrot: torch.Tensor, terms: tuple, logits: torch.Tensor) -> None:
    h, g, d = qrot.shape
    keys = plan.keys
    a, b, c = terms
    if plan.rope is not None:
        cos, sin = _cos_sin(plan.rope, plan.last_position, qrot.device)
    else:
        cos = sin = torch.zeros(1, device=qrot.device)
    # the query's sum over each group of channels: what a group's zero point adds to its score
    qsum = qrot.reshape(h, g, d // keys.group, keys.group).sum(-1).contiguous() if keys.has_zeros else None
    codes, scales, zeros, coef, has_mean = keys.c_args
    rc = library().kvq_scores(
        len(plan.lengths), codes, scales, zeros, coef, plan.n, plan.pos0, has_mean,
        h, g, d, keys.bits, keys.group, _ptr(keys.levels), _ptr(qrot), _ptr(qsum), _ptr(a), _ptr(b),
        _ptr(c), a.shape[-1], _ptr(cos), _ptr(sin), _ptr(logits), logits.shape[-1],
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError("quant_attention refused the key segments' arguments")


def _kernel_values(plan: SegmentPlan, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h, g, stride = w.shape
    d, values = plan.dim, plan.values
    acc = torch.empty(h, g, d, device=w.device)
    wmean = torch.empty(len(plan.lengths), h, g, device=w.device)
    codes, scales, zeros, coef, has_mean = values.c_args
    rc = library().kvq_values(
        len(plan.lengths), codes, scales, zeros, coef, plan.n, has_mean,
        h, g, d, values.bits, values.group, _ptr(values.levels), _ptr(w), stride, _ptr(acc), _ptr(wmean),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError("quant_attention.kvq_values refused its arguments")
    return acc, wmean


# -- torch ops on the packed codes (any device) ----------------------------------------------------------


def _spans(plan: SegmentPlan, multiple: int = 1):
    """``(segment, offset, t0, t1)`` chunks of slots, each decoding at most ~CHUNK_ELEMENTS values
    (a multiple of ``multiple`` slots: whole token groups of a per-channel code)."""
    step = max(multiple, (CHUNK_ELEMENTS // (plan.heads * plan.dim)) // multiple * multiple)
    off = 0
    for s, n in enumerate(plan.lengths):
        for t0 in range(0, n, step):
            yield s, off, t0, min(n, t0 + step)
        off += n


def _codes(packed: torch.Tensor, bits: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``packed`` bytes ``[..., nbytes]`` -> codes ``[..., nbytes * 8 / bits]`` (int64), in
    :func:`~kvlab.policy.quant.pack.pack_bits`' layout (byte j holds codes per*j + r at bit bits*r)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*shape).long()


def _token_rows(side: _Side, plan: SegmentPlan, s: int, t0: int, t1: int) -> torch.Tensor:
    """Slots ``t0:t1`` of segment ``s`` decoded to float32 rows ``[H, c, D]`` (in the rotated frame,
    before the mean term): ``level[code] * scale (+ zero)`` per group, as the kernel decodes them."""
    h, d, n, c = plan.heads, plan.dim, plan.lengths[s], t1 - t0
    rowbytes, ng = d * side.bits // 8, d // side.group
    raw = side.packed[s][: h * n * rowbytes].view(h, n, rowbytes)[:, t0:t1]
    y = side.levels[_codes(raw, side.bits, (h, c, ng, side.group))]
    y = y * side.scales[s].view(h, n, ng)[:, t0:t1, :, None].float()
    zero = side.zeros[s]
    if zero is not None:
        y = y + zero.view(h, n, ng)[:, t0:t1, :, None].float()
    return y.reshape(h, c, d)


def _slot_coef(side: _Side, plan: SegmentPlan, s: int, t0: int, t1: int, device) -> torch.Tensor:
    """``[H, c]`` each slot's coefficient on its segment's mean (1 where none is stored)."""
    coef = side.coef[s]
    if coef is None:
        return torch.ones(plan.heads, t1 - t0, device=device)
    return coef.view(plan.heads, plan.lengths[s])[:, t0:t1].float()


def _torch_token_scores(plan: SegmentPlan, qrot: torch.Tensor, terms: tuple, logits: torch.Tensor) -> None:
    keys = plan.keys
    a, b, c = terms
    cos = sin = None
    if plan.rope is not None and any(keys.has_mean):
        cos, sin = _cos_sin(plan.rope, plan.last_position, qrot.device)
    for s, off, t0, t1 in _spans(plan):
        rows = _token_rows(keys, plan, s, t0, t1)  # [H, c, D]
        out = torch.matmul(qrot, rows.transpose(-1, -2))  # [H, G, c]
        if keys.has_mean[s]:  # q . RoPE(m, p) = C + cos(p w).A + sin(p w).B, times the slot's coefficient
            mean = c[s][..., None]
            if cos is not None and sin is not None and a.shape[-1]:
                p0 = plan.starts[s]
                mean = mean + a[s] @ cos[p0 + t0 : p0 + t1].T + b[s] @ sin[p0 + t0 : p0 + t1].T
            out = out + _slot_coef(keys, plan, s, t0, t1, qrot.device)[:, None, :] * mean
        logits[..., off + t0 : off + t1] = out


def _torch_channel_scores(plan: SegmentPlan, qrot: torch.Tensor, logits: torch.Tensor) -> None:
    keys = plan.keys
    h, d, tg = plan.heads, plan.dim, keys.group
    for s, off, t0, t1 in _spans(plan, tg):
        n, c = plan.lengths[s], t1 - t0
        rowbytes = n * keys.bits // 8
        raw = keys.packed[s][: h * d * rowbytes].view(h, d, rowbytes)
        raw = raw[..., t0 * keys.bits // 8 : t1 * keys.bits // 8]
        k = keys.levels[_codes(raw, keys.bits, (h, d, c // tg, tg))]  # [H, D, groups, tg]
        k = k * keys.scales[s].view(h, d, n // tg)[:, :, t0 // tg : t1 // tg, None].float()
        zero = keys.zeros[s]
        if zero is not None:
            k = k + zero.view(h, d, n // tg)[:, :, t0 // tg : t1 // tg, None].float()
        logits[..., off + t0 : off + t1] = torch.matmul(qrot, k.reshape(h, d, c))


def _torch_values(plan: SegmentPlan, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h, g, _ = w.shape
    values = plan.values
    acc = torch.zeros(h, g, plan.dim, device=w.device)
    wmean = torch.zeros(len(plan.lengths), h, g, device=w.device)
    for s, off, t0, t1 in _spans(plan):
        ws = w[..., off + t0 : off + t1]  # [H, G, c]
        acc += torch.matmul(ws, _token_rows(values, plan, s, t0, t1))
        if values.has_mean[s]:
            wmean[s] += (ws * _slot_coef(values, plan, s, t0, t1, w.device)[:, None, :]).sum(-1)
    return acc, wmean
