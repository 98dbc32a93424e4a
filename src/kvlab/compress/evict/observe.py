"""What eviction policies look at: the cache plus the queries that attended to it.

:func:`observe` prefills a text once, capturing each layer's query projection with a forward hook
(read-only) and rotating it with the model's RoPE, so attention weights can be recomputed exactly
for any subset of queries without asking transformers for ``[L, H, T, T]`` attention tensors.

Shapes: queries per layer ``[batch, q_heads, T, head_dim]`` (post-RoPE); keys ``[batch, kv_heads,
T, head_dim]``; attention ``[batch, q_heads, n_queries, T]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.cache.handle_view import HandleView
from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import UnsupportedModelError
from kvlab.rope.ops import apply_rope
from kvlab.rope.spec import rope_for_layer


@dataclass(frozen=True, eq=False)
class Observation:
    """A prefilled context: its snapshot, every layer's post-RoPE queries, logits, and the softmax scale.

    ``views`` keeps the per-layer views :func:`~kvlab.compress.evict.select.layer_views` builds, so what a
    view derives once (H2O's attention received from every query: ``T x T`` per layer) is derived once per
    context, not once per policy and budget that evicts from it.
    """

    snapshot: KVSnapshot
    queries: tuple[torch.Tensor, ...]
    logits: torch.Tensor
    scaling: float
    views: list = field(default_factory=list, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return self.snapshot.num_layers


def attention_modules(model: torch.nn.Module) -> list[Any]:
    """The self-attention modules in layer order; refuses layouts kvlab cannot re-derive queries for."""
    mods = [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "q_proj")]
    if not mods:
        raise UnsupportedModelError(
            "no self_attn.q_proj modules found: kvlab observes Llama-style attention only"
        )
    for m in mods:
        if any(hasattr(m, a) for a in ("q_norm", "q_layernorm")):
            raise UnsupportedModelError(
                "this model normalises queries (q_norm); kvlab's query capture does not model it"
            )
    return mods


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, Hq, T, D]`` by repeating each KV head for its query group (GQA)."""
    rep = q_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def attention_weights(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, query_slots: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention ``[B, Hq, n, T]`` of ``queries [B, Hq, n, D]`` over ``keys [B, Hkv, T, D]``.

    ``query_slots [n]`` are the cache slots of the queries (causal: slot i sees keys 0..i); None means
    the queries come after the cache and see every key.
    """
    k = expand_kv(keys.float(), queries.shape[1])
    scores = torch.matmul(queries.float(), k.transpose(-1, -2)) * scaling
    if query_slots is not None:
        t = keys.shape[-2]
        mask = torch.arange(t, device=keys.device)[None, :] > query_slots.to(keys.device)[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


@torch.no_grad()
def observe(handle: HandleView, tokens: list[int] | torch.Tensor, *, all_logits: bool = False) -> Observation:
    """Prefill ``tokens`` and capture every layer's queries (the model is left as it was).

    ``logits`` are ``[T, vocab]`` with ``all_logits=True``, else only the last row ``[1, vocab]``.
    """
    mods = attention_modules(handle.model)
    rope = handle.rope
    captured: list[torch.Tensor] = []
    hooks = [m.q_proj.register_forward_hook(lambda _m, _i, out: captured.append(out.detach())) for m in mods]
    try:
        fwd = handle.prefill(tokens, all_logits=all_logits)
    finally:
        for h in hooks:
            h.remove()
    snap = fwd.snapshot
    d = snap.head_dim
    queries = []
    for i, q in enumerate(captured):
        b, t, _ = q.shape
        q = q.view(b, t, -1, d).transpose(1, 2)
        spec = rope_for_layer(rope, i)  # hybrid models rotate each layer type with its own base
        queries.append(apply_rope(q, snap.positions, spec).float() if spec is not None else q.float())
    scaling = float(getattr(mods[0], "scaling", d**-0.5))
    return Observation(snapshot=snap, queries=tuple(queries), logits=fwd.logits, scaling=scaling)
