"""CompressedCache keeping a budget while decoding (``every=``), and eviction over a per-token quantizer.

Issue 28: a 10,000-token generation under H2O / SnapKV with ``every=`` never attends over more than
``budget + every`` slots; the live cache equals eviction recomputed from scratch with ``keep_indices``
on the same views; the kept codes of an evicting quantized cache are the direct encodes of the kept
tokens (bit-exact), and no token is encoded twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, StoppingCriteria, StoppingCriteriaList

from kvlab.errors import BadInputError
from kvlab.hf import cache_argument
from kvlab.hf.compressed_cache import CompressedCache
from kvlab.policy.evict import H2O, TOVA, KeyNorm, LayerView, SnapKV, StreamingLLM, keep_indices
from kvlab.policy.quant import KIVIQuantizer, PerTokenQuantizer, RotatedQuantizer
from kvlab.rope.ops import apply_rope
from kvlab.rope.spec import rope_for_layer
from tests.layers_ref import logits_after_layers
from tests.tolerances import assert_forward_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(layers: int):
    from kvlab.model.random import tiny_random_model

    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=16384,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return tiny_random_model(cfg, head_dim=16, layers=layers)


@pytest.fixture(scope="module")
def tiny():
    return _model(2)


@pytest.fixture(scope="module")
def one_layer():
    return _model(1)


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


class _Watch(StoppingCriteria):
    """After every generated token: each layer holds at most ``limit`` slots; record the bytes held."""

    def __init__(self, cache: CompressedCache, limit: int):
        self.cache, self.limit, self.steps, self.most_bytes = cache, limit, 0, 0

    def __call__(self, input_ids, scores, **kw):
        self.steps += 1
        for layer in self.cache.layers:
            assert layer.held <= self.limit, (self.steps, layer.held)
            assert layer.most_held <= self.limit, (self.steps, layer.most_held)
        self.most_bytes = max(self.most_bytes, self.cache.nbytes)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.slow  # 10,000 decode steps, seconds each: kept out of `make test-fast`
@pytest.mark.parametrize("policy", [H2O(window=4), SnapKV(window=4, observe=8)], ids=lambda p: p.name)
def test_ten_thousand_tokens_stay_within_budget_plus_one_chunk_at_every_step(one_layer, policy):
    """The acceptance: budget + every slots at most, at every one of 10,000 decode steps, through
    model.generate; bytes stay bounded (a DynamicCache would hold 10,064 slots)."""
    h, n, every = one_layer, 10_000, 32
    prompt = ids_of(64)
    cache = CompressedCache(h.config, policy=policy, keep=0.5, every=every, model=h.model)
    watch = _Watch(cache, 32 + every)
    try:
        out = h.model.generate(
            prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([watch]),
            **{cache_argument(h.model): cache},
        )
    finally:
        cache.close()
    assert out.shape[1] == 64 + n and watch.steps == n
    layer = cache.layers[0]
    assert layer.budget == 32 and layer.query_hook is None  # close() removed the hook
    assert cache.get_seq_length() == 64 + n - 1  # the last token is never fed back
    assert layer.evictions == 1 + (n - 1) // every  # the prefill's, then one per `every` tokens
    assert layer.most_held == 32 + every
    slot_bytes = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16 fp32 per slot and layer
    assert watch.most_bytes <= (32 + every) * slot_bytes
    assert cache.nbytes < 0.01 * (64 + n) * slot_bytes
    # positions are tokens seen, per head: the window's last tokens, and no position held twice
    pos = layer.positions[0]
    assert pos.shape == (2, layer.held) and bool((pos.diff(dim=-1) > 0).all())
    assert pos[:, -1].tolist() == [64 + n - 2] * 2
    assert len(layer.recent_queries) == 0 or sum(q.shape[1] for q in layer.recent_queries) <= every


def _replay(h, cache, policy, budget, every, prompt, steps):
    """Feed ``prompt`` then ``steps`` single tokens to ``cache`` and, beside it, a from-scratch
    eviction: per layer the K/V each update received, the raw queries each ``q_proj`` produced, and
    ``keep_indices`` on a :class:`LayerView` built here. Checks the live cache after every feed."""
    layers = cache.layers
    fed: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layers]
    for i, layer in enumerate(layers):  # record what each layer is given, then run it as usual
        real = layer.update

        def spy(k, v, *a, _i=i, _real=real, **kw):
            fed[_i].append((k.clone(), v.clone()))
            return _real(k, v, *a, **kw)

        layer.update = spy
    raw: list[list[torch.Tensor]] = [[] for _ in layers]
    mods = [m for name, m in h.model.named_modules() if name.endswith("self_attn")]
    hooks = [
        m.q_proj.register_forward_hook(lambda _m, _i, out, _l=i: raw[_l].append(out.detach().clone()))
        for i, m in enumerate(mods)
    ]
    ref = [dict(k=None, v=None, pos=None, q=[], qpos=[]) for _ in layers]
    arg = cache_argument(h.model)
    seen = 0
    try:
        feeds = [prompt] + [ids_of(1, seed=100 + s) for s in range(steps)]
        for x in feeds:
            with torch.no_grad():
                logits = h.model(x, **{arg: cache}, use_cache=True).logits
            n_new = x.shape[1]
            new_pos = torch.arange(seen, seen + n_new)
            seen += n_new
            for i, layer in enumerate(layers):
                k, v = fed[i][-1]
                r = ref[i]
                b, hk = k.shape[:2]
                pos = new_pos.expand(b, hk, n_new)
                first = r["k"] is None
                if first:
                    r["k"], r["v"], r["pos"] = k, v, pos
                else:
                    r["k"] = torch.cat((r["k"], k), dim=-2)
                    r["v"] = torch.cat((r["v"], v), dim=-2)
                    r["pos"] = torch.cat((r["pos"], pos), dim=-1)
                r["q"].append(raw[i][-1])
                r["qpos"].append(new_pos)
                t = r["k"].shape[-2]
                if first or t >= budget + every:
                    q = torch.cat(r["q"], dim=1)
                    qb, qt, _ = q.shape
                    q = q.view(qb, qt, -1, 16).transpose(1, 2).float()
                    q = apply_rope(q, torch.cat(r["qpos"]), rope_for_layer(h.rope, i)).float()
                    slots = None if qt == t else torch.arange(t - qt, t)
                    view = LayerView(i, len(layers), r["k"], r["v"], r["pos"], q, cache.scaling, slots)
                    idx = keep_indices(policy.score(view), budget, policy.sinks, policy.window)
                    g = idx[..., None].expand(-1, -1, -1, 16)
                    r["k"], r["v"], r["pos"] = (
                        r["k"].gather(2, g),
                        r["v"].gather(2, g),
                        r["pos"].gather(-1, idx),
                    )
                    r["q"], r["qpos"] = [], []
                assert torch.equal(layer.keys, r["k"]) and torch.equal(layer.values, r["v"]), (i, seen)
                assert torch.equal(layer.positions, r["pos"]), (i, seen)
                assert layer.held == r["k"].shape[-2] == (budget if first or t >= budget + every else t)
    finally:
        for hk in hooks:
            hk.remove()
        cache.close()
    return logits, ref, seen


@pytest.mark.parametrize(
    "policy",
    [H2O(window=2), SnapKV(window=2, observe=4), TOVA(), KeyNorm(), StreamingLLM(sinks=2)],
    ids=lambda p: p.name,
)
def test_every_equals_evicting_from_scratch_with_keep_indices(tiny, policy):
    """Prompt of 30, budget 12, every 5, 23 single tokens (five evictions after the prefill's): after
    every feed each layer holds exactly what keep_indices keeps on the same view, at the same
    per-head positions; and the next token's logits equal a plain cache holding those K/V."""
    h, budget, every = tiny, 12, 5
    cache = CompressedCache(h.config, policy=policy, budget=budget, every=every, model=h.model)
    _, ref, seen = _replay(h, cache, policy, budget, every, ids_of(30), 23)
    assert cache.layers[0].evictions == 1 + 23 // every
    assert all(layer.query_hook is None for layer in cache.layers)  # close() removed them
    # the held K/V run like any cache: the next token (no eviction due) at position `seen` sees them
    nxt = ids_of(1, seed=7)
    want = logits_after_layers(
        h, tuple(r["k"] for r in ref), tuple(r["v"] for r in ref), nxt[0].tolist(), seen
    )
    with torch.no_grad():
        live = h.model(nxt, **{cache_argument(h.model): cache}, use_cache=True).logits[0]
    assert cache.layers[0].evictions == 1 + 23 // every
    assert_forward_close(live, want, h, what="logits after decode-time evictions")


def test_without_every_the_cache_evicts_once_and_drops_its_hooks(tiny):
    cache = CompressedCache(tiny.config, policy=H2O(window=2), budget=10, model=tiny.model)
    out = tiny.model.generate(
        ids_of(20),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        **{cache_argument(tiny.model): cache},
    )
    assert out.shape[1] == 32
    layer = cache.layers[0]
    assert layer.evictions == 1 and layer.query_hook is None and layer.held == 10 + 11
    assert layer.positions.shape == (1, 2, 21) and layer.positions[0, 0, -11:].tolist() == list(range(20, 31))


def test_padded_batch_refusal_is_unchanged_and_every_runs_rows_alone(tiny):
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    mask = (torch.arange(10)[None, :] >= torch.tensor([[3], [0]])).long()
    arg = cache_argument(tiny.model)
    unbound = CompressedCache(tiny.config, policy=KeyNorm(), keep=0.5, every=4)
    with pytest.raises(BadInputError, match="padded batch"):
        tiny.model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **{arg: unbound})
    # bound, attention-scored, every=: its rows would need decode-time queries, refused in one line
    scored = CompressedCache(tiny.config, policy=H2O(window=2), keep=0.5, every=4, model=tiny.model)
    with pytest.raises(BadInputError, match="padded batch .* every="):
        tiny.model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **{arg: scored})
    scored.close()
    # bound, key-scored: each row keeps its own budget while decoding, exactly as alone
    cache = CompressedCache(tiny.config, policy=KeyNorm(), keep=0.5, every=4, model=tiny.model)
    out = tiny.model.generate(
        ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, **{arg: cache}
    )
    for r, p in enumerate((3, 0)):
        alone = CompressedCache(tiny.config, policy=KeyNorm(), keep=0.5, every=4, model=tiny.model)
        want = tiny.model.generate(
            ids[r : r + 1, p:], max_new_tokens=12, min_new_tokens=12, do_sample=False, **{arg: alone}
        )
        assert out[r, 10:].tolist() == want[0, 10 - p :].tolist(), r
        assert cache.rows[r].layers[0].held == alone.layers[0].held <= alone.layers[0].budget + 4


# -- eviction over a per-token quantizer -----------------------------------------------------------

ENCODED: list[torch.Tensor] = []  # every key row block a _Counting quantizer was asked to encode


@dataclass(frozen=True)
class _Counting(PerTokenQuantizer):
    """A per-token quantizer that records what it encodes (no ``kind`` of its own: not registered)."""

    def encode(self, keys, values, positions, rope):
        ENCODED.append(keys.detach().clone())
        return super().encode(keys, values, positions, rope)


@pytest.mark.parametrize("every", [None, 6], ids=["once", "every6"])
def test_quantized_eviction_keeps_codes_exact_and_encodes_each_token_once(tiny, every):
    """H2O over int4 per-token codes (2 fp sinks, 3-token fp window): after a 60-token prompt and 70
    steps every held code equals a direct encode of the kept token's original K/V (bit-exact: codes,
    scales, zero points), sinks and the fp tail are the originals, positions are per head, and no
    token's K/V was handed to the quantizer twice (nor a decoded value: only original rows)."""
    ENCODED.clear()
    q = _Counting(bits=4, group_size=8, sinks=2, window=3)
    policy = H2O(window=2, sinks=2)
    cache = CompressedCache(tiny.config, quantizer=q, policy=policy, budget=40, every=every, model=tiny.model)
    originals: list[list[torch.Tensor]] = [[] for _ in cache.layers]  # K, V fed, in position order
    for i, layer in enumerate(cache.layers):
        real = layer.update

        def spy(k, v, *a, _i=i, _real=real, **kw):
            originals[_i].append(torch.stack((k, v)).clone())
            return _real(k, v, *a, **kw)

        layer.update = spy
    arg = cache_argument(tiny.model)
    try:
        out = tiny.model.generate(
            ids_of(60), max_new_tokens=70, min_new_tokens=70, do_sample=False, **{arg: cache}
        )
    finally:
        cache.close()
    assert out.shape[1] == 130
    for i, layer in enumerate(cache.layers):
        full = torch.cat(originals[i], dim=-2)  # [2, B, H, seen, D], slot = position
        assert full.shape[-2] == cache.get_seq_length() == 129
        pos = layer.positions  # [B, H, held]
        assert pos.shape[-1] == layer.held
        if every is not None:
            assert layer.held < 40 + every and layer.evictions == 1 + (129 - 60) // every
        else:
            assert layer.held == 40 + 69 and layer.evictions == 1
        at = 0

        def orig(kind: int, p: torch.Tensor, full: torch.Tensor = full) -> torch.Tensor:
            return full[kind].gather(2, p[..., None].expand(-1, -1, -1, full.shape[-1]))

        s = layer.sink_keys.shape[-2]
        assert s == 2 and pos[..., :2].tolist() == [[[0, 1], [0, 1]]]
        assert torch.equal(layer.sink_keys, orig(0, pos[..., :2])) and torch.equal(
            layer.sink_values, orig(1, pos[..., :2])
        )
        at = s
        assert layer.segments, "some tokens are held as codes"
        for seg in layer.segments:
            p = pos[..., at : at + seg.length]
            direct = PerTokenQuantizer(bits=4, group_size=8).encode(orig(0, p), orig(1, p), p[0, 0], None)
            for got, want in ((seg.keys.q, direct.keys.q), (seg.values.q, direct.values.q)):
                assert torch.equal(got.packed, want.packed) and torch.equal(got.scale, want.scale)
                assert torch.equal(got.zero, want.zero) and got.shape == want.shape
            at += seg.length
        p = pos[..., at:]
        assert torch.equal(layer.keys, orig(0, p)) and torch.equal(layer.values, orig(1, p))
        assert layer.nbytes < 0.5 * layer.held * 2 * 2 * 16 * 4  # mostly int4 codes
    # every row ever encoded is an original key of some layer, and no (layer, head, token) twice
    index = {}
    for i in range(len(cache.layers)):
        full = torch.cat(originals[i], dim=-2)[0, 0]  # [H, seen, D]
        for hh in range(full.shape[0]):
            for t in range(full.shape[1]):
                index[(hh, full[hh, t].numpy().tobytes())] = (i, hh, t)
    seen: set = set()
    for block in ENCODED:
        for hh in range(block.shape[1]):
            for row in block[0, hh]:
                if not bool(row.any()):
                    continue  # a pad row (zeros), never stored
                who = index.get((hh, row.numpy().tobytes()))
                assert who is not None, "a decoded (re-quantized) row was encoded"
                assert who not in seen, f"token encoded twice: {who}"
                seen.add(who)


def test_bad_combinations_are_one_clear_error(tiny):
    cfg, m = tiny.config, tiny.model
    with pytest.raises(BadInputError, match="per-token.*pertoken.*kivi.*per channel"):
        CompressedCache(cfg, quantizer=KIVIQuantizer(bits=2, group_size=16), policy=StreamingLLM(), keep=0.5)
    with pytest.raises(BadInputError, match="pertoken.*rotation.*positions"):
        CompressedCache(cfg, quantizer=RotatedQuantizer(bits=4, group_size=16), policy=KeyNorm(), keep=0.5)
    with pytest.raises(BadInputError, match="sinks >= 4"):
        CompressedCache(
            cfg, quantizer=PerTokenQuantizer(bits=4, group_size=16, sinks=4), policy=KeyNorm(), keep=0.5
        )
    for bad in (0, -3, 2.5, True):
        with pytest.raises(BadInputError, match="every must be"):
            CompressedCache(cfg, policy=KeyNorm(), keep=0.5, every=bad)
    with pytest.raises(BadInputError, match="need an eviction policy"):
        CompressedCache(cfg, every=8)
    with pytest.raises(BadInputError, match="not both"):
        CompressedCache(cfg, policy=KeyNorm(), keep=0.5, budget=8)
    with pytest.raises(BadInputError, match="budget must be"):
        CompressedCache(cfg, policy=KeyNorm(), budget=0)
    with pytest.raises(BadInputError, match="smaller than the 4 sinks"):
        CompressedCache(cfg, policy=StreamingLLM(sinks=4), budget=3)
    # a budget above the prompt, evicting once: refused at the prefill, before the cache changes
    cache = CompressedCache(cfg, policy=H2O(), budget=50, model=m)
    with pytest.raises(BadInputError, match=r"budget=50 .* prompt's 20 tokens"):
        m(ids_of(20), **{cache_argument(m): cache}, use_cache=True)
    assert cache.get_seq_length() == 0 and cache.held == 0
    cache.close()


def test_a_budget_above_the_prompt_keeps_everything_until_the_stream_outgrows_it(tiny):
    """With every= (a stream, a server's conversation) a budget above the first prompt is not a mistake: the
    cache keeps every token until it holds budget + every, then evicts back to the budget."""
    m = tiny.model
    cache = CompressedCache(tiny.config, policy=H2O(), budget=50, every=8, model=m)
    ids = ids_of(80)
    with torch.no_grad():
        out = m(ids[:, :20], **{cache_argument(m): cache}, use_cache=True)
        assert cache.held == 20 and cache.evictions == 1  # the prefill's "eviction" kept all 20
        held = []
        for i in range(20, 80):
            out = m(ids[:, i : i + 1], **{cache_argument(m): cache}, use_cache=True)
            held.append(cache.held)
    assert out.logits.isfinite().all()
    assert max(held) == 50 + 8 - 1 and min(held[40:]) >= 50 and cache.evictions > 1
    assert held[:30] == list(range(21, 51))  # nothing dropped while under the budget
    cache.close()
