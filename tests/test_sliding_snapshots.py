"""Models with sliding-window layers past their window: kvlab's snapshots hold every token in every layer
and each sliding layer's window is applied on the slots' positions (:mod:`kvlab.hf.slot_mask`), so a
prefill, an extension, a live batch and a greedy answer equal what transformers computes with its own
sliding cache (which drops the old slots). Gemma-3 (a sliding layer of 64 beside a full one) and Mistral
(every layer sliding, a window of 16)."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.model.facts import load_config_file
from kvlab.model.random import tiny_random_model
from tests.conftest import config_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")
N = 150  # past every window


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def slid(request):
    cfg = load_config_file(config_path(request.param))
    if request.param == "mistral":
        cfg.sliding_window = 16
    return tiny_random_model(cfg)


def _ids(n: int = N) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def _theirs(h, ids: list[int]) -> torch.Tensor:
    """transformers' own forward (its own sliding cache), float32 logits ``[n, vocab]``."""
    with torch.no_grad():
        return h.model(torch.tensor([ids])).logits[0].float()


def test_a_prefill_past_the_window_holds_every_token_and_equals_transformers(slid):
    ids = _ids()
    f = slid.prefill(ids)
    assert all(k.shape[-2] == N for k in f.snapshot.keys)  # every layer, the sliding ones too
    torch.testing.assert_close(f.logits, _theirs(slid, ids), atol=1e-5, rtol=0)


def test_an_extension_and_a_live_batch_equal_one_prefill(slid):
    ids, ref = _ids(), None
    ref = _theirs(slid, ids)
    past = slid.prefill(ids[:100]).snapshot
    torch.testing.assert_close(slid.extend(past, ids[100:]).logits, ref[100:], atol=1e-5, rtol=0)
    with slid.live_rows([past, past], room=N) as live:
        both = live.feed(ids[100:])
        live.rewind(10)  # back, and again: the same slots rewritten in place
        again = live.feed(ids[110:])
    for row in (both[0], both[1]):
        torch.testing.assert_close(row, ref[100:], atol=1e-5, rtol=0)
    torch.testing.assert_close(again[0], ref[110:], atol=1e-5, rtol=0)


def test_a_greedy_answer_past_the_window_is_transformers_argmax_at_every_step(slid):
    ids = _ids(100)
    with slid.live_rows([slid.prefill(ids[:-1]).snapshot], room=50) as live:
        first = live.feed([ids[-1]])[:, -1]
        mine = live.greedy(first, 40)[0]
    theirs = _theirs(slid, ids + mine[:-1])[99:].argmax(-1).tolist()  # the answer teacher-forced
    assert mine == theirs and len(set(mine)) > 1


def test_a_window_counts_positions_not_slots(slid):
    """A past whose positions skip ahead (a context placed later): each query sees the slots within its
    window of *positions*, as one contiguous run of those positions would."""
    ids = _ids(60)
    window = max(w for w in (getattr(slid.config, "sliding_window", None), 16) if w)
    gap = window // 2
    past = slid.prefill(ids[:40]).snapshot
    later = slid.forward(ids[40:], past, positions=list(range(40 + gap, 60 + gap))).logits
    # the same tokens with every position shifted by the gap after slot 40: the reference puts a run of
    # ``gap`` filler slots there, hidden from every query, which a plain forward cannot do, so compare
    # against kvlab's masked-forward reference (its own per-layer-type masks)
    from kvlab.hf.masked import forward_masked

    positions = torch.tensor(list(range(40)) + list(range(40 + gap, 60 + gap)))
    visible = torch.ones(20, 60, dtype=torch.bool).tril(40)
    _, _, ref = forward_masked(slid, past, torch.tensor(ids[40:]), positions[40:], visible)
    torch.testing.assert_close(later, ref, atol=1e-5, rtol=0)


def test_attention_weights_past_the_window_equal_transformers_and_refuse_skipped_positions(slid):
    ids = _ids(80)
    with slid.eager_attention(), torch.no_grad():
        theirs = slid.model(torch.tensor([ids]), output_attentions=True).attentions
    mine = slid.prefill(ids, output_attentions=True).attentions
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    past = slid.prefill(ids[:40]).snapshot
    with pytest.raises(BadInputError, match="positions 0, 1, 2"):
        slid.forward(ids[40:], past, positions=list(range(50, 90)), output_attentions=True)


def test_an_evicted_past_on_a_sliding_model_is_still_refused(slid):
    from kvlab.policy.evict import KeyNorm, evict

    past = evict(slid.prefill(_ids()).snapshot, KeyNorm(), keep=0.5)
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        slid.forward([5, 6], past)
