"""The full layout: every slot stays (the reference), in full precision or over a codec.

``full`` is the model's own cache (:class:`~kvlab.hf.live_cache.FullCache`); ``codec=kivi4`` (with
``sinks=N`` full-precision first slots) stores every slot as codes
(:class:`~kvlab.hf.compressed_cache.CompressedCache`); offline, the snapshot encoded and decoded back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvlab.policy.layouts.base import Items, Layout, context

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle
    from kvlab.policy.layouts.base import Applied, CachePolicy, Model, Source


@dataclass(frozen=True)
class FullLayout(Layout):
    """Every slot stays."""

    name: ClassVar[str] = "full"
    exact: ClassVar[bool] = True
    keys: ClassVar[tuple[str, ...]] = ("sinks",)
    syntax: ClassVar[str] = "full"

    @classmethod
    def read(cls, items: Items) -> Layout:
        if "sinks" in items.opts and items.codec is None:
            items.refuse("sinks= alone keeps everything; add window=N or codec=")
        return cls()

    def codec_sinks(self, items: Items) -> int:
        return items.int("sinks", 0) or 0

    def describe(self) -> str:
        return "every slot"

    def cache(self, policy: CachePolicy, handle: Model, *, packed_path: str = "auto", pinned: int = 0) -> Any:
        from kvlab.hf.policy_cache import full_cache, model_parts

        config, model, codec = model_parts(policy, handle)
        if codec is None:
            return full_cache(config)
        from kvlab.hf.compressed_cache import CompressedCache

        return CompressedCache(config, quantizer=codec, model=model, packed_path=packed_path)

    def apply(self, policy: CachePolicy, source: Source, handle: ModelHandle) -> Applied:
        from kvlab.policy.quant import quantize_snapshot

        snap = context(source)
        codec = policy.quantizer(snap.head_dim)
        if codec is None:
            return snap, snap.nbytes, {}
        qs = quantize_snapshot(snap, codec)
        return qs.decompress(), qs.nbytes, {}
