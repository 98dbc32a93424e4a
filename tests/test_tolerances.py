"""Tolerances derive from the dtype and the computation, and they separate exact from wrong."""

from __future__ import annotations

import pytest
import torch

from kvlab.metrics.tolerance import elementwise_tolerance, forward_tolerance


def test_forward_tolerance_scales_with_eps_depth_and_magnitude():
    f32 = forward_tolerance(torch.float32, num_layers=30, scale=30.0)
    assert f32 == pytest.approx(10 * torch.finfo(torch.float32).eps * 30 * 30)
    assert forward_tolerance(torch.float64, num_layers=30, scale=30.0) < f32 * 1e-8
    assert forward_tolerance(torch.bfloat16, num_layers=30, scale=30.0) > f32 * 1e4
    assert forward_tolerance(torch.float32, num_layers=60, scale=30.0) == pytest.approx(2 * f32)
    # magnitudes below 1 do not shrink the bound below the dtype's own resolution
    assert forward_tolerance(torch.float32, num_layers=1, scale=1e-6) == forward_tolerance(
        torch.float32, num_layers=1, scale=1.0
    )


def test_float32_bound_covers_reordered_sums_but_not_a_wrong_value():
    """A sum in two orders differs by rounding only; a dropped term is far outside the bound."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g, dtype=torch.float32) * 10
    forward, backward = x.sum(), x.flip(0).sum()
    chunked = torch.stack([c.sum() for c in x.split(7)]).sum()
    scale = float(x.abs().sum())
    tol = elementwise_tolerance(torch.float32, ops=x.numel(), scale=1.0) * max(scale / x.numel(), 1.0)
    assert abs(float(forward - backward)) <= tol and abs(float(forward - chunked)) <= tol
    assert abs(float(forward - (forward - x[17]))) > tol


def test_integer_dtypes_and_bad_depth_are_refused():
    with pytest.raises(ValueError, match="floating"):
        forward_tolerance(torch.int8, num_layers=1, scale=1.0)
    with pytest.raises(ValueError, match="num_layers"):
        forward_tolerance(torch.float32, num_layers=0, scale=1.0)
    with pytest.raises(ValueError, match="floating"):
        elementwise_tolerance(torch.int64)


# -- the tests' helpers (tests/tolerances.py) on a real forward pass ------------------------------------


def test_forward_tol_covers_chunked_prefill_and_catches_a_dropped_token(tiny_model):
    """Chunked and one-shot prefills of a tiny Llama agree within forward_tol; a cache missing one token
    (or at shifted positions) is orders of magnitude outside it."""
    from tests.tolerances import assert_forward_close, forward_tol, max_abs_diff

    h = tiny_model("llama")
    ids = list(range(20, 60))
    full = h.prefill(ids)
    chunked = h.extend(h.prefill(ids[:25]).snapshot, ids[25:])
    tol = forward_tol(h, full.logits[25:])
    assert tol == forward_tolerance(
        h.dtype, num_layers=h.facts.num_layers, scale=float(full.logits[25:].abs().max())
    )
    assert_forward_close(chunked.logits, full.logits[25:], h, what="chunked logits")
    assert_forward_close(chunked.snapshot.keys, full.snapshot.keys, h, what="chunked keys")
    dropped = h.extend(h.prefill(ids[:10] + ids[11:25]).snapshot, ids[25:])
    assert max_abs_diff(dropped.logits, full.logits[25:]) > 100 * tol
    shifted = h.extend(h.prefill(ids[:25], start_position=3).snapshot, ids[25:])
    assert max_abs_diff(shifted.logits[-1:], full.logits[-1:]) > 0 and max_abs_diff(
        shifted.snapshot.keys, full.snapshot.keys
    ) > 100 * forward_tol(h, full.snapshot.keys)
    with pytest.raises(AssertionError, match="tolerance"):
        assert_forward_close(dropped.logits, full.logits[25:], h, what="a wrong cache")


def test_rope_angle_tol_grows_with_position_and_dtype():
    from tests.tolerances import rope_angle_tol

    k = torch.full((4,), 3.0)
    assert rope_angle_tol(torch.float32, 4000, k) == pytest.approx(
        2 * torch.finfo(torch.float32).eps * 4000 * 3.0
    )
    assert rope_angle_tol(torch.float32, 8000, k) == pytest.approx(2 * rope_angle_tol(torch.float32, 4000, k))
    assert rope_angle_tol(torch.float64, 4000, k) < rope_angle_tol(torch.float32, 4000, k) * 1e-8
