"""Eviction: score the cached tokens, keep a budget (see docs/compression.md)."""

from kvlab.policy.evict.learned import LearnedPolicy, train_evictor
from kvlab.policy.evict.observe import Observation, attention_weights, observe
from kvlab.policy.evict.policies import (
    H2O,
    REGISTRY,
    TOVA,
    KeyNorm,
    LayerView,
    Policy,
    RandomPolicy,
    SlidingWindow,
    SnapKV,
    StreamingLLM,
)
from kvlab.policy.evict.select import budget_slots, evict, keep_indices, kept_per_head, repack


def _import_methods() -> None:
    """Import every module in ``methods/``: defining a Policy subclass registers it by name."""
    import importlib
    import pkgutil

    from kvlab.policy.evict import methods

    for info in pkgutil.iter_modules(methods.__path__):
        importlib.import_module(f"{methods.__name__}.{info.name}")


_import_methods()

#: policy classes by name: the built-ins above, then every module in ``methods/`` (alphabetical)
POLICIES = dict(REGISTRY)


def make_policy(name: str, **options) -> Policy:
    """``make_policy("snapkv")``; names: ``POLICIES`` (window, streaming_llm, h2o, snapkv, tova, knorm,
    random, learned, and whatever ``methods/`` adds)."""
    from kvlab.errors import BadInputError

    if name not in POLICIES:
        raise BadInputError(f"unknown eviction policy '{name}'; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**options)


__all__ = [
    "H2O",
    "POLICIES",
    "TOVA",
    "kept_per_head",
    "repack",
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
