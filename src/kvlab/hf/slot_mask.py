"""Hiding cached slots per layer and KV head: how a masked :class:`~kvlab.cache.KVSnapshot` (an evicted
cache, a ragged per-head budget) runs through the model.

Invariant: a forward over a masked snapshot equals a forward over the cache that holds only the valid
slots, each at its own position (tested against compacted caches to float32 rounding). Masked slots stay
in the tensors and are hidden from attention; the new tokens attend causally among themselves, after
the context.

One attention function, registered through transformers' ``AttentionInterface`` (no model code
patched), reads each layer's mask ``[B, Hkv, T]`` from a per-thread stack that
:func:`hidden_slots` pushes for the length of one forward; the model's own mask (one for all layers)
cannot say that layers, and heads within a layer, keep different slots.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlab.errors import UnsupportedModelError

SLOT_MASK_ATTENTION = "kvlab_slot_mask"


class _Active(threading.local):
    """The masked forwards in progress in this thread: per layer the context's ``valid [B, Hkv, T]``."""

    def __init__(self) -> None:
        self.stack: list[Sequence[torch.Tensor]] = []


_ACTIVE = _Active()


def _slot_mask_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
):
    """SDPA with a per-head mask: hidden context slots masked, the new tokens causal. Plain SDPA outside a
    masked forward (a model left switched to it still computes right)."""
    if not _ACTIVE.stack:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    valid = _ACTIVE.stack[-1][module.layer_idx]
    m = valid.shape[-1]
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


AttentionInterface.register(SLOT_MASK_ATTENTION, _slot_mask_attention)


def check_model(model: Any) -> None:
    """Refuse a model whose attention is not plain softmax over the slots (a mask alone cannot model it)."""
    from kvlab.hf.compressed_cache import _attends_plainly

    if not _attends_plainly(model):
        raise UnsupportedModelError(
            "a masked (evicted) cache runs plain softmax attention (no sliding window, soft-capping or "
            "learned sinks)"
        )


@contextlib.contextmanager
def hidden_slots(model: Any, valid: Sequence[torch.Tensor]) -> Iterator[None]:
    """The model switched to the slot-mask attention, hiding ``valid``'s False slots (per layer
    ``[B, Hkv, T]``, the first ``T`` cached slots), for the forwards run inside."""
    check_model(model)
    before = model.config._attn_implementation
    model.set_attn_implementation(SLOT_MASK_ATTENTION)
    _ACTIVE.stack.append(tuple(valid))
    try:
        yield
    finally:
        _ACTIVE.stack.pop()
        model.set_attn_implementation(before)
