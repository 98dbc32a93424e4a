"""The live cache a :class:`~kvlab.policy.spec.CachePolicy` names: one constructor for every spec, which
asks the policy's layout (:mod:`kvlab.policy.layouts`) to build it.

``cache_for(parse("sinks=4,window=2048,codec=kivi4"), model)`` returns a cache ready for
``model.generate(..., cache=...)``, kvlab's own loop or the server, bound to its model (each layout's file
says which cache it builds: the full layout a ``FullCache``, or a ``CompressedCache`` over a codec; sinks +
window a ``RollingCache``; a scored layout a ``CompressedCache`` that evicts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlab.errors import BadInputError
from kvlab.policy.spec import CachePolicy, parse

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from kvlab.hf.runner import Runner
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


def cache_for(
    policy: CachePolicy | str, handle: Runner | PreTrainedModel, *, packed_path: str = "auto", pinned: int = 0
) -> Any:
    """A new, empty live cache running ``policy`` (a :class:`CachePolicy` or its spec string) for
    ``handle`` (a :class:`~kvlab.model.ModelHandle`, read as a :class:`~kvlab.hf.runner.Runner`, or a Hugging
    Face causal LM), bound to the model: its layout builds it (:meth:`~kvlab.policy.layouts.Layout.cache`;
    ``pinned`` first tokens stay where the layout rolls a window)."""
    if isinstance(policy, str):
        policy = parse(policy)
    return policy.layout.cache(policy, handle, packed_path=packed_path, pinned=pinned)


def held_bytes(cache: Any) -> int:
    """K/V bytes a live cache holds now (any cache :func:`cache_for` makes)."""
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
