"""The KV store: reuse caches across requests, processes and agents, in memory, on disk and in Redis.

``open_store(path)`` gives a :class:`KVStore`; ``store.put(snapshot)`` stores a prefix cache as
content-addressed blocks; ``store.lookup(ids, store.namespace(handle))`` returns the longest stored
prefix; :func:`reuse_generate` does both around a generation; :func:`fork` continues one shared
context many ways; :mod:`kvlab.store.blend` reuses stored chunks at other positions (non-prefix);
:class:`CompressedPrefixes` keeps compressed prefixes in their own namespace, never served as exact.
"""

from kvlab.store.blend import (
    Blended,
    RecomputeAll,
    RecomputeDeviating,
    RecomputeFirst,
    RotateOnly,
    blend,
    correction_by_name,
)
from kvlab.store.block import Block
from kvlab.store.compressed import CompressedPrefix, CompressedPrefixes
from kvlab.store.disk import DiskTier
from kvlab.store.errors import (
    BlockNotFoundError,
    CorruptBlockError,
    StoreError,
    StoreUnavailableError,
    StoreWriteError,
    UnsupportedBlockError,
)
from kvlab.store.keys import Namespace, block_hash, chain_hashes
from kvlab.store.memory import MemoryTier
from kvlab.store.reuse import ReuseResult, StoredPrefill, fork, prefill_with_store, reuse_generate
from kvlab.store.store import KVStore, Match, PutReport, default_store_path, open_store

__all__ = [
    "Block",
    "Blended",
    "RecomputeAll",
    "RecomputeDeviating",
    "RecomputeFirst",
    "RotateOnly",
    "blend",
    "correction_by_name",
    "BlockNotFoundError",
    "CompressedPrefix",
    "CompressedPrefixes",
    "CorruptBlockError",
    "DiskTier",
    "KVStore",
    "Match",
    "MemoryTier",
    "Namespace",
    "PutReport",
    "ReuseResult",
    "StoreError",
    "StoreUnavailableError",
    "StoreWriteError",
    "StoredPrefill",
    "UnsupportedBlockError",
    "block_hash",
    "chain_hashes",
    "default_store_path",
    "fork",
    "open_store",
    "prefill_with_store",
    "reuse_generate",
]
