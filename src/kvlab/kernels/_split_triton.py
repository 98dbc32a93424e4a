"""The Triton kernels behind :mod:`kvlab.kernels.split_attention` (imported by its ``prepare()`` only
where Triton is installed; ``TRITON_INTERPRET=1`` set before the import runs them on the CPU)."""

# ruff: noqa: N803 -- Triton kernels name their pointer arguments in capitals, as Triton's own do

import triton
import triton.language as tl


@triton.jit
def load_rows(
    P, PS, PL, base, sbase, cols, dims, feat, ok, sc, ssc, C,
    INT4: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BROADCAST: tl.constexpr, G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_N, BLOCK_D]`` keys or values of slots ``cols``: read as stored, or (``INT4``) decoded from
    their 4-bit codes (element ``2i`` in the low nibble of byte ``i``) times the fp16 scale plus the fp16
    minimum of each ``GROUP`` channels, in fp32 as :func:`kvlab.policy.quant.codecs.int4rows.decode_rows` does.

    int4 columns come permuted: column ``j`` holds channel ``feat[j]`` (the even channels, then the odd
    ones), so each half is one contiguous run of bytes; the caller permutes the queries and the output
    alike. With ``BROADCAST`` (``G`` groups, a power of two, tiling the block exactly) each slot's scales
    and minimums are loaded once and broadcast over their group's columns, rather than gathered per element.
    """
    if INT4:
        byte = tl.load(P + base + cols[:, None] * sc + (dims % (D // 2))[None, :], mask=ok, other=0)
        nib = ((byte.to(tl.int32) >> (4 * (dims // (D // 2)))[None, :]) & 15).to(tl.float32)
        if BROADCAST:
            g = tl.arange(0, G)
            soff = sbase + cols[:, None] * ssc + g[None, :]
            gok = (cols < C)[:, None] & (g < G)[None, :]
            scale = tl.load(PS + soff, mask=gok, other=0.0).to(tl.float32)
            low = tl.load(PL + soff, mask=gok, other=0.0).to(tl.float32)
            # column j = half * D/2 + group * GROUP/2 + i: [slot, half, group, i]
            x = tl.reshape(nib, [BLOCK_N, 2, G, GROUP // 2])
            x = x * tl.reshape(scale, [BLOCK_N, 1, G, 1]) + tl.reshape(low, [BLOCK_N, 1, G, 1])
            return tl.reshape(x, [BLOCK_N, BLOCK_D])
        else:
            soff = sbase + cols[:, None] * ssc + (feat // GROUP)[None, :]
            scale = tl.load(PS + soff, mask=ok, other=0.0).to(tl.float32)
            low = tl.load(PL + soff, mask=ok, other=0.0).to(tl.float32)
            return nib * scale + low
    else:
        return tl.load(P + base + cols[:, None] * sc + dims[None, :], mask=ok, other=0.0)


@triton.jit
def split_kernel(
    Q, K, V, KS, KL, VS, VL, MASK, SLOT_POS, QUERY_POS, ACC, M, L,
    sqb, sqh, sqr, skb, skh, skc, svb, svh, svc, ssb, ssh, ssc, smb, smr, spb,
    H, R, N_TOK, C, CHUNK, S, scale,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
    PRECISION: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, BROADCAST: tl.constexpr, G: tl.constexpr,
    POSITIONS: tl.constexpr,
):  # fmt: skip
    """Rows ``R`` of one (batch, KV head) against slice ``program_id(2)`` of the slots: the partial
    output, running maximum and sum (in log2 units: ``exp2`` of scores pre-scaled by log2(e)).

    Which slots a row sees comes from the additive ``MASK`` rows (a ``[BLOCK_R, BLOCK_N]`` tile read per
    block, as many bytes as the keys), or, with ``POSITIONS``, from the rule that mask was made by:
    slot ``c`` is visible to token ``t`` when ``SLOT_POS[c] <= QUERY_POS[b, t]`` (``BLOCK_N`` integers a
    block; the mask is never read)."""
    rblock = tl.program_id(0)  # fastest axis: the row blocks of one slice run side by side (L2 reuse)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // H
    h = bh % H
    rows = rblock * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    dim_ok = dims < D
    if INT4:  # the channel each column holds (see load_rows)
        feat = 2 * (dims % (D // 2)) + dims // (D // 2)
    else:
        feat = dims
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqr + feat[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    mask_rows = MASK + b * smb + (rows % N_TOK) * smr
    if POSITIONS:  # each row's query position, once
        query_pos = tl.load(QUERY_POS + b * spb + rows % N_TOK, mask=row_ok, other=-1)
    # scale.to: torch.compile passes a Python float as fp64, which would make the running max fp64
    qk_scale = tl.cast(scale, tl.float32) * 1.4426950408889634  # log2(e): exp2 below, one multiply less
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    start = split * CHUNK
    sbase = b * ssb + h * ssh
    for n0 in range(0, CHUNK, BLOCK_N):
        cols = start + n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < C
        kv_ok = col_ok[:, None] & dim_ok[None, :]
        k = load_rows(
            K, KS, KL, b * skb + h * skh, sbase, cols, dims, feat, kv_ok, skc, ssc, C,
            INT4, GROUP, D, BROADCAST, G, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        if POSITIONS:
            slot_pos = tl.load(SLOT_POS + cols, mask=col_ok, other=0)
            visible = (slot_pos[None, :] <= query_pos[:, None]) & col_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
        else:
            bias = tl.load(
                mask_rows[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
            ).to(tl.float32)
            visible = (bias > -1.0e30) & col_ok[None, :]
            s = tl.where(visible, s + bias * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_rows(
            V, VS, VL, b * svb + h * svh, sbase, cols, dims, feat, kv_ok, svc, ssc, C,
            INT4, GROUP, D, BROADCAST, G, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    out = (bh * S + split) * R + rows
    tl.store(ACC + out[:, None] * BLOCK_D + feat[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(M + out, m_i, mask=row_ok)
    tl.store(L + out, l_i, mask=row_ok)


def split_signature(dtype: str, int4: bool, positions: bool, scale: str = "fp32") -> dict[str, str]:
    """The argument types of :func:`split_kernel` as ``attend()`` passes them (Triton type names: ``"bf16"``,
    ``"fp32"``...), for compiling it ahead of time for a target without its GPU (``triton.compile`` of an
    ``ASTSource``); the constexprs are the caller's. Without ``positions`` the unread position pointers are
    the mask's."""
    sig = {name: f"*{dtype}" for name in ("Q", "MASK")}
    sig.update({name: "*u8" if int4 else f"*{dtype}" for name in ("K", "V")})
    sig.update({name: "*fp16" if int4 else f"*{dtype}" for name in ("KS", "KL", "VS", "VL")})
    sig.update({name: "*i64" if positions else f"*{dtype}" for name in ("SLOT_POS", "QUERY_POS")})
    sig.update({name: "*fp32" for name in ("ACC", "M", "L")})
    ints = ("sqb", "sqh", "sqr", "skb", "skh", "skc", "svb", "svh", "svc", "ssb", "ssh", "ssc", "smb", "smr", "spb",
            "H", "R", "N_TOK", "C", "CHUNK", "S")  # fmt: skip
    sig.update(dict.fromkeys(ints, "i32"))
    sig["scale"] = scale
    return sig


@triton.jit
def merge_kernel(
    ACC, M, L, OUT, S, R, sob, sor,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """One program per (row, batch x head): the ``S`` slices' partial outputs weighted by
    ``exp2(max_slice - max_all)`` (maxima in log2 units; a slice that saw nothing has max -inf: weight 0),
    ``BLOCK_S`` slices at a time, written in the query's dtype."""
    r = tl.program_id(0)
    bh = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    sl = tl.arange(0, BLOCK_S)
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        top = tl.maximum(top, tl.load(M + (bh * S + s0 + sl) * R + r, mask=s0 + sl < S, other=float("-inf")))
    best = tl.max(top, 0)
    best = tl.where(best == float("-inf"), 0.0, best)
    num = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ok = s0 + sl < S
        at = (bh * S + s0 + sl) * R + r
        w = tl.exp2(tl.load(M + at, mask=ok, other=float("-inf")) - best)
        den += w * tl.load(L + at, mask=ok, other=0.0)
        part = tl.load(ACC + at[:, None] * BLOCK_D + dims[None, :], mask=ok[:, None], other=0.0)
        num += tl.sum(w[:, None] * part, 0)
    out = num / tl.sum(den, 0)
    tl.store(OUT + bh * sob + r * sor + dims, out.to(OUT.dtype.element_ty), mask=dims < D)


@triton.jit
def round_even(v):
    """``torch.round``: to the nearest integer, ties to even (exact for |v| < 2**22; written out, as
    Triton's interpreter has no ``rint``)."""
    f = tl.floor(v)
    frac = v - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))


@triton.jit
def encode_kernel(
    X, CODES, SCALES, LOWS, INDEX,
    sxb, sxh, sxt, scb, sch, scc, ssb, ssh, ssc, H,
    GROUP: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Token ``program_id(0)`` of row ``program_id(1)`` (batch x head) of ``X [B, H, n, D]`` as int4 codes,
    fp16 scale and fp16 minimum per ``GROUP`` channels, written at slot ``INDEX[t]``: the arithmetic of
    :func:`kvlab.policy.quant.codecs.int4rows.encode4` step for step (IEEE division, round half to even; launched
    with fp fusion off, so no multiply-add is contracted), hence the same bytes."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, GROUP // 2)
    ok = (g < G)[:, None] & (i < GROUP // 2)[None, :]
    at = X + b * sxb + h * sxh + t * sxt + g[:, None] * GROUP + 2 * i[None, :]
    even = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    odd = tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
    lo = tl.minimum(tl.min(tl.where(ok, even, float("inf")), 1), tl.min(tl.where(ok, odd, float("inf")), 1))
    hi = tl.maximum(tl.max(tl.where(ok, even, float("-inf")), 1), tl.max(tl.where(ok, odd, float("-inf")), 1))
    low = (lo - tl.abs(lo) * 0.0009765625 - 5.960464477539063e-08).to(tl.float16)
    span = (
        hi - low.to(tl.float32)
    ) * 0.06666666666666667  # * fp32(1/15): what torch computes for "/ 15" on CUDA
    scale = tl.maximum(span * 1.0009765625 + 5.960464477539063e-08, 6.103515625e-05).to(tl.float16)
    lowf = low.to(tl.float32)[:, None]
    scalef = scale.to(tl.float32)[:, None]
    c_even = tl.minimum(tl.maximum(round_even(tl.math.div_rn(even - lowf, scalef)), 0.0), 15.0)
    c_odd = tl.minimum(tl.maximum(round_even(tl.math.div_rn(odd - lowf, scalef)), 0.0), 15.0)
    byte = (c_even.to(tl.int32) | (c_odd.to(tl.int32) << 4)).to(tl.uint8)
    slot = tl.load(INDEX + t)
    tl.store(CODES + b * scb + h * sch + slot * scc + g[:, None] * (GROUP // 2) + i[None, :], byte, mask=ok)
    tl.store(SCALES + b * ssb + h * ssh + slot * ssc + g, scale, mask=g < G)
    tl.store(LOWS + b * ssb + h * ssh + slot * ssc + g, low, mask=g < G)
