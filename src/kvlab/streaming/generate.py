"""Endless greedy (or sampled) generation with constant memory: kvlab's own loop over a RollingCache.

Unlike ``model.generate``, the loop never passes ``position_ids``: the model takes the next position
from ``cache.get_seq_length()``, so the cache can re-base and positions never pass the model's maximum.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvlab.errors import BadInputError
from kvlab.hf.rolling_cache import RollingCache
from kvlab.loop import Sampling, decode_loop
from kvlab.model.handle import ModelLike, as_handle


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
def feed(
    handle: ModelLike, cache: RollingCache, token_ids: Sequence[int], chunk: int | None = None
) -> torch.Tensor:
    """Run ``token_ids`` through the cache in pieces of at most ``chunk`` tokens; returns the last ``[vocab]`` logits.

    ``handle``: a :class:`~kvlab.model.ModelHandle` or a plain Hugging Face causal LM."""
    handle = as_handle(handle)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=handle.device)[None]
    if ids.shape[1] == 0:
        raise BadInputError("nothing to feed: give at least one token")
    chunk = chunk or cache.headroom
    logits = torch.empty(0, device=handle.device)
    for start in range(0, ids.shape[1], chunk):
        logits = handle.run(ids[:, start : start + chunk], cache, logits_to_keep=1).logits[0, -1].float()
    return logits


@torch.no_grad()
def stream_generate(
    handle: ModelLike,
    cache: RollingCache,
    first_logits: torch.Tensor,
    max_new_tokens: int | None = None,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
) -> Iterator[StreamEvent]:
    """Yield tokens one at a time, forever if ``max_new_tokens`` is None (greedy unless ``temperature > 0``).

    Every yielded token has been fed to the cache, so the next call can continue from it. The loop
    is :func:`kvlab.loop.decode_loop`; this adds what the rolling cache did at each step.
    """
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    before: dict[str, int] = {}

    def feed_one(tokens: torch.Tensor) -> torch.Tensor:
        before.update(rolls=cache.rolls, rebases=cache.rebases, position=cache.next_position)
        return feed(handle, cache, tokens.tolist())

    for step in decode_loop(
        feed_one, first_logits, max_new_tokens, sampling=sampling, stop_ids=stop_ids, feed_last=True
    ):
        yield StreamEvent(
            token_id=step.token(0),
            step=step.step,
            position=before["position"],
            kept=cache.kept,
            rolled=cache.rolls > before["rolls"],
            rebased=cache.rebases > before["rebases"],
            seconds=step.seconds,
        )


@dataclass
class HeldBytes:
    """K/V bytes a live cache holds: ``now`` (after the last step) and ``peak`` (the most after any step)."""

    now: int = 0
    peak: int = 0

    def see(self, cache) -> None:
        from kvlab.hf.policy_cache import held_bytes

        self.now = held_bytes(cache)
        self.peak = max(self.peak, self.now)

    def to_json(self) -> dict:
        return {"held_bytes": self.now, "peak_held_bytes": self.peak}


@torch.no_grad()
def policy_generate(
    handle: ModelLike,
    cache,
    token_ids: Sequence[int],
    max_new_tokens: int | None = None,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    held: HeldBytes | None = None,
) -> Iterator[int]:
    """Token ids generated after ``token_ids`` over any live cache :func:`kvlab.policy.cache_for`
    makes (``held`` sees the cache after the prompt and after every step).

    A :class:`RollingCache` (sinks + window, with or without a codec) streams as :func:`stream_generate`
    does (fed in pieces of its headroom; the cache re-bases); any other cache (a scored layout keeping its
    budget ``every=`` N tokens, a codec over every slot, the full cache) takes the prompt in one forward
    and then one token per step through :func:`kvlab.loop.decode_loop`."""
    handle = as_handle(handle)
    held = held if held is not None else HeldBytes()
    if isinstance(cache, RollingCache):
        first = feed(handle, cache, token_ids)
        held.see(cache)
        events = stream_generate(
            handle, cache, first, max_new_tokens, temperature=temperature, seed=seed, stop_ids=stop_ids
        )
        for ev in events:
            held.see(cache)
            yield ev.token_id
        return
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=handle.device)[None]
    if ids.shape[1] == 0:
        raise BadInputError("nothing to feed: give at least one token")
    first = handle.run(ids, cache, logits_to_keep=1).logits[0, -1].float()
    held.see(cache)

    def feed_one(tokens: torch.Tensor) -> torch.Tensor:
        logits = handle.run(tokens.to(handle.device)[None], cache, logits_to_keep=1).logits[0, -1].float()
        held.see(cache)
        return logits

    sampling = Sampling(temperature=temperature, seed=seed)
    for step in decode_loop(
        feed_one, first, max_new_tokens, sampling=sampling, stop_ids=stop_ids, feed_last=True
    ):
        yield step.token(0)
