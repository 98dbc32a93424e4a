"""Endless greedy (or sampled) generation with constant memory: kvlab's own loop over a RollingCache.

Unlike ``model.generate``, the loop never passes ``position_ids``: the model takes the next position
from ``cache.get_seq_length()``, so the cache can re-base and positions never pass the model's maximum.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvlab.errors import BadInputError
from kvlab.hf.rolling_cache import RollingCache


@dataclass(frozen=True)
class StreamEvent:
    """One generated token: its id, the cache state after it, and whether a roll/re-base just happened."""

    token_id: int
    step: int
    position: int  # RoPE position the token was fed at
    kept: int  # tokens the cache holds
    rolled: bool
    rebased: bool
    seconds: float  # wall time of this step


@torch.no_grad()
def feed(handle, cache: RollingCache, token_ids: Sequence[int], chunk: int | None = None) -> torch.Tensor:
    """Run ``token_ids`` through the cache in pieces of at most ``chunk`` tokens; returns the last ``[vocab]`` logits."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=handle.device)[None]
    if ids.shape[1] == 0:
        raise BadInputError("nothing to feed: give at least one token")
    chunk = chunk or cache.headroom
    logits = None
    for start in range(0, ids.shape[1], chunk):
        out = handle.model(
            input_ids=ids[:, start : start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        logits = out.logits[0, -1].float()
    return logits


@torch.no_grad()
def stream_generate(
    handle,
    cache: RollingCache,
    first_logits: torch.Tensor,
    max_new_tokens: int | None = None,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
) -> Iterator[StreamEvent]:
    """Yield tokens one at a time, forever if ``max_new_tokens`` is None (greedy unless ``temperature > 0``).

    Every yielded token has been fed to the cache, so the next call can continue from it.
    """
    if temperature < 0:
        raise BadInputError(f"temperature must be >= 0, got {temperature}")
    gen = torch.Generator().manual_seed(seed)
    logits, step = first_logits, 0
    stops = set(int(s) for s in stop_ids)
    while max_new_tokens is None or step < max_new_tokens:
        if temperature > 0:
            probs = torch.softmax(logits.double() / temperature, dim=-1)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=gen))
        else:
            tok = int(torch.argmax(logits))
        rolls, rebases, pos = cache.rolls, cache.rebases, cache.next_position
        t0 = time.perf_counter()
        logits = feed(handle, cache, [tok])
        yield StreamEvent(
            tok, step, pos, cache.kept, cache.rolls > rolls, cache.rebases > rebases, time.perf_counter() - t0
        )
        step += 1
        if tok in stops:
            return
