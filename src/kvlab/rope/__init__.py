"""Exact RoPE arithmetic on cached keys (see ``spec`` for what a model's RoPE is, ``ops`` for rotations)."""

from kvlab.rope.ops import apply_rope, remove_rope, rotate, shift_keys
from kvlab.rope.spec import (
    LayerRopes,
    Rope,
    RopeSpec,
    rope_for_layer,
    rope_from_json,
    rope_spec_from_config,
    rope_spec_from_model,
)

__all__ = [
    "LayerRopes",
    "Rope",
    "RopeSpec",
    "apply_rope",
    "remove_rope",
    "rope_for_layer",
    "rope_from_json",
    "rope_spec_from_config",
    "rope_spec_from_model",
    "rotate",
    "shift_keys",
]
