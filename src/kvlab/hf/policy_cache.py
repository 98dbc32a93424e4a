"""What a layout builds its live cache from (:meth:`~kvlab.policy.layouts.Layout.cache`, reached through
:func:`kvlab.policy.spec.cache_for`): the model's config and codec, the full layout's cache, and the bytes any
such cache holds. Nothing here reads a spec: :mod:`kvlab.policy` sits below :mod:`kvlab.hf`, and a layout's own
``cache`` is its one call up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlab.errors import BadInputError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from kvlab.hf.runner import Runner
    from kvlab.policy.layouts.base import CachePolicy
    from kvlab.policy.quant import Quantizer


def model_parts(
    policy: CachePolicy, handle: Runner | PreTrainedModel
) -> tuple[PretrainedConfig, Any, Quantizer | None]:
    """``(config, model, codec)`` of a kvlab handle or a Hugging Face causal LM: the codec's groups cut to
    the model's head size."""
    model = getattr(handle, "model", handle)
    config = getattr(handle, "config", None) or getattr(model, "config", None)
    if config is None or not callable(getattr(model, "forward", None)):
        raise BadInputError(
            f"cache_for needs a kvlab ModelHandle or a Hugging Face causal LM, got {type(handle).__name__}"
        )
    from kvlab.hf.cache import head_dim_of

    return config, model, policy.quantizer(head_dim_of(config))


def full_cache(config: PretrainedConfig) -> Any:
    """The full layout's live cache: a :class:`~kvlab.hf.live_cache.FullCache` where kvlab wraps the model's
    layers, else (linear attention) transformers' own ``DynamicCache``."""
    from kvlab.hf.live_cache import FullCache, full_cache_supported

    if full_cache_supported(config):
        return FullCache(config)
    from transformers import DynamicCache

    return DynamicCache(config=config)


def held_bytes(cache: Any) -> int:
    """K/V bytes a live cache holds now (any cache :func:`kvlab.policy.cache_for` makes)."""
    n = getattr(cache, "nbytes", None)
    if callable(n):
        return int(n())
    if n is not None:
        return int(n)
    return sum(
        t.numel() * t.element_size()
        for layer in getattr(cache, "layers", [])
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if t is not None and hasattr(t, "numel")
    )
