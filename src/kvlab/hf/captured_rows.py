"""Conversations decoded through one captured step: what ``kvlab serve --capture`` and ``kvlab eval
--capture`` run.

Without it, each decode step feeds every conversation's own eager cache in one batched forward whose
attention runs per row (:func:`kvlab.hf.batch.step_rolling_rows`). With it, a conversation that starts
decoding joins a row of one :class:`~kvlab.hf.ring_rows.RingRows` (its eager cache's state, exactly), every
step runs all rows through :class:`~kvlab.hf.graphs.RollingDecoder` (``torch.compile``-d, or a CUDA graph),
and the conversation leaves back into its eager cache when its reply ends, so it continues, is stored
and is reported as before. The rows are sized for a rule (sinks + window in the model's dtype; the caller
checks its policy: :meth:`~kvlab.policy.layouts.base.CachePolicy.captured_roll`) and the most sinks a
conversation may keep (the server's pinned system prompts).
"""

from __future__ import annotations

import torch

from kvlab.hf.graphs import Mode, RollingDecoder
from kvlab.hf.ring_rows import RingRows
from kvlab.hf.rolling_cache import RollingCache, RollRule
from kvlab.hf.runner import Runner


class CapturedRows:
    """``rows`` decoding conversations in one :class:`RingRows`, stepped by one :class:`RollingDecoder`."""

    def __init__(self, handle: Runner, rule: RollRule, rows: int, mode: Mode, *, most_sinks: int) -> None:
        self.pool = RingRows(
            handle.config, rule, rows=rows, most_sinks=most_sinks, dtype=handle.dtype, device=handle.device
        )
        self.decoder = RollingDecoder(handle, self.pool, mode=mode)
        for width in self.pool.widths:  # compiled or captured now, before anything is served: a step
            self.pool.least = width  # of every width, no row fed (all write the scratch slot)
            self.step([], [])
        self.pool.least = 1

    def join(self, cache: RollingCache) -> int:
        """A conversation starts decoding: its eager cache's state into a free row; returns the row."""
        return self.pool.join(cache)

    def leave(self, row: int, into: RollingCache | None) -> None:
        """A conversation stops decoding: its row freed, its state written back ``into`` its eager cache
        (None: dropped, e.g. after a failed step)."""
        self.pool.leave(row, into)

    def evictions(self, row: int) -> int:
        return self.pool.row(row).evictions

    def step(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens[i]`` to row ``rows[i]`` (the other rows sit this step out); ``[len(rows), vocab]``
        float32 logits."""
        self.pool.feeding = list(rows)
        ids = torch.zeros(self.pool.batch, dtype=torch.long, device=self.pool.device)
        if rows:
            ids[rows] = torch.tensor(tokens, dtype=torch.long, device=self.pool.device)
        return self.decoder.feed(ids)[rows]
