"""Fast re-base of cached keys: one scalar RoPE shift for every token, in the cache's dtype.

:func:`kvlab.rope.ops.shift_keys` is the exact reference (float64 angles *and* float64 arithmetic,
per-token deltas, new tensors). A rolling cache's re-base is a special case that can be much cheaper:
every key moves by the same ``delta``, so

* cos/sin of ``delta * inv_freq`` are one ``[rotary_dim/2]`` pair per re-base, computed in float64
  (no large-angle error) and cast once to the keys' dtype;
* the multiply-adds run in that dtype (fp32 for the bundled model): three elementwise kernels out of
  place (``out = x * cos`` over whole keys, then one ``addcmul_`` per half) or five in place, with
  preallocated outputs and no temporaries;
* the keys are processed in chunks of tokens that fit in the L2 cache, so the kernels after the
  first read from cache rather than memory: the pass costs about one read and one write of the keys,
  like a clone (measured: ``benchmarks/results/rolling.md``).

Accuracy: the only error is fp32 rounding of ``x * cos - y * sin`` (a few ulps): measured against the
float64 reference the relative error is ~1e-7 (max ~5e-7) for any ``delta``, whereas computing the
angles in fp32 would cost ~1e-3 at ``|delta|`` in the thousands.

Shapes: ``x`` is ``[..., T, head_dim]`` (kvlab caches hold ``[batch, kv_heads, T, head_dim]``, often as
a strided slice of a larger buffer: views are fine).

Autograd: the preallocated outputs (``out=``) and the reused scratch buffer are what autograd refuses
(``out=`` ops are not differentiable; a scratch overwritten chunk after chunk would corrupt what the
backward pass saved), so where a gradient is wanted (grad mode on and ``x`` or ``out`` requiring one)
both functions compute the rotation out of place and write it with one differentiable copy.
"""

from __future__ import annotations

import functools

import torch

from kvlab.errors import BadInputError
from kvlab.rope.ops import require_one_spec
from kvlab.rope.spec import RopeSpec

# Elements of the input processed per chunk (256 Ki floats = 1 MiB): big enough that per-kernel
# overhead stays small, small enough that a 30-layer cache's passes do not stream it all from memory
# (measured on the bundled model: 16 Ki .. everything at once differ by <10% at W = 2,048).
CHUNK_ELEMENTS = 1 << 18


@functools.lru_cache(maxsize=16)
def _frequencies(
    inv_freq: tuple[float, ...], head_dim: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``inv_freq`` in float64 on ``device`` and ones for a partial rotary's pass-through dims (copied to
    the device once per spec, so a re-base computes its angles there without a host round trip)."""
    freq = torch.tensor(inv_freq, dtype=torch.float64, device="cpu").to(
        device
    )  # device: built on the host once
    ones = torch.ones(head_dim - 2 * len(inv_freq), dtype=torch.float64, device=device)
    return freq, ones


@functools.lru_cache(maxsize=64)
def _cos_sin(
    delta: int, inv_freq: tuple[float, ...], pairing: str, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cos_full [head_dim], sin [r/2], -sin [r/2]`` for ``delta * inv_freq`` (float64, then cast once).

    ``cos_full`` holds each pair's cosine at both members' dimensions and 1 at the pass-through
    dimensions of a partial rotary, so ``x * cos_full`` is one contiguous kernel over whole keys.
    Computed on ``device`` from its cached frequencies: a roll or re-base on a GPU never waits for a
    host-to-device copy (no synchronisation between decode steps).
    """
    freq, ones = _frequencies(inv_freq, head_dim, device)
    theta = float(delta) * freq
    cos, sin = theta.cos(), theta.sin()
    rot = torch.cat([cos, cos]) if pairing == "half" else cos.repeat_interleave(2)
    full = torch.cat([rot, ones])
    return full.to(dtype), sin.to(dtype), (-sin).to(dtype)


def _halves(t: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members of every rotary pair of ``t`` as views (``half``: i, i + r/2; interleaved: 2i, 2i+1)."""
    r = spec.rotary_dim
    if spec.pairing == "half":
        return t[..., : r // 2], t[..., r // 2 : r]
    return t[..., 0:r:2], t[..., 1:r:2]


def _chunks(x: torch.Tensor, *others: torch.Tensor):
    """Yield aligned chunks along the token axis (-2) of ``x`` and ``others``, ~CHUNK_ELEMENTS each."""
    per_token = max(1, x.numel() // max(1, x.shape[-2]))
    step = max(1, CHUNK_ELEMENTS // per_token)
    for a in range(0, x.shape[-2], step):
        yield (x[..., a : a + step, :], *(o[..., a : a + step, :] for o in others))


def _wants_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _rotated(x: torch.Tensor, delta: int, spec: RopeSpec) -> torch.Tensor:
    """A new tensor: ``x`` rotated by ``delta`` with differentiable ops only (the autograd path)."""
    cos_full, sin, nsin = _cos_sin(
        int(delta), spec.inv_freq, spec.pairing, spec.head_dim, x.dtype, str(x.device)
    )
    y = x * cos_full  # a fresh tensor: its halves may be updated in place, x is only read
    x1, x2 = _halves(x, spec)
    y1, y2 = _halves(y, spec)
    y1.addcmul_(x2, nsin)
    y2.addcmul_(x1, sin)
    return y


def _check(x: torch.Tensor, spec: RopeSpec) -> None:
    require_one_spec(spec)
    if x.shape[-1] != spec.head_dim:
        raise BadInputError(f"keys have head_dim {x.shape[-1]}, the RoPE spec expects {spec.head_dim}")
    if not x.is_floating_point():
        raise BadInputError(f"keys must be floating point, got {x.dtype}")


def rotate_by(x: torch.Tensor, delta: int, spec: RopeSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Keys ``[..., T, D]`` rotated by one integer ``delta`` for every token (a re-base), into ``out``.

    ``out`` (same shape and dtype, not overlapping ``x``; may be a strided view such as a slice of a
    larger buffer) receives the result; without it a new tensor is allocated. The caller checks that
    the RoPE is shift-exact (``spec.require_shift_exact``). See the module docstring for accuracy.
    """
    _check(x, spec)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise BadInputError(f"out has shape {tuple(out.shape)} {out.dtype}, keys {tuple(x.shape)} {x.dtype}")
    if _wants_grad(x, out):
        y = x.clone() if delta == 0 else _rotated(x, delta, spec)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty_like(x)
    if delta == 0:
        return out.copy_(x)
    cos_full, sin, nsin = _cos_sin(
        int(delta), spec.inv_freq, spec.pairing, spec.head_dim, x.dtype, str(x.device)
    )
    for xc, oc in _chunks(x, out):  # three kernels per chunk: out = x * cos; out1 -= x2 sin; out2 += x1 sin
        x1, x2 = _halves(xc, spec)
        o1, o2 = _halves(oc, spec)
        torch.mul(xc, cos_full, out=oc)
        o1.addcmul_(x2, nsin)
        o2.addcmul_(x1, sin)
    return out


def rotate_by_(x: torch.Tensor, delta: int, spec: RopeSpec) -> torch.Tensor:
    """In-place :func:`rotate_by`: ``x`` (which the caller owns; views are fine) is overwritten and returned.

    Uses one chunk-sized scratch buffer (~128 KiB), so a re-base of a cache's own storage allocates
    nothing proportional to the cache.
    """
    _check(x, spec)
    if delta == 0:
        return x
    if _wants_grad(x):  # rotate a copy (the backward pass keeps what it read), then write it back
        return x.copy_(_rotated(x.clone(), delta, spec))
    cos_full, sin, nsin = _cos_sin(
        int(delta), spec.inv_freq, spec.pairing, spec.head_dim, x.dtype, str(x.device)
    )
    cos = _halves(cos_full, spec)[0]
    scratch = None
    for (xc,) in _chunks(x):
        x1, x2 = _halves(xc, spec)
        if scratch is None:
            scratch = torch.empty(x1.shape, dtype=x.dtype, device=x.device)
        t = scratch[..., : x1.shape[-2], :]
        t.copy_(x1)
        x1.mul_(cos).addcmul_(x2, nsin)
        x2.mul_(cos).addcmul_(t, sin)
    return x
