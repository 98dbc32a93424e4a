"""Running a model after a :class:`~kvlab.compress.evict.budgets.RaggedCache` (KV heads holding different
numbers of slots).

The ragged cache stores only its kept slots. To compute, each layer's heads are padded to that layer's
largest head (zeros) in a transformers ``DynamicCache`` built for the call, and an attention function
registered through transformers' ``AttentionInterface`` (no model code patched) masks, per KV head, the
padding slots; the new tokens attend causally among themselves, after the context. Layers may hold
different lengths (a pyramid): the mask is built per layer from the keys it is given, never from the
model's one mask. The padding exists only while the forward runs; the memory a ragged cache holds is
:attr:`~kvlab.compress.evict.budgets.RaggedCache.nbytes`.

For uniform budgets this is the same computation as :func:`kvlab.hf.compressed_cache.logits_on_layers`
(tested equal to float32 rounding).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlab.errors import UnsupportedModelError

RAGGED_ATTENTION = "kvlab_ragged"


class _Active(threading.local):
    """The ragged forwards in progress in this thread: per layer ``(context slots, valid [B, Hkv, m])``."""

    def __init__(self) -> None:
        self.stack: list[dict[int, tuple[int, torch.Tensor]]] = []


_ACTIVE = _Active()


def _ragged_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
):
    """SDPA with a per-head mask: padding context slots hidden, the new tokens causal. Plain SDPA outside a
    ragged forward (a model left switched to it still computes right)."""
    if not _ACTIVE.stack:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    m, valid = _ACTIVE.stack[-1][module.layer_idx]
    b, heads, q_len, _ = query.shape
    kv_heads, total = key.shape[1], key.shape[-2]
    new = total - m  # the new tokens fed so far, the last q_len of them being these queries
    ctx = valid.to(query.device).repeat_interleave(heads // kv_heads, dim=1)[:, :, None, :]
    ctx = ctx.expand(b, heads, q_len, m)
    at = torch.arange(q_len, device=query.device)[:, None] + (new - q_len)
    causal = torch.arange(new, device=query.device)[None, :] <= at
    mask = torch.cat([ctx, causal.expand(b, heads, q_len, new)], dim=-1)
    kw.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kw)


AttentionInterface.register(RAGGED_ATTENTION, _ragged_attention)


def _check_model(model: Any) -> None:
    from kvlab.hf.compressed_cache import _attends_plainly

    if not _attends_plainly(model):
        raise UnsupportedModelError(
            "a ragged cache runs plain softmax attention (no sliding window, soft-capping or learned sinks)"
        )


@contextlib.contextmanager
def _ragged_forward(handle: Any, cache: Any) -> Iterator[DynamicCache]:
    """A padded ``DynamicCache`` of ``cache`` and the model switched to the ragged attention meanwhile."""
    model = handle.model
    _check_model(model)
    dyn = DynamicCache(config=handle.config)
    if len(dyn.layers) != cache.num_layers:
        raise UnsupportedModelError(
            f"the model has {len(dyn.layers)} cache layers, the ragged cache {cache.num_layers}"
        )
    state: dict[int, tuple[int, torch.Tensor]] = {}
    for i in range(cache.num_layers):
        k, v, valid = cache.padded(i)
        dyn.update(k.to(handle.device), v.to(handle.device), i)
        state[i] = (k.shape[-2], valid)
    before = model.config._attn_implementation
    model.set_attn_implementation(RAGGED_ATTENTION)
    _ACTIVE.stack.append(state)
    try:
        yield dyn
    finally:
        _ACTIVE.stack.pop()
        model.set_attn_implementation(before)


@torch.no_grad()
def ragged_logits(
    handle: Any, cache: Any, tokens: list[int], start_position: int | None = None
) -> torch.Tensor:
    """``[n, vocab]`` logits of ``tokens`` after a ragged cache, at ``start_position`` (default: the
    cache's ``next_position``) onward; the cache is not modified."""
    start = cache.next_position if start_position is None else int(start_position)
    with _ragged_forward(handle, cache) as dyn:
        positions = torch.arange(start, start + len(tokens), device=handle.device)
        ids = torch.as_tensor(tokens, device=handle.device)
        return handle.run(ids, dyn, positions=positions).logits[0].float()


@torch.no_grad()
def ragged_greedy(
    handle: Any, cache: Any, prompt: list[int], start_position: int | None, max_new_tokens: int
) -> list[int]:
    """Greedy tokens after a ragged cache plus ``prompt`` (:func:`kvlab.hf.compressed_cache.greedy_on_layers`'s
    loop); the cache is not modified."""
    from kvlab.loop import decode_loop

    start = cache.next_position if start_position is None else int(start_position)
    with _ragged_forward(handle, cache) as dyn:
        position = start + len(prompt)
        first = handle.run(
            torch.as_tensor(prompt, device=handle.device),
            dyn,
            positions=torch.arange(start, position, device=handle.device),
            logits_to_keep=1,
        ).logits[:, -1]

        def feed(tokens: torch.Tensor) -> torch.Tensor:
            nonlocal position
            at = torch.tensor([position], device=handle.device)
            out = handle.run(tokens[:, None], dyn, positions=at, logits_to_keep=1)
            position += 1
            return out.logits[:, -1]

        return [s.token(0) for s in decode_loop(feed, first, max_new_tokens)]
