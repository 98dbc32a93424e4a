"""The random-with-sinks baseline: a new eviction policy in one file (methods/random_sinks.py)."""

from __future__ import annotations

import pytest
import torch

from kvlab.policy.evict import POLICIES, RandomPolicy, StreamingLLM, evict, kept_per_head, make_policy
from kvlab.policy.evict.methods.random_sinks import RandomWithSinks
from kvlab.policy.evict.policies import Policy


def test_registered_by_its_file_alone():
    assert POLICIES["random_sinks"] is RandomWithSinks
    assert make_policy("random_sinks", sinks=2) == RandomWithSinks(sinks=2)


def test_keeps_the_sinks_and_a_seeded_random_rest(tiny_model):
    h = tiny_model("llama")
    snap = h.prefill(list(range(3, 63))).snapshot
    a = evict(snap, RandomWithSinks(sinks=4, seed=1), n_keep=20)
    b = evict(snap, RandomWithSinks(sinks=4, seed=1), n_keep=20)
    c = evict(snap, RandomWithSinks(sinks=4, seed=2), n_keep=20)
    streaming = evict(snap, StreamingLLM(sinks=4), n_keep=20)
    plain = evict(snap, RandomPolicy(seed=1), n_keep=20)
    sa, sb, sc, ss, sp = (kept_per_head(ev)[2] for ev in (a, b, c, streaming, plain))
    for layer in range(snap.num_layers):
        slots = sa[layer]
        assert (slots[..., :4] == torch.arange(4)).all()  # every head keeps the sinks
        assert torch.equal(slots, sb[layer])  # seeded
    assert not torch.equal(sa[0], sc[0])
    assert not torch.equal(sa[0], ss[0])  # not recency
    assert not (sp[0][..., :4] == torch.arange(4)).all()  # plain random drops sinks


def test_two_policies_cannot_share_a_name():
    with pytest.raises(TypeError, match="two eviction policies are named 'snapkv'"):
        type("Impostor", (Policy,), {"name": "snapkv", "__module__": "elsewhere"})
    assert POLICIES["snapkv"].__module__ == "kvlab.policy.evict.policies"
