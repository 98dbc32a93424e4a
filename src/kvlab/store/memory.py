"""The in-memory tier: blocks in a segmented LRU (SLRU) under a byte cap.

New blocks enter the *probation* segment; a second hit moves a block to the *protected* segment
(at most :data:`PROTECTED_FRACTION` of the cap). Eviction takes the least recently used probation block
first, so a one-off scan of many new prefixes cannot push out the prefixes that are reused. Evicted
blocks are handed back to the store, which demotes them to the next tier.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvlab.errors import BadInputError
from kvlab.store.block import Block
from kvlab.store.tier import TierCounters

PROTECTED_FRACTION = 0.8  # the share of the cap that blocks hit twice may hold


class MemoryTier:
    """SLRU of :class:`Block` objects; ``max_bytes`` counts K/V bytes."""

    name = "memory"
    persistent = False

    def __init__(self, max_bytes: int = 2 * 2**30):
        if max_bytes < 1:
            raise BadInputError(f"the memory tier needs a positive byte cap, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.protected_max_bytes = int(max_bytes * PROTECTED_FRACTION)
        self._probation: OrderedDict[str, Block] = OrderedDict()
        self._protected: OrderedDict[str, Block] = OrderedDict()
        self._children: dict[str, dict[str, tuple[int, ...]]] = {}
        self._bytes = 0
        self._protected_bytes = 0
        self.counters = TierCounters()

    # -- reads -------------------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """K/V bytes the tier holds now (at most ``max_bytes``)."""
        return self._bytes

    def contains(self, parent: str, block_hash: str) -> bool:
        return block_hash in self._probation or block_hash in self._protected

    def get(self, parent: str, block_hash: str, scratch: Any = None) -> Block | None:
        if block_hash in self._protected:
            self._protected.move_to_end(block_hash)
            block = self._protected[block_hash]
        elif block_hash in self._probation:
            block = self._probation.pop(block_hash)
            self._protected[block_hash] = block
            self._protected_bytes += block.nbytes
            self._rebalance()
        else:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        self.counters.bytes_loaded += block.nbytes
        return block

    def children(self, parent: str) -> dict[str, tuple[int, ...]]:
        return dict(self._children.get(parent, {}))

    def find(self, block_hash: str) -> Block | None:
        return self._protected.get(block_hash) or self._probation.get(block_hash)

    def iter_blocks(self):
        yield from list(self._protected.values()) + list(self._probation.values())

    # -- writes ------------------------------------------------------------------------------------
    def put(self, block: Block) -> list[Block]:
        """Insert (or refresh) a block; returns the blocks evicted to make room."""
        if self.contains(block.parent, block.hash):
            return []
        if block.nbytes > self.max_bytes:
            self.counters.rejected += 1
            return [block]
        self._probation[block.hash] = block
        self._children.setdefault(block.parent, {})[block.hash] = block.token_ids
        self._bytes += block.nbytes
        self.counters.puts += 1
        evicted = []
        while self._bytes > self.max_bytes:
            evicted.append(self._evict_one())
        return evicted

    def delete(self, block_hash: str) -> bool:
        for seg in (self._probation, self._protected):
            if block_hash in seg:
                block = seg.pop(block_hash)
                self._forget(block, protected=seg is self._protected)
                return True
        return False

    def _rebalance(self) -> None:
        # An overfull protected segment demotes its LRU blocks back to probation (most recent end).
        while self._protected_bytes > self.protected_max_bytes and self._protected:
            h, block = self._protected.popitem(last=False)
            self._protected_bytes -= block.nbytes
            self._probation[h] = block

    def _evict_one(self) -> Block:
        seg = self._probation if self._probation else self._protected
        _, block = seg.popitem(last=False)
        self._forget(block, protected=seg is self._protected)
        self.counters.evictions += 1
        return block

    def _forget(self, block: Block, *, protected: bool) -> None:
        self._bytes -= block.nbytes
        if protected:
            self._protected_bytes -= block.nbytes
        kids = self._children.get(block.parent)
        if kids is not None:
            kids.pop(block.hash, None)
            if not kids:
                del self._children[block.parent]

    # -- accounting --------------------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        """``(blocks, bytes)`` held."""
        return len(self._probation) + len(self._protected), self._bytes
