"""Random eviction that keeps the attention sinks: the control for "do sinks alone explain it?".

``RandomPolicy`` keeps a uniform random budget; StreamingLLM keeps the sinks and the most recent
tokens. This baseline keeps the sinks and a uniform random choice of the rest, so the gap between it
and StreamingLLM measures recency, and the gap to plain random measures the sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policy.evict.policies import RandomPolicy


@dataclass(frozen=True)
class RandomWithSinks(RandomPolicy):
    """The first ``sinks`` slots kept, the rest scored like :class:`RandomPolicy` (seeded per layer)."""

    sinks: int = 4
    name = "random_sinks"
