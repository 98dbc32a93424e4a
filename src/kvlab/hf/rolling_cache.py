"""A rolling-window transformers ``Cache``: attention sinks + the last ``window`` tokens, forever.

StreamingLLM's policy on transformers 5.x's layer API, built so that a roll costs almost nothing:

* Slots are always contiguous in RoPE position: slot ``i`` holds position ``base + i``; the sinks sit
  right before the window. ``next_position = base + slots`` is what :meth:`get_seq_length` returns,
  so a model called without ``position_ids`` puts its queries where the cache expects them.
* Evicting ``d`` window tokens is a slice of the window (no key is touched) plus re-rotating the
  ``sinks`` sink keys from their stored originals (float64 angles, never incremental): ``base`` grows
  by ``d`` and ``next_position`` does not change. RoPE only sees relative positions, so this equals
  StreamingLLM's "re-position everything from 0" up to fp32 rounding.
* Positions stay bounded by an occasional re-base: one rotation of every cached key by ``-base``
  (``rebase="auto"``: only when ``next_position`` would pass the model's maximum; ``"always"``:
  after every eviction, StreamingLLM's in-cache positions; ``"never"``: positions follow the token
  count, which is what ``model.generate`` needs, see below). The re-base is
  :func:`kvlab.rope.fast.rotate_by`: one ``[head_dim/2]`` cos/sin pair per re-base (float64 angles,
  fp32 multiply-adds, ~1e-7 relative error against the float64 reference), written chunk by chunk
  straight into the buffer the step allocates anyway for the concatenation, so it replaces that
  copy instead of adding a pass. The cache owns its storage, so this is a re-base in place as far as
  memory goes (no second copy of the cache is ever alive); :func:`kvlab.rope.fast.rotate_by_`
  rotates storage you own in place.
* Eviction and re-basing are lazy: decided at the end of a forward, applied inside the next
  ``update`` as part of the concatenation every step does anyway; the mask offset accounts for it.

``model.generate(..., past_key_values=RollingCache(..., rebase="never"))`` works unpatched: transformers
computes query positions from its own token counter, which equals ``next_position`` as long as the
cache never re-bases. With another ``rebase`` mode the cache detects the generation loop on the call
stack: it warns on the first forward and raises :class:`~kvlab.errors.BadInputError` instead of
planning its first re-base (which would silently mis-position every later token). kvlab's own loop (:func:`kvlab.streaming.stream_generate`) lets the cache choose
the positions and re-bases, so its positions never exceed the model's maximum.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.cache import sliding_windows
from kvlab.rope.fast import rotate_by, rotate_by_
from kvlab.rope.spec import RopeSpec

Rebase = Literal["auto", "always", "never"]

__all__ = ["RollingCache", "RollingLayer", "RollPlan", "rolling_cache_for", "rotate_by", "rotate_by_"]


@dataclass
class RollPlan:
    """What the next ``update`` applies to every layer before appending: drop ``drop`` window tokens
    (after the sinks) and rotate the kept window by ``-rebase`` positions."""

    drop: int = 0
    rebase: int = 0

    @property
    def pending(self) -> bool:
        return self.drop > 0 or self.rebase != 0


class RollingLayer(CacheLayerMixin):
    """One layer's ``[sinks | window]`` keys and values, contiguous ``[batch, kv_heads, slots, head_dim]``.

    ``sink_keys`` keeps the sinks' keys as first computed, at positions ``sink_pos0 ..``; the live
    copy in ``keys[:, :, :sinks]`` is always re-rotated from it, so sinks never drift.
    """

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self.sink_keys: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("RollingLayer.update is driven by RollingCache.update")

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = None
        self.is_initialized = False


class RollingCache(Cache):
    """``sinks`` attention-sink tokens + a rolling window of ``window`` recent tokens, for any length.

    Between forward passes at most ``sinks + window`` tokens are kept; when the window overflows, the
    oldest window tokens are evicted in multiples of ``evict_chunk`` (amortizing the roll). New tokens
    see every kept token plus each other (causal). Positions: see the module docstring.

    Args:
        config: the model config (for the layer count; sliding-window models are refused if their
            window is smaller than ours).
        rope: the model's :class:`RopeSpec` (``ModelHandle.rope``); must be shift-exact.
        window: recent tokens kept (after the sinks).
        sinks: leading tokens kept forever (StreamingLLM's attention sinks); 0 = plain window.
        evict_chunk: tokens evicted at once when the window overflows (>= 1).
        max_position: largest RoPE position allowed + 1 (default: the config's maximum).
        rebase: ``"auto"`` | ``"always"`` | ``"never"`` (see the module docstring).
    """

    def __init__(
        self,
        config: Any,
        rope: RopeSpec | None,
        *,
        window: int,
        sinks: int = 4,
        evict_chunk: int = 64,
        max_position: int | None = None,
        rebase: Rebase = "auto",
    ) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_layers = int(text.num_hidden_layers)
        max_pos = int(max_position or getattr(text, "max_position_embeddings", 0) or 0)
        if rope is None:
            raise UnsupportedModelError(
                "a rolling cache re-positions keys, which needs a model with RoPE; "
                "without RoPE, re-prefill the window instead"
            )
        rope.require_shift_exact("a rolling cache")
        if window < 1 or sinks < 0 or evict_chunk < 1:
            raise BadInputError(
                f"need window >= 1, sinks >= 0, evict_chunk >= 1 (got {window}, {sinks}, {evict_chunk})"
            )
        if sinks >= window:
            raise BadInputError(
                f"sinks ({sinks}) must be fewer than the window ({window}); e.g. --sinks 4 --window 256"
            )
        if evict_chunk > window:
            raise BadInputError(f"evict_chunk ({evict_chunk}) cannot exceed the window ({window})")
        if max_pos and sinks + window >= max_pos:
            raise BadInputError(
                f"sinks + window ({sinks + window}) must stay below the model's maximum position "
                f"({max_pos}); choose a smaller --window"
            )
        if rebase not in ("auto", "always", "never"):
            raise BadInputError(f"rebase must be 'auto', 'always' or 'never', got {rebase!r}")
        sw = [w for w in sliding_windows(text) if w is not None]
        if sw and min(sw) <= sinks + window + evict_chunk:
            raise UnsupportedModelError(
                f"the model's own sliding window ({min(sw)}) is smaller than this rolling "
                f"cache ({sinks} + {window}); use a window below {min(sw) - sinks - evict_chunk}"
            )
        super().__init__(layers=[RollingLayer() for _ in range(n_layers)])
        self.rope, self.window, self.sinks, self.evict_chunk = rope, window, sinks, evict_chunk
        self.max_position, self.rebase_mode = max_pos, rebase
        # Lookahead kept free below max_position after a re-base: the largest feed allowed at once.
        self.headroom = max(1, min(window, max_pos - sinks - window)) if max_pos else window
        self.base = 0  # position of slot 0
        self.slots = 0  # tokens held (including those a pending drop will remove)
        self.sink_pos0 = 0  # position at which the stored sink keys were computed
        self.plan = RollPlan()
        self.tokens_seen = 0
        self.rolls = 0
        self.rebases = 0
        self._n_new = 0
        self._sink_stack: torch.Tensor | None = None
        self._sinks_rotated: tuple[int, torch.Tensor] | None = None

    # -- positions the model sees -----------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Tokens visible to the next forward (slots minus the pending drop)."""
        return self.slots - self.plan.drop

    @property
    def next_position(self) -> int:
        """RoPE position of the next token (after any pending re-base)."""
        return self.base + self.slots - self.plan.rebase

    def positions(self) -> torch.Tensor:
        """``[kept]`` RoPE positions of the kept slots as the next forward sees them (contiguous)."""
        start = self.next_position - self.kept
        return torch.arange(start, self.next_position)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.next_position

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.kept

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.kept + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedModelError(
            "a RollingCache cannot be cropped (it has already forgotten evicted tokens); "
            "disable assisted/speculative decoding with it"
        )

    # -- the update --------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Apply the pending roll to this layer, append the new K/V, return everything visible."""
        n_new = key_states.shape[-2]
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if layer_idx == 0:
            self._n_new = n_new
            if self.tokens_seen == 0 and self.rebase_mode != "never" and driven_by_generate():
                warnings.warn(
                    f"RollingCache(rebase={self.rebase_mode!r}) inside model.generate: generate passes its own "
                    "absolute positions, which stop matching the cache at its first re-base (the cache raises "
                    "then). Use rebase='never' with generate, or kvlab.streaming.stream_generate for bounded "
                    "positions.",
                    stacklevel=2,
                )
            if (
                self.rebase_mode != "never"
                and self.max_position
                and self.next_position + n_new > self.max_position
            ):
                raise BadInputError(
                    f"{n_new} new tokens would pass the maximum position {self.max_position}; "
                    f"feed at most {self.headroom} tokens per forward to a rolling cache"
                )
        keys, values = layer.keys, layer.values
        plan, s = self.plan, min(self.sinks, self.slots)
        if plan.pending:
            window_k = keys[:, :, s + plan.drop :]
            sinks_k = [self._sinks_at(layer_idx, self.base + plan.drop - plan.rebase)] if s else []
            if plan.rebase:  # rotate straight into the output: the re-base replaces this step's copy
                kept = s + window_k.shape[-2]
                full_k = keys.new_empty((*keys.shape[:2], kept + n_new, keys.shape[-1]))
                if s:
                    full_k[:, :, :s] = sinks_k[0]
                rotate_by(window_k, -plan.rebase, self.rope, out=full_k[:, :, s:kept])
                full_k[:, :, kept:] = key_states
            else:
                full_k = torch.cat([*sinks_k, window_k, key_states], dim=-2)
            full_v = torch.cat([values[:, :, :s], values[:, :, s + plan.drop :], value_states], dim=-2)
        else:
            full_k, full_v = torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        if layer.sink_keys is None and self.sinks and full_k.shape[-2] >= self.sinks:
            layer.sink_keys = full_k[:, :, : self.sinks].clone()
        layer.keys, layer.values = full_k, full_v
        if layer_idx == len(self.layers) - 1:
            self._finish_forward()
        return full_k, full_v

    def _sinks_at(self, layer_idx: int, base: int) -> torch.Tensor:
        """Layer ``layer_idx``'s sink keys rotated from their stored originals (one rotation, no drift) to
        positions ``base ..``; all layers are rotated together once per roll."""
        if self._sink_stack is None:
            self._sink_stack = torch.stack([lay.sink_keys for lay in self.layers])  # [L, B, H, sinks, D]
        if self._sinks_rotated is None or self._sinks_rotated[0] != base:
            self._sinks_rotated = (base, rotate_by(self._sink_stack, base - self.sink_pos0, self.rope))
        return self._sinks_rotated[1][layer_idx]

    def _finish_forward(self) -> None:
        """Bookkeeping after every layer took the plan and the new tokens; decide the next roll."""
        plan, n_new = self.plan, self._n_new
        if plan.drop:
            self.rolls += 1
        if plan.rebase:
            self.rebases += 1
        self.base += plan.drop - plan.rebase
        self.slots += n_new - plan.drop
        self.tokens_seen += n_new
        s = min(self.sinks, self.slots)
        capacity = self.sinks + self.window
        drop = 0
        if self.slots > capacity:
            over = self.slots - capacity
            drop = min(self.slots - s, math.ceil(over / self.evict_chunk) * self.evict_chunk)
        near_max = bool(self.max_position) and self.base + self.slots + self.headroom > self.max_position
        wants = (self.rebase_mode == "always" and drop > 0) or (self.rebase_mode == "auto" and near_max)
        rebase = self.base + drop if wants else 0
        if rebase and driven_by_generate():
            raise BadInputError(
                f"this RollingCache (rebase={self.rebase_mode!r}) is about to re-base its positions by "
                f"-{rebase}, but model.generate computes the query positions itself and would keep "
                f"counting from {self.next_position}: every later token would be mis-positioned. Pass "
                "rebase='never' to use it with generate (positions then grow with the token count), or "
                "generate with kvlab.streaming.stream_generate, which lets the cache choose positions."
            )
        self.plan = RollPlan(drop=drop, rebase=rebase)

    # -- inspection ----------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.base = self.slots = self.tokens_seen = self.rolls = self.rebases = 0
        self.plan = RollPlan()
        self._sink_stack = self._sinks_rotated = None

    def kept_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(keys, values)]`` per layer as the next forward will see them (pending roll applied).

        Returns new tensors when a roll is pending, else views of the cache (do not write into them).
        """
        out = []
        plan, s = self.plan, min(self.sinks, self.slots)
        for layer_idx, layer in enumerate(self.layers):
            k, v = layer.keys, layer.values
            if plan.pending:
                wk = rotate_by(k[:, :, s + plan.drop :], -plan.rebase, self.rope)
                parts = [wk]
                vparts = [v[:, :, s + plan.drop :]]
                if s:
                    parts.insert(0, self._sinks_at(layer_idx, self.base + plan.drop - plan.rebase))
                    vparts.insert(0, v[:, :, :s])
                k, v = torch.cat(parts, dim=-2), torch.cat(vparts, dim=-2)
            out.append((k, v))
        return out

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in (layer.keys, layer.values, layer.sink_keys)
            if t is not None
        )

    def describe(self) -> str:
        return (
            f"RollingCache(sinks={self.sinks}, window={self.window}, chunk={self.evict_chunk}, rebase={self.rebase_mode}: "
            f"{self.kept} kept, positions {self.next_position - self.kept}..{self.next_position - 1}, "
            f"{self.tokens_seen} seen, {self.rolls} rolls, {self.rebases} re-bases)"
        )

    def __repr__(self) -> str:
        return self.describe()


_GENERATE_FRAMES = frozenset({"generate", "_sample", "_beam_search", "_assisted_decoding"})


def driven_by_generate() -> bool:
    """True when a transformers generation loop is on the call stack (it passes its own positions).

    Only called on a cache's first forward and when a re-base is planned, so the stack walk (a few
    microseconds) never runs per token.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _GENERATE_FRAMES and str(frame.f_globals.get("__name__", "")).startswith(
            "transformers.generation"
        ):
            return True
        frame = frame.f_back
    return False


def rolling_cache_for(
    handle: Any,
    *,
    window: int,
    sinks: int = 4,
    evict_chunk: int = 64,
    rebase: Rebase = "auto",
    max_position: int | None = None,
) -> RollingCache:
    """A :class:`RollingCache` for a :class:`~kvlab.model.ModelHandle` (its config, RoPE and maximum)."""
    return RollingCache(
        handle.config,
        handle.rope,
        window=window,
        sinks=sinks,
        evict_chunk=evict_chunk,
        max_position=max_position or handle.max_positions,
        rebase=rebase,
    )
