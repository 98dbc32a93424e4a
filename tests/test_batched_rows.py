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
