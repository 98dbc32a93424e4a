"""Sinks + window: the first ``sinks`` slots and the last ``window``, rolled on overflow (StreamingLLM).

``sinks=4,window=2048[,chunk=N][,codec=kivi4[,tail=N]]``. Live it is a
:class:`~kvlab.hf.rolling_cache.RollingCache` (the window stored as codes with a codec:
:mod:`kvlab.hf.coded_rolling`), which re-positions the kept keys contiguously; offline the context's K/V is
fed to that cache's own layers, so the two hold the same slots by construction. The server pins a system
prompt in its sinks, feeds a long prompt in pieces and reuses stored prefixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvlab.policy.catalogue import codec_facts
from kvlab.policy.layouts.base import Items, Layout, Roll, context

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle
    from kvlab.policy.layouts.base import Applied, CachePolicy, Model, Source

DEFAULT_SINKS = 4  # a sinks + window layout without ``sinks=`` keeps StreamingLLM's four


@dataclass(frozen=True)
class SinksWindowLayout(Layout):
    """The first ``sinks`` slots and the last ``window``; a full cache evicts ``chunk`` at a time
    (0: the rolling cache's default for the window)."""

    sinks: int = DEFAULT_SINKS
    window: int = 0
    chunk: int = 0
    name: ClassVar[str] = "sinks_window"
    kind: ClassVar[str] = "window"
    keys: ClassVar[tuple[str, ...]] = ("sinks", "window", "chunk")
    refusal: ClassVar[str] = "applies to sinks + window only (e.g. sinks=4,window=256,chunk=32)"
    syntax: ClassVar[str] = "sinks=N,window=N[,chunk=N]"
    serves: ClassVar[str] = (
        "sinks + window caches, in full precision or over a codec "
        "(sinks=N,window=N[,chunk=N][,codec=C[,tail=N]], e.g. sinks=4,window=2048,codec=kivi4)"
    )

    @classmethod
    def claims(cls, items: Items) -> bool:
        return items.word is None and "window" in items.opts

    @classmethod
    def read(cls, items: Items) -> Layout:
        window = items.int("window") or 0
        if window < 1:
            items.refuse("window must be >= 1")
        return cls(items.int("sinks", DEFAULT_SINKS) or 0, window, items.int("chunk", 0) or 0)

    def check(self, policy: CachePolicy, spec: str) -> None:
        """A window over codes must hold at least one block of codes besides its chunk and full-precision
        tail (checked again, for the model's head size, when the cache is built)."""
        if policy.codec is None:
            return
        from kvlab.errors import BadInputError
        from kvlab.policy.window import default_chunk

        facts = codec_facts(policy.codec)
        tail = facts.tail if policy.tail is None else policy.tail
        chunk = facts.block * math.ceil((self.chunk or default_chunk(self.window)) / facts.block)
        need = chunk + facts.block + tail
        if self.window < need:
            raise BadInputError(
                f"cache spec '{spec}': a window of {self.window} over {policy.codec_name} codes holds none: "
                f"it needs the eviction chunk ({chunk}) + one block of codes ({facts.block}) + the "
                f"full-precision tail ({tail}) = {need} slots (a larger window, chunk=, or tail=)"
            )

    def items(self) -> list[str]:
        return [f"sinks={self.sinks}", f"window={self.window}"] + (
            [f"chunk={self.chunk}"] if self.chunk else []
        )

    def fields(self) -> dict[str, Any]:
        return {"sinks": self.sinks, "window": self.window}

    def describe(self) -> str:
        return f"{self.sinks} sinks + the last {self.window} slots"

    def cache(self, policy: CachePolicy, handle: Model, *, packed_path: str = "auto", pinned: int = 0) -> Any:
        """A :class:`~kvlab.hf.rolling_cache.RollingCache` whose sinks also hold ``pinned`` first tokens."""
        from kvlab.hf.policy_cache import model_parts
        from kvlab.hf.rolling_cache import rolling_cache_for

        codec = model_parts(policy, handle)[2]
        return rolling_cache_for(
            handle,
            window=self.window,
            sinks=max(self.sinks, pinned),
            evict_chunk=self.chunk or None,
            codec=codec,
            packed_path=packed_path,
        )

    def apply(self, policy: CachePolicy, source: Source, handle: ModelHandle) -> Applied:
        """The context's K/V fed to the live cache's own layers (no model forward: the prompt attends to
        itself in full precision in the live cache too): the sinks re-positioned before the window, whole
        eviction chunks dropped, codes where the cache keeps codes."""
        import torch

        snap = context(source)
        cache = self.cache(policy, handle)
        for layer, k, v in zip(cache.layers, snap.keys, snap.values, strict=True):
            layer.update(k, v)
        kept = cache.kept_layers()
        n, sinks = cache.kept, min(cache.layers[0].rule.policy.sinks, cache.kept)
        ids = torch.cat((snap.token_ids[:, :sinks], snap.token_ids[:, snap.seq_len - (n - sinks) :]), dim=1)
        rolled = snap.replace(
            keys=tuple(k for k, _ in kept),
            values=tuple(v for _, v in kept),
            token_ids=ids,
            positions=cache.positions(),
            provenance="rolled",
        )
        if policy.codec is not None:
            return rolled, sum(layer.visible_nbytes() for layer in cache.layers), {}
        return rolled, rolled.nbytes, {}

    def serve_check(self, policy: CachePolicy, spec: str) -> None:
        """Every sinks + window layout is served."""

    def rolls(self) -> Roll:
        return Roll(self.sinks, self.window, self.chunk)

    def for_feed(self, feed: int) -> Layout:
        """Without ``chunk=``, a stream evicts ``feed`` at a time, as the other rolling methods do."""
        from dataclasses import replace

        return replace(self, chunk=self.chunk or feed)
