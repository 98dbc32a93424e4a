"""The decisive RoPE test: keys cached by a prefill at offset d equal shift(keys cached at offset 0, d).

Run on random-weight models of every family in tests/fixtures/model-configs (Llama, Qwen2 with
k_proj bias, Mistral, Phi-2 with partial rotary, Llama-3.1 with llama3 scaling), in fp64 (where the
only error is rounding: the shift is exact) and fp32, and on the bundled SmolLM2 model.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.model.random import tiny_random_model
from kvlab.rope import apply_rope, shift_keys
from tests.conftest import FAMILY_CONFIGS, config_path
from tests.tolerances import forward_tol, rope_angle_tol

OFFSETS = (1, 7, 100, 1_000)


def max_key_error(handle, ids, d):
    """Largest |shifted cache - prefill at offset d| over all layers' keys, and its derived bound: the
    rounding of two equal forward passes plus the fp32 RoPE angle error at positions up to d + len(ids)."""
    base = handle.prefill(ids).snapshot
    moved = handle.prefill(ids, start_position=d).snapshot
    assert moved.positions[0].item() == d
    err = max(
        (shift_keys(k0, d, base.rope) - kd).abs().max().item()
        for k0, kd in zip(base.keys, moved.keys, strict=True)
    )
    bound = forward_tol(handle, moved.keys) + rope_angle_tol(torch.float32, d + len(ids), moved.keys)
    return err, bound


def pre_rope_keys_layer0(handle, ids):
    """Layer 0's keys before RoPE ([1, kv_heads, T, head_dim]), captured from k_proj with a hook."""
    captured = {}
    proj = handle.model.model.layers[0].self_attn.k_proj
    hook = proj.register_forward_hook(lambda mod, inp, out: captured.setdefault("k", out.detach()))
    try:
        base = handle.prefill(ids).snapshot
    finally:
        hook.remove()
    k = captured["k"]
    return base, k.view(1, len(ids), base.num_kv_heads, base.head_dim).transpose(1, 2)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_shift_matches_fp64_reference(family):
    """Against an fp64 reference (pre-RoPE keys rotated to the new positions in float64 angles) the shift's
    error does not grow with d: it stays at the model's own fp32 angle error at the original positions.
    (Run in an fp64 model, whose rotary code still computes angles in fp32.)"""
    handle = tiny_random_model(config_path(family), dtype=torch.float64)
    ids = torch.randint(0, 500, (33,), generator=torch.Generator().manual_seed(0)).tolist()
    base, pre = pre_rope_keys_layer0(handle, ids)
    positions = torch.arange(len(ids))
    at_origin = (apply_rope(pre, positions, base.rope) - base.keys[0]).norm(dim=-1).max().item()
    assert at_origin < 1e-5  # the model's own RoPE agrees with kvlab's
    for d in (1, 100, 1_000, 100_000):
        ref = apply_rope(pre, positions + d, base.rope)
        err = (shift_keys(base.keys[0], d, base.rope) - ref).norm(dim=-1).max().item()  # rotation keeps norms
        assert err <= at_origin + 1e-10, (family, d, err, at_origin)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_shift_equals_prefill_at_offset_fp32(family, tiny_model):
    handle = tiny_model(family)
    ids = torch.randint(0, 500, (33,), generator=torch.Generator().manual_seed(1)).tolist()
    for d in OFFSETS:
        err, bound = max_key_error(handle, ids, d)
        assert err <= bound, (family, d, err, bound)


def test_shift_is_not_a_no_op(tiny_model):
    """Guard against a vacuous pass: without the shift, keys at offset d differ clearly."""
    handle = tiny_model("llama")
    ids = list(range(10, 40))
    base, moved = handle.prefill(ids).snapshot, handle.prefill(ids, start_position=7).snapshot
    assert (base.keys[0] - moved.keys[0]).abs().max().item() > 0.1


@pytest.mark.real_model
def test_bundled_model_shift_equals_prefill_at_offset(smollm):
    ids = smollm.encode("The quick brown fox jumps over the lazy dog, then rests beside the river bank.")
    # Far offsets: the model's own fp32 angles (position * inv_freq in fp32) dominate the error, and the
    # bound grows with the position accordingly.
    for d in (1, 7, 100, 4_000):
        err, bound = max_key_error(smollm, ids, d)
        assert err <= bound < 0.05, (
            d,
            err,
            bound,
        )  # test_shift_is_not_a_no_op: a missing shift is off by > 0.1
