"""Models with sliding-window layers past their window: kvlab's snapshots hold every token in every layer
and each sliding layer's window is applied on the slots' positions (:mod:`kvlab.hf.slot_mask`), so a
prefill, an extension, a live batch and a greedy answer equal what transformers computes with its own
sliding cache (which drops the old slots). Gemma-3 (a sliding layer of 64 beside a full one) and Mistral
(every layer sliding, a window of 16)."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
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


def test_windowed_attention_weights_of_an_observation_equal_transformers(slid):
    from kvlab.policy.evict import attention_weights, observe

    ids = _ids(100)
    o = observe(slid, ids)
    assert o.windows == tuple(w for w in _windows(slid))
    with slid.eager_attention(), torch.no_grad():
        theirs = slid.model(torch.tensor([ids]), output_attentions=True).attentions
    for layer, window in enumerate(o.windows):
        mine = attention_weights(
            o.queries[layer], o.snapshot.keys[layer], o.scaling, torch.arange(100), window
        )
        torch.testing.assert_close(mine, theirs[layer].float(), atol=1e-5, rtol=0)


def _windows(h) -> list[int | None]:
    from kvlab.rope.layers import sliding_windows

    return sliding_windows(h.config)


@pytest.mark.parametrize("score", ["tova", "snapkv", "h2o", "knorm", "streaming_llm"])
def test_an_eviction_keeps_a_sliding_layers_budget_within_its_window(slid, score):
    """A sliding layer holds ``keep`` of the slots the next token can see (the last ``window - 1``), a full
    layer ``keep`` of all; the question then runs on the held slots at their positions, as a cache that
    holds only them (each layer its own slots, transformers' eager attention, masks built here)."""
    from kvlab.policy.evict import evict, make_policy, observe

    ids, question = _ids(), [7, 8, 9, 10]
    ev = evict(observe(slid, ids), make_policy(score), keep=0.5)
    for layer, (valid, window) in enumerate(zip(ev.valid_layers(), _windows(slid), strict=True)):
        held = N if window is None else window - 1
        counts = valid.sum(-1)
        assert bool((counts == round(0.5 * held)).all()), (layer, counts)
        if window is not None:
            assert not bool(valid[..., : N - held].any())  # nothing out of the next token's sight
    got = slid.forward(question, ev).logits
    torch.testing.assert_close(got, _compacted_reference(slid, ev, question), atol=1e-5, rtol=0)


def _compacted_reference(h, ev, question: list[int]) -> torch.Tensor:
    """The question on a transformers cache holding each layer's and KV head's kept slots only, attention
    eager, each layer handed its own mask (per query head, by positions) by a pre-hook."""
    from transformers import DynamicCache

    from kvlab.model.handle import decoder_layers
    from kvlab.policy.evict import kept_per_head

    cache, masks = DynamicCache(), []
    q_pos = torch.arange(ev.next_position, ev.next_position + len(question))
    groups = h.config.num_attention_heads // h.config.num_key_value_heads
    keys, values, slots = kept_per_head(ev)  # each KV head its own kept slots
    for layer, (k, v, idx, window) in enumerate(zip(keys, values, slots, _windows(h), strict=True)):
        cache.update(k, v, layer)
        held = ev.positions[idx[0]].repeat_interleave(groups, dim=0)  # [Hq, n] each query head's slots
        at = torch.cat((held, q_pos[None].expand(held.shape[0], -1)), dim=1)  # [Hq, n + q]
        gap = q_pos[None, :, None] - at[:, None, :]  # [Hq, q, n + q]
        see = (gap >= 0) & (gap < (window or 10**9))
        masks.append(torch.zeros(see.shape).masked_fill(~see, torch.finfo(torch.float32).min)[None])

    def own_mask(layer: int):
        def hook(_module, args, kwargs):
            return args, {**kwargs, "attention_mask": masks[layer]}

        return hook

    hooks = [
        d.self_attn.register_forward_pre_hook(own_mask(i), with_kwargs=True)
        for i, d in enumerate(decoder_layers(h.model))
    ]
    try:
        with h.eager_attention(), torch.no_grad():
            out = h.model(torch.tensor([question]), past_key_values=cache, position_ids=q_pos[None])
    finally:
        for hk in hooks:
            hk.remove()
    return out.logits[0].float()


def test_tova_on_a_sliding_layer_keeps_the_top_of_transformers_windowed_attention(slid):
    """TOVA's scores on a sliding layer are the last query's attention as the model computes it (over its
    window): the kept slots are the top of transformers' own attention weights among the held ones."""
    from kvlab.policy.evict import evict, make_policy, observe

    ids = _ids()
    ev = evict(observe(slid, ids), make_policy("tova"), keep=0.5)
    with slid.eager_attention(), torch.no_grad():
        theirs = slid.model(torch.tensor([ids]), output_attentions=True).attentions
    for layer, window in enumerate(_windows(slid)):
        if window is None:
            continue
        held = window - 1
        last = theirs[layer][0, :, -1, N - held :].float().mean(0)  # every query head's, as TOVA averages
        want = set((last.topk(round(0.5 * held)).indices + N - held).tolist())
        got = set(ev.valid_layers()[layer][0, 0].nonzero().flatten().tolist())
        assert got == want, layer
