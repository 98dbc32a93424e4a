"""SinksWindow, the one sinks + window policy, and roll_amount, the one reader of roll amounts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.errors import BadInputError
from kvlab.ops.suffix import roll
from kvlab.ops.transfer import drop_prefix
from kvlab.policy import SinksWindow, roll_amount
from kvlab.policy.evict import StreamingLLM, evict, kept_per_head
from kvlab.policy.quant.methods import split_plan
from tests.tolerances import assert_forward_close


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 12), st.one_of(st.none(), st.integers(0, 40)), st.integers(0, 60))
def test_kept_is_sinks_then_window(sinks, window, t):
    policy = SinksWindow(sinks, window)
    kept = policy.kept(t)
    assert kept == sorted(set(kept))  # in order, nothing twice
    assert kept[: min(sinks, t)] == list(range(min(sinks, t)))
    expected = t if window is None else min(t, sinks + window)
    assert len(kept) == expected
    if window is not None and t > sinks + window:
        assert kept[min(sinks, t) :] == list(range(t - window, t))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), st.integers(1, 40), st.integers(0, 120), st.integers(1, 16))
def test_overflow_fits_the_capacity_in_chunks(sinks, window, held, chunk):
    policy = SinksWindow(sinks, window)
    drop = policy.overflow(held, chunk)
    if held <= sinks + window:
        assert drop == 0
    else:
        assert held - drop <= sinks + window or drop == held - min(sinks, held)
        assert drop % chunk == 0 or drop == held - min(sinks, held)  # whole chunks, unless it runs out
        assert drop <= held - min(sinks, held)  # the sinks are never evicted


def test_dropping_and_roll_amount_refuse_impossible_rolls():
    with pytest.raises(BadInputError, match="drop at most 5"):
        SinksWindow.dropping(10, 6, 4)
    with pytest.raises(BadInputError):
        SinksWindow(-1, 3)
    assert roll_amount(20, 300) == 20 and roll_amount("20", 300) == 20
    assert roll_amount(0.25, 100) == 25 and roll_amount("25%", 100) == 25
    assert roll_amount(0.01, 10) == 1 and roll_amount(0.99, 10) == 9
    assert roll_amount(0.99, 10, sinks=4) == 5  # leaves one token after the sinks
    for bad in (0, 10, -1, 1.0, 0.0, "abc", "150%", True):
        with pytest.raises(BadInputError):
            roll_amount(bad, 10)
    with pytest.raises(BadInputError, match="with 4 sinks"):
        roll_amount(6, 10, sinks=4)


def test_one_layout_offline_online_and_in_eviction(tiny_model):
    """roll, drop_prefix, StreamingLLM eviction and the quantizers' split all keep SinksWindow's slots."""
    h = tiny_model("llama")
    snap = h.prefill(list(range(3, 43))).snapshot
    policy = SinksWindow.dropping(40, 10, 4)
    rolled = roll(snap, 10, 4)
    assert torch.equal(rolled.token_ids[0], snap.token_ids[0, policy.kept(40)])
    assert torch.equal(rolled.positions, torch.arange(30))
    again = policy.apply(snap)
    for a, b in zip(rolled.keys, again.keys, strict=True):
        assert torch.equal(a, b)
    prefix = drop_prefix(snap, 14, sinks=4)
    assert torch.equal(prefix.token_ids, rolled.token_ids)
    assert_forward_close(prefix.keys[1], rolled.keys[1], h)
    ev = evict(snap, StreamingLLM(sinks=4), n_keep=30)
    assert kept_per_head(ev)[2][0][0, 0].tolist() == policy.kept(40)
    assert split_plan(40, 4, 8, 1) == (4, 32) == SinksWindow(4, 8).bounds(40)


def test_apply_leaves_its_input_alone(tiny_model):
    h = tiny_model("qwen2")
    snap = h.prefill(list(range(3, 23))).snapshot
    before = [k.clone() for k in snap.keys]
    SinksWindow(2, 8).apply(snap)
    assert all(torch.equal(a, b) for a, b in zip(before, snap.keys, strict=True))
    with pytest.raises(BadInputError, match="batch 1"):
        SinksWindow(2, 8).apply(h.prefill([[3, 4, 5, 6], [7, 8, 9, 10]]).snapshot)
