"""The one place that touches transformers' cache API (``DynamicCache`` and its layers).

transformers changed this API in 4.53, 4.54, 4.57, 5.0, ~5.5, 5.16 and 5.20; every other kvlab
module works on :class:`~kvlab.cache.KVSnapshot` and calls the functions here, so the next change
is fixed in one file (and caught by ``tests/test_hf_adapter.py``).

Facts relied on (transformers 5.x): a cache has ``.layers``; each layer has ``.keys`` / ``.values``
of shape ``[batch, kv_heads, seq, head_dim]`` (post-RoPE keys); sliding-window layers set
``is_sliding`` and drop tokens older than their window; a forward pass writes into the cache it is
given, so :func:`to_hf_cache` copies by default.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.rope.layers import sliding_windows, text_config
from kvlab.rope.spec import Rope

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def head_dim_of(config: Any) -> int:
    """The size of one attention head's keys (the config's ``head_dim``, else hidden size / heads)."""
    text = text_config(config)
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def check_fits_sliding_windows(config: Any, total_tokens: int) -> None:
    """Refuse a sequence that a sliding-window layer would silently truncate.

    kvlab snapshots keep every token in every layer; a sliding-window layer (Mistral, Gemma-3 local
    layers) that has dropped tokens cannot be represented, so such sequences are refused up front.
    """
    windows = [w for w in sliding_windows(config) if w is not None]
    if windows and total_tokens >= min(windows):
        raise UnsupportedModelError(
            f"this model has sliding-window attention layers (window {min(windows)}); kvlab snapshots hold every "
            f"token in every layer, so sequences must stay below {min(windows)} tokens (got {total_tokens})"
        )


# Why a cache that drops or moves slots refuses a padded batch (%s: the cache).
PADDED_BATCH = (
    "%s cannot run a padded batch (rows at different positions): transformers masks cached slots by "
    "index, the same for every row, so once slots are dropped a padded row would attend to pads and "
    "lose its own first tokens. Bind the cache to the model (rolling_cache_for(model, ...), "
    "CompressedCache(..., model=model)) to run a padded batch row by row, or batch prompts of equal length."
)


def _position_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The per-row position information a layer's ``update`` receives, where transformers passes it:
    ``position_ids [batch, q]`` inside ``kwargs=`` (5.24) or ``cos [batch, q, dim]`` inside the
    ``cache_kwargs`` dict (earlier 5.x)."""
    for bag in (
        kwargs.get("kwargs"),
        kwargs.get("cache_kwargs"),
        kwargs,
        *[a for a in args if isinstance(a, dict)],
    ):
        if not isinstance(bag, dict):
            continue
        for name in ("position_ids", "cos"):
            t = bag.get(name)
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                return t
    return None


def rows_at_different_positions(args: tuple, kwargs: dict) -> bool:
    """True when the rows of a batched ``update`` sit at different positions: a padded batch (transformers
    derives each row's positions from its attention mask), or per-row positions given by the caller.

    Caches that drop or move slots cannot honour a padded batch with transformers' 2-D mask (which is
    sliced by slot index, the same for every row), so they call this to refuse one instead of
    masking real tokens. False when the model passes no position information (it cannot be told).
    """
    t = _position_tensor(args, kwargs)
    return t is not None and t.shape[0] > 1 and bool((t[1:] != t[:1]).any())


def cache_argument(model: PreTrainedModel | type[PreTrainedModel]) -> str:
    """The keyword a model's ``forward`` / ``generate`` takes its cache by: ``cache`` (transformers >= 5.24)
    or ``past_key_values`` (before; deprecated in 5.24, removed in 5.40). Use as
    ``model.generate(ids, **{cache_argument(model): cache})`` to work on both sides of the rename."""
    cls: Any = model if isinstance(model, type) else type(model)
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_hf_cache(config: Any | None) -> DynamicCache:
    """An empty transformers cache laid out for ``config`` (sliding layers included); without one, layers
    that keep every slot (a model's sliding layers too, their windows masked by kvlab:
    :mod:`kvlab.hf.slot_mask`)."""
    return DynamicCache(config=config) if config is not None else DynamicCache()


def hf_cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def hf_cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values)]`` per layer, as views into the transformers cache (do not write into them)."""
    out = []
    for i, layer in enumerate(cache.layers):
        if layer.keys is None or layer.values is None:
            raise UnsupportedModelError(
                f"cache layer {i} holds no keys (KV sharing or a non-attention layer)"
            )
        out.append((layer.keys, layer.values))
    return out


def snapshot_from_hf(
    cache: Any,
    *,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    rope: Rope | None,
    fingerprint: str,
    model_name: str = "",
    copy: bool = False,
    provenance: str = "unknown",
    valid: tuple[torch.Tensor, ...] | None = None,
) -> KVSnapshot:
    """Capture a transformers cache as a snapshot.

    ``token_ids [batch, T]`` and ``positions [T]`` describe the cached slots. With ``copy=False`` the
    snapshot shares tensors with ``cache``; that is safe for ``DynamicCache``, whose updates replace
    tensors (``torch.cat``) rather than write into them, but call with ``copy=True`` if the cache will
    be used with an in-place cache class afterwards.
    """
    layers = hf_cache_layers(cache)
    for i, layer in enumerate(cache.layers):
        cumulative = getattr(layer, "cumulative_length", None)
        if (
            getattr(layer, "is_sliding", False)
            and cumulative is not None
            and int(cumulative) > layer.keys.shape[-2]
        ):
            raise UnsupportedModelError(
                f"layer {i} is a sliding-window layer that already dropped tokens "
                f"({int(cumulative)} seen, {layer.keys.shape[-2]} kept); kvlab snapshots need every token"
            )
    keys = tuple(k.detach().clone() if copy else k.detach() for k, _ in layers)
    values = tuple(v.detach().clone() if copy else v.detach() for _, v in layers)
    return KVSnapshot(
        keys=keys,
        values=values,
        token_ids=token_ids.detach().to("cpu", torch.long),
        positions=positions.detach().to("cpu", torch.long),
        rope=rope,
        fingerprint=fingerprint,
        model_name=model_name,
        provenance=provenance,
        valid=valid,
    )


class SnapshotCache(DynamicCache):
    """A ``DynamicCache`` that knows the positions of the snapshot it was built from, and refuses a first
    forward that feeds any of those positions again.

    ``model.generate(prompt, cache=to_hf_cache(snapshot_of_prompt))`` is the classic mistake: transformers
    expects the cache of ``prompt[:-1]``, finds every prompt token cached, re-feeds the whole prompt on
    top and continues from a cache that holds it twice — a wrong cache used as if it were right. The
    check costs one comparison on the first forward (positions as transformers passes them to a layer).
    """

    def __init__(self, *args: Any, last_position: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_position = last_position
        self.checking = False  # turned on once the snapshot's slots are in

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.checking and layer_idx == 0:
            self.checking = False
            pos = _position_tensor(args, kwargs)
            if pos is not None and pos.dim() == 2 and int(pos.min()) <= self.last_position:
                first = int(pos.min())
                raise BadInputError(
                    f"this cache already holds positions up to {self.last_position}, and the forward feeds "
                    f"position {first} again: model.generate(prompt, cache=...) expects the cache of "
                    "prompt[:-1] (its last token is fed to get the next logits). Snapshot the prompt without "
                    "its last token, or feed only tokens after the cached ones."
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def to_hf_cache(
    snapshot: KVSnapshot, config: Any = None, *, copy: bool = True, masked: bool = False
) -> DynamicCache:
    """A ``DynamicCache`` holding the snapshot's K/V, ready to pass as ``past_key_values`` / ``cache``.

    A forward pass extends the returned cache, so by default its tensors are copies and the snapshot
    stays untouched, and its first forward must feed positions after the snapshot's (a
    :class:`SnapshotCache`: ``model.generate`` with the snapshot of the whole prompt is refused, not
    continued from the prompt fed twice). ``copy=False`` (kvlab's own forwards, which choose positions
    themselves) shares storage — safe with ``DynamicCache``, whose updates concatenate into new tensors
    — and checks nothing. A masked snapshot is refused unless ``masked=True`` says the caller hides its
    masked slots itself (:meth:`~kvlab.model.ModelHandle.forward` does): a plain cache would show them.
    """
    if not masked:
        snapshot.require_unmasked("a transformers cache of this snapshot")
    if config is not None:
        check_fits_sliding_windows(config, snapshot.seq_len)
    if copy and snapshot.seq_len:
        kw = {"config": config} if config is not None else {}
        cache: DynamicCache = SnapshotCache(last_position=int(snapshot.positions.max()), **kw)
    else:
        cache = new_hf_cache(config) if config is not None else DynamicCache()
    if config is not None and len(cache.layers) != snapshot.num_layers:
        raise UnsupportedModelError(
            f"the model has {len(cache.layers)} cache layers, the snapshot {snapshot.num_layers}"
        )
    for i, (k, v) in enumerate(zip(snapshot.keys, snapshot.values, strict=True)):
        cache.update(k.clone() if copy else k, v.clone() if copy else v, i)
    if isinstance(cache, SnapshotCache):
        cache.checking = True
    return cache


class GrowingStore:
    """The one growing full-precision store: K/V buffers ``[batch, kv_heads, capacity, head_dim]`` written in
    place, ``keys``/``values`` views of their first slots; new buffers get the held slots copied once, the
    old ones are left to the views that hold them. :class:`GrowingLayer` and the rolling layers
    (:class:`~kvlab.hf.rolling_layer.RollingLayer`) use it, each sizing it its own way. Not under
    :class:`~kvlab.hf.live_cache.FullCache`: transformers' ``DynamicLayer`` keeps no room and concatenates
    every update into new tensors (the reference's own update, byte for byte); that one stays transformers'."""

    _buf_k: torch.Tensor | None = None
    _buf_v: torch.Tensor | None = None
    keys: torch.Tensor | None
    values: torch.Tensor | None

    @property
    def capacity(self) -> int:
        return 0 if self._buf_k is None else int(self._buf_k.shape[-2])

    def _regrow(
        self, size: int, held: int, k: torch.Tensor, v: torch.Tensor, batch: int | None = None
    ) -> None:
        """Move to new buffers of ``size`` slots for K/V like ``k``/``v`` (``batch`` rows, default theirs;
        their device and dtype become the layer's), the first ``held`` slots copied from the old ones."""
        rows = k.shape[0] if batch is None else batch
        new_k = k.new_empty((rows, k.shape[1], size, k.shape[-1]))
        new_v = v.new_empty((rows, v.shape[1], size, v.shape[-1]))
        if held:
            assert self._buf_k is not None and self._buf_v is not None  # slots are held in them
            new_k[:, :, :held] = self._buf_k[:, :, :held]
            new_v[:, :, :held] = self._buf_v[:, :, :held]
        self._buf_k, self._buf_v = new_k, new_v
        self.device, self.dtype, self.is_initialized = k.device, k.dtype, True

    def _write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write ``k``/``v`` into slots ``[at, end)`` (they fit), view ``[0, end)``; returns ``end``."""
        assert self._buf_k is not None and self._buf_v is not None  # sized by _regrow first
        end = at + k.shape[-2]
        self._buf_k[:, :, at:end] = k
        self._buf_v[:, :, at:end] = v
        self._show(end)
        return end

    def _show(self, n: int) -> None:
        """``keys``/``values`` become views of the first ``n`` slots."""
        assert self._buf_k is not None and self._buf_v is not None
        self.keys, self.values = self._buf_k[:, :, :n], self._buf_v[:, :, :n]


class GrowingLayer(GrowingStore, DynamicLayer):
    """A ``DynamicLayer`` that writes new tokens into room reserved after the cached ones instead of
    concatenating (a :class:`GrowingStore`): a decode step copies its own token, not the whole cache
    (``DynamicLayer`` re-copies every slot at every step). Slots below ``n`` are never written again, so
    a snapshot taken of a view stays as it was. Out of room, the buffers grow 1.5x."""

    def __init__(self, room: int = 0) -> None:
        super().__init__()
        self.room = max(int(room), 0)
        self._n = 0  # slots written

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self._n + key_states.shape[-2]
        if self._buf_k is None or end > self.capacity:
            cap = end + self.room if self._buf_k is None else max(end + self.room, (3 * end) // 2)
            self._regrow(cap, self._n, key_states, value_states)
        self._n = self._write(self._n, key_states, value_states)
        return self.keys, self.values

    @classmethod
    def of_rows(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], room: int) -> GrowingLayer:
        """One layer holding ``keys``/``values`` (``[b_i, H, T, D]`` each) as the rows of one batch, copied
        once straight into the buffers (no stacked copy in between), with ``room`` slots after them."""
        layer = cls(room)
        k0, t = keys[0], keys[0].shape[-2]
        layer._regrow(t + layer.room, 0, k0, values[0], batch=sum(k.shape[0] for k in keys))
        assert layer._buf_k is not None and layer._buf_v is not None
        at = 0
        for k, v in zip(keys, values, strict=True):  # each row copied into its place
            layer._buf_k[at : at + k.shape[0], :, :t] = k
            layer._buf_v[at : at + v.shape[0], :, :t] = v
            at += k.shape[0]
        layer._n = t
        layer._show(t)
        return layer

    def rewind(self, n: int) -> None:
        """Keep the first ``n`` slots; the next update writes from slot ``n`` (in place: a view taken of
        the slots after ``n`` sees them overwritten, so only the live cache's owner rewinds it)."""
        if not 0 <= n <= self._n:
            raise BadInputError(f"cannot rewind a layer of {self._n} slots to {n}")
        self._n = n
        if self._buf_k is not None:
            self._show(n)


def growing_cache(rows: Sequence[KVSnapshot], config: Any, room: int) -> DynamicCache:
    """A transformers cache of ``rows`` (snapshots of equal length and positions, stacked as one batch)
    with ``room`` new tokens reserved per layer (:class:`GrowingLayer`), for a decode loop: each row is
    copied once into the buffers (a masked one too: the caller hides its slots; a sliding layer keeps every
    slot too, the caller masks its window: :mod:`kvlab.hf.slot_mask`)."""
    cache = new_hf_cache(config)
    if len(cache.layers) != rows[0].num_layers:
        raise UnsupportedModelError(
            f"the model has {len(cache.layers)} cache layers, the snapshot {rows[0].num_layers}"
        )
    cache.layers = [
        GrowingLayer.of_rows([r.keys[i] for r in rows], [r.values[i] for r in rows], room)
        for i in range(len(cache.layers))
    ]
    return cache
