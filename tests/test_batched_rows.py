"""Batched rows: stacking caches into one batch and decoding them together equals one-by-one runs."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import stack_rows
from kvlab.errors import BadInputError
from kvlab.ops.transfer import hybrid_kv

IDS_A = [5, 17, 3, 99, 42, 7, 8, 61, 12, 30, 4, 77]
IDS_B = [9, 2, 51, 33, 18, 64, 71, 6, 25, 40, 13, 88]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_forward_and_greedy_rows_equal_single_rows(tiny_model, family):
    model = tiny_model(family)
    a = model.prefill(IDS_A).snapshot
    b = model.prefill(IDS_B).snapshot
    mixed = hybrid_kv(a, b)  # K of A with V of B: a cache no prefill could make
    rows = [a, b, mixed]
    batch = stack_rows(rows)
    assert batch.batch_size == 3 and batch.seq_len == len(IDS_A)
    feed = [[1, 2, 3]] * 3
    out = model.forward(feed, batch)
    for r, snap in enumerate(rows):
        single = model.forward(feed[0], snap)
        torch.testing.assert_close(out.logits[r], single.logits, atol=1e-4, rtol=1e-4)
    got = model.generate_rows(out.snapshot, out.logits[:, -1], 6)
    for r, snap in enumerate(rows):
        single = model.forward(feed[0], snap)
        want = model.generate(single.snapshot, single.logits[-1], 6, stop_at_eos=False).token_ids
        assert got[r] == want
    # the inputs were not touched
    torch.testing.assert_close(rows[0].keys[0], model.prefill(IDS_A).snapshot.keys[0])


def test_stack_rows_refuses_different_lengths_or_positions(tiny_model):
    model = tiny_model("llama")
    a = model.prefill(IDS_A).snapshot
    with pytest.raises(BadInputError, match="equal lengths"):
        stack_rows([a, model.prefill(IDS_B[:-1]).snapshot])
    with pytest.raises(BadInputError, match="equal lengths"):
        stack_rows([a, a.with_positions(a.positions + 3)])
    with pytest.raises(BadInputError):
        stack_rows([])


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers, transformers' own
def test_live_rows_feed_rewind_and_greedy_equal_fresh_forwards(tiny_model, family):
    """A live batch (each row copied once, fed in place) gives the logits of a fresh forward over the
    stacked rows; rewinding to after the question and feeding other tokens equals feeding them first;
    greedy rows equal generate_rows; the rows' snapshots are not modified."""
    model = tiny_model(family)
    a, b = model.prefill(IDS_A).snapshot, model.prefill(IDS_B).snapshot
    rows = [a, b, hybrid_kv(a, b)]
    before = [r.keys[0].clone() for r in rows]
    question, forced = [1, 2, 3], [40, 41, 42, 43]
    fresh = model.forward([question + forced] * 3, stack_rows(rows)).logits
    with model.live_rows(rows, room=len(question) + 6) as live:
        asked = live.feed(question)
        torch.testing.assert_close(asked, fresh[:, : len(question)], atol=1e-5, rtol=1e-5)
        got = live.greedy(asked[:, -1], 6)
        assert live.fed.shape == (3, len(question) + 5)  # the last answer token is never fed
        live.rewind(len(question))
        tail = live.feed(forced)
        torch.testing.assert_close(tail, fresh[:, len(question) :], atol=1e-5, rtol=1e-5)
        live.rewind(len(question))  # and greedy again from the same point: the same answers
        assert live.greedy(asked[:, -1], 6) == got
        with pytest.raises(BadInputError, match="rewind"):
            live.rewind(len(question) + 7)
        with pytest.raises(BadInputError, match="rows"):
            live.feed([[1, 2]] * 2)
    out = model.forward([question] * 3, stack_rows(rows))
    assert got == model.generate_rows(out.snapshot, out.logits[:, -1], 6)
    assert all(torch.equal(r.keys[0], k) for r, k in zip(rows, before, strict=True))


def test_live_rows_keep_masked_slots_hidden(tiny_model):
    """Evicted (masked) rows beside the full one: the live batch's logits equal a forward over the stacked,
    masked batch, before and after a rewind."""
    from kvlab.policy.evict import H2O, TOVA, evict, observe

    model = tiny_model("llama")
    obs = observe(model, IDS_A)
    rows = [obs.snapshot, evict(obs, H2O(), keep=0.5), evict(obs, TOVA(), keep=0.25)]
    question, forced = [7, 8], [9, 10, 11]
    fresh = model.forward([question + forced] * 3, stack_rows(rows)).logits
    with model.live_rows(rows, room=8) as live:
        asked = live.feed(question)
        live.greedy(asked[:, -1], 4)
        live.rewind(len(question))
        got = torch.cat([asked, live.feed(forced)], dim=1)
    torch.testing.assert_close(got, fresh, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[1], got[0], atol=1e-3)  # the hidden slots changed the answer's logits
