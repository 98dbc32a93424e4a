"""One decode step for several rolling caches at once: one batched forward, each cache updated in place.

Continuous batching (the server, :mod:`kvlab.serve`) decodes every live conversation together. Each
conversation owns a :class:`~kvlab.hf.RollingCache` holding a different number of tokens at
different positions, so the rows are stacked left-padded into one transformers cache, a 4-D mask
hides the padding, each row's query sits at its own cache's ``next_position``, and the new token's
K/V per row are then appended to its own cache (applying the cache's pending roll, exactly as a
single-row step would). What each row computes equals that row's step alone up to the summation
order of a batched matmul (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab.errors import BadInputError
from kvlab.hf.cache import hf_cache_layers, new_hf_cache
from kvlab.hf.rolling_cache import RollingCache, RollingLayer


@torch.no_grad()
def step_rolling_rows(handle: Any, caches: Sequence[RollingCache], tokens: Sequence[int]) -> torch.Tensor:
    """Feed ``tokens[r]`` to ``caches[r]`` for every row in one forward; returns ``[rows, vocab]`` logits.

    Writes into every cache (one token each; in place, like any decode step). A single row takes the
    plain path (:meth:`ModelHandle.run` on its own cache).
    """
    if len(caches) != len(tokens) or not caches:
        raise BadInputError(f"need one token per cache, got {len(tokens)} tokens for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise BadInputError("a cache appears twice in one batched step")
    layers: list[list[RollingLayer]] = [list(c.layers) for c in caches]  # type: ignore[arg-type]
    if any(not per_layer[0].is_initialized for per_layer in layers):
        raise BadInputError("every cache must hold a prompt before a batched decode step")
    if len(caches) == 1:
        out = handle.run(torch.tensor([[int(tokens[0])]]), caches[0], logits_to_keep=1)
        return out.logits[:, -1].float()
    rows = len(caches)
    kept = [c.kept for c in caches]
    longest = max(kept)
    stacked = new_hf_cache(handle.config)
    for i in range(len(layers[0])):
        seen = [per_layer[i].visible() for per_layer in layers]
        k0, v0 = seen[0]
        keys = k0.new_zeros((rows, k0.shape[1], longest, k0.shape[-1]))
        values = v0.new_zeros((rows, v0.shape[1], longest, v0.shape[-1]))
        for r, (k, v) in enumerate(seen):
            keys[r, :, longest - kept[r] :] = k[0]
            values[r, :, longest - kept[r] :] = v[0]
        stacked.update(keys, values, i)
    dtype = handle.dtype
    mask = torch.zeros((rows, 1, 1, longest + 1), dtype=dtype)
    for r, n in enumerate(kept):
        mask[r, :, :, : longest - n] = torch.finfo(dtype).min
    positions = torch.tensor([[c.next_position] for c in caches], dtype=torch.long)
    ids = torch.tensor([[int(t)] for t in tokens], dtype=torch.long)
    out = handle.run(ids, stacked, positions=positions, attention_mask=mask, logits_to_keep=1)
    new = hf_cache_layers(stacked)
    for r, cache in enumerate(caches):
        with cache.choosing_positions():  # the row's query sat at next_position: a re-base may follow
            for layer, (k, v) in zip(layers[r], new, strict=True):
                layer.update(k[r : r + 1, :, -1:], v[r : r + 1, :, -1:])
    return out.logits[:, -1].float()
