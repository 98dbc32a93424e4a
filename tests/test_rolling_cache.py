"""RollingCache: exact over many rolls and re-bases, works in model.generate, refuses bad input."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from transformers import LlamaForCausalLM

from kvlab.cache.snapshot import concat
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf import cache_argument
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for, rotate_by, rotate_by_
from kvlab.rope.ops import shift_keys
from kvlab.streaming import stream_generate
from kvlab.streaming.generate import feed

# the keyword transformers takes the cache by (``cache`` from 5.24, ``past_key_values`` before)
CACHE_ARG = cache_argument(LlamaForCausalLM)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_logits(
    handle, ids: list[int], *, window: int, sinks: int, chunk: int, feed_size: int
) -> list[torch.Tensor]:
    """The same policy on snapshots: window keys never re-rotated, queries at their absolute positions,
    sinks re-positioned (once, from their original keys) to sit just before the window."""
    out, snap, sink0, pending = [], None, None, 0
    for start in range(0, len(ids), feed_size):
        piece = ids[start : start + feed_size]
        if pending:
            s = min(sinks, snap.seq_len)
            window_part = snap.slice(s + pending)
            if s:
                first = int(window_part.positions[0])
                snap = concat(sink0.with_positions(torch.arange(first - s, first)), window_part)
            else:
                snap = window_part
        fwd = handle.forward(piece, snap, positions=torch.arange(start, start + len(piece)))
        snap = fwd.snapshot
        if sink0 is None and sinks and snap.seq_len >= sinks:
            sink0 = snap.slice(0, sinks)
        out.append(fwd.logits)
        over = snap.seq_len - (sinks + window)
        pending = (
            min(snap.seq_len - min(sinks, snap.seq_len), math.ceil(over / chunk) * chunk) if over > 0 else 0
        )
    return out


def rolling_logits(handle, ids: list[int], cache: RollingCache, feed_size: int) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), feed_size):
            x = torch.tensor([ids[start : start + feed_size]])
            out.append(handle.run(x, cache).logits[0].float())  # no positions: the cache chooses them
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi", "llama3-scaling"])
@pytest.mark.parametrize("sinks,rebase", [(0, "always"), (2, "auto"), (4, "always")])
def test_rolled_logits_equal_reference_over_many_rolls(tiny_model, family, sinks, rebase):
    h = tiny_model(family)
    torch.manual_seed(1)
    ids = torch.randint(0, 500, (240,)).tolist()
    # max_position 60 forces a re-base every few rolls in "auto" mode.
    cache = RollingCache(
        h.config, h.rope, window=24, sinks=sinks, evict_chunk=5, max_position=60, rebase=rebase
    )
    got = rolling_logits(h, ids, cache, feed_size=3)
    ref = reference_logits(h, ids, window=24, sinks=sinks, chunk=5, feed_size=3)
    assert cache.rolls >= 30 and cache.rebases >= 5
    assert cache.next_position < 60
    worst = max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True))
    assert worst < 2e-4, worst


def test_plain_window_equals_unrotated_slices(tiny_model):
    """sinks=0: the reference is a plain slice of the cache, keys never touched, queries at absolute positions."""
    h = tiny_model("qwen2")
    torch.manual_seed(2)
    ids = torch.randint(0, 500, (150,)).tolist()
    cache = RollingCache(h.config, h.rope, window=20, sinks=0, evict_chunk=4, max_position=50, rebase="auto")
    got = rolling_logits(h, ids, cache, feed_size=1)
    ref = reference_logits(h, ids, window=20, sinks=0, chunk=4, feed_size=1)
    assert cache.rebases >= 3
    assert max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)) < 2e-4


def test_no_eviction_equals_plain_forward(tiny_model):
    h = tiny_model("llama")
    torch.manual_seed(3)
    ids = torch.randint(0, 500, (40,)).tolist()
    cache = RollingCache(h.config, h.rope, window=64, sinks=4, evict_chunk=8)
    got = torch.cat(rolling_logits(h, ids, cache, feed_size=7))
    ref = h.prefill(ids).logits
    assert float((got - ref).abs().max()) < 1e-5
    assert cache.rolls == 0 and cache.kept == 40


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_exact_over_rolls(smollm):
    ids = smollm.encode("The quick brown fox jumps over the lazy dog. " * 12)[:120]
    cache = RollingCache(
        smollm.config, smollm.rope, window=32, sinks=4, evict_chunk=8, max_position=90, rebase="auto"
    )
    got = rolling_logits(smollm, ids, cache, feed_size=4)
    ref = reference_logits(smollm, ids, window=32, sinks=4, chunk=8, feed_size=4)
    assert cache.rolls >= 8 and cache.rebases >= 1
    worst = max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True))
    assert worst < 2e-3, worst  # logits of magnitude ~20, fp32


def test_model_generate_matches_own_loop(tiny_model):
    h = tiny_model("llama")
    torch.manual_seed(4)
    prompt = torch.randint(0, 500, (1, 12))
    cache = RollingCache(h.config, h.rope, window=16, sinks=2, evict_chunk=4, rebase="never")
    with torch.no_grad():
        g = h.model.generate(prompt, **{CACHE_ARG: cache}, max_new_tokens=50, do_sample=False, pad_token_id=0)
    assert cache.rolls >= 10
    new = g[0, 12:].tolist()
    mine = RollingCache(h.config, h.rope, window=16, sinks=2, evict_chunk=4, rebase="never")
    first = feed(h, mine, prompt[0].tolist())
    ours = [e.token_id for e in stream_generate(h, mine, first, 50)]
    assert new == ours


def test_model_generate_never_rebases_and_refuses_to_pass_the_maximum(tiny_model):
    """generate passes its own positions: the cache never re-bases under it, so every token sits where
    generate thinks it does; at the model's maximum the cache raises instead of mis-positioning."""
    h = tiny_model("llama")
    prompt = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(6))
    for mode in ("auto", "always"):
        cache = RollingCache(
            h.config, h.rope, window=16, sinks=2, evict_chunk=4, max_position=40, rebase=mode
        )
        with pytest.raises(BadInputError, match="stream_generate"), torch.no_grad():
            h.model.generate(prompt, **{CACHE_ARG: cache}, max_new_tokens=40, do_sample=False, pad_token_id=0)
        assert cache.rebases == 0 and cache.rolls > 0
        assert cache.next_position == 40  # it stopped exactly at the maximum
    # below the maximum, generate with a re-basing mode equals kvlab's own loop (which may re-base
    # but does not need to here)
    auto = RollingCache(h.config, h.rope, window=16, sinks=2, evict_chunk=4, rebase="auto")
    with torch.no_grad():
        g = h.model.generate(prompt, **{CACHE_ARG: auto}, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert auto.rolls > 0 and auto.rebases == 0
    mine = RollingCache(h.config, h.rope, window=16, sinks=2, evict_chunk=4, rebase="auto")
    first = feed(h, mine, prompt[0].tolist())
    assert [e.token_id for e in stream_generate(h, mine, first, 30)] == g[0, 12:].tolist()


def test_a_plain_model_call_never_sees_a_rebase(tiny_model):
    """Called directly (not through ModelHandle.run), the cache cannot know who picks positions: it keeps
    them, and refuses at the maximum."""
    h = tiny_model("qwen2")
    cache = RollingCache(h.config, h.rope, window=8, sinks=2, evict_chunk=2, max_position=30, rebase="always")
    with torch.no_grad():
        for t in range(29):
            h.model(input_ids=torch.tensor([[t + 3]]), **{CACHE_ARG: cache}, use_cache=True)
        assert cache.rebases == 0 and cache.next_position == 29
        with pytest.raises(BadInputError, match="maximum"):
            h.model(input_ids=torch.tensor([[5, 6]]), **{CACHE_ARG: cache}, use_cache=True)
        h.run(torch.tensor([[5]]), cache)  # through kvlab the cache may re-base; it plans one
        assert cache.plan.rebase > 0 and cache.next_position < 30


def test_model_generate_without_eviction_equals_dynamic_cache(tiny_model):
    h = tiny_model("qwen2")
    prompt = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = h.model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
        rolled = h.model.generate(
            prompt,
            **{CACHE_ARG: RollingCache(h.config, h.rope, window=64, sinks=4, rebase="never")},
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        )
    assert plain.tolist() == rolled.tolist()


def test_stream_generate_bounded_positions(tiny_model):
    h = tiny_model("llama")
    cache = RollingCache(h.config, h.rope, window=16, sinks=2, evict_chunk=4, max_position=40)
    first = feed(h, cache, [1, 2, 3, 4, 5])
    events = list(stream_generate(h, cache, first, 300))
    assert len(events) == 300
    assert max(e.position for e in events) < 40
    assert any(e.rebased for e in events) and any(e.rolled for e in events)
    assert max(e.kept for e in events) <= 2 + 16 + 1


def test_rotate_by_matches_exact_shift(tiny_model):
    spec = tiny_model("phi").rope  # partial rotary
    x = torch.randn(2, 3, 10, spec.head_dim)
    for delta in (-500, -1, 7, 3000):
        assert torch.allclose(rotate_by(x, delta, spec), shift_keys(x, delta, spec), atol=2e-5)


@pytest.mark.parametrize("family", ["llama", "phi", "llama3-scaling"])
def test_fast_rebase_out_and_in_place_match_float64_reference(tiny_model, family):
    """The fp32 re-base (float64 cos/sin, fp32 multiply-adds) stays within ~1e-6 relative of the
    float64 reference for large shifts, into a strided slice of a bigger buffer and in place."""
    spec = tiny_model(family).rope
    x = torch.randn(1, 2, 300, spec.head_dim)
    for delta in (-8000, -4096, -64, 1, 100_000):
        ref = shift_keys(x.double(), delta, spec)
        buf = torch.full((1, 2, 310, spec.head_dim), 7.0)
        out = rotate_by(x, delta, spec, out=buf[:, :, 5:305])
        own = x.clone()
        assert rotate_by_(own, delta, spec) is own
        for got in (out, own, rotate_by(x, delta, spec)):
            rel = ((got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max()
            assert float(rel) < 1e-6, (delta, float(rel))
        assert torch.equal(out, own)
        assert bool((buf[:, :, :5] == 7).all() and (buf[:, :, 305:] == 7).all())  # nothing outside the slice


def test_bad_input(tiny_model, smollm):
    h = tiny_model("llama")
    with pytest.raises(BadInputError, match="fewer than the window"):
        RollingCache(h.config, h.rope, window=8, sinks=8)
    with pytest.raises(BadInputError, match="maximum position"):
        rolling_cache_for(smollm, window=smollm.max_positions, sinks=0)
    with pytest.raises(BadInputError):
        RollingCache(h.config, h.rope, window=8, sinks=0, evict_chunk=0)
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        RollingCache(h.config, None, window=8, sinks=1)
    dyn = h.rope.__class__(**{**h.rope.to_json(), "rope_type": "dynamic", "shift_exact": False})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        RollingCache(h.config, dyn, window=8, sinks=1)
    cache = RollingCache(h.config, h.rope, window=8, sinks=1, evict_chunk=2, max_position=20)
    with pytest.raises(BadInputError, match="per forward"):
        h.run(torch.zeros(1, 25, dtype=torch.long), cache)
    with pytest.raises(BadInputError, match="stream_generate"):
        h.model(input_ids=torch.zeros(1, 25, dtype=torch.long), **{CACHE_ARG: cache}, use_cache=True)
    assert cache.tokens_seen == 0  # refused before anything was written
    with pytest.raises(UnsupportedModelError):
        cache.crop(-1)


def test_kept_layers_are_copies_that_later_steps_do_not_touch(tiny_model):
    """The cache writes in place; what it hands out must not change under the caller."""
    h = tiny_model("llama")
    cache = RollingCache(h.config, h.rope, window=8, sinks=2, evict_chunk=2, max_position=60)
    h.run(torch.tensor([list(range(3, 12))]), cache)
    before = cache.kept_layers()
    kept = [(k.clone(), v.clone()) for k, v in before]
    for t in range(12):  # rolls and (near the maximum) a re-base rewrite the buffers
        h.run(torch.tensor([[t + 20]]), cache)
    assert cache.rolls > 0
    for (k, v), (k0, v0) in zip(before, kept, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def _mistral(window: int):
    from kvlab.model.facts import load_config_file
    from kvlab.model.random import tiny_random_model
    from tests.conftest import config_path

    cfg = load_config_file(config_path("mistral"))
    cfg.sliding_window = window
    return tiny_random_model(cfg)


@pytest.mark.parametrize("rebase", ["never", "always"])
def test_a_cache_larger_than_the_models_sliding_window_equals_the_full_forward(rebase):
    """Mistral with a 64-token sliding window under a 4 + 100-slot rolling cache: every layer slides, so
    a layer never sees more than its last 64 tokens, all of which the cache holds. The rolled logits
    equal one plain forward over the whole 300-token stream (transformers' sliding mask works on slot
    distances, and slots are contiguous positions); without the window (the cache's sinks and older
    slots visible) they would not."""
    h = _mistral(64)
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = RollingCache(h.config, h.rope, window=100, sinks=4, evict_chunk=8, rebase=rebase)
    got = torch.cat(rolling_logits(h, ids, cache, feed_size=3))
    with torch.no_grad():
        full = h.model(torch.tensor([ids])).logits[0]
    assert cache.rolls >= 20 and (rebase == "never" or cache.rebases >= 20)
    assert float((got - full).abs().max()) < 1e-4
    wide = _mistral(4096)  # the same weights with a window wider than the cache: it sees the sinks
    wide.model.load_state_dict(h.model.state_dict())
    other = RollingCache(wide.config, wide.rope, window=100, sinks=4, evict_chunk=8, rebase=rebase)
    assert float((torch.cat(rolling_logits(wide, ids, other, feed_size=3)) - full).abs().max()) > 0.01


def test_sliding_window_model_decodes_in_batched_steps():
    """The server's batched step on the 64-token-window model with a 4 + 72-slot cache:
    the batched rows (per-row attention, the window applied as a slot distance) equal the rows alone."""
    from kvlab.hf.batch import step_rolling_rows

    h = _mistral(64)
    prompts = [
        torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (90, 70)
    ]
    caches = [rolling_cache_for(h, window=72, sinks=4, evict_chunk=8) for _ in prompts]
    alone = [rolling_cache_for(h, window=72, sinks=4, evict_chunk=8) for _ in prompts]
    firsts = [feed(h, c, p) for c, p in zip(caches, prompts, strict=True)]
    for c, p in zip(alone, prompts, strict=True):
        feed(h, c, p)
    tokens = [int(f.argmax()) for f in firsts]
    for _ in range(60):
        batched = step_rolling_rows(h, caches, tokens)
        single = [
            h.run(torch.tensor([[t]]), c).logits[0, -1].float() for c, t in zip(alone, tokens, strict=True)
        ]
        for r in range(2):
            assert float((batched[r] - single[r]).abs().max()) < 1e-4
        tokens = [int(x.argmax()) for x in single]
    assert min(c.rolls for c in caches) >= 3 and max(c.kept for c in caches) > 64


def _small_max_model(max_positions: int):
    from kvlab.model.facts import load_config_file
    from kvlab.model.random import tiny_random_model
    from tests.conftest import config_path

    cfg = load_config_file(config_path("llama"))
    cfg.max_position_embeddings = max_positions
    return tiny_random_model(cfg)


def test_model_generate_with_a_bound_cache_rebases_forever_and_equals_own_loop():
    """Issue 14's bar: generate 3x the model's maximum through ``model.generate`` with
    ``rolling_cache_for(hf_model)``: no position fed to RoPE ever reaches the maximum (recorded at the
    model's rotary module, and from the cache after every forward), and the tokens equal kvlab's loop."""
    h = _small_max_model(128)
    fed, after = [], []
    rotary = h.model.model.rotary_emb
    spy = rotary.register_forward_pre_hook(
        lambda _m, a, k: fed.append(int((a[1] if len(a) > 1 else k["position_ids"]).max())), with_kwargs=True
    )
    prompt = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(6))
    cache = rolling_cache_for(h.model, window=32, sinks=4, evict_chunk=8)  # a plain HF model
    watch = h.model.register_forward_hook(lambda *_: after.append(cache.next_position))
    try:
        with torch.no_grad():
            out = h.model.generate(
                prompt, **{CACHE_ARG: cache}, max_new_tokens=3 * 128, do_sample=False, pad_token_id=0
            )
    finally:
        watch.remove()
    assert out.shape[1] - 12 == 3 * 128 and cache.tokens_seen == 12 + 3 * 128 - 1
    assert cache.rebases >= 3 and max(fed) < 128 and max(after) <= 128
    fed.clear()
    mine = RollingCache(h.config, h.rope, window=32, sinks=4, evict_chunk=8)
    first = feed(h, mine, prompt[0].tolist())
    assert [e.token_id for e in stream_generate(h, mine, first, 3 * 128)] == out[0, 12:].tolist()
    spy.remove()


def test_binding_leaves_other_caches_and_explicit_positions_alone():
    h = _small_max_model(128)
    prompt = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = h.model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
        bound = rolling_cache_for(h, window=32, sinks=4, evict_chunk=8)
        rolling_cache_for(h, window=16, sinks=2, evict_chunk=4)  # a second binding: one hook pair per model
        assert len(h.model._forward_pre_hooks) == 1
        # a DynamicCache (generate's default) is not touched by the hook
        assert (
            h.model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0).tolist()
            == before.tolist()
        )
        # positions the caller chose (not the token count) are passed on untouched
        prefix, x, at40 = torch.tensor([[9, 8, 7, 6]]), torch.tensor([[5, 6, 7]]), torch.arange(40, 43)
        unbound = RollingCache(h.config, h.rope, window=32, sinks=4, evict_chunk=8)
        for c in (bound, unbound):
            h.run(prefix, c)
        got = h.run(x, bound, positions=at40).logits
        assert torch.equal(got, h.run(x, unbound, positions=at40).logits)
        fresh = RollingCache(h.config, h.rope, window=32, sinks=4, evict_chunk=8)
        h.run(prefix, fresh)
        assert not torch.allclose(got, h.run(x, fresh).logits, atol=1e-3)  # at 4..6 it would differ


@pytest.mark.parametrize("window", [64, 12])
def test_gradients_through_several_steps(window, tiny_model):
    """With autograd on for every piece, the last logits' gradient reaches the first piece's input
    embeddings (the cache writes into copies under autograd, not into the views earlier forwards saved).
    Without a roll it equals the gradient through a DynamicCache; with rolls and re-bases it is finite and
    reaches the sinks, which the cache always keeps."""
    from transformers import DynamicCache

    h = tiny_model("llama")
    ids = torch.randint(0, h.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    emb = h.model.get_input_embeddings()

    def grads(cache):
        xs, out = [], None
        choosing = getattr(cache, "choosing_positions", None)
        for a, b in ((0, 16), (16, 24), (24, 32), (32, 33), (33, 34)):
            x = emb(ids[None, a:b]).detach().requires_grad_(True)
            xs.append(x)
            with choosing() if choosing is not None else contextlib.nullcontext():
                out = h.model(inputs_embeds=x, use_cache=True, **{cache_argument(h.model): cache})
        (g,) = torch.autograd.grad(out.logits[0, -1].float().pow(2).mean(), [xs[0]])
        return g

    rolling = RollingCache(h.config, h.rope, window=window, sinks=4, evict_chunk=4, rebase="always")
    got = grads(rolling)
    assert bool(torch.isfinite(got).all()) and float(got[0, :4].abs().sum()) > 0
    if window == 64:
        assert rolling.rolls == 0
        assert torch.allclose(got, grads(DynamicCache(config=h.config)), atol=1e-6)
    else:
        assert rolling.rolls >= 3 and rolling.rebases >= 1


@pytest.mark.parametrize("window, sinks", [(32, 4), (5, 4), (1, 0), (300, 4)])
def test_any_window_works_with_the_default_chunk(window, sinks, tiny_model):
    """The default eviction chunk (64, at most half the window) makes any window >= sinks + 1 valid; once
    full, the model sees the sinks and between window - chunk + 1 and window recent tokens."""
    from kvlab.hf.rolling_cache import default_chunk

    h = tiny_model("llama")
    cache = rolling_cache_for(h, window=window, sinks=sinks)
    assert cache.evict_chunk == default_chunk(window) == max(1, min(64, window // 2))
    seen = set()
    for t in torch.randint(
        0, h.config.vocab_size, (window + 150,), generator=torch.Generator().manual_seed(1)
    ):
        h.run(t.view(1, 1), cache)
        if cache.tokens_seen > sinks + window:
            seen.add(cache.kept - sinks)
    assert min(seen) >= window - cache.evict_chunk + 1 and max(seen) <= window
