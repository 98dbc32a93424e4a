"""Comparing next-token distributions: KL, Jensen-Shannon, cosine, top-k overlap, NLL.

Inputs are logits ``[..., vocab]`` (any float dtype); everything is computed in float64 so tiny
divergences (1e-6) are not rounding noise.
"""

from __future__ import annotations

import math

import torch


def _logp(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) in nats per row, P the reference."""
    lp, lq = _logp(p_logits), _logp(q_logits)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


def js_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in nats per row (symmetric, at most ln 2)."""
    lp, lq = _logp(p_logits), _logp(q_logits)
    m = torch.logsumexp(torch.stack((lp, lq)), dim=0) - math.log(2.0)
    return (0.5 * (lp.exp() * (lp - m)).sum(-1) + 0.5 * (lq.exp() * (lq - m)).sum(-1)).clamp_min(0.0)


def logit_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int = 10) -> torch.Tensor:
    """Fraction of the top-k tokens of ``a`` that are also in the top-k of ``b``, per row."""
    ta, tb = a.topk(k, dim=-1).indices, b.topk(k, dim=-1).indices
    return (ta[..., :, None] == tb[..., None, :]).any(-1).double().mean(-1)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (nats) of ``targets [T]`` under ``logits [T, vocab]``, per token (on the
    logits' device: targets made on the host are moved there)."""
    idx = targets.to(device=logits.device, dtype=torch.long)
    return -_logp(logits).gather(-1, idx[..., None]).squeeze(-1)


def perplexity(token_nll: torch.Tensor) -> float:
    return float(torch.exp(token_nll.double().mean()))
