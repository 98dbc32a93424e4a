"""Eviction policies: exact budgets, forced sinks, clear errors, exact query capture and repacking."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.policy.evict import (
    H2O,
    POLICIES,
    TOVA,
    KeyNorm,
    LearnedPolicy,
    RandomPolicy,
    SlidingWindow,
    SnapKV,
    StreamingLLM,
    attention_weights,
    budget_slots,
    evict,
    keep_indices,
    kept_per_head,
    make_policy,
    observe,
    repack,
)
from kvlab.policy.evict.learned import load_weights, save_weights, train_evictor
from tests.layers_ref import logits_after_layers
from tests.tolerances import assert_forward_close

BUILT_IN = [SlidingWindow, StreamingLLM, H2O, SnapKV, TOVA, KeyNorm, RandomPolicy, LearnedPolicy]
ALL = list(POLICIES.values())  # every registered policy gets the generic tests, added ones too


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_2x64):
    return tiny_llama_2x64


@pytest.fixture(scope="module")
def obs(tiny):
    return observe(tiny, torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(0)).tolist())


def test_captured_queries_reproduce_eager_attention(tiny):
    ids = list(range(3, 40))
    o = observe(tiny, ids)
    with tiny.eager_attention():
        ref = tiny.prefill(ids, output_attentions=True)
    for layer in range(o.num_layers):
        mine = attention_weights(o.queries[layer], o.snapshot.keys[layer], o.scaling, torch.arange(len(ids)))
        assert torch.allclose(mine, ref.attentions[layer], atol=1e-5)


@pytest.mark.parametrize("policy_cls", ALL, ids=lambda c: c.name)
@pytest.mark.parametrize("keep", [0.1, 0.5, 1.0])
def test_every_policy_keeps_exactly_the_budget(obs, policy_cls, keep):
    ev = evict(obs, policy_cls(), keep=keep)
    n = max(1, round(keep * 60))
    assert _n_keep(ev) == n and ev.seq_len == 60 and torch.equal(ev.positions, obs.snapshot.positions)
    assert all(torch.equal(a, b) for a, b in zip(ev.keys, obs.snapshot.keys, strict=True))  # untouched
    keys, values, slots_per_layer = kept_per_head(ev)
    for k, v, slots in zip(keys, values, slots_per_layer, strict=True):
        assert k.shape == (1, 2, n, 16) and v.shape == (1, 2, n, 16)
        for row in slots[0]:
            assert len(set(row.tolist())) == n and row.tolist() == sorted(row.tolist())


@pytest.mark.parametrize("policy_cls", ALL, ids=lambda c: c.name)
def test_an_observation_scores_once_and_evicts_alike(tiny, policy_cls):
    """Scores derived from an Observation are kept on it (H2O's T x T attention once per context, not once per
    budget); every budget evicted after that equals the same eviction from a fresh observation."""
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    shared = observe(tiny, ids)
    for keep in (0.75, 0.5, 0.25):
        ev = evict(shared, policy_cls(), keep=keep)
        fresh = evict(observe(tiny, ids), policy_cls(), keep=keep)
        assert all(torch.equal(a, b) for a, b in zip(ev.valid, fresh.valid, strict=True))
    views = shared.views
    assert len(views) == shared.num_layers and evict(shared, policy_cls(), keep=0.5) is not None
    assert shared.views is views and all(a is b for a, b in zip(shared.views, views, strict=True))
    if policy_cls is H2O:  # derived once: the memo is what the next eviction reads
        assert all("received" in v.__dict__ for v in views)


@pytest.mark.parametrize("policy_cls", ALL, ids=lambda c: c.name)
def test_sinks_are_always_kept_when_asked(obs, policy_cls):
    ev = evict(obs, policy_cls(sinks=3), keep=0.1)
    for valid in ev.valid:
        assert bool(valid[..., :3].all())


def snapkv_reference_scores(attentions, kv_heads: int, w: int) -> torch.Tensor:
    """SnapKV as its reference code (and kvpress's SnapKVPress) computes it, written out from a model's eager
    attention ``[1, Hq, T, T]`` per layer: the last ``w`` queries' mean attention over the slots before the
    window, a mean over 5 neighbours with the zero padding counted, averaged over each KV head's query group;
    the window scored above everything (kept). ``[layers, kv_heads, T]`` in float64."""
    out = []
    for a in attentions:
        t = a.shape[-1]
        seen = a[0, :, t - w :, : t - w].double().mean(dim=1)  # [Hq, T - w]
        padded = torch.nn.functional.pad(seen, (2, 2))
        pooled = sum(padded[:, i : i + t - w] for i in range(5)) / 5
        per_kv = pooled.view(kv_heads, -1, t - w).mean(dim=1)
        out.append(torch.nn.functional.pad(per_kv, (0, w), value=float(per_kv.max()) + 1))
    return torch.stack(out)


def test_snapkv_keeps_the_slots_of_snapkvs_reference_algorithm(tiny):
    ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    t, w, n_keep = len(ids), 8, 30
    with tiny.eager_attention():
        attn = tiny.prefill(ids, output_attentions=True).attentions
    ev = evict(observe(tiny, ids), SnapKV(window=w, observe=w), n_keep=n_keep)
    ref = snapkv_reference_scores(attn, ev.keys[0].shape[1], w)
    for layer in range(len(attn)):
        for h in range(ref.shape[1]):
            want = ref[layer, h].topk(n_keep).indices.sort().values.tolist()
            assert want[-w:] == list(range(t - w, t))
            assert ev.valid[layer][0, h].nonzero().flatten().tolist() == want, (layer, h)


def test_kept_keys_are_the_original_keys(obs):
    ev = evict(obs, SnapKV(), keep=0.5)
    keys, _, slots_per_layer = kept_per_head(ev)
    for layer, (k, slots) in enumerate(zip(keys, slots_per_layer, strict=True)):
        for h in range(2):
            assert torch.equal(k[0, h], obs.snapshot.keys[layer][0, h, slots[0, h]])


def test_window_policy_keeps_the_most_recent():
    scores = SlidingWindow().score(type("V", (), {"seq_len": 10, "keys": torch.zeros(1, 2, 10, 4)})())
    assert keep_indices(scores, 4)[0, 0].tolist() == [6, 7, 8, 9]
    assert keep_indices(scores, 4, sinks=2)[0, 1].tolist() == [0, 1, 8, 9]


def test_budgets_outside_the_range_are_refused(obs):
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(BadInputError, match=r"\(0, 1\]"):
            evict(obs, TOVA(), keep=bad)
    for bad in (0, 61):
        with pytest.raises(BadInputError, match="n_keep"):
            evict(obs, TOVA(), n_keep=bad)
    with pytest.raises(BadInputError, match="exactly one budget"):
        budget_slots(10)
    with pytest.raises(BadInputError, match="sinks"):
        evict(obs, StreamingLLM(sinks=8), n_keep=4)
    with pytest.raises(BadInputError, match="queries"):
        evict(obs.snapshot, SnapKV(), keep=0.5)
    with pytest.raises(BadInputError, match="unknown eviction policy"):
        make_policy("lru")
    assert _n_keep(evict(obs.snapshot, KeyNorm(), keep=0.5)) == 30  # key-only policies need no queries


def _n_keep(ev) -> int:
    """Slots every layer and head of an evicted (masked) snapshot holds (they all hold the same)."""
    counts = torch.stack([m.sum(-1) for m in ev.valid])
    assert bool((counts == counts.flatten()[0]).all())
    return int(counts.flatten()[0])


def test_full_budget_reproduces_uncompressed_logits_kept_and_repacked(tiny, obs):
    cont = [5, 6, 7, 8]
    ref = tiny.forward(cont, past=obs.snapshot).logits
    ev = evict(obs, H2O(), keep=1.0)
    assert ev.is_masked and ev.held_slots == obs.snapshot.held_slots and ev.next_position == 60
    for name, past in (("keep", ev), ("repack", repack(ev))):
        got = tiny.forward(cont, past=past).logits
        assert_forward_close(got, ref, tiny, what=f"logits ({name})")


def test_evicted_snapshot_runs_like_its_compacted_slots(tiny, obs):
    """The masked snapshot's forward equals a forward over only the kept slots (an independent path)."""
    ev = evict(obs, SnapKV(), keep=0.4)
    keys, values, slots = kept_per_head(ev)
    assert keys[0].shape[-2] == _n_keep(ev) == 24 and ev.held_nbytes * 100 // ev.nbytes == 40
    cont = [5, 6, 7, 8]
    want = logits_after_layers(tiny, keys, values, cont, ev.next_position)
    assert_forward_close(tiny.forward(cont, past=ev).logits, want, tiny, what="masked vs compacted")
    # the hidden slots' contents do not matter
    noisy = ev.replace(
        keys=tuple(k.masked_fill(~m[..., None], 1e3) for k, m in zip(ev.keys, ev.valid, strict=True))
    )
    assert torch.equal(tiny.forward(cont, past=noisy).logits, tiny.forward(cont, past=ev).logits)


def test_repack_rotates_keys_to_contiguous_positions(obs):
    ev = evict(obs, StreamingLLM(), keep=0.25)
    rp = repack(ev)
    n = _n_keep(ev)
    assert not rp.is_masked and rp.seq_len == n and rp.next_position == n and rp.provenance == "repositioned"
    assert torch.equal(rp.positions, torch.arange(n))
    # Re-rotating back to the original positions recovers the kept keys (exact up to float rounding).
    from kvlab.rope.ops import shift_keys

    keys, _, slots = kept_per_head(ev)
    for k0, k1, idx in zip(keys, rp.keys, slots, strict=True):
        back = shift_keys(k1, ev.positions[idx] - torch.arange(n), obs.snapshot.rope)
        assert torch.allclose(back, k0, atol=1e-5)
    # StreamingLLM keeps the same slots in every head: the packed slots' tokens are known
    assert bool((rp.token_ids >= 0).all())


def test_learned_policy_weights_load_and_round_trip(tiny, obs, tmp_path):
    weights = load_weights()  # the packaged file
    assert weights.w1.shape[0] == 8
    assert _n_keep(evict(obs, LearnedPolicy(), keep=0.5)) == 30
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    trained, report = train_evictor(tiny, [ids[:100], ids[100:]], context=80, future=20, steps=20)
    path = save_weights(trained, tmp_path / "w.json")
    again = load_weights(str(path))
    x = torch.randn(5, 8)
    assert torch.allclose(again.predict(x), trained.predict(x), atol=1e-6)
    assert report["test_rows"] > 0 and set(report) >= {"test_spearman", "test_spearman_received_only"}
    with pytest.raises(BadInputError, match="train-evictor"):
        load_weights(str(tmp_path / "missing.json"))
    assert set(POLICIES) == {c.name for c in BUILT_IN} | {"random_sinks", "kvzip"}  # + the one-file methods


def _qk_normed_model(family: str):
    """A tiny random model whose attention normalises its queries before RoPE, its norm weights randomised
    (their init, ones or zeros, would hide a norm applied without its weight)."""
    from transformers import Olmo2Config, Qwen3Config

    from kvlab.model.random import tiny_random_model
    from tests.conftest import config_path

    small = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    config = {
        "qwen3": lambda: Qwen3Config(head_dim=16, **small),  # q_norm per head, on [B, T, H, D]
        "olmo2": lambda: Olmo2Config(**small),  # q_norm over the whole projection, before the head split
        "gemma3": lambda: config_path("gemma3"),  # q_norm per head, on [B, H, T, D]; a sliding layer of 64
    }[family]()
    h = tiny_random_model(config)
    with torch.no_grad():
        for name, p in h.model.named_parameters():
            if "q_norm" in name:
                p.uniform_(0.5, 1.5)
    return h


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "gemma3"])
def test_captured_queries_reproduce_eager_attention_under_a_query_norm(family):
    h = _qk_normed_model(family)
    ids = list(range(3, 40))  # within Gemma's sliding window: every layer attends to every earlier token
    o = observe(h, ids)
    with h.eager_attention():
        ref = h.prefill(ids, output_attentions=True)
    for layer in range(o.num_layers):
        mine = attention_weights(o.queries[layer], o.snapshot.keys[layer], o.scaling, torch.arange(len(ids)))
        assert torch.allclose(mine, ref.attentions[layer], atol=1e-5), (family, layer)
