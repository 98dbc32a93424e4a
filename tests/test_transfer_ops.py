"""Transfer and transplant operations: exact equivalences on tiny random models, one check on the real model."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, IncompatibleCacheError
from kvlab.ops.crossmodel import apply_cache_map, fit_cache_map, transplant
from kvlab.ops.transfer import (
    concat_caches,
    drop_prefix,
    hybrid_kv,
    layer_indices,
    replace_span,
    reposition,
    swap_slots,
    transfer_layers,
)
from kvlab.rope.ops import apply_rope, remove_rope

torch.manual_seed(0)
IDS = torch.randint(5, 500, (40,)).tolist()


def _max_diff(a: KVSnapshot, b: KVSnapshot) -> float:
    return max(
        float((x - y).abs().max()) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True)
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cache_then_feed_equals_prefill_random(tiny_model, family):
    m = tiny_model(family)
    a, b = IDS[:25], IDS[25:]
    injected = m.extend(m.prefill(a).snapshot, b)
    full = m.prefill(a + b)
    assert float((injected.logits - full.logits[len(a) :]).abs().max()) <= 1e-4
    assert injected.snapshot.positions.tolist() == list(range(len(a) + len(b)))


@pytest.mark.real_model
def test_cache_then_feed_equals_prefill_bundled(smollm):
    a = smollm.encode("Hello, my name is Lyra and I live in Seattle.")
    b = smollm.encode(" What is my name? My name is")
    injected = smollm.extend(smollm.prefill(a).snapshot, b)
    full = smollm.prefill(a + b)
    assert float((injected.logits - full.logits[len(a) :]).abs().max()) <= 1e-4
    assert int(injected.logits[-1].argmax()) == int(full.logits[-1].argmax())


def test_reposition_of_a_shifted_prefill_is_the_plain_prefill(tiny_model):
    # RoPE attention depends only on relative positions, so prefill at start 7 moved back to 0 == prefill at 0.
    m = tiny_model("llama")
    shifted = m.prefill(IDS[:20], start_position=7).snapshot
    plain = m.prefill(IDS[:20]).snapshot
    moved = reposition(shifted, 0)
    assert moved.positions.tolist() == list(range(20))
    assert _max_diff(moved, plain) <= 1e-4
    assert shifted.positions[0] == 7  # input untouched


def test_concat_caches_places_second_after_first(tiny_model):
    m = tiny_model("qwen2")
    a, b = m.prefill(IDS[:12]).snapshot, m.prefill(IDS[12:20]).snapshot
    both = concat_caches(a, b)
    assert both.positions.tolist() == list(range(20))
    assert both.token_list() == IDS[:20]
    # B's slots equal B prefilled on its own at positions 12.. (no view of A), not prefill(A+B).
    alone_at_12 = m.prefill(IDS[12:20], start_position=12).snapshot
    assert _max_diff(both.slice(12), alone_at_12) <= 1e-4
    joint = m.prefill(IDS[:20]).snapshot
    assert _max_diff(both.slice(12), joint.slice(12)) > 1e-3


def test_drop_prefix_with_and_without_sinks(tiny_model):
    m = tiny_model("llama")
    full = m.prefill(IDS[:30]).snapshot
    no_sink = drop_prefix(full, 10)
    assert no_sink.positions.tolist() == list(range(20)) and no_sink.token_list() == IDS[10:30]
    sinks = drop_prefix(full, 10, sinks=4)
    assert sinks.token_list() == IDS[:4] + IDS[10:30]
    assert sinks.positions.tolist() == list(range(24))
    assert torch.equal(sinks.values[1][:, :, 4:], full.values[1][:, :, 10:])
    expect = full.select(list(range(10, 30))).with_positions(torch.arange(4, 24))
    assert torch.allclose(sinks.keys[1][:, :, 4:], expect.keys[1], atol=1e-6)
    with pytest.raises(BadInputError):
        drop_prefix(full, 5, sinks=6)


def test_replace_span_shifts_the_tail(tiny_model):
    m = tiny_model("llama")
    rec, don = m.prefill(IDS[:10]).snapshot, m.prefill(IDS[20:24]).snapshot
    out = replace_span(rec, 3, 5, don)
    assert out.seq_len == 12 and out.positions.tolist() == list(range(12))
    assert out.token_list() == IDS[:3] + IDS[20:24] + IDS[5:10]
    assert torch.equal(out.values[0][:, :, 3:7], don.values[0])
    tail = rec.slice(5).with_positions(torch.arange(7, 12))
    assert torch.allclose(out.keys[1][:, :, 7:], tail.keys[1], atol=1e-6)
    with pytest.raises(BadInputError):
        replace_span(rec, 5, 5, don)


def test_transfer_layers_and_bad_ranges(tiny_model):
    m = tiny_model("llama", layers=4)
    rec, don, fill = (m.prefill(IDS[i : i + 12]).snapshot for i in (0, 12, 24))
    out = transfer_layers(rec, don, "1-2")
    for i in range(4):
        src = don if i in (1, 2) else rec
        assert torch.equal(out.values[i], src.values[i]) and torch.equal(out.keys[i], src.keys[i])
    filled = transfer_layers(rec, don, [0], fill=fill)
    assert torch.equal(filled.values[3], fill.values[3]) and torch.equal(filled.values[0], don.values[0])
    assert layer_indices("0, 2-3", 4) == (0, 2, 3)
    for bad in ("0-4", "-1", [7], "3-1", "", "x"):
        with pytest.raises(BadInputError):
            transfer_layers(rec, don, bad)
    with pytest.raises(IncompatibleCacheError):
        transfer_layers(rec, m.prefill(IDS[:9]).snapshot, "0")
    aligned = transfer_layers(rec, m.prefill(IDS[:9]).snapshot, "0", align=(range(9), range(9)))
    assert aligned.seq_len == 9


def test_hybrid_kv_and_roll_alignment(tiny_model):
    m = tiny_model("qwen2")
    orig, rolled = m.prefill(IDS[:20]).snapshot, m.prefill(IDS[5:20]).snapshot
    with pytest.raises(IncompatibleCacheError):
        hybrid_kv(orig, rolled)
    mix = hybrid_kv(orig, rolled, align=(range(5, 20), range(15)))
    assert mix.positions.tolist() == list(range(5, 20))  # positions travel with the keys
    assert torch.equal(mix.values[1], rolled.values[1])
    assert torch.equal(mix.keys[1], orig.keys[1][:, :, 5:])
    other = tiny_model("llama")
    with pytest.raises(IncompatibleCacheError):
        hybrid_kv(orig, other.prefill(IDS[:20]).snapshot)


def test_sink_only_swap_touches_one_slot_and_not_the_input(tiny_model):
    m = tiny_model("llama")
    base, donor = m.prefill(IDS[:16]).snapshot, m.prefill(IDS[16:32], start_position=3).snapshot
    before = base.clone()
    k_only = swap_slots(base, donor, which="k")
    assert _max_diff(base, before) == 0.0
    for i in range(base.num_layers):
        assert torch.equal(k_only.values[i], base.values[i])
        assert torch.equal(k_only.keys[i][:, :, 1:], base.keys[i][:, :, 1:])
        # the donor's key moved from position 3 to position 0
        expect = donor.slice(0, 1).with_positions([0]).keys[i]
        assert torch.allclose(k_only.keys[i][:, :, :1], expect, atol=1e-6)
    v_only = swap_slots(base, donor, [0], which="v")
    assert torch.equal(v_only.values[0][:, :, 0], donor.values[0][:, :, 0])
    assert torch.equal(v_only.keys[0], base.keys[0])
    with pytest.raises(BadInputError):
        swap_slots(base, donor, which="q")  # type: ignore[arg-type]
    with pytest.raises(BadInputError):
        swap_slots(base, donor, [16])


def test_transplant_between_random_models(tiny_model):
    from kvlab.model.random import tiny_random_model

    a = tiny_model("llama")
    b = tiny_random_model(a.config, seed=1, layers=2, head_dim=16)
    b.config.vocab_size = a.config.vocab_size
    snap = a.prefill(IDS[:12]).snapshot
    moved = transplant(snap, a, b)
    assert moved.fingerprint == b.fingerprint and torch.equal(moved.keys[0], snap.keys[0])
    out = b.extend(moved, IDS[12:14])  # the receiver accepts it
    assert out.logits.shape[0] == 2
    with pytest.raises(IncompatibleCacheError):
        b.extend(snap, IDS[12:14])  # without transplant the receiver refuses
    wide = tiny_random_model(a.config, seed=2, layers=2, head_dim=32)
    with pytest.raises(IncompatibleCacheError, match="geometry"):
        transplant(snap, a, wide)
    other_vocab = tiny_random_model(a.config, seed=3, layers=2, head_dim=16, vocab=600)
    with pytest.raises(IncompatibleCacheError, match="token_ids"):
        transplant(snap, a, other_vocab)
    assert transplant(snap, a, other_vocab, token_ids=IDS[:12]).seq_len == 12


def test_ridge_map_recovers_an_exact_linear_relation(tiny_model):
    src = tiny_model("llama")
    long_ids = torch.randint(5, 500, (160,), generator=torch.Generator().manual_seed(1)).tolist()
    snaps = [src.prefill(long_ids[i : i + 40]).snapshot for i in (0, 40, 80, 120)]  # 120 rows > 32 features
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(src.facts.num_kv_heads * src.facts.head_dim, 3 * 8, generator=gen, dtype=torch.float64)

    def mapped(s: KVSnapshot) -> KVSnapshot:
        def lin(t: torch.Tensor, rope: bool) -> torch.Tensor:
            x = remove_rope(t[0].double(), s.positions, s.rope) if rope else t[0].double()
            y = (x.transpose(0, 1).flatten(1) @ w).reshape(s.seq_len, 3, 8).transpose(0, 1)
            return y[None]

        return KVSnapshot(
            keys=tuple(lin(k, True) for k in s.keys),
            values=tuple(lin(v, False) for v in s.values),
            token_ids=s.token_ids,
            positions=s.positions,
            rope=None,
            fingerprint="synthetic",
        )

    dst = [mapped(s) for s in snaps]
    cmap = fit_cache_map(snaps[:3], dst[:3], snaps[3:], dst[3:], alpha=1e-9)
    assert cmap.ev_k.min() > 0.999 and cmap.ev_v.min() > 0.999 and cmap.ev_k_identity is None
    other = [src.prefill(long_ids[i + 1 : i + 41]).snapshot for i in (0, 40, 80, 119)]
    noisy = fit_cache_map(snaps[:3], other[:3], snaps[3:], other[3:], alpha=1e-3)
    assert noisy.ev_v.mean() < 0.99  # a different text is not a linear function of this one
    with pytest.raises(IncompatibleCacheError):
        fit_cache_map(snaps[:1], [src.prefill(IDS[:9]).snapshot], snaps[3:], dst[3:])


def test_apply_cache_map_same_geometry_identity(tiny_model):
    m = tiny_model("llama")
    long_ids = torch.randint(5, 500, (160,), generator=torch.Generator().manual_seed(2)).tolist()
    snaps = [m.prefill(long_ids[i : i + 40]).snapshot for i in (0, 40, 80, 120)]
    cmap = fit_cache_map(snaps[:3], snaps[:3], snaps[3:], snaps[3:], alpha=1e-9)
    assert cmap.ev_k_identity is not None and cmap.ev_k_identity.min() == pytest.approx(1.0)
    out = apply_cache_map(cmap, snaps[3], m)
    assert _max_diff(out, snaps[3]) < 1e-3
    rot = apply_rope(
        remove_rope(snaps[3].keys[0].double(), snaps[3].positions, m.rope), snaps[3].positions, m.rope
    )
    assert torch.allclose(rot.float(), snaps[3].keys[0], atol=1e-5)
