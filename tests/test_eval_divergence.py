"""kvlab.metrics.divergence: exact values of per-token KL and top-1 agreement."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.metrics.divergence import (
    Divergence,
    compare_logits,
    divergence_summary,
    token_kl,
    top1_agreement,
)


def test_identical_logits_have_zero_kl_exactly():
    x = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(token_kl(x, x), torch.zeros(7, dtype=torch.float64))
    assert compare_logits(x, x) == Divergence(0.0, 1.0, 7)


def test_kl_is_never_negative_and_float64():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(20, 30, generator=g), torch.randn(20, 30, generator=g)
    kl = token_kl(a, b)
    assert kl.dtype == torch.float64 and kl.shape == (20,)
    assert (kl >= 0).all() and (kl > 0).all()


def test_kl_matches_a_hand_computed_value_on_three_tokens():
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    # 0.5 ln 2 + 0.25 ln 1 + 0.25 ln 0.5 = 0.25 ln 2
    expected = 0.25 * math.log(2.0)
    got = token_kl(p.log()[None], q.log()[None])
    assert got.item() == pytest.approx(expected, rel=1e-12, abs=0)
    # the other direction: 0.25 ln 0.5 + 0 + 0.5 ln 2 = 0.25 ln 2 as well (a symmetric pair)
    assert token_kl(q.log()[None], p.log()[None]).item() == pytest.approx(expected, rel=1e-12)
    r = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    hand = sum(pi * math.log(pi / ri) for pi, ri in zip(p.tolist(), r.tolist(), strict=True))
    assert token_kl(p.log()[None], r.log()[None]).item() == pytest.approx(hand, rel=1e-12)


def test_adding_a_constant_to_logits_changes_nothing():
    g = torch.Generator().manual_seed(2)
    a, b = (
        torch.randn(5, 11, generator=g, dtype=torch.float64),
        torch.randn(5, 11, generator=g, dtype=torch.float64),
    )
    base = token_kl(a, b)
    shifted = token_kl(a + 100.0, b - 37.5)
    assert torch.allclose(base, shifted, rtol=1e-10, atol=1e-12)
    assert torch.equal(top1_agreement(a, b), top1_agreement(a + 3.0, b + 9.0))


def test_minus_inf_logits_give_no_nan():
    inf = float("inf")
    p = torch.tensor([[0.0, -inf, 1.0], [2.0, 0.0, -inf]])
    q = torch.tensor([[0.0, -inf, 1.0], [2.0, 1.0, -inf]])
    kl = token_kl(p, q)
    assert not torch.isnan(kl).any()
    assert kl[0].item() == 0.0 and kl[1].item() > 0
    # the reference allows a token the other rules out: the divergence is infinite (its true value)
    assert token_kl(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -inf]])).item() == inf
    # the reverse is finite: P rules out what Q allows
    assert math.isfinite(token_kl(torch.tensor([[0.0, -inf]]), torch.tensor([[0.0, 0.0]])).item())


def test_top1_agreement_on_constructed_rows():
    full = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0], [1.0, 1.0, 0.0]])
    other = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [9.0, 0.0, 10.0], [1.0, 1.0, 0.0]])
    assert top1_agreement(full, other).tolist() == [1.0, 0.0, 1.0, 1.0]
    d = compare_logits(full, other)
    assert d.top1 == 0.75 and d.n == 4


def test_bad_inputs_are_refused():
    with pytest.raises(BadInputError):
        token_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(BadInputError):
        token_kl(torch.full((1, 3), float("-inf")), torch.zeros(1, 3))
    with pytest.raises(BadInputError):
        compare_logits(torch.zeros(0, 3), torch.zeros(0, 3))
    with pytest.raises(BadInputError):
        divergence_summary([])


def test_summary_has_intervals_from_five_trials():
    pairs = [(0.1, 0.9), (0.2, 0.8), (0.3, 1.0), (0.05, 0.7), (0.15, 0.85)]
    items = [Divergence(k, t, 10) for k, t in pairs]
    s = divergence_summary(items)
    assert s.kl.value == pytest.approx(0.16) and s.kl.n == 5
    assert s.kl.low < s.kl.value < s.kl.high
    assert s.top1.value == pytest.approx(0.85) and s.top1.low < 0.85 < s.top1.high <= 1
    four = divergence_summary(items[:4])
    assert four.kl.value == pytest.approx(0.1625) and not four.kl.has_interval
    assert not four.top1.has_interval
    assert set(s.to_json()) == {"kl", "top1"}


def test_top1_agreement_at_every_trial_keeps_a_wilson_interval():
    s = divergence_summary([Divergence(0.0, 1.0, 10)] * 8)
    assert s.top1.value == 1.0 and s.top1.high == 1.0 and 0.6 < s.top1.low < 1.0  # not a collapsed [1, 1]
