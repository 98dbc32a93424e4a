"""The live cache a :class:`~kvlab.compress.spec.CachePolicy` names: one constructor for every spec.

``cache_for(parse("sinks=4,window=2048,codec=kivi4"), model)`` returns a cache ready for
``model.generate(..., cache=...)``, kvlab's own loop or the server, bound to its model:

* ``full`` — :class:`~kvlab.hf.live_cache.FullCache`: transformers' dynamic layers (the reference, the same
  numbers as a ``DynamicCache``) with the live-cache interface;
* a codec over every slot — :class:`~kvlab.hf.compressed_cache.CompressedCache` (``quantizer=``);
* sinks + window, with or without a codec — :class:`~kvlab.hf.rolling_cache.RollingCache`
  (a codec stores the window as codes: :mod:`kvlab.hf.coded_rolling`);
* a scored layout — :class:`~kvlab.hf.compressed_cache.CompressedCache` (``policy=``, ``keep=`` or
  ``budget=``, ``every=``, and a per-token codec for the survivors).
"""

from __future__ import annotations

from typing import Any

from kvlab.compress.spec import CachePolicy, ScoredLayout, SinksWindowLayout, parse
from kvlab.errors import BadInputError


def _model_of(handle: Any) -> tuple[Any, Any]:
    """``(config, model)`` of a kvlab ModelHandle or a Hugging Face causal LM."""
    model = getattr(handle, "model", handle)
    config = getattr(handle, "config", None) or getattr(model, "config", None)
    if config is None or not callable(getattr(model, "forward", None)):
        raise BadInputError(
            f"cache_for needs a kvlab ModelHandle or a Hugging Face causal LM, got {type(handle).__name__}"
        )
    return config, model


def _head_dim(config: Any) -> int:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def cache_for(policy: CachePolicy | str, handle: Any, *, packed_path: str = "auto") -> Any:
    """A new, empty live cache running ``policy`` (a :class:`CachePolicy` or its spec string) for
    ``handle`` (a :class:`~kvlab.model.ModelHandle`, read as a :class:`~kvlab.hf.runner.Runner`, or a Hugging
    Face causal LM: hence ``Any``), bound to the model."""
    if isinstance(policy, str):
        policy = parse(policy)
    config, model = _model_of(handle)
    lay = policy.layout
    codec = policy.quantizer(_head_dim(config))
    if isinstance(lay, SinksWindowLayout):
        from kvlab.hf.rolling_cache import rolling_cache_for

        return rolling_cache_for(
            handle,
            window=lay.window,
            sinks=lay.sinks,
            evict_chunk=lay.chunk or None,
            codec=codec,
            packed_path=packed_path,
        )
    from kvlab.hf.compressed_cache import CompressedCache

    if isinstance(lay, ScoredLayout):
        budget: dict[str, Any] = {"keep": lay.keep} if lay.keep is not None else {"budget": lay.budget}
        return CompressedCache(
            config,
            quantizer=codec,
            policy=lay.policy(),
            every=lay.every or None,
            heads=lay.heads,
            layers=lay.layers,
            model=model,
            packed_path=packed_path,
            **budget,
        )
    if codec is not None:
        return CompressedCache(config, quantizer=codec, model=model, packed_path=packed_path)
    from kvlab.hf.live_cache import FullCache, full_cache_supported

    if full_cache_supported(config):
        return FullCache(config)
    from transformers import DynamicCache

    return DynamicCache(config=config)  # layers kvlab does not wrap (linear attention): transformers' own


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
