"""The layers of a rolling-window cache: attention sinks + the last ``window`` tokens, forever.

StreamingLLM's policy on transformers 5.x's layer API, built so that a roll costs almost nothing:

* Slots are always contiguous in RoPE position: slot ``i`` holds position ``base + i``; the sinks sit
  right before the window. ``next_position = base + slots`` is what :meth:`get_seq_length` returns,
  so a model called without ``position_ids`` puts its queries where the cache expects them.
* Storage is written in place (a :class:`~kvlab.hf.cache.GrowingStore`): each layer owns key and value
  buffers sized for ``sinks + window`` plus one slot (a decode step's token; a sliding layer: its reach
  plus one eviction chunk). A plain decode step writes only the new token (a ``DynamicCache``
  concatenates the whole cache every step); views of the buffers are what attention reads. A larger
  feed grows them for its forward; the next update shrinks them back.
* Evicting ``d`` window tokens moves the kept window down once (every ``evict_chunk`` tokens, so the
  copy is amortized) and re-rotates the ``sinks`` sink keys from their stored originals (float64
  angles, never incremental): ``base`` grows by ``d`` and ``next_position`` does not change. RoPE
  only sees relative positions, so this equals StreamingLLM's "re-position everything from 0" up to
  fp32 rounding.
* Positions stay bounded by an occasional re-base: one rotation of every kept key by ``-base``, in
  place (:func:`kvlab.rope.fast.rotate_by_`: one ``[head_dim/2]`` cos/sin pair per re-base, float64
  angles, fp32 multiply-adds, ~1e-7 relative error against the float64 reference). ``rebase="auto"``
  re-bases only when ``next_position`` would pass the model's maximum, ``"always"`` after every
  eviction (StreamingLLM's in-cache positions), ``"never"`` not at all.
* Eviction and re-basing are lazy: decided at the end of a layer's update, applied at the start of
  its next one; the mask offset accounts for it. One exception keeps memory the policy's: a feed
  larger than the headroom (a long prompt in one forward, e.g. ``model.generate``'s prefill) is
  *settled* at the end of its update: the plan is applied into new buffers of the steady size and the
  prompt-sized ones live on only in the views this forward's attention reads. So between forwards a
  layer holds at most ``sinks + window + 1`` slots (plus the sinks' original keys), except after a
  feed of at most ``headroom`` tokens into a full window (how kvlab's loops and the server feed a
  prompt, holding the roll between pieces: :meth:`~kvlab.hf.live_cache.LiveCache.hold_roll`), which
  holds ``kept + feed <= sinks + 2 * window`` slots until the next update. A settled roll cannot be
  held: ``hold_roll`` after such a feed is refused.

Each :class:`RollingLayer` owns its state and follows one immutable :class:`RollRule` (the
:class:`~kvlab.policy.SinksWindow` policy, the chunk, the re-base mode); layers never reach back
into the cache, and the cache only answers questions (positions, counts) from its first layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from transformers.cache_utils import CacheLayerMixin

from kvlab.errors import BadInputError
from kvlab.hf.cache import PADDED_BATCH, GrowingStore, rows_at_different_positions
from kvlab.policy.quant.pack import tensor_bytes
from kvlab.policy.window import SinksWindow
from kvlab.rope.fast import rotate_by, rotate_by_
from kvlab.rope.spec import Rope

Rebase = Literal["auto", "always", "never"]


@dataclass(frozen=True)
class RollPlan:
    """What a layer's next ``update`` applies before appending: drop ``drop`` window tokens (after
    the sinks) and rotate the kept window by ``-rebase`` positions."""

    drop: int = 0
    rebase: int = 0

    @property
    def pending(self) -> bool:
        return self.drop > 0 or self.rebase != 0


@dataclass(frozen=True)
class RollRule:
    """What every layer of one rolling cache follows (immutable, shared): the sinks + window policy,
    the eviction chunk and when to re-base positions."""

    policy: SinksWindow
    rope: Rope  # one spec, or one per layer (each RollingLayer holds its own)
    evict_chunk: int
    max_position: int  # 0: no maximum
    rebase: Rebase
    codec: Any = None  # a Quantizer: the window is stored as its codes (kvlab.hf.coded_rolling)
    packed_path: str = "auto"  # how a bound coded cache's one-token steps read the codes

    chooses_positions = True  # the cache re-positions tokens: a bound forward lets it pick positions

    def describe(self) -> str:
        codec = f", codec={self.codec.name}" if self.codec is not None else ""
        return (
            f"sinks={self.policy.sinks}, window={self.policy.window}, chunk={self.evict_chunk}, "
            f"rebase={self.rebase}{codec}"
        )

    def check_seed(self, n: int) -> None:
        """A prefix is taken exactly only while no roll would have happened feeding it."""
        if n > int(self.policy.capacity or 0):
            raise BadInputError(f"seed() takes 1 to sinks + window ({self.policy.capacity}) tokens, got {n}")

    @property
    def headroom(self) -> int:
        """Lookahead kept free below ``max_position`` after a re-base: the largest feed allowed at once."""
        cap = int(self.policy.capacity or 0)
        return (
            max(1, min(int(self.policy.window or 1), self.max_position - cap))
            if self.max_position
            else int(self.policy.window or 1)
        )

    def next_plan(self, base: int, slots: int, may_rebase: bool) -> RollPlan:
        """The roll to apply next, after a forward left ``slots`` slots from position ``base``."""
        drop = self.policy.overflow(slots, self.evict_chunk)
        if not may_rebase or self.rebase == "never":
            return RollPlan(drop=drop)
        near_max = bool(self.max_position) and base + slots + self.headroom > self.max_position
        wants = near_max or (self.rebase == "always" and drop > 0)
        return RollPlan(drop=drop, rebase=base + drop if wants else 0)


class RollingLayer(GrowingStore, CacheLayerMixin):
    """One layer's ``[sinks | window]`` keys and values, contiguous ``[batch, kv_heads, slots, head_dim]``.

    The layer owns its state (``base``, ``slots``, the pending ``plan``) and follows the shared
    :class:`RollRule`; every layer sees the same token counts, so all layers make the same decisions.
    ``sink_keys`` keeps the sinks' keys as first computed, at positions ``0 ..``; the live copy in
    ``keys[:, :, :sinks]`` is always re-rotated from it, so sinks never drift. ``rope`` is this layer's
    RoPE (hybrid models rotate layer types differently); None for a layer without RoPE, whose keys carry
    no position and are never rotated.
    """

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, rule: RollRule, layer: int = 0) -> None:
        super().__init__()
        self.rule = rule
        self.rope = rule.rope.for_layer(layer)
        self.sink_keys: torch.Tensor | None = None
        self._buf_k: torch.Tensor | None = None  # [batch, kv_heads, capacity, head_dim]; keys is a view
        self._buf_v: torch.Tensor | None = None
        self.base = 0  # position of slot 0
        self.slots = 0  # tokens held (including those a pending drop will remove)
        self.plan = RollPlan()
        self.tokens_seen = self.rolls = self.rebases = 0
        self.updates = 0  # forwards taken (a checkpoint of the buffers undoes one)
        self.may_rebase = False  # set by the cache while its caller lets it choose positions
        self.settled = False  # the last update applied its own plan (a long feed: _settle); no hold then

    # -- positions -----------------------------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Tokens visible to the next forward (slots minus the pending drop)."""
        return self.slots - self.plan.drop

    @property
    def next_position(self) -> int:
        """RoPE position of the next token (after any pending re-base)."""
        return self.base + self.slots - self.plan.rebase

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.next_position

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kept + query_length, 0

    def query_offset(self) -> int:
        """Slot index of the next forward's first query in this layer's own storage."""
        return self.kept

    def get_max_length(self) -> int:
        return -1

    def _steady_slots(self) -> int:
        """The buffers' size between forwards: the most slots a forward keeps plus a decode step's token."""
        return int(self.rule.policy.capacity or 0) + 1

    # -- the live-layer interface (kvlab.hf.live_cache) --------------------------------------------------
    @property
    def evictions(self) -> int:
        return self.rolls

    @property
    def nbytes(self) -> int:
        """Bytes held: the key and value buffers (with their spare room) and the sinks' original keys."""
        return tensor_bytes(self._buf_k, self._buf_v, self.sink_keys)

    def kept_positions(self) -> torch.Tensor:
        """``[kept]`` RoPE positions of the kept slots as the next forward sees them (contiguous), on the host."""
        return torch.arange(self.next_position - self.kept, self.next_position, device="cpu")

    def hold(self) -> None:
        """Cancel the roll the last forward planned, so that the next forward continues it (in place);
        refused after a feed longer than the headroom, whose roll its update already applied (_settle)."""
        if self.settled:
            raise BadInputError(
                f"the last forward fed more than the rolling cache's headroom ({self.rule.headroom} tokens), so "
                "its update already rolled the window (no prompt-sized buffer outlives the forward): to hold "
                f"the roll between the pieces of a prompt, feed pieces of at most {self.rule.headroom} tokens"
            )
        self.plan = RollPlan()

    def seed(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.update(k, v)

    def close(self) -> None:
        """Nothing held outside the cache."""

    def _moves_held(self) -> bool:
        """Whether the next update moves or rotates held slots (a roll or a re-base)."""
        return self.plan.pending

    def checkpoint(self) -> Callable[[], None]:
        """The layer's state now, as a function that puts it back (in place) after the next forward (a step
        that failed part-way); refused after more than one, whose writes it does not cover.

        A step that applies no roll writes only past the held slots, so the layer's attributes (counts, the
        plan, the buffer views) are all there is to restore; a step that moves or rotates held slots (a roll,
        a sliding layer's trim, a re-base) has them copied too (once per eviction chunk)."""
        held = None
        if self._moves_held() and self.keys is not None and self.values is not None:
            held = (self.keys.clone(), self.values.clone())
        saved = dict(vars(self))

        def restore() -> None:
            if self.updates > saved["updates"] + 1:
                raise BadInputError(
                    f"this checkpoint of a rolling layer undoes one forward; {self.updates - saved['updates']} "
                    "ran since it was taken (take one before each forward)"
                )
            vars(self).clear()
            vars(self).update(saved)
            if held is not None:  # the views of the buffers as they were: their slots back in place
                assert self.keys is not None and self.values is not None  # they were (see held above)
                self.keys.copy_(held[0])
                self.values.copy_(held[1])

        return restore

    def describe_state(self) -> str:
        return (
            f"{self.kept} kept, positions {self.next_position - self.kept}..{self.next_position - 1}, "
            f"{self.tokens_seen} seen, {self.rolls} rolls, {self.rebases} re-bases"
        )

    # -- the update ------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Apply the pending roll, append the new K/V, plan the next roll; return everything visible.

        In place: the layer owns two buffers (keys, values) with room for ``sinks + window`` plus the
        eviction chunk and a feed; a plain step writes only the new tokens (no copy of the cache), a
        roll moves the kept window down once (every ``evict_chunk`` tokens) and re-rotates the sinks,
        a re-base rotates the kept keys where they are. The returned tensors are views of the buffers,
        valid until the next update.
        """
        n_new = self._start_update(key_states, value_states, args, kwargs)
        self._copy_on_write(key_states, value_states)
        kept = self._apply_plan()
        self._reserve(kept + n_new, kept, key_states, value_states)
        self._stored(self._write(kept, key_states, value_states))
        return self._advance(n_new)

    def _start_update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, args: tuple, kwargs: dict
    ) -> int:
        """Refuse a padded batch and a feed past the maximum position; initialize on the first feed.
        Returns the number of new tokens."""
        n_new = key_states.shape[-2]
        if rows_at_different_positions(args, kwargs):
            raise BadInputError(PADDED_BATCH % "RollingCache")
        self._check_room(n_new)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return n_new

    def _stored(self, total: int) -> None:
        """After the new tokens are written (``total`` slots held): keep the sinks' original keys, once."""
        sinks = self.rule.policy.sinks
        if self.sink_keys is None and sinks and total >= sinks:
            assert self.keys is not None  # the update just set it
            self.sink_keys = self.keys[:, :, :sinks].clone()

    def _copy_on_write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Under autograd, write into copies of the buffers: the previous forwards saved views of the old
        ones for their backward, which an in-place write would invalidate (gradients through several
        steps, e.g. to an earlier token's embedding). Without a gradient nothing is copied."""
        if self._buf_k is None or not torch.is_grad_enabled():
            return
        assert self._buf_v is not None  # allocated with _buf_k (_reserve)
        if key_states.requires_grad or value_states.requires_grad or self._buf_k.requires_grad:
            self._buf_k, self._buf_v = self._buf_k.clone(), self._buf_v.clone()

    def _advance(self, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The counts after a feed of ``n_new`` tokens with the pending plan applied, and the next plan
        (the same in every layer, so every layer makes the same decisions); then, after a feed longer than
        the headroom, that plan settled at once (:meth:`_settle`). Returns what this forward attends to."""
        self._count_plan()
        self.slots += n_new
        self.tokens_seen += n_new
        self.updates += 1
        self.plan = self.rule.next_plan(self.base, self.slots, self.may_rebase)
        out = cast(torch.Tensor, self.keys), cast(torch.Tensor, self.values)  # set by the update
        self.settled = False
        if n_new > self.rule.headroom and self._moves_held():
            self._settle()
        return out

    def _count_plan(self) -> None:
        """The counts with the pending plan applied (its slots moved already), and no plan pending."""
        plan = self.plan
        self.rolls += plan.drop > 0
        self.rebases += plan.rebase != 0
        self.base += plan.drop - plan.rebase
        self.slots -= plan.drop
        self.plan = RollPlan()

    def _settle(self) -> None:
        """Apply the plan now, into new buffers of the steady size: after a long feed (a prompt in one
        forward) the buffers are prompt-sized, and only this forward's attention, which reads the views
        the update returned (of the old buffers, left untouched), still needs them. Every layer settles
        the same feeds (the same count, the same plan), so the layers keep the same counts; the result
        equals the lazy roll of the next update, bit for bit."""
        # allocated by the update that is settling
        old_k, old_v = cast(torch.Tensor, self._buf_k), cast(torch.Tensor, self._buf_v)
        size = (*old_k.shape[:2], self._steady_slots())
        into = old_k.new_empty((*size, old_k.shape[-1])), old_v.new_empty((*size, old_v.shape[-1]))
        self.settled = self.plan.pending
        held = self._apply_plan(into)
        self._count_plan()
        self._buf_k, self._buf_v = into
        self._show(held)

    def _apply_plan(self, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """Apply the pending drop and re-base to the buffers in place, or with the kept slots copied
        ``into`` other buffers (the old ones left as they are); returns the slots kept."""
        plan = self.plan
        if not plan.pending and into is None:
            return self.slots
        # a roll is planned only by an update, once _reserve has allocated the buffers
        assert self._buf_k is not None and self._buf_v is not None
        s = min(self.rule.policy.sinks, self.slots)
        kept = self.slots - plan.drop
        dst_k, dst_v = into or (self._buf_k, self._buf_v)
        for src, dst in ((self._buf_k, dst_k), (self._buf_v, dst_v)):
            if into is not None:
                dst[:, :, :s] = src[:, :, :s]
                dst[:, :, s:kept] = src[:, :, s + plan.drop : self.slots]
            elif plan.drop:  # overlapping move down: copy the survivors out first (once per evicted chunk)
                dst[:, :, s:kept] = src[:, :, s + plan.drop : self.slots].clone()
        if plan.rebase and self.rope is not None:
            rotate_by_(dst_k[:, :, s:kept], -plan.rebase, self.rope)
        if s and plan.pending:  # the sinks rotated from their stored originals straight into place (no drift)
            dst_k[:, :, :s] = self.sinks_at(self.base + plan.drop - plan.rebase)
        return kept

    def _reserve(self, need: int, held: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers with room for ``need`` slots (:class:`~kvlab.hf.cache.GrowingStore`): allocated once at
        the steady-state size, grown for a larger feed (kept for the feeds that follow it: the pieces of a
        prompt), shrunk back to the steady size by the first update that fits in it (a decode step)."""
        steady, cap = self._steady_slots(), self.capacity
        if need > cap or (cap > steady and need <= steady):
            self._regrow(max(need, steady), held, key_states, value_states)

    def _check_room(self, n_new: int) -> None:
        """Refuse a feed whose positions would pass the model's maximum (``rebase="never"`` opts out)."""
        rule = self.rule
        if rule.rebase == "never" or not rule.max_position or self.next_position + n_new <= rule.max_position:
            return
        if self.may_rebase:
            raise BadInputError(
                f"{n_new} new tokens would pass the maximum position {rule.max_position}; "
                f"feed at most {rule.headroom} tokens per forward to a rolling cache"
            )
        raise BadInputError(
            f"positions would pass the model's maximum ({rule.max_position}): this RollingCache re-bases "
            "its positions only when the caller lets it choose them, and the caller (e.g. model.generate) "
            "passes its own. Generate with kvlab.streaming.stream_generate (or ModelHandle.run without "
            "positions), or pass rebase='never' to let positions grow past the maximum knowingly."
        )

    def sinks_at(self, base: int) -> torch.Tensor:
        """The sink keys rotated from their stored originals (one rotation, no drift) to ``base ..``."""
        if self.sink_keys is None:
            raise RuntimeError("no sink keys stored yet")
        return self.sink_keys if self.rope is None else rotate_by(self.sink_keys, base, self.rope)

    def visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` as the next forward will see them: ``[sinks | kept window]``, pending roll applied.

        New tensors when a roll is pending, else views of the layer's buffers, which the next update
        overwrites in place (copy them to keep them; :meth:`RollingCache.kept_layers` does).
        """
        keys, values, plan = self.keys, self.values, self.plan
        if keys is None or values is None:
            raise BadInputError("the cache is empty: nothing to read")
        if not plan.pending:
            return keys, values
        s = min(self.rule.policy.sinks, self.slots)
        window_k = keys[:, :, s + plan.drop :]
        if plan.rebase and self.rope is not None:
            window_k = rotate_by(window_k, -plan.rebase, self.rope)
        sinks = [self.sinks_at(self.base + plan.drop - plan.rebase)] if s else []
        k = torch.cat([*sinks, window_k], dim=-2)
        return k, torch.cat([values[:, :, :s], values[:, :, s + plan.drop :]], dim=-2)

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = None
        self._buf_k = self._buf_v = None
        self.is_initialized = False
        self.base = self.slots = self.tokens_seen = self.rolls = self.rebases = self.updates = 0
        self.plan = RollPlan()
        self.settled = False


class SlidingRollingLayer(RollingLayer):
    """A sliding-window layer (Mistral, Gemma-3's local layers) in a rolling cache whose window is at
    least the layer's own ``sliding_window``: it keeps the same counts as every layer (``base``,
    ``slots``, the pending ``plan``: the same decisions) but stores only the newest slots its attention
    can reach, as transformers' hybrid caches do — at most ``sliding_window - 1`` before a forward, plus
    up to one eviction chunk awaiting a trim (hidden by the sliding mask), and never the sinks (with the
    rolling window at least the sliding window, they are out of its reach).

    Storage: ``_buf_k[:, :, :held]`` are the newest ``held`` slots, positions
    ``next_position - held ..``; a trim moves the newest ``sliding_window - 1`` down once per chunk.
    """

    is_sliding = True

    def __init__(self, rule: RollRule, layer: int, sliding_window: int) -> None:
        super().__init__(rule, layer)
        self.sliding_window = int(sliding_window)
        self.held = 0

    @property
    def reach(self) -> int:
        """Earlier slots one query can see: the window minus the query itself."""
        return self.sliding_window - 1

    def _held_next(self) -> int:
        """Slots the next forward keeps (after the trim the next update makes, if due)."""
        return self.reach if self.held >= self.reach + self.rule.evict_chunk else self.held

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._held_next() + query_length, 0

    def query_offset(self) -> int:
        return self._held_next()

    def _steady_slots(self) -> int:
        """Its reach, up to one chunk awaiting a trim, and a decode step's token."""
        return self.reach + self.rule.evict_chunk

    def _moves_held(self) -> bool:
        return self.plan.pending or self._held_next() < self.held

    def _stored(self, total: int) -> None:
        """The update wrote the new tokens after the ``held`` slots (trimmed, re-based): all are held now
        (never the sinks: they are out of this layer's reach)."""
        self.held = total

    def _apply_plan(self, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """Trim to the reach (once per chunk) and apply a pending re-base to what is held, in place or
        copied ``into`` other buffers (the old ones left as they are); returns the slots held."""
        keep = self._held_next()
        if into is not None or keep < self.held:  # the newest `reach` slots move down (once per chunk)
            assert self._buf_k is not None and self._buf_v is not None  # slots are held in them
            for src, dst in zip((self._buf_k, self._buf_v), into or (self._buf_k, self._buf_v), strict=True):
                moved = src[:, :, self.held - keep : self.held]
                dst[:, :, :keep] = moved if into is not None else moved.clone()
        dst_k = into[0] if into is not None else self._buf_k
        if self.plan.rebase and self.rope is not None and keep:
            assert dst_k is not None  # slots are held in it
            rotate_by_(dst_k[:, :, :keep], -self.plan.rebase, self.rope)
        self.held = keep
        return keep

    def visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` the next forward will see (trim and pending re-base applied); views when
        nothing is pending, else new tensors."""
        keep = self._held_next()
        # the buffers are None only before the first update (where this fails as it always did)
        k = cast(torch.Tensor, self._buf_k)[:, :, self.held - keep : self.held]
        v = cast(torch.Tensor, self._buf_v)[:, :, self.held - keep : self.held]
        if self.plan.rebase and self.rope is not None:
            k = rotate_by(k, -self.plan.rebase, self.rope)
        return k, v

    def reset(self) -> None:
        super().reset()
        self.held = 0
