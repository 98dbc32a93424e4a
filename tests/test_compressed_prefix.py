"""A shared prefix compressed once (:meth:`ScoredLayout.compress_prefix`) and loaded into a conversation's live
cache (:meth:`LiveCache.seed_kept`) is the eval's offline eviction of that prefix: the question that follows sees
the same slots at the same positions, so its logits equal the offline cache's; and a conversation that starts
from it keeps its budget while decoding like one that evicted by itself."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.policy.evict import evict, make_policy, observe
from kvlab.policy.spec import cache_for, parse

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ids(n: int, seed: int, vocab: int = 200) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, vocab, (n,), generator=g)]


@pytest.mark.parametrize(
    ("spec", "codec"),
    [
        ("h2o,budget=24,every=8", False),
        ("knorm,keep=0.5,every=8", False),
        ("h2o,budget=24,every=8,prefix=kvzip", False),
        ("snapkv,budget=20,every=8,codec=int8", True),
    ],
)
def test_a_seeded_compressed_prefix_answers_as_the_offline_eviction(tiny_model, spec, codec):
    h = tiny_model("llama")
    policy = parse(spec)
    layout = policy.layout
    prefix, question = _ids(60, 1), _ids(7, 2)
    assert layout.compresses_prefix(len(prefix))
    kept = layout.compress_prefix(h, prefix)
    # the offline eviction the eval runs on the same context
    score = make_policy(layout.prefix or layout.score)
    source = observe(h, prefix) if score.needs_queries else h.prefill(prefix).snapshot
    n_keep = kept[0][0].shape[-2]
    ev = evict(source, score, n_keep=n_keep)
    offline = h.forward(question, ev, all_logits=True).logits.float()
    cache = cache_for(policy.live(), h)
    cache.seed_kept(kept, len(prefix))
    assert cache.kept == n_keep and cache.tokens_seen == len(prefix) and cache.evictions == 1
    with torch.no_grad():
        live = h.run(torch.tensor([question]), cache, logits_to_keep=0).logits[0].float()
    tol = 5e-2 if codec else 1e-5  # a codec stores the kept slots as codes (the offline eviction does not)
    assert torch.allclose(live, offline, atol=tol, rtol=0), float((live - offline).abs().max())
    assert torch.equal(cache.positions(0)[..., :n_keep], kept[0][2]) and not torch.equal(
        kept[0][2][0, 0], torch.arange(n_keep)
    )
    cache.close()


def _compressed(h, spec: str = "h2o,budget=24,every=8"):
    """A 60-token prefix compressed by ``spec`` and an empty live cache of it."""
    policy = parse(spec)
    return policy.layout.compress_prefix(h, _ids(60, 1)), cache_for(policy, h)


def test_a_conversation_from_a_compressed_prefix_keeps_its_budget(tiny_model):
    h = tiny_model("llama")
    kept, cache = _compressed(h)
    cache.seed_kept(kept, 60)
    x = _ids(30, 3)
    with torch.no_grad():
        for t in x:
            h.run(torch.tensor([[t]]), cache, logits_to_keep=1)
            assert cache.kept <= 24 + 8
    assert cache.tokens_seen == 90 and cache.evictions > 1
    cache.close()


def test_seed_kept_refuses_what_it_cannot_hold_before_changing_anything(tiny_model):
    h = tiny_model("llama")
    kept, cache = _compressed(h)
    bad = [(k, v, p.flip(-1)) for k, v, p in kept]
    with pytest.raises(BadInputError, match="increase"):
        cache.seed_kept(bad, 60)
    with pytest.raises(BadInputError, match="within"):
        cache.seed_kept(kept, 10)
    assert cache.empty
    big = parse("h2o,budget=16,every=8")
    small = cache_for(big, h)
    with pytest.raises(BadInputError, match="budget"):
        small.seed_kept(kept, 60)
    full = cache_for(parse("full"), h)
    with pytest.raises(BadInputError, match="cannot fill"):
        full.seed_kept(kept, 60)
    for c in (cache, small):
        c.close()


def test_prefix_is_a_serve_spec_only(tiny_model):
    policy = parse("h2o,budget=24,every=8,prefix=kvzip")
    assert policy.spec == "h2o,budget=24,every=8,prefix=kvzip" and policy.to_json()["prefix"] == "kvzip"
    with pytest.raises(BadInputError, match="drop prefix="):
        cache_for(policy, tiny_model("llama"))
    with pytest.raises(BadInputError, match="prefix= names a score"):
        parse("h2o,budget=24,every=8,prefix=nope")
    assert not parse("h2o,budget=24,every=8").layout.compresses_prefix(24)
    assert not parse("h2o,budget=24").layout.compresses_prefix(100)  # no every=: kvlab serve refuses it
    assert not parse("sinks=4,window=32").layout.compresses_prefix(100)
