"""Sinks + a rolling window over a quantized history: a :class:`RollingLayer` whose window is stored as codes.

The counts, decisions and positions are the rolling cache's own (:class:`~kvlab.hf.rolling_layer.RollRule`:
the same ``base``, ``slots``, plan, rolls and re-bases in every layer); only the storage differs:

* the sinks stay in full precision, re-rotated from their stored originals as in every rolling layer;
* the window's older slots are packed codes (any :class:`~kvlab.policy.quant.Quantizer`), encoded
  ``block`` slots at a time, oldest first, once the newest ``tail`` slots (the codec's full-precision
  window) are full; a roll drops whole blocks (the eviction chunk is a multiple of the block), so no
  slot is ever quantized twice and nothing is re-encoded;
* the newest slots wait in a full-precision tail; like a roll, encoding is decided at the end of an
  update and applied at the start of the next, so a prompt fed in pieces with the roll held
  (:meth:`~kvlab.hf.live_cache.LiveCache.hold_roll`, which also holds the codes) sees its earlier pieces in full
  precision, as one forward would; and like a roll, a feed longer than the headroom is settled at the
  end of its own update (encoded, rolled, its tail copied out of the prompt-sized tensor), so no
  prompt-sized tail outlives its forward (:meth:`~kvlab.hf.rolling_layer.RollingLayer._settle`).

Invariant: codes are stored at their slots' *original* positions (a roll does not move a window key's
position; a re-base by ``r`` rotates every kept key by ``-r``): the layer keeps ``frame``, the total of
its re-bases, and a key's true rotation is its decoded code rotated by ``-frame`` (an exact RoPE shift,
applied to the decoded keys on the reference path, or as the query rotated by ``+frame`` on the
packed-code path, :func:`kvlab.policy.quant.attention.decode_attention`). Nothing is rotated in place:
each update builds new tensors and lists, so a checkpoint of the layer's attributes restores it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.cache import head_dim_of
from kvlab.hf.cache_steps import packed_step
from kvlab.hf.live_cache import restore_vars
from kvlab.hf.rolling_layer import RollingLayer, RollPlan, RollRule
from kvlab.policy.quant.methods import Quantizer, Segment
from kvlab.policy.quant.pack import tensor_bytes
from kvlab.rope.fast import rotate_by
from kvlab.rope.layers import sliding_windows


class CodedRollingLayer(RollingLayer):
    """``[sinks | codes | full-precision tail]`` of one layer, following the shared :class:`RollRule`."""

    def __init__(self, rule: RollRule, layer: int, codec: Quantizer, packed_path: str = "auto") -> None:
        super().__init__(rule, layer)
        self.packed_path = packed_path
        self.layer_index = layer
        self.codec, self.block = codec, codec.rolling_block()
        self.tail_slots = int(codec.window)  # newest slots kept in full precision
        self.segments: list[Segment] = []  # each `block` slots, oldest first, at original positions
        self.tail_start = 0  # original position of the tail's first slot
        self.frame = 0  # total re-base: true rotation = code's rotation - frame
        self.sink_values: torch.Tensor | None = None
        self.sink_live: torch.Tensor | None = None  # sink keys rotated to the current base
        # placeholders, replaced by the first update's (its dtype and device)
        self.tail_k: torch.Tensor = torch.empty(0, device="cpu")
        self.tail_v: torch.Tensor = torch.empty(0, device="cpu")
        self.encode_pending = False  # the tail's ready blocks are encoded at the next update
        self._plan_key: tuple[int, int, int] = (-1, 0, 0)
        self._seg_plan: Any = None

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def coded(self) -> int:
        return self.block * len(self.segments)

    @property
    def nbytes(self) -> int:
        live = self.sink_live if self.sink_live is not self.sink_keys else None  # re-rotated copy
        fp = tensor_bytes(self.sink_keys, live, self.sink_values, self.tail_k, self.tail_v)
        return fp + sum(s.nbytes for s in self.segments)

    # -- the update ----------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n_new = self._start_update(key_states, value_states, args, kwargs)
        self._prepare()
        k, v = self._take_sinks(key_states, value_states)
        self.tail_k = torch.cat((self.tail_k, k), dim=-2)
        self.tail_v = torch.cat((self.tail_v, v), dim=-2)
        out = self._attend(key_states, value_states)
        self.encode_pending = True  # like a roll: decided now, applied at the start of the next update
        self.keys, self.values = self.tail_k, self.tail_v
        self._advance(n_new)
        return out

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.tail_k, self.tail_v = key_states[:, :, :0], value_states[:, :, :0]

    def _prepare(self) -> None:
        """What the last update left pending: encode the tail's ready blocks, then apply the roll."""
        if self.encode_pending:
            self._encode_ready()
            self.encode_pending = False
        self._apply(self.plan)

    def _moves_held(self) -> bool:
        """Whether the next update rolls, re-bases or encodes what is held."""
        return self.plan.pending or self.encode_pending

    def _settle(self) -> None:
        """What the next update would do first (encode the ready blocks, apply the plan), done now after a
        feed longer than the headroom, with the tail copied to tensors of its own size: the one it is a
        slice of is as long as the prompt (``_attend`` returned new tensors, so this forward is unaffected)."""
        encodes = self.tail_k.shape[-2] - self.tail_slots >= self.block
        self.settled = self.plan.pending or encodes  # a held piece would see these codes, not the fp tail
        self._prepare()
        self._count_plan()
        self.tail_k, self.tail_v = self.tail_k.clone(), self.tail_v.clone()
        self.keys, self.values = self.tail_k, self.tail_v

    def hold(self) -> None:
        """Cancel the pending roll and keep the tail in full precision through the next forward (a prompt
        fed in pieces, with :meth:`~kvlab.hf.live_cache.LiveCache.hold_roll`): every piece then sees the
        earlier ones as one forward would."""
        super().hold()
        self.encode_pending = False

    def checkpoint(self) -> Callable[[], None]:
        """Nothing is written in place here (module docstring): the attributes, lists copied, are the state."""
        return restore_vars(self)

    def _take_sinks(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream's first ``sinks`` tokens become the sinks (originals at positions 0..); the rest."""
        have = 0 if self.sink_keys is None else self.sink_keys.shape[-2]
        take = min(max(self.rule.policy.sinks - have, 0), k.shape[-2])
        if take:
            sk, sv = k[:, :, :take].clone(), v[:, :, :take].clone()
            self.sink_keys = sk if self.sink_keys is None else torch.cat((self.sink_keys, sk), dim=-2)
            self.sink_values = sv if self.sink_values is None else torch.cat((self.sink_values, sv), dim=-2)
            self.sink_live = self.sink_keys if self.base == 0 else self.sinks_at(self.base)
            self.tail_start += take
        return k[:, :, take:], v[:, :, take:]

    def _apply(self, plan: RollPlan) -> None:
        """Drop ``plan.drop`` window slots (whole blocks of codes first, then the tail's oldest) and re-base."""
        if not plan.pending:
            return
        drop = plan.drop
        whole = min(drop // self.block, len(self.segments))
        if drop and drop < self.coded and drop % self.block:
            raise RuntimeError(f"a roll of {drop} slots would split a block of {self.block} codes")
        if whole:
            self.segments = self.segments[whole:]
        rest = drop - whole * self.block
        if rest:
            self.tail_start += rest
            self.tail_k, self.tail_v = self.tail_k[:, :, rest:], self.tail_v[:, :, rest:]
        if plan.rebase:
            self.frame += plan.rebase
            if self.rope is not None:
                self.tail_k = rotate_by(self.tail_k, -plan.rebase, self.rope)
        if self.sink_keys is not None:
            self.sink_live = self.sinks_at(self.base + plan.drop - plan.rebase)

    def _encode_ready(self) -> None:
        """Encode the tail's oldest whole blocks beyond its full-precision ``tail_slots``."""
        n = (self.tail_k.shape[-2] - self.tail_slots) // self.block
        if n <= 0:
            return
        new = []
        for i in range(n):
            k = self.tail_k[:, :, i * self.block : (i + 1) * self.block]
            v = self.tail_v[:, :, i * self.block : (i + 1) * self.block]
            start = self.tail_start + i * self.block
            if self.frame and self.rope is not None:
                k = rotate_by(k, self.frame, self.rope)  # back to the slots' original positions
            positions = torch.arange(start, start + self.block, device="cpu")
            new.append(self.codec.encode(k, v, positions, self.rope))
        self.segments = [*self.segments, *new]
        cut = n * self.block
        self.tail_start += cut
        self.tail_k, self.tail_v = self.tail_k[:, :, cut:], self.tail_v[:, :, cut:]

    def decoded_codes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The coded slots decoded and rotated to their true positions, ``[B, H, coded, D]``."""
        if not self.segments:
            return None
        parts = [s.decode() for s in self.segments]
        k = torch.cat([p[0] for p in parts], dim=-2).to(self.dtype)
        v = torch.cat([p[1] for p in parts], dim=-2).to(self.dtype)
        if self.frame and self.rope is not None:
            k = rotate_by(k, -self.frame, self.rope)
        return k, v

    def _attend(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """What this forward's attention reads: the packed codes (a bound one-token step) or the decoded slots."""
        step = packed_step(self.rule)
        sinks_k = [self.sink_live] if self.sink_live is not None else []
        sinks_v = [self.sink_values] if self.sink_values is not None else []
        if step is not None and key_states.shape[-2] == 1 and key_states.shape[0] == 1 and self.segments:
            plan = self.segment_plan()
            if plan is not None:
                fp_k = torch.cat([*sinks_k, self.tail_k], dim=-2)[0]
                fp_v = torch.cat([*sinks_v, self.tail_v], dim=-2)[0]
                step.views[self.index] = (plan, fp_k, fp_v)
                return key_states, value_states
        codes = self.decoded_codes()
        ks = [*sinks_k, *([codes[0]] if codes else []), self.tail_k]
        vs = [*sinks_v, *([codes[1]] if codes else []), self.tail_v]
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def segment_plan(self) -> Any:
        """The codes as the packed-code attention reads them, with the query turned by ``+frame``."""
        key = (len(self.segments), id(self.segments[0]), self.frame)
        if self._plan_key != key:
            from kvlab.policy.quant.attention import segment_plan

            plan = segment_plan(self.segments, path=self.packed_path)
            if plan is not None and self.frame and self.rope is not None:
                plan = dataclasses.replace(plan, frame=self.frame, frame_rope=self.rope)
            self._seg_plan, self._plan_key = plan, key
        return self._seg_plan

    @property
    def index(self) -> int:
        return self.layer_index

    # -- inspection ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _prepared(self) -> Iterator[None]:
        """Inside: the layer as its next update finds it (the pending codes and roll applied); then put back."""
        put_back = restore_vars(self)
        try:
            self._prepare()
            yield
        finally:
            put_back()

    def visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` as the next forward will see them (pending roll applied), decoded; new tensors."""
        with self._prepared():
            codes = self.decoded_codes()
            ks = [t for t in (self.sink_live, codes[0] if codes else None, self.tail_k) if t is not None]
            vs = [t for t in (self.sink_values, codes[1] if codes else None, self.tail_v) if t is not None]
            return torch.cat(ks, dim=-2).clone(), torch.cat(vs, dim=-2).clone()

    def visible_nbytes(self) -> int:
        """Bytes held once the pending roll is applied (what the next forward's cache holds)."""
        with self._prepared():
            return self.nbytes

    def reset(self) -> None:
        super().reset()
        self.segments, self.tail_start, self.frame, self.encode_pending = [], 0, 0, False
        self.sink_values = self.sink_live = None
        self.tail_k, self.tail_v = torch.empty(0, device="cpu"), torch.empty(0, device="cpu")


def check_codec(text: Any, rope: Any, codec: Quantizer, *, window: int, chunk: int, packed_path: str) -> int:
    """Refuse a codec the rolling window cannot hold (before anything is built); returns the eviction
    chunk rounded up to whole blocks of codes."""
    from kvlab.policy.quant.attention import PATHS

    if not isinstance(codec, Quantizer):
        raise BadInputError(f"codec must be a kvlab Quantizer, got {type(codec).__name__}")
    if packed_path not in PATHS:
        raise BadInputError(f"packed_path must be one of {', '.join(PATHS)}, got {packed_path!r}")
    if any(w is not None for w in sliding_windows(text)):
        raise UnsupportedModelError(
            "a rolling window over codes supports full-attention models only (this one has sliding-window layers)"
        )
    if codec.sinks:
        raise BadInputError("a rolling window keeps its own sinks in full precision: give the codec sinks=0")
    head_dim = head_dim_of(text)
    for i in range(int(text.num_hidden_layers)):
        codec.check(head_dim, rope.for_layer(i) if rope is not None else None)
    block = codec.rolling_block()
    chunk = block * math.ceil(max(1, int(chunk)) / block)
    need = chunk + block + int(codec.window)
    if window < need:
        raise BadInputError(
            f"a window of {window} over {codec.name} codes holds none: it needs at least the eviction chunk "
            f"({chunk}) + one block of codes ({block}) + the full-precision tail ({codec.window}) = {need} slots"
        )
    return chunk
