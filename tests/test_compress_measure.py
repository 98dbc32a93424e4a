"""kvlab.policy.measure.continuation_quality: NLL and divergence to the full cache, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.policy.measure import continuation_nll, continuation_quality

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hand_kl_top1(full: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """Mean over rows of sum_v p_v (log p_v - log q_v) and argmax agreement, in float64 numpy."""

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(full.astype(np.float64)), log_softmax(other.astype(np.float64))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return float(kl.mean()), float((full.argmax(-1) == other.argmax(-1)).mean())


def test_continuation_quality_matches_a_hand_computation(tiny_llama_2x64):
    h = tiny_llama_2x64
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    context, cont = ids[:28], ids[28:]
    snap = h.prefill(context, all_logits=False).snapshot
    full = h.forward(cont, past=snap).logits
    # the "compressed" context: its first 12 tokens dropped (a truncated cache)
    other = h.forward(cont, past=h.prefill(context[12:], all_logits=False).snapshot).logits

    token_nll, d = continuation_quality(other, cont, full)
    assert np.array_equal(token_nll, continuation_nll(other, cont))
    kl, top1 = _hand_kl_top1(full.numpy(), other.numpy())
    assert d.n == len(cont)
    assert d.kl == pytest.approx(kl, rel=1e-9, abs=1e-12) and d.kl > 0
    assert d.top1 == top1
    own_nll, own = continuation_quality(full, cont, full)  # the full cache against itself
    assert own.kl == 0.0 and own.top1 == 1.0
    assert np.array_equal(own_nll, continuation_nll(full, cont))
