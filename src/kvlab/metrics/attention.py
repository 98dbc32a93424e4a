"""Comparing attention rows of two runs over aligned tokens, with the attention sink kept apart.

A query row is a distribution over the keys it can see. Two runs are compared on aligned queries
(query ``queries_a[q]`` of run A against ``queries_b[q]`` of run B) restricted to aligned keys
(``keys_a[k]`` against ``keys_b[k]``). Under a roll by n, A's slots n..T-1 align with B's 0..T-n-1.

Why sink-aware: without a BOS token, the first slot of every run is an attention sink that draws
most of the mass in most layers. After a roll, B's first slot is a *new* sink while the same token
in A drew little attention, so a row comparison over aligned keys is dominated by the sink moving
(the thread's "cos ≈ 0.41 at every roll"), not by the content. So every comparison is reported
twice: over all aligned keys, and over aligned keys without the first ``exclude_first`` of them,
each row renormalised over what is left. The sink mass (attention on slot 0 of each run) is
reported on its own.

Jensen-Shannon divergences are in nats (at most ln 2 ≈ 0.693), computed in float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvlab.errors import BadInputError
from kvlab.metrics.similarity import select_along

IndexLike = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class AttentionComparison:
    """Per aligned query, each ``[layers, heads, queries]`` float64 (NaN where a row has no mass left).

    ``cos`` / ``js`` / ``topk``: rows over all aligned keys; ``cos_rest`` / ``js_rest`` / ``topk_rest``:
    the same without the first ``exclude_first`` aligned keys, rows renormalised. ``sink_a`` / ``sink_b``:
    attention on slot 0 of each run. ``first_aligned_a`` / ``first_aligned_b``: attention on the first
    aligned key (for a roll: the token that is B's new sink, seen from A and from B).
    ``aligned_mass_a`` / ``aligned_mass_b``: share of each row on the aligned keys (A's rest went to
    keys B does not have, e.g. the rolled-off tokens and A's sink).
    """

    cos: np.ndarray
    js: np.ndarray
    topk: np.ndarray
    cos_rest: np.ndarray
    js_rest: np.ndarray
    topk_rest: np.ndarray
    sink_a: np.ndarray
    sink_b: np.ndarray
    first_aligned_a: np.ndarray
    first_aligned_b: np.ndarray
    aligned_mass_a: np.ndarray
    aligned_mass_b: np.ndarray
    exclude_first: int
    k: int

    def arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        """Every array field by name (for ``ExperimentResult.arrays``)."""
        return {
            f"{prefix}{f.name}": getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }


def stack_attentions(attentions: Sequence[torch.Tensor] | torch.Tensor | np.ndarray) -> torch.Tensor:
    """Per-layer ``[batch, heads, T_q, T_k]`` tensors (as ``Forward.attentions``) -> ``[layers, heads, T_q, T_k]``
    of the first row.

    A 4-D tensor or array is taken as already stacked.
    """
    if isinstance(attentions, np.ndarray):
        attentions = torch.from_numpy(attentions)  # device: a numpy array lives on the host
    if isinstance(attentions, torch.Tensor):
        if attentions.ndim != 4:
            raise BadInputError(
                f"stacked attentions must be [layers, heads, T_q, T_k], got {tuple(attentions.shape)}"
            )
        return attentions
    if not attentions:
        raise BadInputError("no attention maps: run the model with output_attentions=True")
    shapes = {tuple(a.shape) for a in attentions}
    if len(shapes) != 1 or len(next(iter(shapes))) != 4:
        raise BadInputError(
            f"expected per-layer [batch, heads, T_q, T_k] attention maps of one shape, got {shapes}"
        )
    return torch.stack([a[0] for a in attentions])


def _index(idx: IndexLike | None, default: int, name: str, bound: int) -> torch.Tensor:
    t = (  # indices are host bookkeeping (checked here); select_along moves them to the maps
        torch.arange(default, device="cpu")
        if idx is None
        else torch.as_tensor(np.asarray(idx), dtype=torch.long, device="cpu").reshape(-1)
    )
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= bound):
        raise BadInputError(f"{name} must lie in [0, {bound}), got {int(t.min())}..{int(t.max())}")
    return t


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    num = (a * b).sum(-1)
    den = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, math.nan))


def _renorm(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = p.sum(-1, keepdim=True)
    return p / s.clamp_min(1e-300), s.squeeze(-1) > 0


def _js(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """JS divergence (nats) between rows of non-negative weights, each renormalised first.

    Uses JS = H(m) - (H(p) + H(q)) / 2 with m = (p + q) / 2 (three entropies, 0 log 0 = 0).
    """
    p, ok_p = _renorm(p)
    q, ok_q = _renorm(q)

    def entropy(x: torch.Tensor) -> torch.Tensor:
        return -torch.special.xlogy(x, x).sum(-1)

    js = (entropy(0.5 * (p + q)) - 0.5 * (entropy(p) + entropy(q))).clamp(0.0, math.log(2.0))
    return torch.where(ok_p & ok_q, js, torch.full_like(js, math.nan))


def _topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Share of A's k most-attended keys among B's k most-attended; NaN where fewer than k keys carry mass.

    Only the ranking matters, so it runs in the maps' own dtype (no float64 copy).
    """
    if a.shape[-1] < k:
        return torch.full(a.shape[:-1], math.nan, dtype=torch.float64, device=a.device)
    ta, tb = a.topk(k, dim=-1).indices, b.topk(k, dim=-1).indices
    share = (ta[..., :, None] == tb[..., None, :]).any(-1).double().mean(-1)
    enough = ((a > 0).sum(-1) >= k) & ((b > 0).sum(-1) >= k)
    return torch.where(enough, share, torch.full_like(share, math.nan))


def compare_attention_rows(
    att_a: Sequence[torch.Tensor] | torch.Tensor | np.ndarray,
    att_b: Sequence[torch.Tensor] | torch.Tensor | np.ndarray,
    keys_a: IndexLike | None = None,
    keys_b: IndexLike | None = None,
    queries_a: IndexLike | None = None,
    queries_b: IndexLike | None = None,
    *,
    exclude_first: int = 1,
    k: int = 5,
) -> AttentionComparison:
    """Compare aligned attention rows of two runs (neither input is modified).

    ``att_a`` / ``att_b``: per-layer ``[batch, heads, T_q, T_k]`` (``Forward.attentions``, batch row 0
    used) or stacked ``[layers, heads, T_q, T_k]``. ``keys_*``: aligned key slots (default: all, equal
    counts). ``queries_*``: aligned query rows (default: the aligned key slots when the maps are
    square, as after a prefill). ``exclude_first``: how many leading aligned keys the ``*_rest``
    metrics drop. ``k``: top-k overlap size.
    """
    a, b = stack_attentions(att_a), stack_attentions(att_b)
    if a.shape[:2] != b.shape[:2]:
        raise BadInputError(f"layers/heads differ: {tuple(a.shape[:2])} vs {tuple(b.shape[:2])}")
    ka = _index(keys_a, a.shape[-1], "keys_a", a.shape[-1])
    kb = _index(keys_b, b.shape[-1], "keys_b", b.shape[-1])
    if ka.numel() != kb.numel() or ka.numel() == 0:
        raise BadInputError(
            f"need the same non-zero number of aligned keys on both sides, got {ka.numel()} and {kb.numel()}"
        )
    if queries_a is None and a.shape[-2] != a.shape[-1]:
        raise BadInputError("attention maps are not square: pass queries_a/queries_b explicitly")
    if queries_b is None and b.shape[-2] != b.shape[-1]:
        raise BadInputError("attention maps are not square: pass queries_a/queries_b explicitly")
    qa = ka if queries_a is None else _index(queries_a, 0, "queries_a", a.shape[-2])
    qb = kb if queries_b is None else _index(queries_b, 0, "queries_b", b.shape[-2])
    if qa.numel() != qb.numel() or qa.numel() == 0:
        raise BadInputError(
            f"need the same non-zero number of aligned queries, got {qa.numel()} and {qb.numel()}"
        )
    if not 0 <= exclude_first < ka.numel():
        raise BadInputError(f"exclude_first must lie in [0, {ka.numel()}), got {exclude_first}")
    if k < 1:
        raise BadInputError(f"k must be >= 1, got {k}")
    per_layer: list[dict[str, torch.Tensor]] = []
    for layer in range(a.shape[0]):  # one layer at a time: [heads, Q, K] float64 stays small
        rows_a32 = select_along(a[layer], 1, qa)  # [H, Q, T_k], the maps' own dtype
        rows_b32 = select_along(b[layer], 1, qb)
        pa32, pb32 = select_along(rows_a32, 2, ka), select_along(rows_b32, 2, kb)  # [H, Q, K]
        rows_a, rows_b = rows_a32[..., 0].double(), rows_b32[..., 0].double()  # the sink column
        pa, pb = pa32.double(), pb32.double()
        ra, rb = pa[..., exclude_first:], pb[..., exclude_first:]
        per_layer.append(
            {
                "cos": _cosine(pa, pb),
                "js": _js(pa, pb),
                "topk": _topk_overlap(pa32, pb32, k),
                "cos_rest": _cosine(ra, rb),
                "js_rest": _js(ra, rb),
                "topk_rest": _topk_overlap(pa32[..., exclude_first:], pb32[..., exclude_first:], k),
                "sink_a": rows_a,
                "sink_b": rows_b,
                "first_aligned_a": pa[..., 0],
                "first_aligned_b": pb[..., 0],
                "aligned_mass_a": pa.sum(-1),
                "aligned_mass_b": pb.sum(-1),
            }
        )
    out = {n: torch.stack([d[n] for d in per_layer]).numpy() for n in per_layer[0]}
    return AttentionComparison(**out, exclude_first=exclude_first, k=k)


def roll_alignment(seq_len: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Aligned slots after dropping the first ``n`` of ``seq_len`` tokens: (n..T-1 of A, 0..T-n-1 of B)."""
    if not 0 <= n < seq_len:
        raise BadInputError(f"a roll by {n} needs 0 <= n < context length {seq_len}")
    return np.arange(n, seq_len), np.arange(seq_len - n)
