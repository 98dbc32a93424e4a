"""Orthogonal rotations per head and the 1-bit residual sketch (QJL-style).

A rotation ``R [D, D]`` (``R @ R.T = I``) leaves every inner product unchanged, ``(R q)·(R k) = q·k``,
but spreads a few large channels over all of them, so a scalar quantizer sees flat groups without
outliers. Rotations are regenerated from a seed, so they cost no stored bytes.

The sketch stores ``sign(S r)`` for a Gaussian ``S [m, D]`` and ``|r|`` of a residual ``r``; then
``sqrt(pi/2) / m * |r| * S.T @ sign(S r)`` is an unbiased estimate of ``r`` (Gaussian rows ``s``
satisfy ``E[s sign(s·r)] = sqrt(2/pi) r / |r|``), so ``q · (k_hat + r_hat)`` is unbiased for ``q·k``.

Both are drawn on the host from a seeded CPU generator (the same matrices on every device) and cached
per device they are asked for, so a cache on ``cuda`` rotates with a ``cuda`` matrix.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from kvlab.errors import BadInputError


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64, device="cpu")
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


@lru_cache(maxsize=64)
def rotation_matrix(
    dim: int, kind: str = "hadamard", seed: int = 0, heads: int = 1, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[heads, dim, dim]`` float64 orthogonal matrices on ``device``, one per head (random signs x
    Hadamard, or Haar)."""
    if torch.device(device) != torch.device("cpu"):
        return rotation_matrix(dim, kind, seed, heads).to(device)
    gen = torch.Generator().manual_seed(seed)
    if kind == "hadamard":
        if dim & (dim - 1):
            raise BadInputError(
                f"a Hadamard rotation needs a power-of-two head_dim, got {dim}; use rotation='random'"
            )
        signs = torch.randint(0, 2, (heads, dim), generator=gen, device="cpu").double() * 2 - 1
        return _hadamard(dim)[None] * signs[:, None, :]  # H @ diag(signs): orthogonal
    if kind == "random":
        g = torch.randn(heads, dim, dim, generator=gen, dtype=torch.float64, device="cpu")
        q, r = torch.linalg.qr(g)
        return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    raise BadInputError(f"unknown rotation '{kind}'; choose hadamard or random")


@lru_cache(maxsize=64)
def _as_float(rot: torch.Tensor) -> torch.Tensor:
    return rot.float()


def rotate_heads(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` -> ``x @ R_h.T`` per head (float32)."""
    return torch.matmul(x.float(), _as_float(rot).transpose(-1, -2))


def unrotate_heads(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate_heads`: ``y @ R_h`` per head (float32)."""
    return torch.matmul(x.float(), _as_float(rot))


@lru_cache(maxsize=16)
def sketch_matrix(dim: int, m: int, seed: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[m, dim]`` standard Gaussian projection for the residual sketch, on ``device``."""
    if torch.device(device) != torch.device("cpu"):
        return sketch_matrix(dim, m, seed).to(device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, dim, generator=gen, dtype=torch.float32, device="cpu")


def sketch_estimate(signs: torch.Tensor, norms: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """Unbiased residual estimate from ``signs [..., m]`` (+-1) and ``norms [...]``: ``[..., dim]``."""
    m = proj.shape[0]
    return math.sqrt(math.pi / 2) / m * norms[..., None] * (signs @ proj)
