"""Random eviction that keeps the attention sinks: the control for "do sinks alone explain it?".

``RandomPolicy`` keeps a uniform random budget; StreamingLLM keeps the sinks and the most recent
tokens. This baseline keeps the sinks and a uniform random choice of the rest, so the gap between it
and StreamingLLM measures recency, and the gap to plain random measures the sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compress.evict.policies import LayerView, Policy


@dataclass(frozen=True)
class RandomWithSinks(Policy):
    """The first ``sinks`` slots, then uniform random scores (seeded per layer, so runs repeat)."""

    sinks: int = 4
    seed: int = 0
    name = "random_sinks"

    def score(self, view: LayerView) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1000 + view.layer)
        b, h = view.keys.shape[:2]
        return torch.rand(b, h, view.seq_len, generator=gen)
