"""One live cache, one interface: every preset `cache_for` builds answers the same questions, takes a
checkpoint that restores it exactly, seeds or refuses, and the full cache equals transformers' own."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.coded_rolling import CodedRollingLayer
from kvlab.hf.live_cache import Bytes, FullCache, LiveCache
from kvlab.hf.rolling_cache import RollingLayer
from kvlab.policy.spec import cache_for

# one spec per kind of layer: full, rolling, rolling over codes, codes over every slot, scored eviction
# (attention- and key-scored, keeping a budget while decoding), shared budgets (per layer, per head)
SPECS = [
    "full",
    "sinks=4,window=24,chunk=8",
    "sinks=4,window=72,chunk=32,codec=int4,tail=8",
    "codec=int4",
    "h2o,budget=16,every=8",
    "knorm,keep=0.5,every=4",
    "snapkv,keep=0.5,layers=pyramid",
    "tova,keep=0.5,heads=ada",
]


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def _steps(h, cache, ids: torch.Tensor) -> list[torch.Tensor]:
    """One forward per token of ``ids``; the last logits of each."""
    with torch.no_grad():
        return [h.run(ids[:, i : i + 1], cache).logits[0, -1].clone() for i in range(ids.shape[1])]


@pytest.mark.parametrize("spec", SPECS)
def test_every_preset_answers_the_live_cache_questions(tiny_llama_2x64, one_torch_thread, spec):
    h = tiny_llama_2x64
    cache = cache_for(spec, h)
    assert isinstance(cache, LiveCache) and cache.empty and int(cache.nbytes) == 0
    with torch.no_grad():
        h.run(_ids(70), cache)
    _steps(h, cache, _ids(12, seed=1))
    assert cache.tokens_seen == 82 and not cache.empty
    assert 0 < cache.kept <= 82
    # one byte count, a property, that also answers the old call (RollingCache.nbytes())
    assert isinstance(cache.nbytes, Bytes) and cache.nbytes == sum(layer.nbytes for layer in cache.layers)
    assert cache.nbytes() == int(cache.nbytes)
    assert type(cache).__name__ in cache.describe() and f"{cache.kept} kept" in cache.describe()
    if "heads=ada" in spec:  # heads hold different counts: no rectangular read, said in one line
        with pytest.raises(BadInputError, match="per head"):
            cache.kept_layers()
        with pytest.raises(BadInputError, match="per head"):
            cache.positions()
        return
    (k, v), *_ = cache.kept_layers()
    assert k.shape == (1, 2, cache.kept, 16) and v.shape == k.shape
    pos = cache.positions()
    assert pos.device.type == "cpu" and pos.shape[-1] == cache.kept
    assert int(pos.max()) <= 81 and int(pos.min()) >= 0
    if spec == "full" or spec == "codec=int4":
        assert torch.equal(pos, torch.arange(82))


@pytest.mark.parametrize("spec", SPECS)
def test_a_checkpoint_puts_every_preset_back_exactly(tiny_llama_2x64, one_torch_thread, spec):
    """A forward that rolls (the roll the prompt left pending), evicts (every=), encodes a block of codes or
    grows ragged heads, undone by the checkpoint taken before it: the same forward and steps again give the
    same logits, bit for bit (how the server undoes a batched step that failed)."""
    h = tiny_llama_2x64
    cache = cache_for(spec, h)
    with torch.no_grad():
        h.run(_ids(70), cache)
    before = (cache.tokens_seen, cache.kept, int(cache.nbytes))
    nxt = _ids(17, seed=3)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return h.run(nxt, cache).logits[0].clone()

    undo = cache.checkpoint()
    first = forward()
    undo()
    assert (cache.tokens_seen, cache.kept, int(cache.nbytes)) == before
    undo = cache.checkpoint()
    assert torch.equal(forward(), first)
    steps = _steps(h, cache, _ids(3, seed=4))
    if isinstance(cache.layers[0], RollingLayer) and not isinstance(cache.layers[0], CodedRollingLayer):
        with pytest.raises(BadInputError, match="undoes one forward"):
            undo()  # its buffers were written by four forwards since: refused, not half-restored
    else:  # layers that never write a tensor in place restore after any number of forwards
        undo()
        assert (cache.tokens_seen, cache.kept, int(cache.nbytes)) == before
        assert torch.equal(forward(), first)
        for a, b in zip(steps, _steps(h, cache, _ids(3, seed=4)), strict=True):
            assert torch.equal(a, b)
    cache.close()


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])  # full layers; sliding + global; no RoPE
def test_the_full_cache_equals_transformers_dynamic_cache(tiny_model, one_torch_thread, family):
    h = tiny_model(family)
    ids = _ids(70, seed=4)
    ours, theirs = cache_for("full", h), DynamicCache(config=h.config)
    assert isinstance(ours, FullCache)
    with torch.no_grad():
        a = h.run(ids[:, :50], ours).logits
        b = h.run(ids[:, :50], theirs).logits
        assert torch.equal(a, b)
        for i in range(50, 70):
            x, y = h.run(ids[:, i : i + 1], ours).logits, h.run(ids[:, i : i + 1], theirs).logits
            assert torch.equal(x, y)
    assert ours.get_seq_length() == theirs.get_seq_length() == 70
    for mine, ref in zip(ours.layers, theirs.layers, strict=True):
        assert type(ref) in type(mine).__mro__ and torch.equal(mine.keys, ref.keys)
    assert ours.nbytes == sum(
        t.numel() * t.element_size() for la in theirs.layers for t in (la.keys, la.values)
    )
    if family != "gemma3":
        ours.crop(-5)  # exact here, as transformers' own
        assert ours.get_seq_length() == 65
    else:  # a sliding layer past its window cannot roll back (transformers' own refusal, unchanged)
        with pytest.raises(RuntimeError, match="sliding window"):
            theirs.crop(-5)
        with pytest.raises(RuntimeError, match="sliding window"):
            ours.crop(-5)


def test_seed_takes_a_prefix_exactly_or_refuses_before_anything_changes(tiny_llama_2x64, one_torch_thread):
    h = tiny_llama_2x64
    ids = _ids(40, seed=5)
    with torch.no_grad():
        prefix = h.prefill(ids[0, :32].tolist()).snapshot
    kv = list(zip(prefix.keys, prefix.values, strict=True))
    for spec in ("full", "codec=int4", "knorm,keep=0.5"):
        fed, seeded = cache_for(spec, h), cache_for(spec, h)
        with torch.no_grad():
            h.run(ids[:, :32], fed)
        seeded.seed(kv)
        assert (seeded.tokens_seen, seeded.kept, int(seeded.nbytes)) == (32, fed.kept, int(fed.nbytes))
        a, b = _steps(h, fed, ids[:, 32:]), _steps(h, seeded, ids[:, 32:])
        for x, y in zip(a, b, strict=True):  # the prefix's K/V came from another forward: fp32 rounding
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    refuses = cache_for("h2o,keep=0.5", h)
    with pytest.raises(BadInputError, match="queries"):
        refuses.seed(kv)
    assert refuses.empty
    refuses.close()
    rolling = cache_for("sinks=4,window=16,chunk=4", h)
    with pytest.raises(BadInputError, match="sinks \\+ window"):
        rolling.seed(kv)
    assert rolling.empty


def test_hold_roll_is_refused_where_pieces_would_not_equal_one_forward(tiny_llama_2x64, one_torch_thread):
    h = tiny_llama_2x64
    cache = cache_for("h2o,keep=0.5,every=8", h)
    with torch.no_grad():
        h.run(_ids(20), cache)
    with pytest.raises(BadInputError, match="one forward"):
        cache.hold_roll()
    cache.close()
    full = cache_for("full", h)
    with torch.no_grad():
        h.run(_ids(20), full)
    full.hold_roll()  # nothing to hold: every piece sees every earlier token
    assert full.tokens_seen == 20


@pytest.mark.parametrize("spec", [s for s in SPECS if s != "full"])
def test_a_cache_that_may_have_dropped_tokens_refuses_a_crop(tiny_llama_2x64, one_torch_thread, spec):
    h = tiny_llama_2x64
    cache = cache_for(spec, h)
    with torch.no_grad():
        h.run(_ids(70), cache)
    before = cache.tokens_seen
    with pytest.raises(UnsupportedModelError, match="cannot be cropped"):
        cache.crop(-3)
    assert cache.tokens_seen == before
    cache.close()
