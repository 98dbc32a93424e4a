"""A rolling-window transformers ``Cache``: attention sinks + the last ``window`` tokens, forever.

:class:`RollingCache` is the preset: it validates its settings and builds one layer per model layer
(:mod:`kvlab.hf.rolling_layer`: the in-place buffers, the roll and the re-base; a sliding layer's reach;
:mod:`kvlab.hf.coded_rolling`: a window stored as codes), all following one :class:`RollRule`.

A re-base is only safe when the model takes query positions from the cache. kvlab's own calls do
(:meth:`kvlab.model.ModelHandle.run` without positions, :func:`kvlab.streaming.stream_generate`),
and they say so by entering :meth:`RollingCache.choosing_positions`; only then does the cache plan a
re-base. ``model.generate`` passes its own positions (the token count). A cache made by
:func:`rolling_cache_for` is *bound* to its model (:func:`~kvlab.hf.binding.bind_to_model`): a forward hook drops
generate's positions for calls that carry this cache, so the model takes them from the cache and
endless generation through ``generate`` stays below the model's maximum, token for token equal to
kvlab's own loop. An unbound ``RollingCache(...)`` under generate never re-bases: positions follow
the token count and, when they would pass the model's maximum, the cache raises
:class:`~kvlab.errors.BadInputError` instead of mis-positioning a token (``rebase="never"`` opts into
passing the maximum). Either way transformers may print its generic "exceeded the model's predefined
maximum length" reminder: it counts generated tokens, not positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.binding import bind_to_model
from kvlab.hf.coded_rolling import CodedRollingLayer, check_codec
from kvlab.hf.live_cache import LiveCache
from kvlab.hf.rolling_layer import Rebase, RollingLayer, RollPlan, RollRule, SlidingRollingLayer
from kvlab.hf.runner import Runner
from kvlab.policy.window import SinksWindow, default_chunk
from kvlab.rope.fast import rotate_by, rotate_by_
from kvlab.rope.layers import sliding_windows, text_config
from kvlab.rope.spec import Rope, rope_spec_from_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "RollRule",
    "default_chunk",
    "RollingCache",
    "RollingLayer",
    "RollPlan",
    "Rebase",
    "SlidingRollingLayer",
    "rolling_cache_for",
    "rotate_by",
    "rotate_by_",
]


class RollingCache(LiveCache):
    """``sinks`` attention-sink tokens + a rolling window of ``window`` recent tokens, for any length.

    Between forward passes at most ``sinks + window`` tokens are kept (:class:`~kvlab.policy.SinksWindow`);
    when the window overflows, the oldest window tokens are evicted in multiples of ``evict_chunk``
    (amortizing the roll). New tokens see every kept token plus each other (causal). Positions: see
    the module docstring. The cache is a list of :class:`RollingLayer` s that each own their state.

    Args:
        config: the model config (layer count, sliding windows). Slots are contiguous positions, so
            transformers' sliding mask (a slot distance below the window, from :meth:`get_query_offset`
            and :meth:`get_mask_sizes`) lets a sliding-window layer see exactly its window's most recent
            slots; when ``window`` is at least a layer's sliding window, that layer also stores only
            those (:class:`SlidingRollingLayer`), as transformers' hybrid caches do.
        rope: the model's RoPE (``ModelHandle.rope``: one :class:`RopeSpec`, or one per layer for hybrid
            models); must be shift-exact.
        window: recent tokens kept (after the sinks).
        sinks: leading tokens kept forever (StreamingLLM's attention sinks); 0 = plain window.
        evict_chunk: tokens evicted at once when the window overflows (>= 1; default
            :func:`default_chunk`: 64, or half the window for windows under 128, so any window works).
            Between forwards the cache holds at most ``sinks + window`` tokens and, once full, at least
            ``sinks + window - evict_chunk + 1``: the model sees the sinks and the last
            ``window - evict_chunk + 1`` to ``window`` tokens.
        max_position: largest RoPE position allowed + 1 (default: the config's maximum).
        rebase: ``"auto"`` | ``"always"`` | ``"never"`` (see the module docstring).
        codec: a :class:`~kvlab.policy.quant.Quantizer`: the window is stored as its packed codes
            (:mod:`kvlab.hf.coded_rolling`; its ``window`` is the full-precision tail); the eviction chunk
            is rounded up to whole blocks of codes. Full-attention models only.
        packed_path: how a bound cache's one-token steps read the codes (``"auto"``, ``"kernel"``,
            ``"torch"``: :func:`kvlab.policy.quant.attention.packed_path`).
    """

    # Only RollingLayers, typed as ours: transformers' Cache types the (invariant) list as any of its own
    # layer kinds, so narrowing it is an override mypy cannot accept.
    layers: list[RollingLayer]  # type: ignore[assignment]
    rule: RollRule

    def __init__(
        self,
        config: Any,
        rope: Rope | None,
        *,
        window: int,
        sinks: int = 4,
        evict_chunk: int | None = None,
        max_position: int | None = None,
        rebase: Rebase = "auto",
        codec: Any = None,
        packed_path: str = "auto",
    ) -> None:
        text = text_config(config)
        rule = roll_rule(text, rope, window, sinks, evict_chunk, max_position, rebase, codec, packed_path)
        n_layers = int(text.num_hidden_layers)
        per_layer = getattr(rope, "layers", None)
        if per_layer is not None and len(per_layer) != n_layers:
            raise BadInputError(
                f"the per-layer RoPE covers {len(per_layer)} layers, the model has {n_layers}"
            )
        # a sliding layer the rolling window covers stores only what it can reach (hybrid models)
        layers: list[RollingLayer] = [
            SlidingRollingLayer(rule, i, w) if w is not None and window >= w else RollingLayer(rule, i)
            for i, w in enumerate(sliding_windows(text))
        ]
        if codec is not None:
            layers = [CodedRollingLayer(rule, i, codec, packed_path) for i in range(n_layers)]
        preset = {
            "rope": rope,
            "window": window,
            "sinks": sinks,
            "evict_chunk": rule.evict_chunk,
            "max_position": rule.max_position or None,
            "rebase": rebase,
            "codec": codec,
            "packed_path": packed_path,
        }
        super().__init__(
            cast("list[Any]", layers), rule, text, preset
        )  # transformers' list of its layer kinds

    # -- settings and state (every layer holds the same counts; layer 0 answers) ----------------------
    window = property(lambda self: self.rule.policy.window)
    sinks = property(lambda self: self.rule.policy.sinks)
    evict_chunk = property(lambda self: self.rule.evict_chunk)
    max_position = property(lambda self: self.rule.max_position)
    rebase_mode = property(lambda self: self.rule.rebase)
    headroom = property(lambda self: self.rule.headroom)
    codec = property(lambda self: self.rule.codec)
    packed_path = property(lambda self: self.rule.packed_path)
    base = property(lambda self: self.layers[0].base)
    slots = property(lambda self: self.layers[0].slots)
    plan = property(lambda self: self.layers[0].plan)
    next_position = property(lambda self: self.layers[0].next_position)
    rolls = property(lambda self: self.layers[0].rolls)
    rebases = property(lambda self: self.layers[0].rebases)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].next_position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1


def roll_rule(
    text: Any,
    rope: Rope | None,
    window: int,
    sinks: int,
    evict_chunk: int | None,
    max_position: int | None,
    rebase: Rebase,
    codec: Any = None,
    packed_path: str = "auto",
) -> RollRule:
    """The rule of a rolling cache (:class:`RollingCache`, :class:`~kvlab.hf.static_rolling.StaticRollingCache`)
    for a model's text config: the eviction chunk defaulted (rounded up to whole blocks of a codec's
    codes), the maximum position the config's unless given; settings it cannot honour refused."""
    evict_chunk = default_chunk(window) if evict_chunk is None else evict_chunk
    if codec is not None:
        evict_chunk = check_codec(
            text, rope, codec, window=window, chunk=evict_chunk, packed_path=packed_path
        )
    max_pos = int(max_position or getattr(text, "max_position_embeddings", 0) or 0)
    _validate(rope, window=window, sinks=sinks, evict_chunk=evict_chunk, max_pos=max_pos, rebase=rebase)
    assert rope is not None  # _validate refused None
    return RollRule(SinksWindow(sinks, window), rope, evict_chunk, max_pos, rebase, codec, packed_path)


def _validate(rope: Rope | None, *, window, sinks, evict_chunk, max_pos, rebase) -> None:
    """Refuse settings a rolling cache cannot honour, before anything is built."""
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


def rolling_cache_for(
    handle: Runner | PreTrainedModel,
    *,
    window: int,
    sinks: int = 4,
    evict_chunk: int | None = None,
    rebase: Rebase = "auto",
    max_position: int | None = None,
    codec: Any = None,
    packed_path: str = "auto",
) -> RollingCache:
    """A :class:`RollingCache` for a :class:`~kvlab.model.ModelHandle` or a plain Hugging Face causal LM
    (its config, RoPE and maximum position; what it reads from a handle: :class:`~kvlab.hf.runner.Runner`),
    bound to the model (:func:`~kvlab.hf.binding.bind_to_model`) so that
    ``model.generate(..., cache=rolling_cache_for(model, ...))`` re-bases positions too and runs forever
    without passing the model's maximum."""
    if hasattr(handle, "rope") and hasattr(handle, "max_positions"):  # a kvlab handle
        runner = cast(Runner, handle)
        rope, max_pos, model = runner.rope, runner.max_positions, runner.model
        problem = getattr(runner, "rope_problem", None)
        if rope is None and problem:
            raise UnsupportedModelError(problem)
    elif hasattr(handle, "config") and callable(getattr(handle, "forward", None)):  # a PreTrainedModel
        model = cast("PreTrainedModel", handle)
        text = model.config.get_text_config(decoder=True)
        rope, max_pos = rope_spec_from_model(model), int(getattr(text, "max_position_embeddings", 0) or 0)
    else:
        raise BadInputError(
            f"rolling_cache_for needs a kvlab ModelHandle or a Hugging Face causal LM, got {type(handle).__name__}"
        )
    cache = RollingCache(
        handle.config,
        rope,
        window=window,
        sinks=sinks,
        evict_chunk=evict_chunk,
        max_position=max_position or max_pos,
        rebase=rebase,
        codec=codec,
        packed_path=packed_path,
    )
    bind_to_model(cache, model)
    return cache
