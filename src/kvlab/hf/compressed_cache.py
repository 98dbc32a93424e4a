"""A drop-in transformers ``Cache`` that quantizes or evicts as the model runs (transformers 5.x layer API).

``CompressedCache(config, quantizer=...)`` stores every layer as full-precision sinks, packed
segments (any :class:`~kvlab.policy.quant.Quantizer`) and a full-precision recent tail; each
``update`` returns the decoded history plus the new tokens, so attention runs on what the cache
really holds. ``CompressedCache(config, policy=..., keep=0.5, model=model)`` lets the prefill attend
to everything, then keeps ``keep`` of the slots per layer and head (or ``budget=`` slots); with
``every=N`` it then keeps that budget while decoding: whenever a layer holds ``budget + N`` slots
(after the step that brought it there has attended to them all) it scores everything it holds and
evicts back to the budget (kvpress's DecodingPress). Attention-scored policies see the queries of
the tokens fed since the last eviction, captured by a read-only hook on each ``q_proj`` (removed
after the prefill's eviction, or by :meth:`CompressedCache.close` with ``every``). With a per-token
quantizer as well, eviction runs on full-precision (decoded) K/V and the survivors stay encoded:
kept tokens' codes are gathered (:meth:`~kvlab.policy.quant.methods.TokenCode.gather`), never
re-quantized, and a token is encoded once, when it leaves the full-precision tail.

The layers (and the bookkeeping invariant: positions seen, slots held) are in
:mod:`kvlab.hf.compressed_layer`; per-head (AdaKV) budgets in :mod:`kvlab.hf.ragged_layer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.binding import bind_to_model
from kvlab.hf.cache import head_dim_of
from kvlab.hf.cache_steps import attends_plainly
from kvlab.hf.compressed_layer import DECODE_BLOCK, CompressedLayer, CompressionRule
from kvlab.hf.live_cache import LiveCache
from kvlab.hf.ragged_layer import RaggedLayer
from kvlab.policy.evict.observe import attention_modules
from kvlab.policy.evict.policies import Policy
from kvlab.policy.evict.select import budget_slots
from kvlab.policy.quant.methods import Quantizer
from kvlab.rope.layers import sliding_windows, text_config
from kvlab.rope.spec import Rope, rope_for_layer, rope_spec_from_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["DECODE_BLOCK", "CompressedCache", "CompressedLayer", "CompressionRule"]


class CompressedCache(LiveCache):
    """A transformers cache that quantizes (``quantizer``), evicts (``policy`` + ``keep`` or ``budget``),
    or both, as it fills.

    Pass it as ``cache=`` (``past_key_values=`` before transformers 5.24) to ``model(...)`` or ``model.generate(...)``. Attention-based
    policies need ``model`` (for the query hooks). With ``model`` the cache is bound to it, so a
    left-padded batch runs row by row (each row evicts or quantizes its own tokens, as alone); without
    it an evicting cache refuses a padded batch. ``nbytes`` is what the cache holds for K/V now.

    Eviction: the prefill attends to everything, then each layer keeps ``budget`` slots per KV head
    (``budget=`` slots, or ``keep=`` a fraction of the prompt); without ``every`` later tokens are
    appended. ``every=N`` keeps that budget while decoding: a layer holding ``budget + N`` slots (the
    step that brought it there has attended to them all) scores everything it holds, attention-based
    policies with the queries of the tokens fed since the last eviction, and evicts back to
    ``budget``, so a long generation holds at most ``budget + N`` slots per layer. Call :meth:`close`
    when done with an ``every`` cache of an attention-based policy (it removes the query hooks).
    ``quantizer=`` with ``policy=`` needs a per-token, position-free codec (``pertoken``, with no
    more full-precision ``sinks`` than the policy keeps): eviction runs on full precision, the kept
    tokens stay encoded (their codes gathered, never re-quantized).

    A bound quantizing cache decodes one-token steps on its packed codes: ``packed_path="auto"`` reads
    them with the C kernel on the CPU and with torch ops on other devices (``"kernel"`` / ``"torch"``
    force one; see :func:`kvlab.policy.quant.attention.packed_path`). ``packed_steps`` counts those
    steps, ``packed_steps_by_path`` which path read them.
    """

    # Only CompressedLayers (or RaggedLayers), typed as ours: transformers' Cache types the (invariant)
    # list as any of its own layer kinds, so narrowing it is an override mypy cannot accept.
    layers: list[CompressedLayer]  # type: ignore[assignment]
    rule: CompressionRule

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        quantizer: Quantizer | None = None,
        policy: Policy | None = None,
        keep: float | None = None,
        budget: int | None = None,
        every: int | None = None,
        heads: str = "uniform",
        layers: str = "uniform",
        model: PreTrainedModel | None = None,
        rope: Rope | None = None,
        packed_path: str = "auto",
        _row_of: CompressedCache | None = None,
    ):
        _check_eviction(quantizer, policy, keep, budget, every)
        _check_shares(heads, layers, quantizer, policy, every, model)
        from kvlab.policy.quant.attention import PATHS

        if packed_path not in PATHS:
            raise BadInputError(f"packed_path must be one of {', '.join(PATHS)}, got {packed_path!r}")
        text = text_config(config)
        if any(w is not None for w in sliding_windows(config)):
            raise UnsupportedModelError(
                "CompressedCache supports full-attention models only (this one has sliding-window layers)"
            )
        head_dim = head_dim_of(text)
        self.rope = rope if rope is not None else rope_spec_from_config(text)
        if quantizer is not None:
            for i in range(int(text.num_hidden_layers)):
                quantizer.check(head_dim, rope_for_layer(self.rope, i))
        self.quantizer, self.policy, self.keep, self.budget, self.every = (
            quantizer,
            policy,
            keep,
            budget,
            every,
        )
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
        self.rule = CompressionRule(
            n_layers, quantizer, policy, keep, self.rope, scaling, packed_path, budget, every, heads, layers
        )
        layer_class: type[CompressedLayer] = CompressedLayer
        if heads == "ada":
            layer_class = RaggedLayer
        preset = {
            "quantizer": quantizer,
            "policy": policy,
            "keep": keep,
            "budget": budget,
            "every": every,
            "layers": layers,
            "rope": self.rope,
            "packed_path": packed_path,
        }
        super().__init__([layer_class(self.rule, i) for i in range(n_layers)], self.rule, config, preset)
        for layer, mod in zip(self.layers, mods or (), strict=False):
            layer.hook_queries(mod)
        if model is not None and _row_of is None:
            bind_to_model(self, model)  # a left-padded batch then runs row by row (kvlab.hf.binding)

    def _check_rows(self) -> None:
        if self.rule.heads == "ada":
            raise BadInputError(
                "a padded batch cannot run on per-head (ada) budgets (each row would need its own ragged "
                "step); run the prompts one at a time"
            )
        if self.every is not None and self.policy is not None and self.policy.needs_queries:
            raise BadInputError(
                f"a padded batch cannot run on a CompressedCache with every= and an attention-scored policy "
                f"({self.policy.name}): its rows would need their decode-time queries; batch prompts of equal "
                "length, or use a policy that scores keys only (knorm, window, streaming_llm)"
            )

    def _new_row(self) -> CompressedCache:
        """A row of a padded batch: evicts from its own tokens at its own budget, scored by its own queries
        (its scaling, and where its queries come from, are the caller's: ``_row_of``), or quantizes its
        own tokens, exactly as alone."""
        return CompressedCache(self._config, **self._preset, _row_of=self)

    @property
    def scaling(self) -> float:
        return self.rule.scaling

    @property
    def held(self) -> int:
        return self.layers[0].held


def _check_shares(
    heads: str,
    layers: str,
    quantizer: Quantizer | None,
    policy: Policy | None,
    every: int | None,
    model: PreTrainedModel | None,
) -> None:
    """Refuse shared budgets the live cache cannot honour, in one line, before anything is built."""
    from kvlab.policy.evict.budgets import HEAD_SHARES, LAYER_SHARES

    if heads not in HEAD_SHARES or layers not in LAYER_SHARES:
        raise BadInputError(
            f"heads must be one of {', '.join(HEAD_SHARES)} and layers one of {', '.join(LAYER_SHARES)}; "
            f"got heads={heads!r}, layers={layers!r}"
        )
    if (heads, layers) == ("uniform", "uniform"):
        return
    if heads == "global":
        raise BadInputError(
            "heads=global runs offline only (kvlab eval): it ranks every layer's scores together, and a live "
            "cache evicts each layer inside the forward, before the later layers are scored"
        )
    if policy is None:
        raise BadInputError("shared budgets (heads=, layers=) need an eviction policy (policy=...)")
    if model is None:  # layers and heads hold different counts: they attend through kvlab's step
        raise BadInputError("shared budgets (heads=, layers=) attend through kvlab's step: pass model=")
    if heads != "ada":
        return
    if quantizer is not None or every is not None:
        raise BadInputError(
            "per-head (ada) budgets run in a live cache without a codec and without every= so far "
            "(the heads' selection is made once, after the prefill)"
        )
    if not attends_plainly(model):
        raise UnsupportedModelError(
            "per-head (ada) budgets run plain softmax attention (no sliding window, soft-capping or learned sinks)"
        )


def _check_eviction(
    quantizer: Quantizer | None,
    policy: Policy | None,
    keep: float | None,
    budget: int | None,
    every: int | None,
) -> None:
    """Refuse a combination the cache cannot honour, in one line, before anything is built."""
    if policy is None:
        if keep is not None or budget is not None or every is not None:
            raise BadInputError("keep=, budget= and every= need an eviction policy (policy=...)")
        return
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise BadInputError(f"budget must be a whole number of slots >= 1, got {budget!r}")
        if keep is not None:
            raise BadInputError(
                "give one budget: keep= (a fraction of the prompt) or budget= (slots), not both"
            )
        if budget < policy.sinks:
            raise BadInputError(
                f"budget={budget} is smaller than the {policy.sinks} sinks policy '{policy.name}' keeps"
            )
    else:
        budget_slots(1000, keep)  # validates the fraction (and that one was given)
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise BadInputError(f"every must be a whole number of tokens >= 1, got {every!r}")
    if quantizer is None:
        return
    if quantizer.kind != "pertoken":
        why = (
            "its keys are coded per channel across tokens, so single tokens cannot be dropped"
            if quantizer.token_multiple() > 1
            else "its codes depend on the tokens' positions or on a per-segment mean"
        )
        raise BadInputError(
            f"an eviction policy combines with a per-token, position-free quantizer only (pertoken); "
            f"{quantizer.name}: {why}"
        )
    if quantizer.sinks > policy.sinks:
        raise BadInputError(
            f"the quantizer keeps {quantizer.sinks} full-precision sinks but policy '{policy.name}' may evict "
            f"them: give the policy sinks >= {quantizer.sinks} (or the quantizer fewer)"
        )
