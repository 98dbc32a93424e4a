"""Rotations of cached keys: apply, remove and shift RoPE.

All functions are pure (they return new tensors) and compute angles and the rotation in float64 by
default, then cast back to the input dtype: a shift by ``delta`` then equals the key the model would
have computed at the new position up to the model's own fp32 angle error (a few 1e-5 for small
offsets). Rotating by the same angles on both sides of a comparison leaves every cosine unchanged;
that is why de-rotating two caches "with the same positions 0..L-1" (the thread's bug) shows nothing.

Shapes: keys are ``[..., T, head_dim]`` (kvlab stores ``[batch, kv_heads, T, head_dim]``);
``positions`` / ``delta`` are a scalar, ``[T]`` or broadcastable to ``[..., T]``.
"""

from __future__ import annotations

import torch

from kvlab.errors import BadInputError
from kvlab.rope.spec import Rope, RopeSpec

PositionsLike = int | float | torch.Tensor


def require_one_spec(spec: object) -> None:
    """Rotations act on one layer's keys: a per-layer RoPE must be narrowed with ``for_layer(i)`` first
    (rotating with a guessed base is exactly the silent error kvlab exists to avoid)."""
    if not isinstance(spec, RopeSpec):
        raise BadInputError(
            f"a rotation needs one layer's RoPE spec, got {type(spec).__name__}; "
            "for a model with one RoPE per layer use rope.for_layer(layer)"
        )


def _angles(
    positions: PositionsLike, spec: RopeSpec, length: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """Angles ``[..., T, rotary_dim/2]`` for the given positions."""
    pos = torch.as_tensor(positions, dtype=dtype, device=device)
    if pos.ndim == 0:
        pos = pos.expand(length)
    if pos.shape[-1] != length:
        raise BadInputError(f"got {pos.shape[-1]} positions for {length} tokens")
    return pos[..., None] * spec.inv_freq_tensor(dtype, device)


def rotate(
    x: torch.Tensor,
    positions: PositionsLike,
    spec: RopeSpec,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Rotate every rotary pair of ``x [..., T, D]`` by ``positions * inv_freq`` (no scaling)."""
    require_one_spec(spec)
    if x.shape[-1] != spec.head_dim:
        raise BadInputError(f"keys have head_dim {x.shape[-1]}, the RoPE spec expects {spec.head_dim}")
    r = spec.rotary_dim
    theta = _angles(positions, spec, x.shape[-2], compute_dtype, x.device)
    cos, sin = theta.cos(), theta.sin()
    xr = x[..., :r].to(compute_dtype)
    if spec.pairing == "half":
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    out = out.to(x.dtype)
    if r == x.shape[-1]:
        return out
    return torch.cat((out, x[..., r:]), dim=-1)


def apply_rope(keys: torch.Tensor, positions: PositionsLike, spec: RopeSpec, **kw) -> torch.Tensor:
    """Pre-RoPE keys -> the post-RoPE keys the model caches at ``positions``."""
    out = rotate(keys, positions, spec, **kw)
    if spec.attention_scaling != 1.0:
        r = spec.rotary_dim
        out = torch.cat((out[..., :r] * spec.attention_scaling, out[..., r:]), dim=-1)
    return out


def remove_rope(keys: torch.Tensor, positions: PositionsLike, spec: RopeSpec, **kw) -> torch.Tensor:
    """Post-RoPE keys cached at ``positions`` -> the pre-RoPE keys (inverse of :func:`apply_rope`)."""
    out = rotate(keys, -torch.as_tensor(positions, device=keys.device), spec, **kw)
    if spec.attention_scaling != 1.0:
        r = spec.rotary_dim
        out = torch.cat((out[..., :r] / spec.attention_scaling, out[..., r:]), dim=-1)
    return out


def shift_keys(keys: torch.Tensor, delta: PositionsLike, spec: RopeSpec, **kw) -> torch.Tensor:
    """Post-RoPE keys at position p -> the keys at position p + delta (per token if ``delta`` is [T]).

    Raises :class:`~kvlab.errors.UnsupportedModelError` for RoPE types whose frequencies depend on the
    sequence length (dynamic NTK, longrope), where no rotation is exact.
    """
    spec.require_shift_exact("shifting cached keys")
    return rotate(keys, delta, spec, **kw)


def remove_rope_stacked(keys: torch.Tensor, positions: PositionsLike, rope: Rope, **kw) -> torch.Tensor:
    """:func:`remove_rope` on keys stacked by layer (``[layers, ..., T, D]``), each layer with its own
    RoPE (hybrid models); a layer without RoPE is returned as it is."""
    if isinstance(rope, RopeSpec):
        return remove_rope(keys, positions, rope, **kw)
    if keys.shape[0] != len(rope.layers):
        raise BadInputError(f"got keys of {keys.shape[0]} layers for a RoPE of {len(rope.layers)} layers")
    return torch.stack(
        [
            k if (s := rope.for_layer(i)) is None else remove_rope(k, positions, s, **kw)
            for i, k in enumerate(keys)
        ]
    )
