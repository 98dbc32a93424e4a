"""Eviction: score the cached tokens, keep a budget (see docs/compression.md)."""

from kvlab.compress.evict.learned import LearnedPolicy, train_evictor
from kvlab.compress.evict.observe import Observation, attention_weights, observe
from kvlab.compress.evict.policies import (
    H2O,
    TOVA,
    KeyNorm,
    LayerView,
    Policy,
    RandomPolicy,
    SlidingWindow,
    SnapKV,
    StreamingLLM,
)
from kvlab.compress.evict.select import EvictedCache, budget_slots, evict, keep_indices

POLICIES = {
    p.name: p for p in (SlidingWindow, StreamingLLM, H2O, SnapKV, TOVA, KeyNorm, RandomPolicy, LearnedPolicy)
}


def make_policy(name: str, **options) -> Policy:
    """``make_policy("snapkv")``; names: window, streaming_llm, h2o, snapkv, tova, knorm, random, learned."""
    from kvlab.errors import BadInputError

    if name not in POLICIES:
        raise BadInputError(f"unknown eviction policy '{name}'; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**options)


__all__ = [
    "H2O",
    "POLICIES",
    "TOVA",
    "EvictedCache",
    "KeyNorm",
    "LayerView",
    "LearnedPolicy",
    "Observation",
    "Policy",
    "RandomPolicy",
    "SlidingWindow",
    "SnapKV",
    "StreamingLLM",
    "attention_weights",
    "budget_slots",
    "evict",
    "keep_indices",
    "make_policy",
    "observe",
    "train_evictor",
]
