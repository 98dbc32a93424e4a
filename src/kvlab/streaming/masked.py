"""A rolling cache's perplexity at the cost of one forward pass: its visibility rebuilt as a mask.

Feeding a :class:`~kvlab.hf.rolling_cache.RollingCache` ``feed`` tokens per forward is a token loop:
hundreds of small forwards per method. But what each query sees is known in advance: while nothing
has been evicted, every earlier token; after ``d`` window tokens have been evicted, the ``sinks``
first tokens re-positioned to sit right before the window, then tokens ``sinks + d .. i``. So the
same per-token NLL comes from a few large masked forwards (blocks of ``block`` queries):

* stream token ``t`` is computed once, at position ``t``, seeing exactly what the cache let it see
  when it was fed (its K/V then serves every later query, as the cache's does);
* the re-positioned sinks are extra key slots: for each eviction count ``d``, the sinks' keys
  rotated from their positions ``0 ..`` to ``d ..`` (an exact RoPE shift, as the cache re-rotates
  them; values unchanged), visible only to the queries fed after ``d`` evictions;
* between blocks, slots no later query can see are dropped, so a block attends to at most the
  window, one eviction chunk, the block and a few sink copies.

Relative positions do not depend on the cache's re-base mode, so one schedule serves ``window``,
``window_abs`` and every ``sinks{s}`` method; the token loop stays the reference
(``tests/test_streaming_masked.py`` proves them equal within fp32 rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvlab.cache.snapshot import KVSnapshot, concat
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.masked import forward_masked
from kvlab.metrics.logits import nll
from kvlab.model.handle import ModelHandle, ModelLike, as_handle
from kvlab.policy.window import SinksWindow


def evicted_before(n_queries: int, *, sinks: int, window: int, feed: int, evict_chunk: int) -> np.ndarray:
    """``[n_queries]``: window tokens a :class:`RollingCache` has evicted when query ``i`` is fed.

    Replays the cache's own bookkeeping (the pending drop is applied at the start of the next feed,
    in multiples of ``evict_chunk``, via :meth:`SinksWindow.overflow`).
    """
    policy = SinksWindow(sinks, window)
    out = np.zeros(n_queries, dtype=np.int64)
    slots = dropped = pending = 0
    for start in range(0, n_queries, feed):
        stop = min(start + feed, n_queries)
        dropped += pending
        slots -= pending
        out[start:stop] = dropped
        slots += stop - start
        pending = policy.overflow(slots, evict_chunk)
    return out


@torch.no_grad()
def masked_rolling_nll(
    handle: ModelLike,
    ids: torch.Tensor,
    *,
    sinks: int,
    window: int,
    feed: int,
    evict_chunk: int,
    block: int = 256,
    on_progress: Callable[[int], None] | None = None,
    on_logits: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> np.ndarray:
    """Per-token NLL ``[n - 1]`` of ``ids [n]`` (targets ``1 .. n-1``) under a rolling cache of ``sinks`` +
    ``window`` fed ``feed`` tokens at a time, evicting ``evict_chunk`` at once: what
    :func:`kvlab.streaming.stream_nll` computes token loop by token loop, in about ``n / block`` forwards.
    ``handle``: a :class:`~kvlab.model.ModelHandle` or a plain Hugging Face causal LM. ``on_logits(rows,
    logits)`` sees each block's logits ``[len(rows), vocab]`` for the queries ``rows`` (query ``i``
    predicts token ``i + 1``)."""
    handle = as_handle(handle)
    # the schedule (ids, slots, what each query sees) is host bookkeeping; forward_masked moves what it feeds
    ids = torch.as_tensor(ids, dtype=torch.long, device="cpu").reshape(-1)
    n_q = ids.numel() - 1
    if n_q < 1 or block < 1:
        raise BadInputError("masked evaluation needs at least 2 tokens and a block of at least 1")
    if handle.rope is None:
        raise UnsupportedModelError(
            "masked rolling evaluation re-positions sinks, which needs a model with RoPE"
        )
    handle.rope.require_shift_exact("masked rolling evaluation")
    dropped = torch.from_numpy(  # device: host bookkeeping, like the rest of the schedule
        evicted_before(n_q, sinks=sinks, window=window, feed=feed, evict_chunk=evict_chunk)
    )
    live: KVSnapshot | None = None
    sink_keys: KVSnapshot | None = None
    slot_stream = slot_copy = torch.zeros(
        0, dtype=torch.long, device="cpu"
    )  # per live slot: stream index | copy's d
    out, b0 = [], 0
    while b0 < n_q:
        b1 = min(b0 + block, n_q)
        if sinks and sink_keys is None and bool((dropped[b0:b1] > 0).any()):  # sinks not computed yet
            b1 = min(b1, int((dropped > 0).nonzero()[0]))
        copies = sorted(set(dropped[b0:b1].tolist()) - set(slot_copy.tolist()) - {0}) if sinks else []
        if copies:
            live, slot_stream, slot_copy = _add_sink_copies(live, sink_keys, copies, slot_stream, slot_copy)
        q = torch.arange(b0, b1, device="cpu")
        visible = _visible(
            torch.cat((slot_stream, q)), torch.cat((slot_copy, torch.zeros_like(q))), q, dropped[q], sinks
        )
        keys, values, logits = forward_masked(handle, live, ids[q], q, visible)
        out.append(nll(logits, ids[b0 + 1 : b1 + 1]))
        if on_logits:
            on_logits(q, logits)
        added = _snapshot(handle, keys, values, ids[q], q)
        live = added if live is None else concat(live, added)
        slot_stream, slot_copy = torch.cat((slot_stream, q)), torch.cat((slot_copy, torch.zeros_like(q)))
        if sinks and sink_keys is None and b1 >= sinks:
            sink_keys = live.select(torch.nonzero((slot_stream >= 0) & (slot_stream < sinks)).flatten())
        if b1 < n_q:  # keep only what a later query can see
            d = int(dropped[b1])
            keep = (slot_stream >= sinks + d) | ((d == 0) & (slot_stream >= 0)) | (slot_copy >= max(d, 1))
            idx = keep.nonzero().flatten()
            live, slot_stream, slot_copy = live.select(idx), slot_stream[idx], slot_copy[idx]
        if on_progress:
            on_progress(b1 - b0)
        b0 = b1
    return torch.cat(out).cpu().numpy()


def _add_sink_copies(live, sink_keys, copies: list[int], slot_stream, slot_copy):
    """Append, per eviction count ``d``, the sinks re-rotated to positions ``d ..`` (right before the window,
    as the cache re-rotates them; values unchanged)."""
    if live is None or sink_keys is None:
        raise RuntimeError("sink copies are needed before the sinks were computed")
    sinks = sink_keys.seq_len
    for d in copies:
        live = concat(live, sink_keys.with_positions(torch.arange(d, d + sinks, device="cpu")))
        slot_stream = torch.cat((slot_stream, torch.full((sinks,), -1, device="cpu")))
        slot_copy = torch.cat((slot_copy, torch.full((sinks,), d, device="cpu")))
    return live, slot_stream, slot_copy


def _visible(
    k_stream: torch.Tensor, k_copy: torch.Tensor, q: torch.Tensor, q_dropped: torch.Tensor, sinks: int
) -> torch.Tensor:
    """``[queries, keys]`` bool. Key slots are stream tokens (``k_stream >= 0``) or sink copies for eviction
    count ``k_copy``; query ``i`` fed after ``d`` evictions sees tokens ``<= i`` (only ``sinks + d ..``
    once ``d > 0``) and the sink copy for ``d``."""
    ks, kc = k_stream[None, :], k_copy[None, :]
    qi, d = q[:, None], q_dropped[:, None]
    stream = (ks >= 0) & (ks <= qi) & ((d == 0) | (ks >= sinks + d))
    return stream | ((ks < 0) & (kc == d) & (d > 0))


def _snapshot(
    handle: ModelHandle,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    tokens: torch.Tensor,
    positions: torch.Tensor,
) -> KVSnapshot:
    return KVSnapshot(
        keys=keys,
        values=values,
        token_ids=tokens[None],
        positions=positions,
        rope=handle.rope,
        fingerprint=handle.fingerprint,
        model_name=handle.name,
        provenance="edited",
    )
