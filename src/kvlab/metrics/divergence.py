"""How far a compressed cache moves the model's next-token distributions from the full cache's.

Inputs are two logit tensors ``[T, vocab]`` for the same tokens: ``full`` (the reference P, from the
uncompressed cache) and ``other`` (Q, from a compressed one). Per token:

* ``KL(P || Q) = sum_v p_v (log p_v - log q_v)`` in nats, computed in float64 on the tensors' device
  from ``log_softmax`` (so adding a constant to a row of logits changes nothing). Terms with
  ``p_v = 0`` (a ``-inf`` logit in the reference) contribute 0, never NaN; a token the reference
  allows and the other forbids (``q_v = 0 < p_v``) gives ``+inf``, the true value.
* top-1 agreement: 1.0 where both argmaxes are the same token, else 0.0 (ties go to the lowest index,
  ``torch.argmax``'s rule, on both sides).

:func:`divergence_summary` turns per-trial values into means with intervals over trials (the
independent samples): a bootstrap for KL (:func:`kvlab.metrics.stats.bootstrap_ci`), a Wilson interval
for top-1 agreement, a proportion (:func:`kvlab.metrics.stats.wilson_ci`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.errors import BadInputError
from kvlab.metrics.stats import Interval, bootstrap_ci, wilson_ci


def _check_pair(full: torch.Tensor, other: torch.Tensor) -> None:
    if full.shape != other.shape:
        raise BadInputError(
            f"logits must have the same shape, got {tuple(full.shape)} and {tuple(other.shape)}"
        )
    if full.ndim < 1 or full.shape[-1] < 1:
        raise BadInputError(f"logits need a vocabulary axis, got shape {tuple(full.shape)}")


def token_kl(full: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(P_full || P_other)`` in nats, ``[...]`` for logits ``[..., vocab]`` (float64).

    Exactly 0 for identical rows; never negative; ``+inf`` where the reference gives a token mass the
    other rules out. A row whose logits are all ``-inf`` is no distribution and is refused.
    """
    _check_pair(full, other)
    device = full.device
    lp = torch.log_softmax(full.to(device=device, dtype=torch.float64), dim=-1)
    lq = torch.log_softmax(other.to(device=device, dtype=torch.float64), dim=-1)
    if torch.isnan(lp).any() or torch.isnan(lq).any():
        raise BadInputError("logits hold NaN, or a row whose every logit is -inf (no distribution)")
    p = lp.exp()
    # p * (lp - lq), with 0 where p == 0 (lp = -inf: the difference would be nan or -inf there)
    terms = torch.where(p > 0, p * (lp - lq), torch.zeros((), dtype=torch.float64, device=device))
    return terms.sum(-1).clamp_min(0.0)


def top1_agreement(full: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per token, 1.0 where both logit rows have the same argmax, else 0.0 (float64, ``[...]``)."""
    _check_pair(full, other)
    return (full.argmax(dim=-1) == other.to(full.device).argmax(dim=-1)).to(torch.float64)


@dataclass(frozen=True)
class Divergence:
    """One comparison of two runs over the same ``n`` tokens: the mean per-token KL and top-1 agreement."""

    kl: float
    top1: float
    n: int

    def to_json(self) -> dict:
        return {"kl": self.kl, "top1": self.top1, "n": self.n}


def compare_logits(full: torch.Tensor, other: torch.Tensor) -> Divergence:
    """Mean per-token KL (nats) and top-1 agreement of ``other`` against the reference ``full`` ``[T, vocab]``."""
    kl = token_kl(full, other)
    agree = top1_agreement(full, other)
    if kl.numel() == 0:
        raise BadInputError("no tokens to compare")
    return Divergence(float(kl.mean()), float(agree.mean()), int(kl.numel()))


@dataclass(frozen=True)
class DivergenceSummary:
    """Per-trial divergences summarised: mean KL (bootstrap interval) and mean top-1 agreement (Wilson)."""

    kl: Interval
    top1: Interval

    def to_json(self) -> dict:
        return {"kl": self.kl.to_json(), "top1": self.top1.to_json()}


def divergence_summary(
    items: Sequence[Divergence], *, confidence: float = 0.95, seed: int = 0
) -> DivergenceSummary:
    """Means over trials (each trial one sample): KL with a percentile bootstrap interval, top-1 agreement
    with a Wilson interval; fewer than 5 trials give values without an interval (see
    :class:`~kvlab.metrics.stats.Interval`)."""
    if not items:
        raise BadInputError("no divergences to summarise")
    return DivergenceSummary(
        kl=bootstrap_ci([d.kl for d in items], confidence=confidence, seed=seed),
        top1=wilson_ci([d.top1 for d in items], confidence=confidence),
    )
