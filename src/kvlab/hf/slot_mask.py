"""Hiding cached slots per layer and KV head: how a masked :class:`~kvlab.cache.KVSnapshot` (an evicted
cache, a ragged per-head budget) runs through the model.

Invariant: a forward over a masked snapshot equals a forward over the cache that holds only the valid
slots, each at its own position (tested against compacted caches to float32 rounding). Masked slots stay
in the tensors and are hidden from attention; the new tokens attend causally among themselves, after
the context. A model with sliding-window layers (Gemma-3, Mistral) runs every forward over a snapshot
here, masked or not: kvlab's snapshots hold every token in every layer, and each sliding layer's window
is applied on the slots' RoPE positions (``p_q - p_k < window``, transformers' rule), so a snapshot
longer than the window runs as the model would have run its tokens.

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
from kvlab.hf.cache_steps import attention_extras
from kvlab.hf.step import Step, causal_after, grouped_sdpa, stepping

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class SlotMaskStep(Step):
    """A forward in progress over a past: per layer the context's ``valid [B, Hkv, T]`` (None: every slot
    visible), and for a model with sliding-window layers each layer's window (None: full attention),
    applied on RoPE positions: ``context`` ``[T]`` are the past's slots' positions, ``fed`` those of the
    tokens fed after it (``[n]``, or an int: the first of a contiguous run)."""

    def __init__(
        self,
        valid: Sequence[torch.Tensor] | None,
        *,
        context: torch.Tensor | None = None,
        fed: torch.Tensor | int = 0,
        windows: Sequence[int | None] = (),
    ) -> None:
        self.valid = None if valid is None else tuple(valid)
        self.context = None if context is None else context.to("cpu", torch.long)
        self.fed, self.windows = fed, tuple(windows)
        # the last window mask built: the layers of a forward share it
        self._near: tuple[tuple, torch.Tensor] | None = None
        if self.valid is None and self.context is None:
            raise ValueError("a slot mask needs the past's valid slots or its positions")

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
    ) -> tuple[torch.Tensor, Any]:
        """SDPA with a per-head mask: hidden context slots masked, the new tokens causal, a sliding layer's
        slots beyond its window masked; each KV head's query heads stacked
        (:func:`~kvlab.hf.step.grouped_sdpa`: the keys and values are never copied)."""
        i = module.layer_idx
        m = int(self.context.numel()) if self.context is not None else self.valid[i].shape[-1]  # type: ignore[index]
        b, _, q_len, _ = query.shape
        kv_heads, total = key.shape[1], key.shape[-2]
        new = total - m  # the new tokens fed so far, the last q_len of them being these queries
        if self.valid is None:
            ctx = torch.ones(1, 1, q_len, m, dtype=torch.bool, device=query.device)
        else:
            ctx = self.valid[i].to(query.device)[:, :, None, :].expand(b, kv_heads, q_len, m)
        causal = causal_after(q_len, new, query.device)
        mask = torch.cat([ctx, causal.expand(*ctx.shape[:2], q_len, new)], dim=-1)
        window = self.windows[i] if self.windows else None
        if window is not None:
            at = (window, m, new, q_len, query.device)
            if self._near is None or self._near[0] != at:
                self._near = at, self._within(window, m, new, q_len).to(query.device)
            mask = mask & self._near[1]
        kw.pop("is_causal", None)
        return grouped_sdpa(module, query, key, value, mask, **kw)

    def _within(self, window: int, m: int, new: int, q_len: int) -> torch.Tensor:
        """``[q_len, m + new]``: which slots lie within ``window`` positions of each query (transformers'
        rule, ``p_q - p_k < window``, on the slots' RoPE positions)."""
        if self.context is None:
            raise ValueError("a sliding window needs the past's positions")
        fed = (  # positions: host-side metadata
            torch.arange(self.fed, self.fed + new, device="cpu")
            if isinstance(self.fed, int)
            else self.fed[:new].cpu()
        )
        at = torch.cat((self.context, fed))
        return (at[-q_len:, None] - at[None, :]) < window


def check_model(model: PreTrainedModel, windowed: bool = False) -> None:
    """Refuse a model whose attention is not plain softmax over the slots (a mask alone cannot model it); a
    sliding window passes where the step applies it (``windowed``)."""
    extras = attention_extras(model) - ({"sliding window"} if windowed else set())
    if extras:
        raise UnsupportedModelError(
            f"a masked (evicted) cache runs plain softmax attention; this model's has {', '.join(sorted(extras))}"
        )


@contextlib.contextmanager
def hidden_slots(
    model: PreTrainedModel,
    valid: Sequence[torch.Tensor] | None,
    *,
    context: torch.Tensor | None = None,
    fed: torch.Tensor | int = 0,
    windows: Sequence[int | None] = (),
) -> Iterator[None]:
    """The model attending with ``valid``'s False slots hidden (per layer ``[B, Hkv, T]``, the first ``T``
    cached slots; None: none hidden) and, given ``windows`` (per layer, None for full attention), each
    sliding layer's window over the positions of the past's slots (``context``) and of those ``fed``
    after it (:class:`SlotMaskStep`), for the forwards run inside."""
    check_model(model, windowed=any(w is not None for w in windows))
    with stepping(model, SlotMaskStep(valid, context=context, fed=fed, windows=windows)):
        yield
