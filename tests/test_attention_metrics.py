"""Exact properties of the attention-row comparison (synthetic maps and tiny random models)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.metrics.attention import compare_attention_rows, roll_alignment, stack_attentions


def _causal_maps(layers: int, heads: int, t: int, seed: int = 0, sink: float = 0.0) -> torch.Tensor:
    """Random causal attention maps ``[L, H, T, T]``; ``sink`` of every row's mass put on slot 0."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(layers, heads, t, t, generator=g, dtype=torch.float64) + 0.05
    w = torch.tril(w)
    w = w / w.sum(-1, keepdim=True)
    if sink:
        w = w * (1 - sink)
        w[..., 0] += sink
    return w


def test_identical_runs_give_cos_one_js_zero_topk_one():
    att = _causal_maps(3, 2, 12, sink=0.6)
    cmp = compare_attention_rows(att, att.clone(), exclude_first=1, k=3)
    valid = np.isfinite(cmp.cos)
    assert valid.all()
    np.testing.assert_allclose(cmp.cos, 1.0, atol=1e-12)
    np.testing.assert_allclose(cmp.js, 0.0, atol=1e-12)
    # Row 0 sees only slot 0: without it nothing is left, so the "rest" metrics are NaN there and exact elsewhere.
    assert np.isnan(cmp.cos_rest[..., 0]).all() and np.isnan(cmp.js_rest[..., 0]).all()
    np.testing.assert_allclose(cmp.cos_rest[..., 1:], 1.0, atol=1e-12)
    np.testing.assert_allclose(cmp.js_rest[..., 1:], 0.0, atol=1e-12)
    np.testing.assert_array_equal(cmp.topk[..., 2:], 1.0)  # rows with >= 3 visible keys
    assert np.isnan(cmp.topk[..., :2]).all()
    np.testing.assert_allclose(cmp.sink_a, att[..., 0].numpy())
    np.testing.assert_allclose(cmp.aligned_mass_a, 1.0, atol=1e-12)


def test_disjoint_rows_give_cos_zero_js_ln2():
    a = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    b = torch.zeros_like(a)
    a[..., 0] = 1.0  # every row on slot 0
    b[..., 1:, 1] = 1.0  # rows 1.. on slot 1
    b[..., 0, 0] = 1.0
    cmp = compare_attention_rows(a, b, queries_a=[1, 2, 3], queries_b=[1, 2, 3], exclude_first=0, k=1)
    np.testing.assert_allclose(cmp.cos, 0.0, atol=1e-15)
    np.testing.assert_allclose(cmp.js, math.log(2.0), rtol=1e-12)
    np.testing.assert_array_equal(cmp.topk, 0.0)


def test_moved_sink_hurts_full_rows_but_not_the_rest():
    """B is A rolled by n with its first slot turned into a sink: only the sink-free comparison stays exact."""
    t, n, sink = 16, 3, 0.7
    base = _causal_maps(2, 3, t, seed=1)
    ka, kb = roll_alignment(t, n)
    # A: slot 0 is a sink; B: A's rows over keys n.. (renormalised), shifted to 0.., with a new sink at slot 0.
    a = base * (1 - sink)
    a[..., 0] += sink
    sub = base[..., n:, n:]
    sub = sub / sub.sum(-1, keepdim=True)
    b = sub * (1 - sink)
    b[..., 0] += sink
    cmp = compare_attention_rows(a, b, ka, kb, exclude_first=1, k=2)
    rest = np.isfinite(cmp.cos_rest)
    assert rest[..., 1:].all()
    # Without the first aligned key, B's rows are A's rows over the same keys, up to scale: exact.
    np.testing.assert_allclose(cmp.cos_rest[..., 1:], 1.0, atol=1e-12)
    np.testing.assert_allclose(cmp.js_rest[..., 1:], 0.0, atol=1e-12)
    # With it, the new sink dominates B's rows: clearly below 1.
    assert np.nanmean(cmp.cos[..., 1:]) < 0.9
    assert np.nanmean(cmp.js[..., 1:]) > 0.05
    np.testing.assert_allclose(cmp.sink_a, sink + (1 - sink) * base[..., n:, 0].numpy(), atol=1e-12)
    np.testing.assert_allclose(cmp.sink_b, b[..., :, 0].numpy(), atol=1e-12)
    np.testing.assert_allclose(cmp.first_aligned_b, cmp.sink_b, atol=0)  # B's first aligned key is its slot 0
    # A's aligned mass is what it did not spend on the rolled-off keys 0..n-1.
    np.testing.assert_allclose(cmp.aligned_mass_a, 1 - a[..., n:, :n].sum(-1).numpy(), atol=1e-12)


def test_scale_invariance_and_symmetry():
    a, b = _causal_maps(2, 2, 10, seed=2), _causal_maps(2, 2, 10, seed=3)
    ab = compare_attention_rows(a, b)
    ba = compare_attention_rows(b, a)
    scaled = compare_attention_rows(a * 3.0, b * 0.5)
    np.testing.assert_allclose(ab.js, ba.js, atol=1e-14)
    np.testing.assert_allclose(ab.cos, ba.cos, atol=1e-14)
    np.testing.assert_allclose(scaled.js_rest[..., 1:], ab.js_rest[..., 1:], atol=1e-12)
    np.testing.assert_allclose(scaled.cos, ab.cos, atol=1e-12)
    assert (ab.js >= 0).all() and (ab.js <= math.log(2.0) + 1e-15).all()


def test_inputs_are_not_modified():
    a, b = _causal_maps(1, 2, 8, seed=4), _causal_maps(1, 2, 8, seed=5)
    a0, b0 = a.clone(), b.clone()
    compare_attention_rows(a, b, exclude_first=2)
    assert torch.equal(a, a0) and torch.equal(b, b0)


def test_bad_input():
    a = _causal_maps(1, 1, 6)
    with pytest.raises(BadInputError):
        compare_attention_rows(a, a, [0, 1], [0, 1, 2])
    with pytest.raises(BadInputError):
        compare_attention_rows(a, a, [0, 9], [0, 1])
    with pytest.raises(BadInputError):
        compare_attention_rows(a, a, exclude_first=6)
    with pytest.raises(BadInputError):
        compare_attention_rows(a, _causal_maps(2, 1, 6))
    with pytest.raises(BadInputError):
        compare_attention_rows(a[..., :3, :], a[..., :3, :])  # not square: queries must be explicit
    with pytest.raises(BadInputError):
        roll_alignment(6, 6)
    with pytest.raises(BadInputError):
        stack_attentions(())


def test_tiny_model_truncation_rows_are_identical(tiny_model):
    """By causality, a prefix's attention rows equal the full run's rows over the same slots."""
    h = tiny_model("llama")
    ids = list(range(3, 23))
    full = h.forward(ids, output_attentions=True)
    short = h.forward(ids[:14], output_attentions=True)
    keys = np.arange(14)
    cmp = compare_attention_rows(full.attentions, short.attentions, keys, keys, exclude_first=1, k=3)
    np.testing.assert_allclose(cmp.cos, 1.0, atol=1e-6)
    np.testing.assert_allclose(cmp.js, 0.0, atol=1e-6)
    np.testing.assert_allclose(cmp.sink_a, cmp.sink_b, atol=1e-6)
    assert cmp.cos.shape == (h.facts.num_layers, h.facts.num_attention_heads, 14)


def test_tiny_model_roll_reports_sink_and_alignment(tiny_model):
    h = tiny_model("qwen2")
    ids = list(range(5, 29))
    n = 4
    orig = h.forward(ids, output_attentions=True)
    rolled = h.forward(ids[n:], output_attentions=True)
    ka, kb = roll_alignment(len(ids), n)
    cmp = compare_attention_rows(orig.attentions, rolled.attentions, ka, kb)
    att_o = stack_attentions(orig.attentions).double()
    np.testing.assert_allclose(cmp.sink_a, att_o[:, :, n:, 0].numpy(), atol=0)
    np.testing.assert_allclose(cmp.aligned_mass_b, 1.0, atol=1e-5)  # B sees only aligned keys
    assert (cmp.aligned_mass_a < 1.0).all()  # A spent some mass on the rolled-off tokens
