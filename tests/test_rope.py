"""RoPE arithmetic on cached keys: exact properties (hypothesis) and specs read from real configs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.model.facts import load_config_file
from kvlab.rope import RopeSpec, apply_rope, remove_rope, rope_spec_from_config, rotate, shift_keys
from tests.conftest import FAMILY_CONFIGS, config_path


def make_spec(head_dim=16, rotary_dim=None, theta=10_000.0, pairing="half", scaling=1.0) -> RopeSpec:
    r = rotary_dim or head_dim
    inv = tuple(1.0 / theta ** (2 * i / r) for i in range(r // 2))
    return RopeSpec(inv_freq=inv, head_dim=head_dim, pairing=pairing, attention_scaling=scaling, theta=theta)


SPECS = [
    make_spec(),
    make_spec(pairing="interleaved"),
    make_spec(head_dim=16, rotary_dim=6),  # partial rotary, as Phi-2
    make_spec(scaling=1.23),  # yarn-style attention scaling
]
spec_st = st.sampled_from(SPECS)
pos_st = st.integers(min_value=-5_000, max_value=5_000)


def keys(seed: int, n: int = 7, head_dim: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, head_dim, generator=g, dtype=torch.float64)


@settings(max_examples=60, deadline=None)
@given(spec=spec_st, p=pos_st, seed=st.integers(0, 10_000))
def test_apply_then_remove_is_identity(spec, p, seed):
    k = keys(seed)
    positions = torch.arange(p, p + k.shape[-2])
    back = remove_rope(apply_rope(k, positions, spec), positions, spec)
    assert torch.allclose(back, k, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(spec=spec_st, a=pos_st, b=pos_st, seed=st.integers(0, 10_000))
def test_shift_composes(spec, a, b, seed):
    k = keys(seed)
    two_steps = shift_keys(shift_keys(k, a, spec), b, spec)
    assert torch.allclose(two_steps, shift_keys(k, a + b, spec), atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(spec=spec_st, p=pos_st, d=pos_st, seed=st.integers(0, 10_000))
def test_shift_equals_rotating_at_the_new_position(spec, p, d, seed):
    raw = keys(seed)
    positions = torch.arange(p, p + raw.shape[-2])
    shifted = shift_keys(apply_rope(raw, positions, spec), d, spec)
    assert torch.allclose(shifted, apply_rope(raw, positions + d, spec), atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(spec=spec_st, p=pos_st, seed=st.integers(0, 10_000))
def test_same_rotation_on_both_sides_leaves_cosine_unchanged(spec, p, seed):
    """The thread's null result: de-rotating two caches with the same positions changes no cosine."""
    a, b = keys(seed), keys(seed + 1)
    positions = torch.arange(p, p + a.shape[-2])
    cos = torch.nn.functional.cosine_similarity
    before = cos(a, b, dim=-1)
    after = cos(rotate(a, -positions, spec), rotate(b, -positions, spec), dim=-1)
    assert torch.allclose(before, after, atol=1e-10)


def test_different_positions_do_change_cosine():
    """...whereas de-rotating with each cache's own positions does change it (the test above can fail)."""
    spec = make_spec()
    a = keys(0)
    pa, pb = torch.arange(7), torch.arange(7) + 5
    rotated_a, rotated_b = apply_rope(a, pa, spec), apply_rope(a, pb, spec)
    cos = torch.nn.functional.cosine_similarity
    assert cos(rotated_a, rotated_b, dim=-1).min() < 0.99
    assert torch.allclose(
        cos(remove_rope(rotated_a, pa, spec), remove_rope(rotated_b, pb, spec), dim=-1),
        torch.ones(2, 3, 7, dtype=torch.float64),
        atol=1e-12,
    )


def test_partial_rotary_leaves_pass_through_dims():
    spec = make_spec(head_dim=16, rotary_dim=6)
    k = keys(1)
    out = shift_keys(k, 17, spec)
    assert torch.equal(out[..., 6:], k[..., 6:])
    assert not torch.allclose(out[..., :6], k[..., :6])


def test_half_and_interleaved_pairings_differ():
    k = keys(2)
    half, inter = make_spec(), make_spec(pairing="interleaved")
    assert not torch.allclose(shift_keys(k, 3, half), shift_keys(k, 3, inter))
    # Each is a rotation: norms are kept.
    assert torch.allclose(shift_keys(k, 3, inter).norm(dim=-1), k.norm(dim=-1))


def test_per_token_delta_matches_scalar_shifts():
    spec = make_spec()
    k = keys(3, n=5)
    delta = torch.tensor([0, 1, -2, 40, 7])
    out = shift_keys(k, delta, spec)
    for t, d in enumerate(delta.tolist()):
        assert torch.allclose(out[..., t, :], shift_keys(k[..., t : t + 1, :], d, spec)[..., 0, :])


def test_fp32_input_keeps_dtype_and_uses_fp64_angles():
    spec = make_spec(theta=100_000.0)
    k32 = keys(4).float()
    out = shift_keys(k32, 8_000, spec)
    assert out.dtype == torch.float32
    ref = shift_keys(k32.double(), 8_000, spec)
    assert (out.double() - ref).abs().max() < 1e-5


def test_bad_inputs():
    spec = make_spec()
    with pytest.raises(BadInputError):
        rotate(torch.zeros(1, 1, 3, 8), 0, spec)  # wrong head_dim
    with pytest.raises(BadInputError):
        rotate(torch.zeros(1, 1, 3, 16), torch.arange(4), spec)  # wrong number of positions
    dyn = dataclasses.replace(spec, rope_type="dynamic", shift_exact=False)
    with pytest.raises(UnsupportedModelError):
        shift_keys(torch.zeros(1, 1, 3, 16), 1, dyn)


def test_spec_roundtrips_through_json():
    spec = make_spec(rotary_dim=6, scaling=1.5)
    assert RopeSpec.from_json(spec.to_json()) == spec
    assert math.isclose(spec.periods_tokens()[0], 2 * math.pi)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_spec_from_real_configs(family):
    cfg = load_config_file(config_path(family))
    spec = rope_spec_from_config(cfg)
    assert spec is not None and spec.pairing == "half"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert spec.head_dim == head_dim
    if family == "phi":
        assert spec.rotary_dim == int(head_dim * 0.4)
    else:
        assert spec.rotary_dim == head_dim
    if family == "llama3-scaling":
        assert spec.rope_type == "llama3" and spec.shift_exact
        # llama3 scaling stretches the slow frequencies: the slowest period grows by the factor 8.
        plain = 1.0 / 500_000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        assert spec.inv_freq[0] == pytest.approx(float(plain[0]))
        assert spec.inv_freq[-1] == pytest.approx(float(plain[-1]) / 8, rel=1e-6)


def test_dynamic_ntk_is_flagged_not_shift_exact():
    cfg = load_config_file(config_path("llama"))
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}
    spec = rope_spec_from_config(cfg)
    assert spec.rope_type == "dynamic" and not spec.shift_exact


def test_yarn_scaling_is_read_from_the_model_code():
    cfg = load_config_file(config_path("qwen2"))
    cfg.rope_parameters = {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 1_000_000.0,
        "original_max_position_embeddings": 32_768,
    }
    spec = rope_spec_from_config(cfg)
    assert spec.rope_type == "yarn" and spec.shift_exact
    assert spec.attention_scaling > 1.0
