"""Hiding cached slots per layer and KV head: how a masked :class:`~kvlab.cache.KVSnapshot` (an evicted
cache, a ragged per-head budget) runs through the model.

Invariant: a forward over a masked snapshot equals a forward over the cache that holds only the valid
slots, each at its own position (tested against compacted caches to float32 rounding). Masked slots stay
in the tensors and are hidden from attention; the new tokens attend causally among themselves, after
the context.

A :class:`~kvlab.hf.step.Step` (answering kvlab's one registered attention function; no model code
patched) holds each layer's mask ``[B, Hkv, T]`` for the length of one forward (:func:`hidden_slots`);
the model's own mask (one for all layers) cannot say that layers, and heads within a layer, keep
different slots.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvlab.errors import UnsupportedModelError
from kvlab.hf.cache_steps import attends_plainly
from kvlab.hf.step import Step, causal_after, grouped_sdpa, stepping

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class SlotMaskStep(Step):
    """A masked forward in progress: per layer the context's ``valid [B, Hkv, T]``."""

    def __init__(self, valid: Sequence[torch.Tensor]) -> None:
        self.valid = tuple(valid)

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
    ) -> tuple[torch.Tensor, Any]:
        """SDPA with a per-head mask: hidden context slots masked, the new tokens causal; each KV head's
        query heads stacked (:func:`~kvlab.hf.step.grouped_sdpa`: the keys and values are never copied)."""
        valid = self.valid[module.layer_idx]
        m = valid.shape[-1]
        b, _, q_len, _ = query.shape
        kv_heads, total = key.shape[1], key.shape[-2]
        new = total - m  # the new tokens fed so far, the last q_len of them being these queries
        ctx = valid.to(query.device)[:, :, None, :].expand(b, kv_heads, q_len, m)
        causal = causal_after(q_len, new, query.device)
        mask = torch.cat([ctx, causal.expand(b, kv_heads, q_len, new)], dim=-1)
        kw.pop("is_causal", None)
        return grouped_sdpa(module, query, key, value, mask, **kw)


def check_model(model: PreTrainedModel) -> None:
    """Refuse a model whose attention is not plain softmax over the slots (a mask alone cannot model it)."""
    if not attends_plainly(model):
        raise UnsupportedModelError(
            "a masked (evicted) cache runs plain softmax attention (no sliding window, soft-capping or "
            "learned sinks)"
        )


@contextlib.contextmanager
def hidden_slots(model: PreTrainedModel, valid: Sequence[torch.Tensor]) -> Iterator[None]:
    """The model attending with ``valid``'s False slots hidden (per layer ``[B, Hkv, T]``, the first ``T``
    cached slots), for the forwards run inside."""
    check_model(model)
    with stepping(model, SlotMaskStep(valid)):
        yield
