"""Tolerances for the tests, derived from the dtype and the computation (kvlab.metrics.tolerance), never
read off one machine's last digit.

Two mathematically equal forward passes (chunked vs one-shot prefill, a cache from the store vs a fresh
prefill, a RoPE shift vs a prefill at the offset) differ by rounding that grows with the dtype's epsilon,
the depth and the size of the values compared; a wrong cache (a dropped token, a shifted position,
another model) moves them by O(1). ``forward_tol`` is that rounding bound with headroom.
"""

from __future__ import annotations

import torch

from kvlab.metrics.tolerance import HEADROOM, elementwise_tolerance, forward_tolerance

__all__ = [
    "HEADROOM",
    "assert_forward_close",
    "forward_tol",
    "max_abs_diff",
    "rope_angle_tol",
    "elementwise_tol",
]


def _flat(tensors) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out: list[torch.Tensor] = []
    for t in tensors:
        out += _flat(t)
    return out


def _scale(tensors) -> float:
    return max(float(t.detach().abs().max()) for t in _flat(tensors) if t.numel())


def forward_tol(handle, reference, *, dtype: torch.dtype | None = None, layers: int | None = None) -> float:
    """Bound on ``|a - b|`` for outputs of two equal forward passes of ``handle`` (logits, or the K/V of
    every layer), at the magnitude of ``reference`` (a tensor or a list of tensors)."""
    return forward_tolerance(
        dtype or handle.dtype, num_layers=layers or handle.facts.num_layers, scale=_scale(reference)
    )


def rope_angle_tol(dtype: torch.dtype, max_position: int, reference, *, headroom: float = 2.0) -> float:
    """Bound from RoPE angles computed as ``position * inv_freq`` in ``dtype`` (fp32 in the models'
    rotary code): an angle up to ``p`` radians is off by at most eps * p / 2, and rotating a value of
    magnitude |k| by a wrong angle moves it by at most that angle times |k|; two rotations (e.g. the
    shifted cache and the prefill at the offset) double it. The default headroom is over that worst
    case, not a first-order estimate, so it is small."""
    return headroom * torch.finfo(dtype).eps * max(int(max_position), 1) * max(_scale(reference), 1.0)


def elementwise_tol(dtype: torch.dtype, reference, *, ops: int = 1) -> float:
    """Bound after ``ops`` rounded elementwise operations on values of the magnitude of ``reference``."""
    return elementwise_tolerance(dtype, ops=ops, scale=_scale(reference))


def max_abs_diff(actual, expected) -> float:
    a, b = _flat(actual), _flat(expected)
    assert len(a) == len(b), f"{len(a)} tensors vs {len(b)}"
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape, f"shape {tuple(x.shape)} vs {tuple(y.shape)}"
    return max(
        (float((x.detach().double() - y.detach().double()).abs().max()) for x, y in zip(a, b, strict=True)),
        default=0.0,
    )


def assert_forward_close(
    actual, expected, handle, *, what: str = "outputs", tol: float | None = None
) -> None:
    """``actual`` equals ``expected`` (tensors or lists of tensors of ``handle``'s forward pass) within the
    derived rounding bound; the message gives the difference, the bound and how it was derived."""
    bound = forward_tol(handle, expected) if tol is None else tol
    err = max_abs_diff(actual, expected)
    assert err <= bound, (
        f"{what}: max |diff| {err:.3g} > tolerance {bound:.3g} "
        f"({handle.dtype}, {handle.facts.num_layers} layers, scale {_scale(expected):.3g}, headroom {HEADROOM:g})"
    )
