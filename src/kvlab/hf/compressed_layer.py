"""The layers of a :class:`~kvlab.hf.compressed_cache.CompressedCache`, each following one :class:`CompressionRule`.

A :class:`CompressedLayer` stores full-precision sinks, packed segments of codes and a full-precision
recent tail; its ``update`` evicts (scoring everything held, attention-scored policies with the queries
its ``q_proj`` hook captured), encodes what leaves the tail, and returns what attention reads.

Bookkeeping invariant: ``get_seq_length()`` is the number of tokens *seen* (so default position ids
continue at the original positions: evicted caches keep their positions), while the attention mask
and query offset use the number of slots *held*. An evicting layer records each held slot's
position per head (``positions [B, Hkv, held]``): different heads keep different tokens.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import DynamicLayer

from kvlab.errors import BadInputError
from kvlab.hf.cache import PADDED_BATCH, rows_at_different_positions
from kvlab.hf.cache_steps import packed_step
from kvlab.hf.live_cache import restore_vars
from kvlab.policy.evict.observe import prerope_queries
from kvlab.policy.evict.policies import LayerView, Policy
from kvlab.policy.evict.select import budget_slots, keep_indices
from kvlab.policy.quant.methods import Quantizer, Segment, TokenCode, decode_between, split_plan
from kvlab.policy.quant.pack import tensor_bytes
from kvlab.rope.ops import apply_rope
from kvlab.rope.spec import Rope, rope_for_layer

# Per-token quantizers encode generated tokens in blocks of this many (they wait in the fp tail until then).
DECODE_BLOCK = 32


@dataclass(frozen=True)
class CompressionRule:
    """What every layer of one :class:`CompressedCache` applies (immutable, shared by the layers)."""

    num_layers: int
    quantizer: Quantizer | None = None
    policy: Policy | None = None
    keep: float | None = None
    rope: Rope | None = None
    scaling: float = 1.0
    packed_path: str = "auto"  # kvlab.policy.quant.attention.packed_path: kernel, torch or auto
    budget: int | None = None  # slots kept per layer and head (instead of the fraction keep)
    every: int | None = None  # evict back to the budget whenever budget + every slots are held
    heads: str = "uniform"  # "ada": the layer's budget shared by its KV heads (kvlab.hf.ragged_layer)
    layers: str = "uniform"  # "pyramid": per-layer budgets falling from the bottom layer up (PyramidKV)

    chooses_positions = False  # kept slots keep their original positions: the caller's are right

    @property
    def codec(self) -> Quantizer | None:
        return self.quantizer

    @property
    def shared(self) -> bool:
        """Whether layers or heads hold different counts (they attend through kvlab's ragged step)."""
        return (self.heads, self.layers) != ("uniform", "uniform")

    def describe(self) -> str:
        parts = []
        if self.policy is not None:
            parts.append(self.policy.name)
            parts.append(f"budget={self.budget}" if self.budget is not None else f"keep={self.keep}")
            if self.every is not None:
                parts.append(f"every={self.every}")
            parts += [
                f"{k}={v}" for k, v in (("heads", self.heads), ("layers", self.layers)) if v != "uniform"
            ]
        if self.quantizer is not None:
            parts.append(f"codec={self.quantizer.name}")
        return ", ".join(parts) or "every slot, full precision"

    def check_seed(self, n: int) -> None:
        """A prefix is taken exactly unless the eviction would score the prefill's queries (a seed has none)."""
        if self.policy is not None and self.policy.needs_queries:
            raise BadInputError(
                f"seed() cannot fill a cache that evicts by attention ({self.policy.name}): its eviction scores "
                "the prefill's queries, which a stored prefix has not got; feed the prompt through the model"
            )

    def budget_for(self, prefill: int, layer: int = 0) -> int:
        """The slots per KV head (on average, with ``heads="ada"``) layer ``layer`` keeps after a prefill of
        ``prefill`` tokens (and while decoding)."""
        if self.budget is not None and self.budget > prefill:
            if self.every is not None and self.layers == "uniform":
                return self.budget  # keeps every slot until the stream outgrows the budget (a conversation)
            raise BadInputError(
                f"budget={self.budget} slots is more than the prompt's {prefill} tokens: use a budget "
                f"of at most {prefill} (or keep=, a fraction of the prompt)"
            )
        n = budget_slots(prefill, self.keep, self.budget)
        if self.layers != "pyramid" or self.policy is None:
            return n
        from kvlab.policy.evict.budgets import pyramid_counts

        protected = min(prefill, self.policy.sinks + self.policy.window)
        return pyramid_counts(self.num_layers, prefill, n, protected=protected)[layer]


class CompressedLayer(DynamicLayer):
    """One layer: ``sink_keys`` + packed ``segments`` + full-precision tail (``self.keys``/``self.values``).

    The layer owns its state and follows the shared :class:`CompressionRule`; with an attention-based
    eviction policy it also owns the hook that captures its queries (removed once it has evicted,
    unless it keeps evicting while decoding, ``every``). An evicting layer also holds ``positions``
    ``[B, Hkv, held]`` (host), each held slot's original position, and ``budget``, its slot budget.
    """

    def __init__(self, rule: CompressionRule, index: int):
        super().__init__()
        self.rule, self.index = rule, index
        self.rope = rope_for_layer(rule.rope, index)  # this layer's RoPE (None: no RoPE on this layer)
        self.query_hook: Any = None
        self.query_module: Any = (
            None  # the attention whose q_proj is hooked (re-hooked if a checkpoint restores it)
        )
        self.may_rebase = False  # set by LiveCache.choosing_positions; kept slots keep their positions
        self.seen = 0
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.segments: list[Segment] = []
        self.tail_positions = torch.zeros(0, dtype=torch.long, device="cpu")  # positions: host bookkeeping
        self.pending_queries: torch.Tensor | None = None  # the latest queries (before RoPE), not yet consumed
        self.recent_queries: list[torch.Tensor] = []  # queries since the last eviction (every=)
        self.positions: torch.Tensor | None = None  # [B, Hkv, held] original positions (evicting layers)
        self.budget: int | None = None
        self.fresh = 0  # tokens fed since the last eviction
        self.evictions = 0
        self.most_held = 0  # the most slots an attention of this layer has read (held + the new tokens)
        self.evicted = False
        self._plan: Any = None  # kvlab.policy.quant.attention.SegmentPlan of self.segments, or None
        self._plan_of: tuple[int, int] = (-1, 0)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        if not self.is_initialized:
            return 0
        assert self.keys is not None  # set by lazy_initialization
        n = (self.keys.shape[-2] if self.keys.dim() > 1 else 0) + sum(s.length for s in self.segments)
        return n + (self.sink_keys.shape[-2] if self.sink_keys is not None else 0)

    @property
    def nbytes(self) -> int:  # nothing is held before the first update (every tensor None)
        fp = tensor_bytes(self.sink_keys, self.sink_values, self.keys, self.values)
        return fp + sum(s.nbytes for s in self.segments)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held + query_length, 0

    # -- the live-layer interface (kvlab.hf.live_cache) --------------------------------------------------
    @property
    def kept(self) -> int:
        return self.held

    @property
    def tokens_seen(self) -> int:
        return self.seen

    def visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decoded()

    def kept_positions(self) -> torch.Tensor:
        """Original positions of the held slots: ``[B, Hkv, held]`` once the layer has evicted (heads keep
        different tokens), else ``[held]``."""
        if self.positions is not None:
            return self.positions
        return torch.arange(self.seen - self.held, self.seen, device="cpu")

    def checkpoint(self) -> Callable[[], None]:
        """This layer writes no tensor in place (each update builds new ones): its attributes, lists copied,
        are its state; a query hook removed since (the prefill's eviction) is put back on its module."""
        restore = restore_vars(self)
        hooked = self.query_hook is not None

        def put_back() -> None:
            removed = hooked and self.query_hook is None
            restore()
            if removed and self.query_module is not None:
                self._register_hook()

        return put_back

    def hold(self) -> None:
        raise BadInputError(
            "a CompressedCache evicts and encodes inside each update, so a prompt fed in pieces is not the "
            "prompt fed at once: feed it in one forward"
        )

    def seed(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.update(k, v)

    def seed_kept(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, seen: int) -> None:
        """Slots kept out of a ``seen``-token prefix (original ``positions [1, Hkv, n]``) into this empty layer, as
        if it had evicted them itself after a prefill of those tokens (a codec encodes them as it would then)."""
        n = int(k.shape[-2])
        self.budget = self.rule.budget_for(seen, self.index)
        if n > int(self.budget):
            raise BadInputError(f"seed_kept(): {n} slots are more than this cache's budget of {self.budget}")
        self.lazy_initialization(k, v)
        self.seen, self.most_held = seen, n
        if self.rule.quantizer is None:
            self.keys, self.values = k, v
        else:
            self._keep_encoded(k, v, torch.arange(n, device=k.device).expand(1, k.shape[1], n))
        self.positions = positions.cpu().clone()
        self.evicted, self.evictions = True, int(n < seen)
        self.pending_queries, self.recent_queries, self.fresh = None, [], 0
        if self.rule.every is None:
            self.remove_hook()

    def close(self) -> None:
        self.remove_hook()

    def describe_state(self) -> str:
        return f"{self.held} kept, {self.seen} seen, {self.evictions} evictions"

    def query_offset(self) -> int:
        """Where the next queries sit among the slots: after every slot held (kept positions are RoPE's)."""
        return self.held

    # -- contents --------------------------------------------------------------------------------
    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything held, as full tensors ``[B, H, held, D]`` (dequantized)."""
        sinks, tail = (self.sink_keys, self.sink_values), (self.keys, self.values)
        return decode_between(sinks, self.segments, tail, self.dtype)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # transformers >= 5.24 no longer records these on the layer; the decoded history is cast to them
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rule = self.rule
        if rule.policy is not None and rows_at_different_positions(args, kwargs):
            raise BadInputError(PADDED_BATCH % f"CompressedCache with eviction ({rule.policy.name})")
        n_new = key_states.shape[-2]
        if rule.policy is not None and not self.evicted:
            self.budget = rule.budget_for(self.seen + n_new, self.index)  # refused before anything changes
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = torch.arange(self.seen, self.seen + n_new, device="cpu")  # moved where they rotate
        self.seen += n_new
        self.most_held = max(self.most_held, self.held + n_new)
        if rule.policy is not None:
            assert self.budget is not None  # set above, at this evicting layer's first update
            if not self.evicted or (
                rule.every is not None and self.held + n_new >= int(self.budget) + rule.every
            ):
                return self._evict(key_states, value_states, positions)
            b, h = key_states.shape[:2]
            assert self.positions is not None  # set by the eviction (this layer has evicted)
            self.positions = torch.cat((self.positions, positions.expand(b, h, n_new)), dim=-1)
            self.fresh += n_new
            if rule.every is not None:
                self._take_queries(n_new)
        step = packed_step(rule)
        if step is not None and n_new == 1 and key_states.shape[0] == 1 and self.segments:
            plan = self.segment_plan()
            if plan is not None:  # attention reads the packed codes (PackedStep.attend): no decoded copy
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
        None when they need the reference path (see :func:`kvlab.policy.quant.attention.segment_plan`)."""
        key = (len(self.segments), id(self.segments[-1]) if self.segments else 0)
        if self._plan_of != key:
            from kvlab.policy.quant.attention import segment_plan

            self._plan, self._plan_of = segment_plan(self.segments, path=self.rule.packed_path), key
        return self._plan

    def _store(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, first: bool = False) -> None:
        """Append to the full-precision tail; encode what the quantizer may take as one packed segment.

        The first feed (the prompt) is encoded at once, as :func:`quantize_snapshot` would. Later feeds
        of a per-token quantizer wait in the tail until ``DECODE_BLOCK`` tokens can be encoded together
        (KIVI's residual): one segment per generated token would make every step slower than the last.
        """
        q = self.rule.quantizer
        assert q is not None  # only a quantizing layer stores codes
        assert self.keys is not None and self.values is not None  # set by lazy_initialization
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

    # -- eviction --------------------------------------------------------------------------------
    def _queries(self, m: int, positions: torch.Tensor, head_dim: int) -> torch.Tensor | None:
        """Post-RoPE queries ``[B, Hq, <=m, D]`` of the last ``m`` tokens fed (``positions [m]``), or None."""
        parts = [*self.recent_queries, *([self.pending_queries] if self.pending_queries is not None else [])]
        if not parts:
            return None
        raw = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])[:, -m:]
        b, t, _ = raw.shape
        queries = raw.view(b, t, -1, head_dim).transpose(1, 2).float()
        if self.rope is not None:
            queries = apply_rope(queries, positions[m - t :], self.rope).float()
        return queries

    def _evict(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Attend over everything held plus the new tokens (returned), then keep ``budget`` slots per head."""
        rule = self.rule
        b, h, n_new, d = k.shape
        new_pos = positions.expand(b, h, n_new)
        if self.evicted:
            prior_k, prior_v = self.decoded()
            all_k, all_v = torch.cat((prior_k, k), dim=-2), torch.cat((prior_v, v), dim=-2)
            assert self.positions is not None  # set by the previous eviction
            all_pos = torch.cat((self.positions, new_pos), dim=-1)
        else:
            all_k, all_v, all_pos = k, v, new_pos
        t, m = all_k.shape[-2], self.fresh + n_new
        queries = self._queries(m, torch.arange(self.seen - m, self.seen, device="cpu"), d)
        slots = None
        if queries is not None and queries.shape[2] != t:
            slots = torch.arange(t - queries.shape[2], t, device=all_k.device)
        view = LayerView(
            self.index, rule.num_layers, all_k, all_v, all_pos.to(all_k.device), queries, rule.scaling, slots
        )
        assert rule.policy is not None and self.budget is not None  # an evicting layer; update set its budget
        n_keep = min(int(self.budget), t)  # a budget above what is held (every=, a short prompt): keep it all
        idx = keep_indices(rule.policy.score(view), n_keep, rule.policy.sinks, rule.policy.window)
        if rule.quantizer is None:
            self.keys, self.values = _gather(all_k, idx), _gather(all_v, idx)
        else:
            self._keep_encoded(all_k, all_v, idx)
        self.positions = all_pos.gather(-1, idx.cpu())
        self.pending_queries, self.recent_queries, self.fresh = None, [], 0
        self.evicted = True
        self.evictions += 1
        if rule.every is None:
            self.remove_hook()
        return all_k, all_v

    def _keep_encoded(self, all_k: torch.Tensor, all_v: torch.Tensor, idx: torch.Tensor) -> None:
        """Keep slots ``idx [B, H, n]`` of ``sinks | segments | tail`` (held order, ``all_k`` decoded) as
        ``sinks | one segment | tail``: kept codes are gathered, never re-quantized; kept tail tokens are
        encoded (once) where the new code region needs them, the rest stay in the full-precision tail.

        Per head the number of kept codes differs, so the new code region is as long as the most any
        head kept (the other heads encode their first kept tail tokens to fill it), and at least all but
        the quantizer's ``window`` last slots: the region is rebuilt as one segment anyway, so the tail
        is encoded now rather than ``DECODE_BLOCK`` at a time (as :meth:`_store` does between evictions).
        """
        q = self.rule.quantizer
        assert q is not None  # only a quantizing layer keeps codes
        n = idx.shape[-1]
        s_old = self.sink_keys.shape[-2] if self.sink_keys is not None else 0
        code_hi = s_old + sum(seg.length for seg in self.segments)  # held slots [s_old, code_hi) are codes
        s = min(q.sinks, n)  # the first s slots are tokens 0..s-1 in every head (the policy keeps them)
        rest = idx[..., s:]  # sorted: kept codes first, then kept tail tokens
        r = rest.shape[-1]
        kept_codes = (rest < code_hi).sum(-1)  # [B, H]
        fill = int(kept_codes.max()) if r else 0
        fill = max(fill, r - q.window)  # one merged segment anyway: encode all but the window now
        keys = values = None
        if fill:
            ranks = torch.arange(fill, device=idx.device)
            from_code = ranks < kept_codes[..., None]  # [B, H, fill]
            # tail tokens to encode: each head's first (fill - kept_codes) kept tail tokens, padded with
            # zero rows to the widest head (pads are never stored; no token is encoded twice)
            width = fill - int(kept_codes.min())
            # a per-token codec's (checked in _check_eviction): TokenCode, which gathers
            parts_k = [cast(TokenCode, seg.keys) for seg in self.segments]
            parts_v = [cast(TokenCode, seg.values) for seg in self.segments]
            if width:
                j = torch.arange(width, device=idx.device)
                src = rest.gather(-1, (kept_codes[..., None] + j).clamp_max(r - 1))
                real = (j < (fill - kept_codes)[..., None])[..., None].to(all_k.device)
                fk = torch.where(
                    real, _gather(all_k, src), torch.zeros((), dtype=all_k.dtype, device=all_k.device)
                )
                fv = torch.where(
                    real, _gather(all_v, src), torch.zeros((), dtype=all_v.dtype, device=all_v.device)
                )
                fresh = q.encode(fk, fv, torch.zeros(0, dtype=torch.long, device="cpu"), self.rope)
                parts_k.append(cast(TokenCode, fresh.keys))
                parts_v.append(cast(TokenCode, fresh.values))
            n_codes = code_hi - s_old
            where = torch.where(
                from_code,
                rest[..., :fill] - s_old,
                n_codes + ranks - kept_codes[..., None],
            )
            keys = parts_k[0].gather(where, *parts_k[1:])
            values = parts_v[0].gather(where, *parts_v[1:])
        tail = rest[..., fill:]
        self.sink_keys = all_k[:, :, :s].clone() if s else None
        self.sink_values = all_v[:, :, :s].clone() if s else None
        self.segments = [Segment(keys, values, fill)] if keys is not None and values is not None else []
        self.keys, self.values = _gather(all_k, tail), _gather(all_v, tail)
        # the tail's positions differ per head; position-free codecs ignore them (head 0's, for shape)
        self.tail_positions = torch.zeros(tail.shape[-1], dtype=torch.long, device="cpu")
        self._plan, self._plan_of = None, (-1, 0)

    def capture_queries(self, _module: Any, _inputs: Any, output: torch.Tensor) -> None:
        """Forward hook on this layer's ``q_proj``: the latest call's queries (through the layer's ``q_norm``
        where it has one), until the layer evicts its prefill (for good without ``every``). ``update`` takes
        them into ``recent_queries`` (so a forward of the model on another cache in between overwrites them
        and is never counted)."""
        if not self.evicted or self.rule.every is not None:
            self.pending_queries = prerope_queries(self.query_module, output.detach())

    def _take_queries(self, n_new: int) -> None:
        """After a step that did not evict: keep its queries (at most ``every - 1`` rows are kept, the
        tokens fed since the last eviction)."""
        if self.pending_queries is not None:
            self.recent_queries.append(self.pending_queries[:, -n_new:])
            self.pending_queries = None

    def hook_queries(self, attention: Any) -> None:
        """Capture the queries of ``attention.q_proj`` (attention-scored eviction)."""
        self.query_module = attention
        self._register_hook()

    def _register_hook(self) -> None:
        """The hook holds the layer weakly and removes itself once the layer is gone: a cache dropped
        without :meth:`close` (a server's conversation that failed) leaves nothing behind on the model."""
        ref = weakref.ref(self)
        handle: list[Any] = []

        def capture(module: Any, inputs: Any, output: torch.Tensor) -> None:
            layer = ref()
            if layer is None:
                handle[0].remove()
                return
            layer.capture_queries(module, inputs, output)

        self.query_hook = self.query_module.q_proj.register_forward_hook(capture)
        handle.append(self.query_hook)

    def remove_hook(self) -> None:
        if self.query_hook is not None:
            self.query_hook.remove()
            self.query_hook = None


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` at slots ``idx [B, H, n]``: ``[B, H, n, D]``."""
    return x.gather(2, idx.to(x.device)[..., None].expand(-1, -1, -1, x.shape[-1]))
