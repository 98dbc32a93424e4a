"""Quantizers: exact bit packing, per-element error bounds, real byte counts, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.policy.quant import (
    SUPPORTED_BITS,
    KIVIQuantizer,
    PerTokenQuantizer,
    PreRopeQuantizer,
    RotatedQuantizer,
    make_quantizer,
    pack_bits,
    packed_nbytes,
    quantize,
    quantize_snapshot,
    split_plan,
    unpack_bits,
)
from kvlab.policy.quant.rotation import rotation_matrix, sketch_estimate, sketch_matrix
from kvlab.rope import RopeSpec, apply_rope


def _rope(head_dim: int = 64, theta: float = 1e5) -> RopeSpec:
    return RopeSpec(
        inv_freq=tuple(theta ** (-2 * i / head_dim) for i in range(head_dim // 2)), head_dim=head_dim
    )


def _snapshot(layers=2, heads=3, t=70, d=64, seed=0, rope=True) -> KVSnapshot:
    gen = torch.Generator().manual_seed(seed)
    spec = _rope(d) if rope else None
    keys, values = [], []
    for _ in range(layers):
        pre = torch.randn(1, heads, t, d, generator=gen) + 3 * torch.randn(1, heads, 1, d, generator=gen)
        pre[..., 5] *= 12  # an outlier channel, as real keys have
        keys.append(apply_rope(pre, torch.arange(t), spec).float() if spec else pre)
        values.append(torch.randn(1, heads, t, d, generator=gen))
    return KVSnapshot(
        tuple(keys), tuple(values), torch.arange(t)[None], torch.arange(t), spec, "f" * 64, "synthetic"
    )


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 300), seed=st.integers(0, 10_000))
def test_pack_round_trip_exact(bits, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=gen).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits) == math.ceil(n / 8) * bits
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_uses_every_bit():
    codes = torch.tensor([7, 0, 7, 0, 7, 0, 7, 0], dtype=torch.uint8)
    assert pack_bits(codes, 3).tolist() == [0b11000111, 0b01110001, 0b00011100]  # 3 bytes for 8 codes


def test_pack_rejects_bad_codes_and_widths():
    with pytest.raises(BadInputError):
        pack_bits(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(BadInputError):
        pack_bits(torch.tensor([1], dtype=torch.uint8), 9)
    with pytest.raises(BadInputError):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 9)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_every_element_within_half_a_step(bits, symmetric):
    x = torch.randn(2, 3, 50, 64) * 4 + torch.linspace(-20, 20, 64)
    q = quantize(x, bits, 32, symmetric=symmetric)
    err = (q.dequantize() - x).abs().view(2, 3, 50, 2, 32)
    half_step = q.scale.float()[..., None] / 2
    assert bool((err <= half_step * (1 + 1e-5) + 1e-6).all())
    groups = x.numel() // 32  # packed codes, then an fp16 scale (and zero point) per group
    assert q.nbytes == packed_nbytes(x.numel(), bits) + groups * 2 * (1 if symmetric else 2)


def test_error_shrinks_with_bits_and_bytes_are_real():
    x = torch.randn(1, 3, 128, 64)
    errs = [float((quantize(x, b, 64).dequantize() - x).norm() / x.norm()) for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True)
    assert errs[-1] < 0.01 and errs[2] < 0.1
    assert (
        quantize(x, 4, 64).nbytes == x.numel() // 2 + (x.numel() // 64) * 4
    )  # nibbles + fp16 scale and zero


@pytest.mark.parametrize(
    "quantizer",
    [
        PerTokenQuantizer(bits=4, group_size=32, sinks=4),
        KIVIQuantizer(bits=2, group_size=16, window=8, sinks=2),
        PreRopeQuantizer(bits=3, group_size=16, sinks=4),
        RotatedQuantizer(bits=4, sinks=4, window=3),
        RotatedQuantizer(bits=3, rotation="random", sketch=True),
    ],
    ids=lambda q: q.name,
)
def test_snapshot_round_trip_keeps_metadata_and_fp_slots(quantizer):
    snap = _snapshot()
    before = snap.clone()
    qs = quantize_snapshot(snap, quantizer)
    out = qs.decompress()
    for a, b in zip(snap.keys + snap.values, before.keys + before.values, strict=True):
        assert torch.equal(a, b)  # input untouched
    assert torch.equal(out.positions, snap.positions) and torch.equal(out.token_ids, snap.token_ids)
    assert out.keys[0].shape == snap.keys[0].shape and out.fingerprint == snap.fingerprint
    start, stop = split_plan(snap.seq_len, quantizer.sinks, quantizer.window, quantizer.token_multiple())
    for k, k2, v, v2 in zip(snap.keys, out.keys, snap.values, out.values, strict=True):
        assert torch.equal(k[:, :, :start], k2[:, :, :start]) and torch.equal(v[:, :, stop:], v2[:, :, stop:])
        rel = float((k2 - k).norm() / k.norm())
        assert 0 < rel < 0.5
    assert qs.nbytes < 0.5 * snap.nbytes  # short synthetic cache: fp sinks and windows are a large share


def test_kivi_groups_along_tokens_and_keeps_window():
    snap = _snapshot(t=70)
    qs = quantize_snapshot(snap, KIVIQuantizer(bits=4, group_size=32, window=4))
    layer = qs.layers[0]
    assert layer.segments[0].length == 64 and layer.tail_keys.shape[-2] == 6  # 4-slot window + 2 left over


def test_8bit_errors_are_small_for_every_method():
    snap = _snapshot()
    for name in ("pertoken", "kivi", "prerope", "rotation"):
        out = quantize_snapshot(snap, make_quantizer(name, 8)).decompress()
        assert float((out.keys[0] - snap.keys[0]).norm() / snap.keys[0].norm()) < 0.01, name


def test_rotation_is_orthogonal_and_preserves_inner_products():
    for kind in ("hadamard", "random"):
        r = rotation_matrix(64, kind, 3, 2)
        assert torch.allclose(
            r @ r.transpose(-1, -2), torch.eye(64, dtype=torch.float64).expand(2, 64, 64), atol=1e-12
        )
        q, k = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
        assert torch.allclose((r[0] @ q) @ (r[0] @ k), q @ k, atol=1e-10)


def test_rotation_beats_naive_on_outlier_channels():
    snap = _snapshot()
    naive = quantize_snapshot(snap, PerTokenQuantizer(bits=4)).decompress()
    rot = quantize_snapshot(snap, RotatedQuantizer(bits=4)).decompress()
    e_naive = float((naive.keys[0] - snap.keys[0]).norm())
    e_rot = float((rot.keys[0] - snap.keys[0]).norm())
    assert e_rot < 0.5 * e_naive


def test_sketch_estimate_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(16, generator=gen)
    est = torch.stack(
        [
            sketch_estimate(
                torch.where(sketch_matrix(16, 16, s) @ r >= 0, 1.0, -1.0), r.norm(), sketch_matrix(16, 16, s)
            )
            for s in range(1, 3001)
        ]
    ).mean(0)
    assert float((est - r).norm() / r.norm()) < 0.06  # sampling error ~ 1/sqrt(3000) per unit


def test_bad_inputs_raise_clear_errors():
    snap = _snapshot()
    with pytest.raises(BadInputError, match="unsupported bit width"):
        PerTokenQuantizer(bits=5)
    with pytest.raises(BadInputError, match="unsupported bit width"):
        make_quantizer("kivi", 1)
    with pytest.raises(BadInputError, match="does not divide"):
        quantize_snapshot(snap, PerTokenQuantizer(bits=4, group_size=48))
    with pytest.raises(BadInputError, match="unknown quantizer"):
        make_quantizer("nf4", 4)
    with pytest.raises(UnsupportedModelError, match="rotary"):
        quantize_snapshot(_snapshot(rope=False), PreRopeQuantizer(bits=4))
    odd = KVSnapshot(
        (torch.randn(1, 1, 8, 48),),
        (torch.randn(1, 1, 8, 48),),
        torch.zeros(1, 8, dtype=torch.long),
        torch.arange(8),
        None,
        "f" * 64,
    )
    with pytest.raises(UnsupportedModelError, match="power-of-two"):
        quantize_snapshot(odd, RotatedQuantizer(bits=4, group_size=16))
    ints = KVSnapshot(
        (torch.zeros(1, 1, 8, 64, dtype=torch.int8),),
        (torch.zeros(1, 1, 8, 64, dtype=torch.int8),),
        torch.zeros(1, 8, dtype=torch.long),
        torch.arange(8),
        None,
        "f" * 64,
    )
    with pytest.raises(UnsupportedModelError, match="floating-point"):
        quantize_snapshot(ints, PerTokenQuantizer(bits=4))


def test_lloyd_max_levels_match_the_known_normal_grids():
    from kvlab.policy.quant.scalar import lloyd_max_levels

    assert torch.allclose(lloyd_max_levels(2)[2:], torch.tensor([0.4528, 1.5104]), atol=1e-3)
    assert torch.allclose(lloyd_max_levels(3)[4:], torch.tensor([0.2451, 0.7560, 1.3439, 2.1519]), atol=1e-3)
    assert abs(float(lloyd_max_levels(4)[-1]) - 2.7326) < 1e-3
    for bits in SUPPORTED_BITS:
        lv = lloyd_max_levels(bits)
        assert lv.numel() == 2**bits and torch.all(lv[1:] > lv[:-1]) and torch.allclose(lv, -lv.flip(0))


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_lloyd_grid_beats_uniform_on_gaussian_groups_with_fewer_bytes(bits):
    from kvlab.policy.quant.scalar import quantize_lloyd

    x = torch.randn(500, 64, generator=torch.Generator().manual_seed(bits))
    lq, uq = quantize_lloyd(x, bits, 64), quantize(x, bits, 64)
    e_l = float((lq.dequantize() - x).norm() / x.norm())
    e_u = float((uq.dequantize() - x).norm() / x.norm())
    assert lq.grid == "lloyd" and lq.nbytes == packed_nbytes(x.numel(), bits) + 500 * 2 < uq.nbytes
    # better than min/max at <= 4 bits with one fp16 number per group instead of two; at 8 bits (uniform
    # symmetric grid) the range is |max| on both sides, so a little worse but still fewer bytes
    assert e_l < e_u * (1.0 if bits <= 4 else 1.15)
    assert e_l < {2: 0.36, 3: 0.18, 4: 0.09, 8: 0.008}[bits]


def test_projected_centring_handles_a_sink_key_far_from_the_mean():
    snap = _snapshot(layers=1, t=96)
    k = snap.keys[0].clone()
    k[:, :, 0] = -0.3 * k[:, :, 1:].mean(2)  # a short key pointing away from the shared offset (like a sink)
    snap = snap.replace(keys=(k,))
    errs = {}
    for center in ("proj", "mean"):
        out = quantize_snapshot(snap, RotatedQuantizer(bits=4, center=center, grid="uniform")).decompress()
        errs[center] = float((out.keys[0][:, :, 0] - k[:, :, 0]).norm() / k[:, :, 0].norm())
    assert errs["proj"] < 0.5 * errs["mean"]


def test_rotation_budget_equals_naive_int4_plus_one_mean_per_segment():
    snap = _snapshot(layers=1, heads=3, t=96)
    rot = quantize_snapshot(snap, RotatedQuantizer(bits=4))
    naive = quantize_snapshot(snap, PerTokenQuantizer(bits=4))
    means = 2 * 3 * 64 * 2  # keys and values: one fp16 mean of 64 per head
    assert rot.nbytes == naive.nbytes + means
    # a short (decode-time) segment is not centred, so it stores no mean and no coefficients
    short = RotatedQuantizer(bits=4).encode(
        snap.keys[0][:, :, :3], snap.values[0][:, :, :3], torch.arange(3), snap.rope
    )
    assert short.keys.mean is None and short.keys.coef is None
    assert short.nbytes == 2 * (packed_nbytes(3 * 3 * 64, 4) + 3 * 3 * 2)
    with pytest.raises(BadInputError, match="centring"):
        RotatedQuantizer(center="median")
    with pytest.raises(BadInputError, match="grid"):
        RotatedQuantizer(grid="nf4")
