"""What eviction policies look at: the cache plus the queries that attended to it.

:func:`observe` prefills a text once, capturing each layer's query projection with a forward hook
(read-only) and rotating it with the model's RoPE, so attention weights can be recomputed exactly
for any subset of queries without asking transformers for ``[L, H, T, T]`` attention tensors.

Shapes: queries per layer ``[batch, q_heads, T, head_dim]`` (post-RoPE); keys ``[batch, kv_heads,
T, head_dim]``; attention ``[batch, q_heads, n_queries, T]``.

A score that reads another pass than the prompt's own (KVzip's reconstruction) names its tokens with
:meth:`~kvlab.policy.evict.policies.Policy.probe_ids`; :meth:`Observation.probe` runs that pass through
the handle the observation was made with, once per probe, and keeps it (a :class:`Probe`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvlab.cache.handle_view import HandleView
from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.rope.layers import sliding_windows
from kvlab.rope.ops import apply_rope
from kvlab.rope.spec import Rope, rope_for_layer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

R = TypeVar("R")


@dataclass(frozen=True, eq=False)
class Probe:
    """An extra pass a score asked for: ``ids`` fed right after the context, on its cache (every probe
    token attends to the whole context and to the probe tokens before it).

    Per layer: ``queries [B, Hq, n, D]`` of the ``n`` probe tokens (post-RoPE, at positions ``T..T+n-1``)
    and ``keys [B, Hkv, T + n, D]``, the context's keys (the observed ones) then the probe's.
    """

    ids: tuple[int, ...]
    queries: tuple[torch.Tensor, ...]
    keys: tuple[torch.Tensor, ...]


@dataclass(frozen=True, eq=False)
class Observation:
    """A prefilled context: its snapshot, every layer's post-RoPE queries, logits, and the softmax scale.

    ``views`` keeps the per-layer views :func:`~kvlab.policy.evict.select.layer_views` builds, so what a
    view derives once (H2O's attention received from every query: ``T x T`` per layer) is derived once per
    context, not once per policy and budget that evicts from it. ``handle`` (set by :func:`observe`) runs
    the extra passes scores ask for (:meth:`probe`); ``probes`` keeps them by their tokens.
    """

    snapshot: KVSnapshot
    queries: tuple[torch.Tensor, ...]
    logits: torch.Tensor
    scaling: float
    views: list = field(default_factory=list, repr=False, compare=False)
    handle: HandleView | None = field(default=None, repr=False, compare=False)
    probes: dict = field(default_factory=dict, repr=False, compare=False)
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full); empty: no sliding layer

    @property
    def num_layers(self) -> int:
        return self.snapshot.num_layers

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The handle's tokenizer, where it has one (a probe's text is encoded with it)."""
        return getattr(self.handle, "tokenizer", None)

    def probe(self, ids: list[int]) -> Probe:
        """The pass of ``ids`` right after this context (run once per ``ids``, then kept), attending to the
        observed K/V, through the handle this observation was made with."""
        key = tuple(int(i) for i in ids)
        if key not in self.probes:
            if self.handle is None or not key:
                raise BadInputError(
                    "this score reads an extra pass after the context: observe the context with "
                    "kvlab.policy.observe(handle, tokens) (it keeps the handle) and give it tokens"
                )
            if self.snapshot.batch_size != 1:
                raise BadInputError("an extra pass after the context runs on one sequence (batch 1)")
            self.probes[key] = _probe_pass(self.handle, self.snapshot, key)
        return self.probes[key]


def attention_modules(model: torch.nn.Module) -> list[Any]:
    """The self-attention modules in layer order; refuses layouts kvlab cannot re-derive queries for."""
    mods = [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "q_proj")]
    if not mods:
        raise UnsupportedModelError(
            "no self_attn.q_proj modules found: kvlab observes Llama-style attention only"
        )
    for m in mods:
        if getattr(m, "q_layernorm", None) is not None:
            raise UnsupportedModelError(
                "this model normalises queries with q_layernorm; kvlab's query capture models q_norm only"
            )
    return mods


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, Hq, T, D]`` by repeating each KV head for its query group (GQA)."""
    rep = q_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def attention_weights(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_slots: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Softmax attention ``[B, Hq, n, T]`` of ``queries [B, Hq, n, D]`` over ``keys [B, Hkv, T, D]``.

    ``query_slots [n]`` are the cache slots of the queries (causal: slot i sees keys 0..i); None means
    the queries come after the cache and see every key. ``window``: a sliding layer's, over slots (a
    query at slot i sees slots after ``i - window``; an observed prefill's slots are its positions).
    """
    k = expand_kv(keys.float(), queries.shape[1])
    scores = torch.matmul(queries.float(), k.transpose(-1, -2)) * scaling
    if query_slots is not None:
        t = keys.shape[-2]
        at, q = torch.arange(t, device=keys.device)[None, :], query_slots.to(keys.device)[:, None]
        mask = (at > q) | (q - at >= window) if window is not None else at > q
        scores = scores.masked_fill(mask, float("-inf"))
    elif window is not None:
        raise ValueError("a window needs the queries' slots")
    return torch.softmax(scores, dim=-1)


@torch.no_grad()
def observe(handle: HandleView, tokens: list[int] | torch.Tensor) -> Observation:
    """Prefill ``tokens`` and capture every layer's queries (the model is left as it was).

    ``logits`` are the last row only, ``[1, vocab]``.
    """
    mods = attention_modules(handle.model)
    fwd, raw = _capturing(mods, lambda: handle.prefill(tokens, all_logits=False))
    snap = fwd.snapshot
    queries = _rotated(raw, snap.positions, handle.rope, snap.head_dim)
    windows = tuple(sliding_windows(handle.config))
    return Observation(
        snap,
        queries,
        fwd.logits,
        _scaling(mods, snap.head_dim),
        handle=handle,
        windows=windows if any(w is not None for w in windows) else (),
    )


@torch.no_grad()
def _probe_pass(handle: HandleView, snap: KVSnapshot, ids: tuple[int, ...]) -> Probe:
    """``ids`` fed after ``snap`` (at the positions after it, attending to every slot): their queries and
    every layer's keys, the snapshot's then theirs. ``snap`` is left as it was."""
    mods = attention_modules(handle.model)
    fwd, raw = _capturing(mods, lambda: handle.forward(list(ids), snap, all_logits=False))
    out = fwd.snapshot
    queries = _rotated(raw, out.positions[snap.seq_len :], handle.rope, snap.head_dim)
    return Probe(ids, queries, out.keys)


def _capturing(mods: list[Any], run: Callable[[], R]) -> tuple[R, list[torch.Tensor]]:
    """``run()`` with every layer's queries before RoPE captured ``[B, n, Hq * D]``: ``q_proj``'s output, put
    through the layer's own ``q_norm`` where it has one (Qwen3, Gemma-3, OLMo-2). Read-only hooks, removed
    after."""
    captured: list[torch.Tensor] = []

    def hook(m: Any) -> Callable[..., None]:
        return lambda _m, _i, out: captured.append(prerope_queries(m, out.detach()))

    hooks = [m.q_proj.register_forward_hook(hook(m)) for m in mods]
    try:
        return run(), captured
    finally:
        for h in hooks:
            h.remove()


def prerope_queries(module: Any, q: torch.Tensor) -> torch.Tensor:
    """``q_proj``'s output ``[B, n, Hq * D]`` as the layer's attention sees it before RoPE: through its
    ``q_norm``, over each head (a ``[D]`` or ``[Hq, D]`` weight: Qwen3, Gemma-3) or the whole projection
    (OLMo-2); an elementwise norm, so the layout the model applies it in does not change it."""
    norm = getattr(module, "q_norm", None)
    if norm is None:
        return q
    weight = getattr(norm, "weight", None)
    head_dim = int(getattr(module, "head_dim", 0))
    b, n, width = q.shape
    if weight is not None and weight.shape == (width,):
        return norm(q)
    if (
        weight is None
        or not head_dim
        or tuple(weight.shape) not in ((head_dim,), (width // head_dim, head_dim))
    ):
        raise UnsupportedModelError(
            f"this model's q_norm ({type(norm).__name__}, weight {tuple(getattr(weight, 'shape', ()))}) "
            "is neither per head nor over the whole projection: kvlab's query capture does not model it"
        )
    return norm(q.view(b, n, width // head_dim, head_dim)).reshape(b, n, width)


def _rotated(
    raw: list[torch.Tensor], positions: torch.Tensor, rope: Rope | None, head_dim: int
) -> tuple[torch.Tensor, ...]:
    """``q_proj`` outputs ``[B, n, Hq * D]`` as post-RoPE queries ``[B, Hq, n, D]`` (float32)."""
    queries = []
    for i, q in enumerate(raw):
        b, t, _ = q.shape
        q = q.view(b, t, -1, head_dim).transpose(1, 2)
        spec = rope_for_layer(rope, i)  # hybrid models rotate each layer type with its own base
        queries.append(apply_rope(q, positions, spec).float() if spec is not None else q.float())
    return tuple(queries)


def _scaling(mods: list[Any], head_dim: int) -> float:
    return float(getattr(mods[0], "scaling", head_dim**-0.5))
