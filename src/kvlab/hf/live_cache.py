"""One live cache: a transformers ``Cache`` whose layers own their state and follow one rule.

Invariant: every layer of a :class:`LiveCache` follows the same rule object (``rule``: a
:class:`~kvlab.hf.rolling_layer.RollRule` for sinks + window, with or without a codec; a
:class:`~kvlab.hf.compressed_layer.CompressionRule` for scored layouts, codecs and shared budgets; a
:class:`FullRule` for the full cache), holds only what that rule keeps, and answers every question
about its contents itself. The cache adds nothing of its own but the plumbing every kind shares, once;
all it knows of a layer is this interface (each kind of layer implements it):

==========================  ==========================================================================
``update(k, v, ...)``       transformers' own: store the new K/V, return what attention reads
``kept``                    slots the next forward sees; ``tokens_seen``: tokens fed; ``evictions``
``nbytes``                  bytes the layer holds now (codes, buffers with their spare room, sinks)
``visible()``               ``(keys, values)`` the next forward sees, full precision (new tensors or views)
``kept_positions()``        their original positions: ``[kept]``, or ``[B, Hkv, kept]`` when heads differ
``checkpoint()``            a function that puts the layer back as it is now (a step that fails part-way)
``hold()``                  let the next forward continue this one (a prompt fed in pieces), or refuse
``seed(k, v)``              take a prefix's K/V as if fed; ``close()``: release hooks
``query_offset()``          where the next queries sit among the slots; ``get_mask_sizes``
==========================  ==========================================================================

and the rule answers ``describe()``, ``check_seed(n)`` and ``chooses_positions`` (whether the cache
re-positions tokens, so a bound forward lets the cache pick its positions). A rule only describes its
storage (``codec``, ``shared`` budgets): the step a bound forward opens for it is chosen on the step side
(:func:`kvlab.hf.cache_steps.open_cache_step`), and binding a cache to a model is
:func:`kvlab.hf.binding.bind_to_model`'s.

:class:`~kvlab.hf.rolling_cache.RollingCache`, :class:`~kvlab.hf.compressed_cache.CompressedCache` and
:class:`FullCache` are thin presets: each validates its arguments and builds its rule and layers (the
in-place rolling buffers, the packed-code layers, the ragged per-head layers, transformers' own dynamic
layers). :func:`kvlab.policy.cache_for` picks the preset a policy spec names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.policy.quant.pack import tensor_bytes
from kvlab.rope.layers import text_config


class Bytes(int):
    """A byte count that may also be called: ``cache.nbytes`` is a property of every live cache, and
    ``cache.nbytes()`` (how a :class:`~kvlab.hf.rolling_cache.RollingCache` was once read) still works."""

    def __call__(self) -> int:
        return int(self)


class LiveCache(Cache):
    """Layers that own their state, one ``rule`` they follow, and the shared plumbing (module docstring).

    A preset passes its layers, its rule, the config rows are built from, and ``preset``: its own
    keyword arguments, from which :meth:`start_rows` builds each row (``type(self)(config, **preset)``)."""

    rule: Any
    _bound_to: Callable[[], object] | None = None  # the model it is bound to (kvlab.hf.binding), weakly
    # kvlab's layer kinds (each preset narrows it): transformers types the list as its own kinds
    layers: list[Any]  # type: ignore[assignment]

    def __init__(self, layers: list[Any], rule: Any, config: Any, preset: dict[str, Any]) -> None:
        self.rule = rule
        self._config = config
        self._preset = preset
        self.rows: list[Any] | None = None  # per-row caches once a padded batch arrived (bind)
        self.packed_steps = 0  # one-token steps whose attention read the packed codes (bound, coded caches)
        self.packed_steps_by_path = {"kernel": 0, "torch": 0}
        super().__init__(layers=layers)

    # -- what it holds (layer 0 answers: every layer sees the same tokens) -----------------------------
    @property
    def kept(self) -> int:
        """Slots the next forward sees (per KV head; the most any head holds where heads differ)."""
        return int(self.layers[0].kept)

    @property
    def tokens_seen(self) -> int:
        """Tokens fed so far (kept or not)."""
        return int(self.layers[0].tokens_seen)

    @property
    def evictions(self) -> int:
        """Times the cache dropped tokens (a roll of the window, an eviction back to the budget): the most
        any layer did (layers with per-layer budgets evict at different steps)."""
        return max((int(layer.evictions) for layer in self.layers), default=0)

    @property
    def empty(self) -> bool:
        """Whether no token has been fed yet (rows can only start, and a prefix only be seeded, on an empty cache)."""
        return self.tokens_seen == 0

    @property
    def nbytes(self) -> Bytes:
        """K/V bytes every layer holds now (codes, buffers with their spare room, full-precision sinks)."""
        return Bytes(sum(int(layer.nbytes) for layer in self.layers))

    def positions(self, layer_idx: int = 0) -> torch.Tensor:
        """Original positions of the slots layer ``layer_idx`` keeps, on the host like every snapshot's:
        ``[kept]`` when every head keeps the same, ``[B, Hkv, kept]`` when heads keep different tokens."""
        return self.layers[layer_idx].kept_positions()

    def kept_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(keys, values)]`` per layer as the next forward will see them, in full precision.

        Copies: a layer may write into its buffers in place, so views would change under the caller."""
        return [(k.clone(), v.clone()) for k, v in (layer.visible() for layer in self.layers)]

    def describe(self) -> str:
        first = self.layers[0]
        return f"{type(self).__name__}({self.rule.describe()}: {first.describe_state()})"

    def __repr__(self) -> str:
        return self.describe()

    # -- operations every kind answers (each layer does its part) ----------------------------------------
    def seed(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load a prefix's K/V (``[1, kv_heads, T, head_dim]`` per layer, keys at positions ``0..T-1``) into
        this empty cache, as if those ``T`` tokens had been fed (in place). Each layer refuses what it could
        not take exactly (a rolling window past its capacity, an eviction that scores the prefill's queries)
        before anything changes. The server starts a conversation from a stored prefix with it."""
        if not self.empty:
            raise BadInputError(f"seed() needs an empty {type(self).__name__}")
        if len(layers) != len(self.layers):
            raise BadInputError(f"seed() got {len(layers)} layers for a {len(self.layers)}-layer cache")
        n = int(layers[0][0].shape[-2])
        for k, v in layers:
            if k.shape[0] != 1 or k.shape[-2] != n or v.shape[-2] != n or n < 1:
                raise BadInputError(
                    "seed() takes one row of at least one token, of equal length in every layer"
                )
        self.rule.check_seed(n)
        for layer, (k, v) in zip(self.layers, layers, strict=True):
            layer.seed(k, v)

    def seed_kept(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], seen: int) -> None:
        """Load what a cache keeps of a ``seen``-token prefix into this empty cache: per layer the kept keys and
        values ``[1, Hkv, n, D]`` and their original positions ``[1, Hkv, n]`` (strictly increasing per head, in
        ``[0, seen)``), as if it had fed those tokens and evicted the rest itself. A cache that keeps every
        slot, or that cannot hold that many, refuses before anything changes. The server starts a conversation
        from a shared compressed prefix with it (:meth:`~kvlab.policy.layouts.Layout.compress_prefix`)."""
        if not self.empty:
            raise BadInputError(f"seed_kept() needs an empty {type(self).__name__}")
        if len(layers) != len(self.layers) or not hasattr(self.layers[0], "seed_kept"):
            raise BadInputError(
                f"seed_kept() cannot fill this {type(self).__name__} with {len(layers)} layers"
            )
        for k, v, pos in layers:
            n = int(k.shape[-2])
            if (
                k.shape[0] != 1
                or v.shape[:3] != k.shape[:3]
                or tuple(pos.shape) != tuple(k.shape[:3])
                or n < 1
            ):
                raise BadInputError(
                    "seed_kept() takes one row: keys, values [1, Hkv, n, D], positions [1, Hkv, n]"
                )
            if bool((pos[..., 1:] <= pos[..., :-1]).any()) or int(pos.min()) < 0 or int(pos.max()) >= seen:
                raise BadInputError(f"seed_kept(): positions must increase per head within [0, {seen})")
        for layer, (k, v, pos) in zip(self.layers, layers, strict=True):
            layer.seed_kept(k, v, pos, seen)

    def hold_roll(self) -> None:
        """Let the next forward continue the last one (in place): a prompt fed in pieces with this called
        after every piece but the last equals the prompt fed in one forward (up to the summation order of
        the matmuls). A rolling cache cancels the roll (and the encoding) the last piece planned; a cache
        that evicts or encodes inside its update (a :class:`~kvlab.hf.compressed_cache.CompressedCache`)
        refuses: feed it the prompt in one forward."""
        for layer in self.layers:
            layer.hold()

    def checkpoint(self) -> Callable[[], None]:
        """The cache's state now, as a function that puts it back (in place) if a step fails part-way."""
        undo = [layer.checkpoint() for layer in self.layers]

        def restore() -> None:
            for put_back in undo:
                put_back()

        return restore

    def close(self) -> None:
        """Release what the layers hold outside the cache (the query hooks of an attention-scored eviction
        that keeps evicting while decoding); a no-op for every other kind."""
        for layer in self.layers:
            layer.close()

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedModelError(
            f"a {type(self).__name__} cannot be cropped (it may have evicted, re-positioned or encoded the "
            "tokens a crop would keep); disable assisted/speculative decoding with it"
        )

    @contextlib.contextmanager
    def choosing_positions(self) -> Iterator[None]:
        """Inside, the caller passes no ``position_ids``: the model takes them from :meth:`get_seq_length`,
        so a cache that re-positions tokens (a rolling window) may re-base. :meth:`kvlab.model.ModelHandle.run`
        enters this whenever it is called without positions; ``model.generate`` passes its own positions,
        so only a bound cache (:func:`kvlab.hf.binding.bind_to_model`) lets it choose them there."""
        before = [layer.may_rebase for layer in self.layers]
        for layer in self.layers:
            layer.may_rebase = True
        try:
            yield
        finally:
            for layer, was in zip(self.layers, before, strict=True):
                layer.may_rebase = was

    # -- rows of a padded batch (bound caches: kvlab.hf.binding) ------------------------------------------
    def start_rows(self, n: int) -> list[Any]:
        """Switch this empty cache to ``n`` per-row caches of the same preset (a left-padded batch under
        ``model.generate``): each row keeps, evicts or quantizes its own tokens exactly as it would alone.
        In place; the rows are in :attr:`rows`."""
        if self.rows is not None or not self.empty:
            raise BadInputError(f"start_rows() needs an empty {type(self).__name__}")
        self._check_rows()
        self.rows = [self._new_row() for _ in range(n)]
        return self.rows

    def _check_rows(self) -> None:
        """Refuse a padded batch this preset cannot run row by row (nothing to refuse by default)."""

    def _new_row(self) -> LiveCache:
        return type(self)(self._config, **self._preset)

    # -- transformers' per-layer questions -----------------------------------------------------------------
    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].query_offset() if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):  # transformers' convention for a layer the cache has not got
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)


def restore_vars(obj: Any) -> Callable[[], None]:
    """A checkpoint of a layer that never writes a tensor in place (each update builds new tensors and
    lists): its attributes, with the lists among them copied, put back by the returned function."""

    def copied(state: dict[str, Any]) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, list) else v for k, v in state.items()}

    saved = copied(vars(obj))

    def restore() -> None:
        vars(obj).clear()
        vars(obj).update(copied(saved))

    return restore


# -- the full cache: transformers' dynamic layers, as a live cache ------------------------------------------
@dataclass(frozen=True)
class FullRule:
    """Keep every slot in full precision (the reference every other policy is judged against)."""

    chooses_positions = False

    def describe(self) -> str:
        return "every slot, full precision"

    def check_seed(self, n: int) -> None:
        """Any prefix is taken exactly."""


class _FullLive:
    """The live-layer interface over one of transformers' dynamic layers (whose update it keeps, byte for
    byte): a full layer holds every slot, a sliding one (``DynamicSlidingWindowLayer``) its last
    ``sliding_window - 1``; positions follow the token count, as transformers' own (``query_offset``)."""

    may_rebase = False
    evictions = 0  # keeps every slot
    keys: torch.Tensor | None
    values: torch.Tensor | None
    is_initialized: bool
    get_seq_length: Callable[[], int]
    update: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    @property
    def tokens_seen(self) -> int:
        return int(self.get_seq_length())

    @property
    def kept(self) -> int:
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return 0
        return int(self.keys.shape[-2])

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values)  # None before the first update

    def query_offset(self) -> int:
        return self.tokens_seen

    def visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.kept or self.keys is None or self.values is None:
            raise BadInputError("the cache is empty: nothing to read")
        return self.keys, self.values

    def kept_positions(self) -> torch.Tensor:
        return torch.arange(self.tokens_seen - self.kept, self.tokens_seen, device="cpu")

    def checkpoint(self) -> Callable[[], None]:
        return restore_vars(self)  # transformers' dynamic layers concatenate into new tensors

    def hold(self) -> None:
        """Nothing to hold: every piece of a prompt sees what one forward would (its window, for a sliding layer)."""

    def seed(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.update(k, v)

    def close(self) -> None:
        """Nothing held outside the cache."""

    def describe_state(self) -> str:
        return f"{self.kept} kept, {self.tokens_seen} seen"


class FullLayer(_FullLive, DynamicLayer):
    """Every slot of a full-attention layer (transformers' :class:`DynamicLayer`)."""


class SlidingFullLayer(_FullLive, DynamicSlidingWindowLayer):
    """A sliding-window layer's last ``sliding_window - 1`` slots (transformers' ``DynamicSlidingWindowLayer``)."""


_FULL_LAYERS: dict[type, type] = {DynamicLayer: FullLayer, DynamicSlidingWindowLayer: SlidingFullLayer}


class FullCache(LiveCache):
    """The reference: what transformers' ``DynamicCache`` keeps (its layers' own updates, so the same numbers)
    behind the live-cache interface (:attr:`nbytes`, :meth:`seed`, :meth:`checkpoint`, :meth:`positions`...),
    so code that takes any live cache takes the full one too. A model whose dynamic cache has layers of
    other kinds (linear attention, indexed attention) is refused: :func:`full_cache_supported` says which."""

    def __init__(self, config: Any) -> None:
        text = text_config(config)
        layers = []
        for kind, kwargs in zip(*get_layer_types_and_kwargs(text), strict=True):
            live = _FULL_LAYERS.get(DYNAMIC_LAYER_TYPE_MAPPING[kind])
            if live is None:
                raise UnsupportedModelError(
                    f"kvlab's full cache wraps transformers' full and sliding layers; this model's cache has "
                    f"{kind} layers (use transformers' DynamicCache for it)"
                )
            layers.append(live(**kwargs))  # transformers' own layer, built as DynamicCache(config=) builds it
        super().__init__(layers, FullRule(), config, {})

    def crop(self, tokens_to_remove: int) -> None:
        """Exact here (every slot is kept in full precision): transformers' own crop."""
        Cache.crop(self, tokens_to_remove)


def full_cache_supported(config: Any) -> bool:
    """Whether :class:`FullCache` can wrap this model's dynamic cache (full and sliding layers only)."""
    text = text_config(config)
    return all(
        DYNAMIC_LAYER_TYPE_MAPPING.get(kind) in _FULL_LAYERS for kind in get_layer_types_and_kwargs(text)[0]
    )
