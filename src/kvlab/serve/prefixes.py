"""Shared prefixes compressed once: a scored layout's system prompt, reused by every conversation that shares it.

A served conversation under a scored layout (``h2o,budget=1024,every=64``) would evict from its whole first
prompt, so two conversations with the same system prompt and different questions keep different slots of it
and nothing can be shared. Instead the system prompt (the request's pinned tokens) is compressed **alone**, by
the layout's prefix score (``prefix=kvzip``: KVzip's reconstruction pass; default the layout's own score), as
the eval compresses a context (:meth:`~kvlab.policy.layouts.Layout.compress_prefix`). The result depends on
the prefix and the policy only, so it is stored under both (:class:`~kvlab.store.compressed.CompressedPrefixes`:
a namespace of its own, salted per tenant, checked on every read, never returned as an exact prefix) and every
conversation that shares it, in any process on the same store, starts from it
(:meth:`~kvlab.hf.live_cache.LiveCache.seed_kept`); the conversation then keeps its budget while decoding.
A hit and a miss leave the same cache: a miss computes, stores and then seeds the same record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlab.store.compressed import CompressedPrefix, CompressedPrefixes
from kvlab.store.errors import StoreError

if TYPE_CHECKING:
    from kvlab.hf.live_cache import LiveCache
    from kvlab.model.handle import ModelHandle
    from kvlab.policy.spec import CachePolicy
    from kvlab.store.keys import Namespace
    from kvlab.store.store import KVStore

log = logging.getLogger("kvlab.serve")


@dataclass
class SharedPrefixes:
    """The compressed system prompts of one server: looked up, else computed and stored, then seeded."""

    policy: CachePolicy
    handle: ModelHandle
    kv: KVStore | None  # the exact store, whose tiers (and namespaces) the compressed prefixes share
    store: CompressedPrefixes | None
    counts: dict[str, int] = field(default_factory=lambda: {"computed": 0, "reused": 0, "warnings": 0})

    @classmethod
    def make(cls, policy: CachePolicy, handle: ModelHandle, store: KVStore | None) -> SharedPrefixes:
        return cls(policy, handle, store, CompressedPrefixes(store) if store is not None else None)

    def applies(self, pinned: int, total: int) -> bool:
        """Whether a conversation whose first ``pinned`` of ``total`` tokens are shared starts from them compressed."""
        return 0 < pinned < total and self.policy.layout.compresses_prefix(pinned)

    def load(self, cache: LiveCache, ids: list[int], salt: str) -> dict[str, object]:
        """``ids`` (the shared prefix) compressed into the empty ``cache``: stored, or computed and stored.
        Returns what the response reports (``source``: the tier it came from, or ``computed``)."""
        record = self._find(ids, salt)
        if record is None:
            kept = self.policy.layout.compress_prefix(self.handle, ids)
            record = CompressedPrefix(tuple(ids), self.policy.spec, kept)
            self._put(record, salt)
        source = record.source or "computed"
        device = self.handle.device
        cache.seed_kept([(k.to(device), v.to(device), p) for k, v, p in record.layers], len(ids))
        self.counts["reused" if source != "computed" else "computed"] += 1
        kept_slots = int(record.layers[0][0].shape[-2])
        return {"tokens": len(ids), "kept": kept_slots, "source": source, "policy": self.policy.spec}

    def stats(self) -> dict[str, object]:
        """Shared prefixes computed and reused here, and the compressed store's counters (hits per tier,
        rejected records...)."""
        return {**self.counts, **(self.store.stats() if self.store is not None else {})}

    def _namespace(self, salt: str) -> Namespace:
        assert self.kv is not None
        return self.kv.namespace(self.handle, salt=salt or None)

    def _find(self, ids: list[int], salt: str) -> CompressedPrefix | None:
        """The stored record (its ``source`` the tier it came from), or None."""
        if self.store is None:
            return None
        try:
            return self.store.get(self._namespace(salt), self.policy.spec, ids)
        except StoreError as exc:
            self.counts["warnings"] += 1
            log.warning("kvlab serve: the compressed-prefix store failed (%s); computing the prefix", exc)
            return None

    def _put(self, record: CompressedPrefix, salt: str) -> None:
        if self.store is None:
            return
        try:
            self.store.put(self._namespace(salt), record)
        except StoreError as exc:
            self.counts["warnings"] += 1
            log.warning("kvlab serve: could not store a compressed prefix (%s); serving it anyway", exc)
