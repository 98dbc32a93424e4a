"""What every tier provides, and the counters it keeps.

A tier maps ``(parent hash, block hash)`` to a :class:`~kvlab.store.block.Block`. ``get`` returns
None on a miss (including a corrupt or unreachable entry, which is counted and reported, never
returned); ``put`` returns the blocks it evicted so the store can demote them; ``children(parent)``
lists the blocks stored under a parent with their token ids, which is how a partially matching last
block is found.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvlab.store.block import Block


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    rejected: int = 0
    corrupt: int = 0
    errors: int = 0
    promotions_in: int = 0
    demotions_in: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


class Tier(Protocol):
    name: str
    persistent: bool
    counters: TierCounters

    def contains(self, parent: str, block_hash: str) -> bool: ...

    def get(self, parent: str, block_hash: str, scratch: Any = None) -> Block | None:
        """The block or None; tiers that read bytes may decode into ``scratch`` (then copy before reusing it)."""
        ...

    def children(self, parent: str) -> dict[str, tuple[int, ...]]: ...

    def put(self, block: Block) -> list[Block]: ...

    def find(self, block_hash: str) -> Block | None: ...

    def delete(self, block_hash: str) -> bool: ...

    def usage(self) -> tuple[int, int]: ...
