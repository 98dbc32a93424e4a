"""Strided: every ``stride``-th slot of the history plus the most recent ``recent`` (``stride=4,recent=64``).

Invariant: after ``T`` tokens the cache holds the slots at positions ``p`` with ``p % stride == 0`` or
``p >= T - recent``, at their original positions (no re-rotation), in order. A forward attends to every
slot held plus its own tokens; the cache drops the slots that fall out afterwards, so a prompt fed in one
forward sees itself whole. ``stride=1`` keeps every slot (the full cache, bit for bit).

Live it is a :class:`StridedCache` (transformers' dynamic layers that gather the kept slots after each
update); offline (:meth:`StridedLayout.apply`) the context's snapshot is masked to the same slots. This file
is the whole layout: the spec reader, the eval, ``kvlab generate``, stream-ppl and ``kvlab serve`` find it in
the registry. A conversation's cache grows with it (one slot in ``stride``), but its slots keep their original
positions, so the model's position limit ends a conversation: ``kvlab serve`` refuses a request that would pass
it, and each conversation holds at most :meth:`StridedLayout.held_at_most` slots.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvlab.errors import BadInputError
from kvlab.policy.layouts.base import Items, Layout, context

if TYPE_CHECKING:
    import torch

    from kvlab.model.handle import ModelHandle
    from kvlab.policy.layouts.base import Applied, CachePolicy, Model, Source


@dataclass(frozen=True)
class StridedLayout(Layout):
    """Every ``stride``-th slot and the last ``recent`` slots."""

    stride: int = 1
    recent: int = 0
    name: ClassVar[str] = "strided"
    kind: ClassVar[str] = "strided"
    keys: ClassVar[tuple[str, ...]] = ("stride", "recent")
    refusal: ClassVar[str] = "apply to a strided layout only (e.g. stride=4,recent=64)"
    syntax: ClassVar[str] = "stride=N,recent=N"
    serves: ClassVar[str] = (
        "strided caches (stride=N,recent=N, e.g. stride=4,recent=64: one slot in N plus the last N, at their "
        "original positions; a conversation ends at the model's position limit, which bounds its cache)"
    )

    @classmethod
    def claims(cls, items: Items) -> bool:
        return items.word is None and "stride" in items.opts

    @classmethod
    def read(cls, items: Items) -> Layout:
        stride = items.int("stride") or 0
        if stride < 1:
            items.refuse("stride must be >= 1")
        return cls(stride, items.int("recent", 0) or 0)

    def check(self, policy: CachePolicy, spec: str) -> None:
        if policy.codec is not None:
            raise BadInputError(
                f"cache spec '{spec}': a strided layout keeps its slots in full precision (drop codec=)"
            )

    def serve_check(self, policy: CachePolicy, spec: str) -> None:
        """Served: a codec is refused while the spec is read (:meth:`check`), a model with sliding or
        non-attention layers when the engine starts (it builds a cache), one without a position limit too."""

    def held_at_most(self, limit: int) -> int:
        """The slots held after ``limit`` tokens (the count only grows with the tokens seen)."""
        return len(range(0, max(0, limit - self.recent), self.stride)) + min(self.recent, limit)

    def items(self) -> list[str]:
        return [f"stride={self.stride}", f"recent={self.recent}"]

    def fields(self) -> dict[str, Any]:
        return {"stride": self.stride, "recent": self.recent}

    def describe(self) -> str:
        return f"one slot in {self.stride} + the last {self.recent} slots"

    def kept(self, positions: torch.Tensor, seen: int) -> torch.Tensor:
        """Which of the slots at ``positions`` stay after ``seen`` tokens (a bool tensor like ``positions``)."""
        return (positions % self.stride == 0) | (positions >= seen - self.recent)

    def cache(self, policy: CachePolicy, handle: Model, *, packed_path: str = "auto", pinned: int = 0) -> Any:
        from kvlab.hf.policy_cache import model_parts

        return _cache_class()(model_parts(policy, handle)[0], self)

    def apply(self, policy: CachePolicy, source: Source, handle: ModelHandle) -> Applied:
        """The context's snapshot with only the kept slots valid (at their original positions)."""
        import torch

        snap = context(source)
        keep = self.kept(torch.arange(snap.seq_len, device="cpu"), snap.seq_len)
        valid = tuple(keep.to(k.device).expand(*k.shape[:2], -1).clone() for k in snap.keys)
        masked = snap.replace(valid=valid, provenance="edited")
        return masked, masked.held_nbytes, {}


@functools.cache
def _cache_class() -> type:
    """The live cache's classes, defined on first use (they import torch; reading a spec must not)."""
    import torch

    from kvlab.errors import UnsupportedModelError
    from kvlab.hf.live_cache import FullLayer, FullRule, LiveCache, full_cache_supported
    from kvlab.rope.layers import sliding_windows

    class StridedLayer(FullLayer):
        """One full-attention layer: transformers' own update (FullLayer's), then the slots that fall out gathered away."""

        def __init__(self, layout: StridedLayout) -> None:
            super().__init__()
            self.layout, self.seen, self.evictions = layout, 0, 0
            self.pos = torch.zeros(
                0, dtype=torch.long, device="cpu"
            )  # original positions of the held slots (host)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kw: Any) -> Any:
            keys, values = super().update(key_states, value_states, *args, **kw)
            n = key_states.shape[-2]
            self.seen += n
            pos = torch.cat((self.pos, torch.arange(self.seen - n, self.seen, device="cpu")))
            keep = self.layout.kept(pos, self.seen)
            if not bool(keep.all()):
                at = keep.nonzero().squeeze(-1).to(keys.device)
                self.keys, self.values = keys.index_select(-2, at), values.index_select(-2, at)
                self.evictions += 1
            self.pos = pos[keep]
            return keys, values  # this forward attends to everything held before it, and to itself

        def get_seq_length(self) -> int:
            return self.seen

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.kept + query_length, 0

        def query_offset(self) -> int:
            return self.kept

        def kept_positions(self) -> torch.Tensor:
            return self.pos.clone()

        def hold(self) -> None:
            raise BadInputError(
                "a strided cache drops slots after each forward: feed a prompt in one forward"
            )

    @dataclass(frozen=True)
    class StridedRule(FullRule):
        layout: StridedLayout

        def describe(self) -> str:
            return self.layout.describe()

    class StridedCache(LiveCache):
        """Transformers' dynamic layers that keep a strided layout's slots (full-attention models only)."""

        def __init__(self, config: Any, layout: StridedLayout) -> None:
            windows = sliding_windows(config)
            if not full_cache_supported(config) or any(windows):
                raise UnsupportedModelError("a strided cache runs on models whose layers all attend fully")
            super().__init__(
                [StridedLayer(layout) for _ in windows], StridedRule(layout), config, {"layout": layout}
            )

    return StridedCache
