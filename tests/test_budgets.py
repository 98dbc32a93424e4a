"""Shared budgets (kvlab.policy.evict.budgets) and the forward on a ragged cache (run masked)."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.policy.evict import H2O, SnapKV, evict, kept_per_head, observe
from kvlab.policy.evict.budgets import (
    ada_indices,
    allocate,
    evict_ragged,
    pyramid_counts,
)
from tests.layers_ref import logits_after_layers
from tests.tolerances import assert_forward_close


@pytest.fixture(scope="module")
def obs(tiny_llama_2x64, one_torch_thread):
    ids = torch.randint(0, 512, (1, 96), generator=torch.Generator().manual_seed(3))
    return observe(tiny_llama_2x64, ids)


def _scores(h=4, t=50, seed=0, b=1):
    g = torch.Generator().manual_seed(seed)
    # heads of very different spread, so AdaKV moves budget between them
    scale = torch.tensor([0.1, 1.0, 5.0, 20.0][:h])[None, :, None]
    return torch.rand(b, h, t, generator=g) * scale


@pytest.mark.parametrize("n_keep", [1, 7, 25, 50])
def test_ada_sums_to_the_layer_budget_with_floors_and_protected_slots(n_keep):
    s = _scores()
    sinks, window = (1, 3) if n_keep >= 4 else (0, 0)
    idx = ada_indices(s, n_keep, sinks, window, alpha_safeguard=0.2)
    counts = [int(i.shape[-1]) for i in idx]
    assert sum(counts) == n_keep * 4
    floor = max(1, int(0.2 * n_keep))
    for h, i in enumerate(idx):
        row = i[0].tolist()
        assert row == sorted(set(row)) and all(0 <= x < 50 for x in row)
        assert len(row) >= floor
        assert set(range(sinks)) <= set(row) and set(range(50 - window, 50)) <= set(row)
        # the safeguard (kvpress: the head's own top-`floor`, its protected slots counting first) is kept
        free = s[0, h].clone()
        free[:sinks] = float("inf")
        free[50 - min(window, floor - sinks) :] = float("inf")
        assert set(torch.topk(free, floor).indices.tolist()) <= set(row)
    if 1 < n_keep < 50:
        assert len(set(counts)) > 1  # heads of different spread keep different counts


def test_ada_keeps_the_top_scores_over_heads():
    s = _scores()
    idx = ada_indices(s, 10, 0, 0, alpha_safeguard=0.0)
    kept = torch.zeros(4, 50, dtype=torch.bool)
    for h, i in enumerate(idx):
        kept[h, i[0]] = True
    # every kept score is at least every dropped one
    assert s[0][kept].min() >= s[0][~kept].max()


@pytest.mark.parametrize(
    ("layers", "length", "n_keep", "protected"),
    [(30, 1024, 512, 36), (2, 96, 48, 16), (5, 10, 3, 2), (7, 100, 100, 4), (30, 16, 8, 0), (30, 40, 2, 0)],
)
def test_pyramid_sums_to_the_total_and_falls_from_bottom_to_top(layers, length, n_keep, protected):
    c = pyramid_counts(layers, length, n_keep, protected=protected)
    assert sum(c) == layers * n_keep
    assert all(max(protected, 1) <= x <= length for x in c)  # every layer keeps at least one slot
    assert all(a >= b for a, b in zip(c, c[1:], strict=False))
    if n_keep < length:
        assert c[0] > c[-1]


def test_pyramid_follows_kvpress_where_kvpress_has_a_pyramid():
    # kvpress: max_capacity = window + q_len * keep; min = (max_capacity - window) / beta; max = 2 * n - min
    q_len, n, window, layers, beta = 4096, 2048, 64, 30, 20
    lo = n / beta
    hi = 2 * n - lo
    hi, lo = (q_len - window, 2 * n - (q_len - window)) if hi >= q_len - window else (hi, lo)
    steps = (hi - lo) / (layers - 1)
    kvpress = [round(hi - i * steps) for i in range(layers)]
    ours = pyramid_counts(layers, q_len, n, protected=window)
    assert max(abs(a - b) for a, b in zip(ours, kvpress, strict=True)) <= 1  # rounding only
    # kvpress's own cap (q_len - window) at 1024 tokens, keep 0.5, window 64: 926 down to 64
    c = pyramid_counts(30, 990, 495, protected=64)
    assert (c[0], c[-1], sum(c)) == (926, 64, 30 * 495)


def test_impossible_budgets_are_clear_errors():
    s = _scores()
    with pytest.raises(BadInputError, match="protected"):
        pyramid_counts(4, 100, 10, protected=20)
    with pytest.raises(BadInputError, match="cannot keep"):
        ada_indices(s, 0)
    with pytest.raises(BadInputError, match="cannot keep"):
        ada_indices(s, 51)
    with pytest.raises(BadInputError, match="sinks"):
        ada_indices(s, 3, sinks=4)
    with pytest.raises(BadInputError, match="per sequence"):
        ada_indices(_scores(b=2), 10)
    with pytest.raises(BadInputError, match="heads must be"):
        allocate([s], 5, heads="median")
    with pytest.raises(BadInputError, match="protected"):
        allocate([s, s], 5, sinks=2, window=8, layers="pyramid")


def test_ragged_cache_holds_fewer_bytes_than_padded_and_masked(obs):
    rc = evict_ragged(obs, H2O(), keep=0.5, heads="ada")
    counts = rc.counts
    assert [sum(c) for c in counts] == [48 * 2, 48 * 2]  # the layer budget is kept, shared unevenly
    assert any(len(set(c)) > 1 for c in counts)
    assert rc.nbytes < rc.padded_nbytes < rc.masked_nbytes
    per_slot = 2 * 16 * 4  # K and V, head dim 16, float32
    assert rc.nbytes == rc.held_slots * per_slot
    assert rc.masked_nbytes == 2 * 2 * 96 * per_slot
    uniform = evict(obs, H2O(), keep=0.5)
    assert rc.nbytes == uniform.held_nbytes  # same budget, same memory: the heads share it
    pyr = evict_ragged(obs, SnapKV(), keep=0.5, layers="pyramid")
    c = pyr.counts
    assert sum(sum(x) for x in c) == 2 * 2 * 48 and c[0][0] > c[1][0] and len(set(c[0])) == 1


def test_uniform_ragged_cache_equals_evict(obs):
    ev = evict(obs, SnapKV(), keep=0.5)
    rc = evict_ragged(obs, SnapKV(), keep=0.5)
    keys, _, slots = kept_per_head(ev)
    for layer in range(2):
        for h in range(2):
            assert torch.equal(rc.keys[layer][h], keys[layer][:, h])
            assert torch.equal(rc.slots[layer][h], slots[layer][:, h])
    assert rc.nbytes == rc.padded_nbytes == ev.held_nbytes
    masked = rc.masked(obs.snapshot)  # the same masked snapshot as the uniform eviction
    assert all(torch.equal(a, b) for a, b in zip(masked.valid, ev.valid, strict=True))


def test_ragged_forward_equals_each_heads_own_slots(tiny_llama_2x64, obs):
    """A ragged cache run masked computes attention over each head's own kept slots: layers keeping
    different counts equal an independent compacted forward; hidden slots' contents never matter; one
    more slot hidden in one head changes the result (the mask is read per head)."""
    h = tiny_llama_2x64
    pyr = evict_ragged(obs, SnapKV(), keep=0.5, layers="pyramid")  # heads uniform within a layer
    keys = tuple(torch.stack(layer, dim=1) for layer in pyr.keys)
    values = tuple(torch.stack(layer, dim=1) for layer in pyr.values)
    assert keys[0].shape[-2] != keys[1].shape[-2]
    want = logits_after_layers(h, keys, values, [9], pyr.next_position)  # one token: no causal mask needed
    got = h.forward([9], past=pyr.masked(obs.snapshot)).logits
    assert_forward_close(got, want, h, what="pyramid run masked vs compacted")
    rc = evict_ragged(obs, H2O(), keep=0.5, heads="ada", layers="pyramid")
    counts = rc.counts
    assert any(len(set(c)) > 1 for c in counts) and counts[0] != counts[1]
    masked = rc.masked(obs.snapshot)
    assert masked.held_nbytes == rc.nbytes and masked.held_slots == rc.held_slots
    question = [9, 8, 7]
    a = h.forward(question, past=masked).logits
    # hidden slots' contents do not matter
    noisy = masked.replace(
        keys=tuple(k.masked_fill(~m[..., None], 1e3) for k, m in zip(masked.keys, masked.valid, strict=True)),
        values=tuple(
            v.masked_fill(~m[..., None], -1e3) for v, m in zip(masked.values, masked.valid, strict=True)
        ),
    )
    assert torch.equal(a, h.forward(question, past=noisy).logits)
    # dropping one more slot of one head changes the answer: the mask is read per head
    valid = [m.clone() for m in masked.valid]
    first = int(valid[1][0, 1].nonzero()[1])
    valid[1][0, 1, first] = False
    fewer = masked.replace(valid=tuple(valid))
    assert not torch.equal(a, h.forward(question, past=fewer).logits)
    # the model is switched back: a plain forward afterwards is plain SDPA
    assert h.model.config._attn_implementation == "sdpa"


def test_eval_runs_shared_budgets(tiny_llama_2x64):
    from kvlab.eval.run import run_trial
    from kvlab.eval.specs import parse_cache_specs
    from kvlab.eval.tasks import make_trial
    from kvlab.model.handle import ModelHandle
    from tests.test_eval_tasks import HAYSTACK, WordTokenizer

    handle = ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")
    specs = parse_cache_specs(["h2o,keep=0.5", "h2o,keep=0.5,heads=ada", "snapkv,keep=0.5,layers=pyramid"])
    trial = make_trial("niah_single", handle, 128, 0, HAYSTACK)
    rows = {r["spec"]: r for r in run_trial(handle, trial, specs, max_new_tokens=4)}
    uni, ada, pyr = (
        rows["h2o,keep=0.5"],
        rows["h2o,keep=0.5,heads=ada"],
        rows["snapkv,keep=0.5,layers=pyramid"],
    )
    assert ada["kv_bytes"] == uni["kv_bytes"]  # same total budget
    assert ada["kv_bytes_padded"] >= ada["kv_bytes"] and ada["kv_bytes_masked"] > ada["kv_bytes"]
    assert pyr["kept_per_layer"][0] > pyr["kept_per_layer"][-1]
    for r in (ada, pyr):
        assert r["kld"] >= 0 and 0 <= r["top1"] <= 1
