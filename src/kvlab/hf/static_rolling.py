"""A rolling cache with fixed buffers and device-side bookkeeping, for captured decode steps.

:class:`~kvlab.hf.RollingCache` keeps slot ``i`` at position ``base + i`` and moves its window down
once per eviction chunk; its counts are Python integers that change every step. Both are fine eagerly
and both defeat ``torch.compile`` and CUDA graphs (a graph replays fixed kernels on fixed addresses).
:class:`StaticRollingCache` follows the *same* :class:`~kvlab.hf.rolling_layer.RollRule` — the same
sinks, window, eviction chunks, re-bases and sink placement, so every forward sees the same tokens at
the same relative positions — with a storage built for capture:

* **Invariant**: ``slot_pos[j]`` is the RoPE position of the key in slot ``j`` (``EMPTY`` if none).
  A query at position ``p`` attends exactly to the slots with ``slot_pos <= p``. Attention does not
  care about slot order, so the window is a **ring**: evicting tokens only marks their slots empty,
  and a roll moves no data (at 32k tokens, moving the window would copy 4 GiB per roll on an 8B model).
* **Storage**: per layer, keys and values ``[batch, kv_heads, capacity, head_dim]`` allocated once,
  ``capacity = sinks + window + evict_chunk``: slots ``[0, sinks)`` hold the sinks, the rest is the
  ring (the window plus room for one feed of up to ``evict_chunk`` tokens). With ``codec="int4"``
  they are rows of the registered codec ``int4rows`` (:mod:`kvlab.policy.quant.codecs.int4rows`:
  4-bit codes with an fp16 scale and minimum per group of ``group`` channels, 0.31x the bytes at
  head_dim 128), written as each token arrives and decoded inside the step.
* **A step** (what a graph captures) reads only device tensors: the feed's slot indices
  (:meth:`write_index`), its positions, ``slot_pos``; it writes the new K/V with ``index_copy_`` and
  returns the whole buffers with the mask ``slot_pos <= position`` (:meth:`attention_mask`).
* **Between steps** (on the host, never captured: :meth:`prepare` before a feed, :meth:`advance`
  after it) the cache applies the rule's pending plan: mark the evicted slots empty, re-rotate the
  sinks from their stored originals to sit right before the oldest kept token (float64 angles, as
  :class:`RollingCache` does), and on a re-base rotate every stored key in place. It then points the
  write index at the next free ring slots. Each of these is a handful of small kernels with Python
  integers as arguments: no host synchronisation.

The ring is a storage kind, not another cache: a :class:`~kvlab.hf.live_cache.LiveCache` whose layers are
:class:`RingLayer` s (as transformers' ``StaticLayer`` is a layer kind of its ``Cache``), reporting as
every live cache does; its counts are kept once, on the cache, and every layer answers from them.
It does not build its own mask or positions inside the model: the caller
(:class:`kvlab.hf.graphs.RollingDecoder`) passes ``position_ids`` and the 4-D mask explicitly.
Sliding-window layers are refused (use :class:`RollingCache`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import torch
from transformers.cache_utils import CacheLayerMixin

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.cache import head_dim_of
from kvlab.hf.live_cache import Bytes, LiveCache
from kvlab.hf.rolling_cache import Rebase, RollingCache, RollPlan, RollRule, roll_rule
from kvlab.hf.runner import Runner
from kvlab.kernels import split_attention
from kvlab.policy.quant.codecs.int4rows import Int4RowsQuantizer, decode_rows
from kvlab.policy.quant.methods import make_quantizer
from kvlab.policy.quant.pack import tensor_bytes
from kvlab.rope.fast import rotate_by, rotate_by_
from kvlab.rope.layers import sliding_windows, text_config
from kvlab.rope.spec import RopeSpec

EMPTY = 1 << 62  # slot_pos of a slot that holds nothing: no query position reaches it
Codec = Literal["none", "int4"]
#: the ring's codec names and the registered codecs they resolve to (:mod:`kvlab.policy.quant.codecs`)
RING_CODECS = {"int4": "int4rows"}


class RingLayer(CacheLayerMixin):
    """One layer's fixed buffers: slots ``[0, sinks)`` the sinks, the rest a ring (see the module). It holds
    storage only and answers the live-layer questions from its cache's counts (all layers make the same
    decisions). ``rope``: this layer's RoPE (None: keys carry no position and are never rotated).
    """

    is_compileable = True
    is_sliding = False
    is_croppable = False
    may_rebase = True  # the ring always picks its positions (its decoder passes them)

    def __init__(self, owner: StaticRollingCache, rope: RopeSpec | None, index: int) -> None:
        super().__init__()
        self.owner, self.rope, self.index = owner, rope, index
        o = owner
        # views of this layer's slots in the cache's one buffer per K and V: the model's dtype, or int4 rows
        self.k_store, self.v_store = o.storage["keys"][index], o.storage["values"][index]
        self.keys, self.values = (None, None) if o.coder else (self.k_store, self.v_store)
        self.dtype, self.device = o.dtype, o.device
        self.is_initialized = True

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step reads or writes (views of the cache's storage)."""
        return [self.k_store, self.v_store]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front: a captured step must find its buffers at fixed addresses

    # -- the step (capturable) ----------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new K/V at the feed's slots (in place); return every slot (the mask hides the empty):
        decoded, or with ``int4`` inside :meth:`StaticRollingCache.packed_reads` the packed rows
        (uint8, :func:`~kvlab.kernels.split_attention.int4_rows`) for an attention that decodes them."""
        if self.owner.defer:  # rows not in lockstep on a CPU: written after the step (RingRows.commit)
            self.owner.fresh[self.index] = (key_states, value_states)
            return self.read()
        self._write(self.owner.write_index(key_states.shape[-2]), key_states, value_states)
        if self.owner.packed and self.owner.coder:
            return self.k_store, self.v_store
        return self.read()

    def _write(self, index: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """Store ``k`` and/or ``v`` (``[batch, heads, n, head_dim]``) at the ``[n]`` slots ``index``."""
        o = self.owner
        for t, buf in ((k, self.k_store), (v, self.v_store)):
            if t is None:
                continue
            if o.coder and o.fused_writes:  # one Triton kernel, the same bytes as the codec's pack
                split_attention.write_int4(buf, index, t, o.group)
            elif index.ndim == 2:  # a slot per row ([batch, n]: rows not in lockstep, kvlab.hf.ring_rows)
                at = index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[-1])
                buf.scatter_(2, at, o.stored(t))
            else:
                buf.index_copy_(2, index, o.stored(t))

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's keys and values of the rows a step computes (:attr:`StaticRollingCache.width`), in
        the model's dtype (decoded from the codes with ``int4``)."""
        o = self.owner
        k, v = self.k_store, self.v_store
        if o.width != o.batch:
            k, v = k[: o.width], v[: o.width]
        if o.span is not None:
            k, v = k[:, :, : o.span.shape[0]], v[:, :, : o.span.shape[0]]
        return o.loaded(k), o.loaded(v)

    # -- between steps (host side) -------------------------------------------------------------------
    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` (a ``[n]`` index), decoded, as new tensors."""
        k, v = (t.index_select(2, slots) for t in (self.k_store, self.v_store))
        return self.owner.loaded(k), self.owner.loaded(v)

    # -- the live-layer interface (kvlab.hf.live_cache), from the cache's counts ------------------------
    @property
    def kept(self) -> int:
        return self.owner.slots - self.owner.plan.drop

    @property
    def tokens_seen(self) -> int:
        return self.owner.seen

    @property
    def evictions(self) -> int:
        return self.owner.rolls

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's slots (the sinks' originals and the slot positions are the cache's)."""
        return tensor_bytes(*self.buffers())

    def visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values in position order as the next forward will see them (new tensors; decoded with
        ``int4``; a pending roll applied): comparable with a :class:`RollingCache` layer's."""
        o = self.owner
        k, v = self.read_slots(o.visible_slots())
        s = min(o.sinks_held, k.shape[-2])
        if o.plan.pending and s and o.sink_keys is not None:
            start, sinks = o.next_position - o.plan.rebase - self.kept, o.sink_keys[self.index]
            k[:, :, :s] = sinks if self.rope is None else rotate_by(sinks, start, self.rope)
        if o.plan.rebase and self.rope is not None:
            rotate_by_(k[:, :, s:], -o.plan.rebase, self.rope)
        return k, v

    def kept_positions(self) -> torch.Tensor:
        """``[kept]`` RoPE positions of the kept slots as the next forward sees them, on the host."""
        end = self.owner.next_position - self.owner.plan.rebase
        return torch.arange(end - self.kept, end, device="cpu")

    def query_offset(self) -> int:
        return self.owner.next_position  # unused: the decoder passes the mask (slot order is not position)

    def get_seq_length(self) -> int:
        return self.owner.next_position

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def checkpoint(self) -> Callable[[], None]:
        raise BadInputError("a StaticRollingCache has no checkpoints (it writes every layer in place)")

    def hold(self) -> None:
        raise BadInputError(
            "a StaticRollingCache takes a prompt through RollingDecoder.prefill, not in held pieces"
        )

    def seed(self, k: torch.Tensor, v: torch.Tensor) -> None:
        raise BadInputError("a StaticRollingCache takes a prefix through load(), not seed()")

    def close(self) -> None:
        """Nothing held outside the cache."""

    def describe_state(self) -> str:
        o, end = self.owner, self.owner.next_position - self.owner.plan.rebase
        codec = f"int4 rows in groups of {o.group}, " if o.codec == "int4" else ""
        return (
            f"{codec}{self.kept} kept, positions {end - self.kept}..{end - 1}, "
            f"{o.seen} seen, {o.rolls} rolls, {o.rebases} re-bases"
        )


class StaticRollingCache(LiveCache):
    """Sinks + a rolling window in fixed buffers: :class:`RollingCache`'s rule, a capturable step.

    It reports as every live cache does (``kept``, ``tokens_seen``, ``evictions``, ``nbytes``, ``describe()``...).

    Args:
        config: the model config (layer count, KV heads, head size).
        rule: the rolling rule (:func:`~kvlab.hf.rolling_cache.roll_rule`: sinks, window, chunk, RoPE,
            maximum position, re-base), :class:`RollingCache`'s own; ``static_rolling_cache_for`` builds it.
        batch: rows fed in lockstep (same positions).
        dtype, device: of the model's K/V (``static_rolling_cache_for`` reads them off the model).
        codec: ``"none"`` (the model's dtype) or ``"int4"``: the registered codec ``int4rows``
            (:mod:`kvlab.policy.quant.codecs.int4rows`: 4-bit codes, fp16 scale and minimum per ``group`` channels).
        capacity: slots per row (default and least: ``sinks + window + evict_chunk``).
        views: ``(storage, slot_pos)`` to hold the state in instead of buffers of its own: views of one row of
            a :class:`~kvlab.hf.ring_rows.RingRows` (``storage["keys"|"values"]`` ``[layers, 1, heads,
            capacity, head_dim]``, ``slot_pos`` ``[capacity]``), written in place.

    One feed holds at most ``evict_chunk`` tokens (the ring's spare room); longer prompts are fed in
    pieces or through a :class:`RollingCache` first (:meth:`load`). Not thread-safe.
    """

    layers: list[RingLayer]  # type: ignore[assignment]  # ours, typed as ours
    rule: RollRule

    def __init__(
        self,
        config: Any,
        rule: RollRule,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        codec: Codec = "none",
        group: int = 32,
        capacity: int | None = None,
        views: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        text = text_config(config)
        self.rule, rope, evict_chunk = rule, rule.rope, rule.evict_chunk
        sinks, window = int(rule.policy.sinks), int(rule.policy.window or 0)
        check_ring_model(config)
        if codec not in ("none", *RING_CODECS):
            raise BadInputError(f"codec must be 'none' or 'int4', got {codec!r}")
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        head_dim = head_dim_of(text)
        self.coder: Int4RowsQuantizer | None = None  # the registered codec the ring's codec names
        if codec != "none":
            self.coder = cast(Int4RowsQuantizer, make_quantizer(RING_CODECS[codec], group_size=int(group)))
            self.coder.check(head_dim, None)
        if batch < 1:
            raise BadInputError(f"batch must be >= 1, got {batch}")
        self.dtype, self.device = dtype, torch.device(device)
        self.codec, self.group, self.batch = codec, int(group), int(batch)
        self.width = self.batch  # the rows a step computes, the first ones (fewer: RingRows)
        self.reach = 0  # 1 + the highest slot ever written (host-side)
        # a step reads slots [0, span.shape[0]) only, when span is set (RingRows on a CPU: a dynamic size)
        self.span: torch.Tensor | None = None
        self.capacity = max(sinks + window + evict_chunk, int(capacity or 0))
        self.ring = window + evict_chunk
        self.slot_pos = (
            views[1] if views else torch.full((self.capacity,), EMPTY, dtype=torch.long, device=self.device)
        )
        self._write_index: dict[int, torch.Tensor] = {}
        n_layers, self.head_dim = int(text.num_hidden_layers), head_dim
        # one buffer per K and V for every layer (each layer holds views): a roll places every layer's
        # sinks, and a re-base rotates every layer's keys, in a few kernels rather than a few per layer
        row = self.coder.row_bytes(head_dim) if self.coder else head_dim
        kind = torch.uint8 if self.coder else dtype
        self.storage = (
            views[0]
            if views
            else {
                name: torch.zeros(
                    (n_layers, self.batch, heads, self.capacity, row), dtype=kind, device=self.device
                )
                for name in ("keys", "values")
            }
        )
        self.sink_keys: torch.Tensor | None = None  # [layers, batch, heads, sinks, head_dim] at 0 ..
        self.sink_values: torch.Tensor | None = None  # int4 only: re-encoded with the keys, never compounding
        self.defer = False  # RingRows on a CPU: a step's new K/V wait in ``fresh`` for commit()
        self.fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> the step's new K/V
        self.packed = False  # int4: update() returns packed rows (see packed_reads)
        self.fused_writes = False  # int4: new rows encoded by one Triton kernel (see packed_reads)
        specs = [rope.for_layer(i) for i in range(n_layers)]
        self._runs: list[tuple[slice, RopeSpec | None]] = []  # consecutive layers sharing one RoPE
        for i, spec in enumerate(specs):
            if self._runs and self._runs[-1][1] == spec:
                self._runs[-1] = (slice(self._runs[-1][0].start, i + 1), spec)
            else:
                self._runs.append((slice(i, i + 1), spec))
        # host-side counts (the same meaning as RollingCache's, kept once for all layers: they answer from them)
        self.next_position = 0  # RoPE position of the next token
        self.slots = 0  # tokens held, including those a pending drop will remove
        self.plan = RollPlan()
        self.sinks_held = 0
        self.tail = 0  # ring index of the oldest window token
        self._fed = (0, 0)  # (tokens, of which into the sinks) of the feed prepare() announced
        self.seen = self.rolls = self.rebases = 0  # tokens fed, window rolls, re-bases
        super().__init__([RingLayer(self, specs[i], i) for i in range(n_layers)], self.rule, text, {})

    sinks = property(lambda self: self.rule.policy.sinks)
    window = property(lambda self: self.rule.policy.window)
    evict_chunk = property(lambda self: self.rule.evict_chunk)

    # -- the step's device inputs ---------------------------------------------------------------------
    def write_index(self, n: int) -> torch.Tensor:
        """The ``[n]`` slot indices the current feed of ``n`` tokens writes (one fixed tensor per ``n``)."""
        if n not in self._write_index:
            self._write_index[n] = torch.zeros(n, dtype=torch.long, device=self.device)
        return self._write_index[n]

    def attention_mask(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[batch, 1, n, capacity]`` additive mask for queries at ``positions [batch, n]``: 0 where a
        slot's position is at most the query's, the dtype's minimum elsewhere (empty slots included).
        ``slot_pos`` is ``[capacity]`` (rows in lockstep) or ``[batch, capacity]`` (a row each)."""
        slot_pos = self.slot_pos[: self.width] if self.slot_pos.ndim == 2 else self.slot_pos[None]
        if self.span is not None:
            slot_pos = slot_pos[:, : self.span.shape[0]]
        # deferring, a query sees the slots strictly before it: its own slot still holds what the ring
        # drops, and its K/V come beside them (``fresh``, written by commit() after the step)
        before = slot_pos[:, None, None, :] < positions[:, None, :, None]
        visible = before if self.defer else slot_pos[:, None, None, :] <= positions[:, None, :, None]
        zero = torch.zeros((), dtype=dtype, device=self.device)
        return torch.where(visible, zero, torch.finfo(dtype).min)

    def commit(self) -> None:
        """After a step: write the K/V it left in :attr:`fresh` (nothing unless :attr:`defer`)."""

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a captured step reads or writes (to mark their addresses static)."""
        return [
            self.slot_pos,
            *self._write_index.values(),
            *self.storage.values(),
            *(t for la in self.layers for t in la.buffers()),
        ]

    @contextlib.contextmanager
    def packed_reads(self, fused_writes: bool = False) -> Iterator[None]:
        """Inside, an ``int4`` cache's layers return their packed rows instead of decoding every slot:
        for an attention that reads the codes itself (:mod:`kvlab.kernels.split_attention`) or decodes
        them (:func:`~kvlab.policy.quant.codecs.int4rows.decode_rows`). :class:`~kvlab.hf.graphs.RollingDecoder` runs its steps inside.
        ``fused_writes``: new rows are encoded by :func:`~kvlab.kernels.split_attention.write_int4`
        (the same bytes in one kernel; Triton prepared, a power-of-two group, not under torch.compile)."""
        before = self.packed, self.fused_writes
        self.packed = True
        self.fused_writes = (
            fused_writes and self.codec == "int4" and split_attention.can_write_int4(self.group)
        )
        try:
            yield
        finally:
            self.packed, self.fused_writes = before

    # -- every layer at once (host side, between steps) -------------------------------------------------
    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """K/V ``[..., head_dim]`` as this cache stores them: int4 rows (the codec's), or the model's dtype."""
        return self.coder.pack(x) if self.coder else x.to(self.dtype)

    def loaded(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored slots in the model's dtype: int4 rows decoded (a new tensor), plain ones as they are."""
        return decode_rows(stored, self.head_dim, self.dtype) if self.coder else stored

    def _write_first(self, run: slice, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """Store ``k`` and/or ``v`` (``[layers of run, batch, heads, n, head_dim]``) in slots ``[0, n)``."""
        for t, name in ((k, "keys"), (v, "values")):
            if t is not None:
                self.storage[name][run, :, :, : t.shape[-2]].copy_(self.stored(t))

    def _read_first(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's keys and values of slots ``[0, n)``, decoded, as new tensors."""
        k, v = (self.loaded(self.storage[name][:, :, :, :n]) for name in ("keys", "values"))
        return (k, v) if self.coder else (k.clone(), v.clone())

    def _place_sinks(self, start: int) -> None:
        """Write the sinks rotated from their originals to positions ``start ..`` into slots ``[0, s)``
        of every layer (the values too under ``int4``, so re-encoding never compounds)."""
        if self.sink_keys is None:
            return
        # rotated into a new tensor, then copied (rotate_by's strided out= is slow on CPUs)
        for run, rope in self._runs:
            k = self.sink_keys[run] if rope is None else rotate_by(self.sink_keys[run], start, rope)
            v = self.sink_values[run] if self.sink_values is not None else None
            self._write_first(run, k, v)

    def _keep_sinks(self, first: int) -> None:
        """Store the sinks (slots ``[0, s)``, written at positions ``first ..``) as their originals at ``0 ..``."""
        k, v = self._read_first(self.sinks)
        for run, rope in self._runs:
            if rope is not None and first:
                k[run] = rotate_by(k[run], -first, rope)
        self.sink_keys = k
        self.sink_values = v if self.codec == "int4" else None  # plain values are never re-written

    def _rotate_stored(self, delta: int) -> None:
        """Rotate every stored key by ``delta`` positions in place (a re-base; ``int4`` keys are re-encoded,
        their values untouched). Empty slots rotate too: harmless, they are never attended."""
        keys = self.storage["keys"]
        for run, rope in self._runs:
            if rope is None or delta == 0:
                continue
            if self.coder:
                keys[run] = self.stored(rotate_by(self.loaded(keys[run]), delta, rope))
            else:
                rotate_by_(keys[run], delta, rope)

    # -- between steps --------------------------------------------------------------------------------
    def prepare(self, n: int) -> torch.Tensor:
        """Before a feed of ``n`` tokens: apply the pending plan, point :meth:`write_index` ``(n)`` at the
        slots the feed fills and record their positions in ``slot_pos``; returns the ``[n]`` positions
        (a new tensor on the cache's device). Host side; small kernels, no synchronisation."""
        if n < 1 or (n > self.rule.evict_chunk and not (self.empty and n <= self.capacity)):
            raise BadInputError(
                f"a StaticRollingCache takes feeds of 1 to evict_chunk ({self.rule.evict_chunk}) tokens, got {n}"
            )
        self._check_room(n)
        self._apply_plan()
        s = self.sinks
        dev = self.device
        into_sinks = min(n, s - self.sinks_held)
        window_held = self.slots - self.sinks_held
        if window_held + (n - into_sinks) > self.ring:
            raise BadInputError(f"a feed of {n} tokens does not fit the ring of {self.ring} slots")
        steps = torch.arange(n, device=dev)
        ring_slots = s + (self.tail + window_held + steps - into_sinks) % self.ring
        index = torch.where(steps < into_sinks, self.sinks_held + steps, ring_slots)
        self.write_index(n).copy_(index)
        written = n - into_sinks  # the slots below `reach` are the only ones ever written (host-side)
        ring_reach = s + min(self.ring, self.tail + window_held + written) if written else 0
        self.reach = max(self.reach, ring_reach, self.sinks_held + into_sinks)
        positions = self.next_position + steps
        self.slot_pos.index_copy_(0, index, positions)
        self._fed = (n, into_sinks)
        return positions

    def advance(self) -> None:
        """After the feed :meth:`prepare` announced ran: update the counts and plan the next roll."""
        n, into_sinks = self._fed
        if into_sinks and self.sinks_held + into_sinks == self.sinks:  # sinks complete: keep the originals
            self._keep_sinks(self.next_position - self.sinks_held)
        self.sinks_held += into_sinks
        self.slots += n
        self.next_position += n
        self.seen += n
        self.plan = self.rule.next_plan(self.next_position - self.slots, self.slots, True)

    def _apply_plan(self) -> None:
        """The pending drop (mark slots empty), re-base (rotate stored keys) and sink placement."""
        plan, dev = self.plan, self.device
        if not plan.pending:
            return
        if plan.drop:
            gone = self.sinks + (self.tail + torch.arange(plan.drop, device=dev)) % self.ring
            self.slot_pos.index_fill_(0, gone, EMPTY)
            self.tail = (self.tail + plan.drop) % self.ring
            self.slots -= plan.drop
            self.rolls += 1
        if plan.rebase:
            self.slot_pos.sub_(torch.where(self.slot_pos != EMPTY, plan.rebase, 0))
            self._rotate_stored(-plan.rebase)
            self.next_position -= plan.rebase
            self.rebases += 1
        self.plan = RollPlan()
        start = self.next_position - self.slots  # the sinks sit right before the oldest kept token
        if self.sinks_held == self.sinks and self.sinks:
            self._place_sinks(start)
            self.slot_pos[: self.sinks] = torch.arange(start, start + self.sinks, device=dev)

    def _check_room(self, n: int) -> None:
        rule = self.rule
        position = self.next_position - self.plan.rebase
        if rule.rebase != "never" and rule.max_position and position + n > rule.max_position:
            raise BadInputError(
                f"{n} new tokens would pass the maximum position {rule.max_position}; "
                f"feed at most {rule.headroom} tokens per forward to a rolling cache"
            )

    # -- from and to the eager cache ------------------------------------------------------------------
    def load(self, cache: RollingCache) -> StaticRollingCache:
        """Take over the state of an eager :class:`RollingCache` (e.g. after a long prefill), as if its
        tokens had been fed here; the eager cache is not modified. Returns self. In place."""
        if self.tokens_seen:
            raise BadInputError("load() needs an empty StaticRollingCache")
        if cache.rule != self.rule:  # the same RoPE and maximum too: positions mean the same
            raise BadInputError(
                "load() needs the same rule (the same sinks, window, chunk, re-base, RoPE and maximum "
                f"position): {cache.describe()} into {self.describe()}"
            )
        if getattr(cache, "rows", None) is not None or not cache.tokens_seen:
            raise BadInputError("load() takes a RollingCache that has been fed one unpadded batch")
        theirs_all: list[Any] = cache.layers
        if len(theirs_all) != len(self.layers):
            raise BadInputError(f"load() got {len(theirs_all)} layers for {len(self.layers)}")
        want = (self.batch, self.storage["keys"].shape[2], self.head_dim)
        for theirs in theirs_all:  # checked before anything is written
            got = theirs.keys.shape
            if (got[0], got[1], got[-1]) != want:
                raise BadInputError(
                    f"load() got keys [{got[0]}, {got[1]}, .., {got[-1]}] for a cache of [{want[0]}, {want[1]}, .., {want[2]}]"
                )
        kept, s = cache.kept, min(self.sinks, cache.kept)
        if s == self.sinks and s and any(la.sink_keys is None for la in theirs_all):
            raise BadInputError(  # its sinks could never be re-rotated here: refused, not guessed
                "load() needs a RollingCache holding its sinks' original keys on every layer"
            )
        start = cache.next_position - kept
        dev = self.device
        window_slots = torch.arange(s, self.capacity, device=dev)[: kept - s]
        index = torch.cat([torch.arange(s, device=dev), window_slots])
        sink_values = []
        for mine, theirs in zip(self.layers, theirs_all, strict=True):
            k, v = theirs.visible()
            mine._write(index, k.to(dev), v.to(dev))
            sink_values.append(v[:, :, :s].to(dev, self.dtype))
        if s == self.sinks and s:
            self.sink_keys = torch.stack([la.sink_keys.to(dev, self.dtype) for la in theirs_all])
            self.sink_values = torch.stack(sink_values) if self.codec == "int4" else None
        self.slot_pos.fill_(EMPTY)
        self.slot_pos.index_copy_(0, index, torch.arange(start, start + kept, device=dev))
        self.next_position, self.slots, self.sinks_held = cache.next_position, kept, s
        self.tail, self.seen, self.reach = 0, cache.tokens_seen, kept
        # visible() applied its pending roll: counted here, as its next update would have counted it
        self.rolls, self.rebases = (
            cache.rolls + (cache.plan.drop > 0),
            cache.rebases + (cache.plan.rebase != 0),
        )
        self.plan = self.rule.next_plan(start, kept, True)
        return self

    def store_into(self, cache: RollingCache) -> RollingCache:
        """Write this cache's state into ``cache`` (an eager :class:`RollingCache` with the same rule, its
        state replaced): the same slots in position order, the same counts and the same pending roll, so
        feeding it continues exactly where this cache stands (the inverse of :meth:`load`). One row only.
        Returns ``cache``; this cache is not modified."""
        if cache.rule != self.rule or self.batch != 1 or self.coder or len(cache.layers) != len(self.layers):
            raise BadInputError(
                f"store_into() needs one full-precision row and the same rule: {self.describe()} into {cache.describe()}"
            )
        if not self.seen:
            raise BadInputError("store_into() needs a StaticRollingCache that has been fed")
        # every held slot in position order, the pending plan not applied (it stays pending there too)
        window = self.slots - self.sinks_held
        ring = self.sinks + (self.tail + torch.arange(window, device=self.device)) % self.ring
        order = torch.cat([torch.arange(self.sinks_held, device=self.device), ring])
        steady = int(self.rule.policy.capacity or 0) + 1
        for i, (mine, theirs) in enumerate(zip(self.layers, cache.layers, strict=True)):
            k, v = mine.read_slots(order)
            theirs.reset()
            theirs._regrow(max(self.slots, steady), 0, k, v)
            theirs._write(0, k, v)
            theirs.sink_keys = None if self.sink_keys is None else self.sink_keys[i].clone()
            theirs.base, theirs.slots, theirs.plan = self.next_position - self.slots, self.slots, self.plan
            theirs.tokens_seen, theirs.rolls, theirs.rebases = self.seen, self.rolls, self.rebases
        return cache

    def clone(self) -> StaticRollingCache:
        """A copy in the same state with buffers of its own (e.g. to feed a captured and an eager decoder
        the same tokens side by side); feeding either leaves the other as it was."""
        twin = copy.copy(self)
        twin.storage = {name: t.clone() for name, t in self.storage.items()}
        twin.sink_keys = None if self.sink_keys is None else self.sink_keys.clone()
        twin.sink_values = None if self.sink_values is None else self.sink_values.clone()
        twin.slot_pos, twin._write_index = self.slot_pos.clone(), {}
        twin.layers = [RingLayer(twin, la.rope, i) for i, la in enumerate(self.layers)]
        return twin

    def visible_slots(self) -> torch.Tensor:
        """Slot indices of the kept tokens in position order (sinks, then the ring from its tail)."""
        s = self.sinks_held
        window = self.kept - s
        first = self.tail + self.plan.drop
        ring = self.sinks + (first + torch.arange(window, device=self.device)) % self.ring
        return torch.cat([torch.arange(s, device=self.device), ring])

    def _check_rows(self) -> None:
        raise BadInputError("a StaticRollingCache feeds its rows in lockstep (batch=), not as a padded batch")

    @property
    def nbytes(self) -> Bytes:
        """Bytes held: every layer's buffers (codes, scales), the sinks' stored originals, the slot positions."""
        return Bytes(super().nbytes + tensor_bytes(self.sink_keys, self.sink_values, self.slot_pos))


def check_ring_model(config: Any) -> None:
    """Refuse a model the ring cannot hold: one with sliding-window layers (a ring layer attends globally)."""
    if any(w is not None for w in sliding_windows(text_config(config))):
        raise UnsupportedModelError(
            "StaticRollingCache supports models whose layers all attend globally; this one has "
            "sliding-window layers: use RollingCache"
        )


def static_rolling_cache_for(
    handle: Runner,
    *,
    window: int,
    sinks: int = 4,
    evict_chunk: int | None = None,
    rebase: Rebase = "auto",
    batch: int = 1,
    codec: Codec = "none",
    group: int = 32,
    max_position: int | None = None,
) -> StaticRollingCache:
    """A :class:`StaticRollingCache` for a :class:`~kvlab.model.ModelHandle` (config, RoPE, maximum
    position, and the device and dtype of its weights)."""
    h = handle
    if not all(hasattr(h, a) for a in ("rope", "max_positions", "dtype", "device", "config")):
        raise BadInputError(
            f"static_rolling_cache_for needs a kvlab ModelHandle (kvlab.as_handle(model)), got {type(h).__name__}"
        )
    if h.rope is None:
        raise UnsupportedModelError(
            getattr(h, "rope_problem", None) or "a rolling cache needs a model with RoPE"
        )
    rule = roll_rule(
        text_config(h.config), h.rope, window, sinks, evict_chunk, max_position or h.max_positions, rebase
    )
    return StaticRollingCache(
        h.config,
        rule,
        batch=batch,
        dtype=h.dtype,
        device=h.device,
        codec=codec,
        group=group,
    )
