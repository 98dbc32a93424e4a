"""A drop-in transformers ``Cache`` that quantizes or evicts as the model runs (transformers 5.x layer API).

``CompressedCache(config, quantizer=...)`` stores every layer as full-precision sinks, packed
segments (any :class:`~kvlab.compress.quant.Quantizer`) and a full-precision recent tail; each
``update`` returns the decoded history plus the new tokens, so attention runs on what the cache
really holds. ``CompressedCache(config, policy=..., keep=0.5, model=model)`` lets the prefill attend
to everything, then keeps ``keep`` of the slots per layer and head (queries are captured by a
read-only hook on each ``q_proj``, removed as soon as the prefill is done).

Bookkeeping invariant: ``get_seq_length()`` is the number of tokens *seen* (so default position ids
continue at the original positions: evicted caches keep their positions), while the attention mask
and query offset use the number of slots *held*.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlab.compress.evict.observe import attention_modules
from kvlab.compress.evict.policies import LayerView, Policy
from kvlab.compress.evict.select import budget_slots, keep_indices
from kvlab.compress.quant.methods import Quantizer, Segment, split_plan
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.cache import PADDED_BATCH, rows_at_different_positions, sliding_windows
from kvlab.hf.rolling_cache import bind_to_model
from kvlab.rope.ops import apply_rope
from kvlab.rope.spec import Rope, rope_for_layer, rope_spec_from_config

# Per-token quantizers encode generated tokens in blocks of this many (they wait in the fp tail until then).
DECODE_BLOCK = 32
QUANT_ATTENTION = "kvlab_quantized"


def _bytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass(eq=False)
class _Step:
    """One decode forward on the packed codes: each layer's view, until its attention consumes it."""

    rule: Any
    views: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    consumed: int = 0
    paths: set[str] = field(default_factory=set)  # which packed-code paths the layers took


class _Steps(threading.local):
    """The packed-code steps in progress, per thread (another thread's forward sees none of them)."""

    def __init__(self) -> None:
        self.stack: list[_Step] = []

    def current(self, rule: Any) -> _Step | None:
        if self.stack and self.stack[-1].rule is rule:
            return self.stack[-1]
        return None


_STEPS = _Steps()


def _quantized_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
):
    """A decode query over its layer's packed segments plus the full-precision sinks, tail and new
    token (:func:`kvlab.compress.quant.attention.decode_attention`); plain SDPA for any other call."""
    step = _STEPS.stack[-1] if _STEPS.stack else None
    view = step.views.pop(module.layer_idx, None) if step is not None else None
    if view is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    from kvlab.compress.quant.attention import decode_attention

    plan, fp_k, fp_v = view
    b, heads, q_len, d = query.shape
    out = decode_attention(plan, query[0, :, -1], fp_k, fp_v, kw.get("scaling") or d**-0.5)
    step.consumed += 1
    step.paths.add(plan.path)
    return out.to(query.dtype).reshape(1, 1, heads, d), None


AttentionInterface.register(QUANT_ATTENTION, _quantized_attention)
_PACKED_OK: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _attends_plainly(model: Any) -> bool:
    """Softmax attention with nothing the packed-code step would drop (no logit soft-capping, no
    learned sinks, no sliding window), checked once per model."""
    if model not in _PACKED_OK:
        mods = [m for name, m in model.named_modules() if name.endswith("self_attn")]
        cfg = (
            model.config.get_text_config(decoder=True)
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        _PACKED_OK[model] = bool(mods) and not any(
            getattr(cfg, "attn_logit_softcapping", None)
            or getattr(m, "sinks", None) is not None
            or getattr(m, "sliding_window", None)
            or not hasattr(m, "layer_idx")
            for m in mods
        )
    return _PACKED_OK[model]


@dataclass(frozen=True)
class CompressionRule:
    """What every layer of one :class:`CompressedCache` applies (immutable, shared by the layers)."""

    num_layers: int
    quantizer: Quantizer | None = None
    policy: Policy | None = None
    keep: float | None = None
    rope: Rope | None = None
    scaling: float = 1.0
    packed_path: str = "auto"  # kvlab.compress.quant.attention.packed_path: kernel, torch or auto


class CompressedLayer(DynamicLayer):
    """One layer: ``sink_keys`` + packed ``segments`` + full-precision tail (``self.keys``/``self.values``).

    The layer owns its state and follows the shared :class:`CompressionRule`; with an attention-based
    eviction policy it also owns the hook that captures its queries (removed once it has evicted).
    """

    def __init__(self, rule: CompressionRule, index: int):
        super().__init__()
        self.rule, self.index = rule, index
        self.rope = rope_for_layer(rule.rope, index)  # this layer's RoPE (None: no RoPE on this layer)
        self.query_hook: Any = None
        self.seen = 0
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.segments: list[Segment] = []
        self.tail_positions = torch.zeros(0, dtype=torch.long, device="cpu")  # positions: host bookkeeping
        self.pending_queries: torch.Tensor | None = None
        self.evicted = False
        self._plan: Any = None  # kvlab.compress.quant.attention.SegmentPlan of self.segments, or None
        self._plan_of: tuple[int, int] = (-1, 0)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        if not self.is_initialized:
            return 0
        n = self.keys.shape[-2] + sum(s.length for s in self.segments)
        return n + (self.sink_keys.shape[-2] if self.sink_keys is not None else 0)

    @property
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return _bytes(self.sink_keys, self.sink_values, self.keys, self.values) + sum(
            s.nbytes for s in self.segments
        )

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held + query_length, 0

    # -- contents --------------------------------------------------------------------------------
    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything held, as full tensors ``[B, H, held, D]`` (dequantized)."""
        ks, vs = [], []
        if self.sink_keys is not None:
            ks.append(self.sink_keys)
            vs.append(self.sink_values)
        for seg in self.segments:
            k, v = seg.decode()
            ks.append(k.to(self.dtype))
            vs.append(v.to(self.dtype))
        ks.append(self.keys)
        vs.append(self.values)
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # transformers >= 5.24 no longer records these on the layer; the decoded history is cast to them
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.rule.policy is not None and rows_at_different_positions(args, kwargs):
            raise BadInputError(PADDED_BATCH % f"CompressedCache with eviction ({self.rule.policy.name})")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        positions = torch.arange(self.seen, self.seen + n_new, device="cpu")  # moved where they rotate
        self.seen += n_new
        rule = self.rule
        if rule.policy is not None and not self.evicted:
            return self._evict(key_states, value_states, positions)
        step = _STEPS.current(rule)
        if step is not None and n_new == 1 and key_states.shape[0] == 1 and self.segments:
            plan = self.segment_plan()
            if plan is not None:  # attention reads the packed codes (kvlab_quantized): no decoded copy
                fp_k = [t for t in (self.sink_keys, self.keys) if t is not None] + [key_states]
                fp_v = [t for t in (self.sink_values, self.values) if t is not None] + [value_states]
                step.views[self.index] = (plan, torch.cat(fp_k, dim=-2)[0], torch.cat(fp_v, dim=-2)[0])
                self._store(key_states, value_states, positions)
                return key_states, value_states
        prior_k, prior_v = self.decoded()
        out = torch.cat((prior_k, key_states), dim=-2), torch.cat((prior_v, value_states), dim=-2)
        if rule.quantizer is None:
            self.keys, self.values = out
            return out
        self._store(key_states, value_states, positions, first=self.seen == n_new)
        return out

    def segment_plan(self) -> Any:
        """The packed segments as the decode kernel reads them (rebuilt when a segment is added), or
        None when they need the reference path (see :func:`kvlab.compress.quant.attention.segment_plan`)."""
        key = (len(self.segments), id(self.segments[-1]) if self.segments else 0)
        if self._plan_of != key:
            from kvlab.compress.quant.attention import segment_plan

            self._plan, self._plan_of = segment_plan(self.segments, path=self.rule.packed_path), key
        return self._plan

    def _store(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, first: bool = False) -> None:
        """Append to the full-precision tail; encode what the quantizer may take as one packed segment.

        The first feed (the prompt) is encoded at once, as :func:`quantize_snapshot` would. Later feeds
        of a per-token quantizer wait in the tail until ``DECODE_BLOCK`` tokens can be encoded together
        (KIVI's residual): one segment per generated token would make every step slower than the last.
        """
        q = self.rule.quantizer
        have = self.sink_keys.shape[-2] if self.sink_keys is not None else 0
        take = min(max(q.sinks - have, 0), k.shape[-2])
        if take:
            sk, sv = k[:, :, :take].clone(), v[:, :, :take].clone()
            self.sink_keys = sk if self.sink_keys is None else torch.cat((self.sink_keys, sk), dim=-2)
            self.sink_values = sv if self.sink_values is None else torch.cat((self.sink_values, sv), dim=-2)
            k, v, positions = k[:, :, take:], v[:, :, take:], positions[take:]
        tail_k = torch.cat((self.keys, k), dim=-2)
        tail_v = torch.cat((self.values, v), dim=-2)
        tail_pos = torch.cat((self.tail_positions, positions))
        _, stop = split_plan(tail_k.shape[-2], 0, q.window, q.token_multiple())
        if stop > 0 and (first or q.token_multiple() > 1 or stop >= DECODE_BLOCK):
            self.segments.append(
                q.encode(tail_k[:, :, :stop], tail_v[:, :, :stop], tail_pos[:stop], self.rope)
            )
            tail_k, tail_v, tail_pos = tail_k[:, :, stop:], tail_v[:, :, stop:], tail_pos[stop:]
        self.keys, self.values, self.tail_positions = tail_k.clone(), tail_v.clone(), tail_pos

    def _evict(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        rule = self.rule
        queries = None
        if self.pending_queries is not None:
            raw = self.pending_queries
            b, t, _ = raw.shape
            queries = raw.view(b, t, -1, k.shape[-1]).transpose(1, 2).float()
            if self.rope is not None:
                queries = apply_rope(queries, positions, self.rope).float()
        view = LayerView(self.index, rule.num_layers, k, v, positions, queries, rule.scaling)
        n = budget_slots(k.shape[-2], rule.keep)
        idx = keep_indices(rule.policy.score(view), n, rule.policy.sinks, rule.policy.window)
        gather = idx[..., None].expand(-1, -1, -1, k.shape[-1])
        self.keys, self.values = k.gather(2, gather), v.gather(2, gather)
        self.evicted, self.pending_queries = True, None
        self.remove_hook()
        return k, v

    def capture_queries(self, _module: Any, _inputs: Any, output: torch.Tensor) -> None:
        """Forward hook on this layer's ``q_proj``: keep the prefill's queries until the layer evicts."""
        if not self.evicted:
            self.pending_queries = output.detach()

    def remove_hook(self) -> None:
        if self.query_hook is not None:
            self.query_hook.remove()
            self.query_hook = None


class CompressedCache(Cache):
    """A transformers cache that quantizes (``quantizer``) or evicts (``policy`` + ``keep``) as it fills.

    Pass it as ``cache=`` (``past_key_values=`` before transformers 5.24) to ``model(...)`` or ``model.generate(...)``. Attention-based
    policies need ``model`` (for the query hooks). With ``model`` the cache is bound to it, so a
    left-padded batch runs row by row (each row evicts or quantizes its own tokens, as alone); without
    it an evicting cache refuses a padded batch. ``nbytes`` is what the cache holds for K/V now.

    A bound quantizing cache decodes one-token steps on its packed codes: ``packed_path="auto"`` reads
    them with the C kernel on the CPU and with torch ops on other devices (``"kernel"`` / ``"torch"``
    force one; see :func:`kvlab.compress.quant.attention.packed_path`). ``packed_steps`` counts those
    steps, ``packed_steps_by_path`` which path read them.
    """

    def __init__(
        self,
        config: Any,
        *,
        quantizer: Quantizer | None = None,
        policy: Policy | None = None,
        keep: float | None = None,
        model: Any = None,
        rope: Rope | None = None,
        packed_path: str = "auto",
        _row_of: CompressedCache | None = None,
    ):
        if quantizer is not None and policy is not None:
            raise BadInputError("choose a quantizer or an eviction policy for one CompressedCache, not both")
        if policy is not None:
            budget_slots(1000, keep)  # validates the fraction
        from kvlab.compress.quant.attention import PATHS

        if packed_path not in PATHS:
            raise BadInputError(f"packed_path must be one of {', '.join(PATHS)}, got {packed_path!r}")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if any(w is not None for w in sliding_windows(config)):
            raise UnsupportedModelError(
                "CompressedCache supports full-attention models only (this one has sliding-window layers)"
            )
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        self.rope = rope if rope is not None else rope_spec_from_config(text)
        if quantizer is not None:
            for i in range(int(text.num_hidden_layers)):
                quantizer.check(head_dim, rope_for_layer(self.rope, i))
        self.quantizer, self.policy, self.keep = quantizer, policy, keep
        scaling = head_dim**-0.5
        mods = None
        if _row_of is not None:  # one row of a padded batch: its queries come from the caller's cache
            scaling = _row_of.rule.scaling
        elif policy is not None and policy.needs_queries:
            if model is None:
                raise BadInputError(
                    f"policy '{policy.name}' scores by attention: pass model= so the cache can "
                    "see the prefill's queries"
                )
            mods = attention_modules(model)
            scaling = float(getattr(mods[0], "scaling", scaling))
        n_layers = int(text.num_hidden_layers)
        self.rule = CompressionRule(n_layers, quantizer, policy, keep, self.rope, scaling, packed_path)
        super().__init__(layers=[CompressedLayer(self.rule, i) for i in range(n_layers)])
        for layer, mod in zip(self.layers, mods or (), strict=False):
            layer.query_hook = mod.q_proj.register_forward_hook(layer.capture_queries)
        self._config = config
        self.rows: list[CompressedCache] | None = None  # per-row caches once a padded batch arrived
        self.packed_steps = 0  # decode steps whose attention read the packed codes (not a decoded copy)
        self.packed_steps_by_path = {"kernel": 0, "torch": 0}
        if model is not None and _row_of is None:
            bind_to_model(self, model)  # a left-padded batch then runs row by row (kvlab.hf.batch)

    def start_rows(self, n: int) -> list[CompressedCache]:
        """Switch this empty cache to ``n`` per-row caches of the same settings (a left-padded batch
        under ``model.generate``): each row evicts from its own tokens at its own budget, scored by its
        own queries, or quantizes its own tokens, exactly as alone. In place; rows in :attr:`rows`."""
        if self.rows is not None or self.layers[0].seen:
            raise BadInputError("start_rows() needs an empty CompressedCache")
        self.rows = [
            CompressedCache(
                self._config,
                quantizer=self.quantizer,
                policy=self.policy,
                keep=self.keep,
                rope=self.rope,
                packed_path=self.rule.packed_path,
                _row_of=self,
            )
            for _ in range(n)
        ]
        return self.rows

    @property
    def scaling(self) -> float:
        return self.rule.scaling

    def begin_step(self, model: Any, kwargs: dict) -> Callable[[Any], None] | None:
        """Called by the bound model's pre-hook: a one-token decode step on a quantizing cache attends
        over the packed codes (no full-precision copy of the history; see
        :mod:`kvlab.compress.quant.attention`). Returns what closes the step, or None (reference path)."""
        x = kwargs.get("input_ids")
        x = x if isinstance(x, torch.Tensor) else kwargs.get("inputs_embeds")
        if (
            self.quantizer is None
            or self.rows is not None
            or not isinstance(x, torch.Tensor)
            or tuple(x.shape[:2]) != (1, 1)
            or getattr(model, "dtype", None) != torch.float32
            or not _attends_plainly(model)
        ):
            return None
        from kvlab.compress.quant.attention import packed_path

        if packed_path(x.device, self.rule.packed_path) is None:
            return None
        before = model.config._attn_implementation
        step = _Step(self.rule)
        model.set_attn_implementation(QUANT_ATTENTION)
        _STEPS.stack.append(step)

        def finish(out: Any) -> None:
            _STEPS.stack.remove(step)
            model.set_attn_implementation(before)
            self.packed_steps += step.consumed > 0
            for path in step.paths:
                self.packed_steps_by_path[path] += 1
            if out is not None and step.views:
                raise UnsupportedModelError(
                    "the model did not attend through transformers' attention interface in every layer, so "
                    "its output ignores the packed history (the cache itself is intact: re-run the step "
                    "without model= on the cache)"
                )

        return finish

    def close(self) -> None:
        """Remove the query hooks (done automatically as each layer evicts its prefill)."""
        for layer in self.layers:
            layer.remove_hook()

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].held if layer_idx < len(self.layers) else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def held(self) -> int:
        return self.layers[0].held


def dynamic_cache_from_layers(
    keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...], config: Any
) -> DynamicCache:
    """A ``DynamicCache`` holding copies of per-layer ``[B, H, n, D]`` K/V (e.g. an evicted cache)."""
    cache = DynamicCache(config=config)
    if len(cache.layers) != len(keys):
        raise UnsupportedModelError(f"the model has {len(cache.layers)} cache layers, got {len(keys)}")
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k.clone(), v.clone(), i)
    return cache


@torch.no_grad()
def logits_on_layers(
    handle: Any,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    tokens: list[int],
    start_position: int,
) -> torch.Tensor:
    """``[n, vocab]`` logits of ``tokens`` run after per-layer K/V, at positions ``start_position`` onward.

    Works for caches that are not :class:`~kvlab.cache.KVSnapshot` s (per-head evicted caches); the
    inputs are copied, never written.
    """
    cache = dynamic_cache_from_layers(keys, values, handle.config)
    positions = torch.arange(start_position, start_position + len(tokens), device=handle.device)
    ids = torch.as_tensor(tokens, device=handle.device)
    return handle.run(ids, cache, positions=positions).logits[0].float()


@torch.no_grad()
def greedy_on_layers(
    handle: Any,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    prompt: list[int],
    start_position: int,
    max_new_tokens: int,
) -> list[int]:
    """Greedy tokens after per-layer K/V plus ``prompt`` (run at ``start_position`` onward); inputs untouched."""
    from kvlab.loop import decode_loop

    cache = dynamic_cache_from_layers(keys, values, handle.config)
    position = start_position + len(prompt)
    first = handle.run(
        torch.as_tensor(prompt, device=handle.device),
        cache,
        positions=torch.arange(start_position, position, device=handle.device),
        logits_to_keep=1,
    ).logits[:, -1]

    def feed(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal position
        at = torch.tensor([position], device=handle.device)
        out = handle.run(tokens[:, None], cache, positions=at, logits_to_keep=1)
        position += 1
        return out.logits[:, -1]

    return [s.token(0) for s in decode_loop(feed, first, max_new_tokens)]
