"""Perturbations and alignments: exact token rules, causality of truncation, de-rotation at layer 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.metrics.similarity import compare_caches
from kvlab.ops import perturb as P
from kvlab.ops.suffix import reprefill_rolled
from kvlab.policy import roll_amount

IDS = [5, 9, 3, 7, 3, 11, 2, 8, 4, 6, 10, 12, 1, 13, 14, 15]


def test_roll_count_ints_and_fractions():
    assert roll_amount(3, 10) == 3
    assert roll_amount(np.int64(9), 10) == 9
    assert roll_amount(0.25, 100) == 25
    assert roll_amount(0.01, 10) == 1  # at least one token
    assert roll_amount(0.99, 10) == 9  # leaves at least one token


@pytest.mark.parametrize("n", [0, -1, 10, 11, 0.0, 1.0, 1.5, -0.2, True])
def test_roll_count_rejects_out_of_range(n):
    with pytest.raises(BadInputError):
        roll_amount(n, 10)


@pytest.mark.parametrize("ids", [[], [7]])
def test_short_texts_rejected(ids):
    with pytest.raises(BadInputError):
        P.scramble_tokens(ids)


def test_token_rules():
    a, b = P.scramble_tokens(IDS, seed=1), P.scramble_tokens(IDS, seed=1)
    assert a == b and sorted(a) == sorted(IDS) and a != IDS
    assert P.scramble_tokens(IDS, seed=2) != a
    kept = P.scramble_tokens(IDS, seed=1, keep_first=2)
    assert kept[:2] == IDS[:2] and sorted(kept) == sorted(IDS)
    with pytest.raises(BadInputError):
        P.scramble_tokens(IDS, keep_first=len(IDS))


def test_alignments():
    al = P.align_roll(10, 3)
    assert al.idx_a.tolist() == list(range(3, 10)) and al.idx_b.tolist() == list(range(7))
    tr = P.align_truncate(10, 3)
    assert tr.idx_a.tolist() == tr.idx_b.tolist() == list(range(7))
    assert len(P.align_positions(5, 8)) == 5
    assert al.drop_first(1).idx_a.tolist() == list(range(4, 10))
    with pytest.raises(BadInputError):
        al.drop_first(len(al))
    with pytest.raises(BadInputError):
        P.align_roll(10, 10)


def test_align_tokens_matches_identities_once():
    scr = P.scramble_tokens(IDS, seed=3)
    al = P.align_tokens(IDS, scr)
    assert len(al) == len(IDS)
    assert all(IDS[i] == scr[j] for i, j in zip(al.idx_a, al.idx_b, strict=True))
    assert len(set(al.idx_a.tolist())) == len(IDS)
    rolled = IDS[4:]
    al = P.align_tokens(IDS, rolled)
    assert all(IDS[i] == rolled[j] for i, j in zip(al.idx_a, al.idx_b, strict=True))
    with pytest.raises(BadInputError):
        P.align_tokens([1, 2], [3, 4])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_truncate_equals_reprefill_by_causality(tiny_model, family):
    model = tiny_model(family)
    snap = model.prefill(IDS, all_logits=False).snapshot
    before = snap.clone()
    cut = P.truncate(snap, 5)
    ref = model.prefill(IDS[:-5], all_logits=False).snapshot
    assert cut.seq_len == ref.seq_len == len(IDS) - 5
    for a, b in zip(cut.keys + cut.values, ref.keys + ref.values, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    c = compare_caches(snap, ref, *(lambda al: (al.idx_a, al.idx_b))(P.align_truncate(len(IDS), 5)))
    assert np.abs(c.cos_k - 1).max() < 1e-6 and np.abs(c.cos_v - 1).max() < 1e-6
    for a, b in zip(snap.keys, before.keys, strict=True):  # the original is untouched
        assert torch.equal(a, b)


def test_reprefilled_roll_derotation_is_exact_at_layer_0(tiny_model):
    """Layer-0 keys depend only on the token: correctly de-rotated they match exactly after a roll."""
    model = tiny_model("llama")
    snap = model.prefill(IDS, all_logits=False).snapshot
    rolled = reprefill_rolled(model, snap, 4)  # the exact reference of a roll: the rolled text re-run
    ref = model.prefill(IDS[4:], all_logits=False).snapshot
    assert rolled.token_list() == IDS[4:] and rolled.positions.tolist() == list(range(len(IDS) - 4))
    torch.testing.assert_close(rolled.keys[1], ref.keys[1])
    al = P.align_roll(len(IDS), 4)
    c = compare_caches(snap, rolled, al.idx_a, al.idx_b, derotate="correct")
    b = compare_caches(snap, rolled, al.idx_a, al.idx_b, derotate="buggy")
    assert np.abs(c.cos_k_derotated[0] - 1).max() < 1e-5
    assert np.abs(c.cos_v[0] - 1).max() < 1e-5
    assert c.cos_k[0].mean() < 0.999  # the raw keys did move
    np.testing.assert_allclose(
        b.cos_k_derotated, b.cos_k, atol=1e-12
    )  # same rotation on both sides: no change


def test_roll_and_scramble_errors(tiny_model):
    model = tiny_model("llama")
    snap = model.prefill(IDS, all_logits=False).snapshot
    with pytest.raises(BadInputError):
        reprefill_rolled(model, snap, len(IDS))
    with pytest.raises(BadInputError):
        P.truncate(snap, 1.5)
    one = model.prefill([3], all_logits=False).snapshot
    with pytest.raises(BadInputError):
        P.truncate(one, 1)
    scr = P.scramble(model, snap, seed=0)
    assert sorted(scr.token_list()) == sorted(IDS)
    with pytest.raises(BadInputError):
        P.unrelated(model, [])
