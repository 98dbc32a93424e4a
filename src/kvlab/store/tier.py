"""What every tier provides, and the counters it keeps.

A tier maps ``(parent hash, block hash)`` to a :class:`~kvlab.store.block.Block`. ``get`` returns
None on a miss (including a corrupt or unreachable entry, which is counted and reported, never
returned); ``put`` returns the blocks it evicted so the store can demote them; ``children(parent)``
lists the blocks stored under a parent with their token ids, which is how a partially matching last
block is found. A tier that cannot make a write it was asked for (Redis down, paused or full) counts it
in ``skipped`` instead of raising, so the store can report it. A tier that can write behind the caller
(:class:`QueuedWrites`: Redis) also takes blocks through ``put_later``, which only queues them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

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
    skipped: int = 0
    dropped: int = 0  # writes a full write-behind queue refused (also counted in skipped)
    promotions_in: int = 0
    demotions_in: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def hit(self, nbytes: int, started: float) -> None:
        """A read that found ``nbytes`` of K/V, begun at ``time.perf_counter()`` ``started``."""
        self.hits += 1
        self.bytes_loaded += nbytes
        self.load_seconds += time.perf_counter() - started


class RateLimitedLog:
    """Warnings that may recur on every call (a tier that keeps failing): one line per kind per
    ``every_s`` seconds, the next one saying how many were held back; never a traceback."""

    def __init__(self, logger: logging.Logger, every_s: float = 30.0):
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> bool:
        """Log ``message`` unless a warning of ``kind`` was logged less than ``every_s`` ago; True if logged."""
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        if held:
            message += f" ({held} more like it in the last {now - last:.0f} s)" if last is not None else ""
        self.logger.warning("%s", message)
        return True


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


@runtime_checkable
class QueuedWrites(Protocol):
    """A tier that can write behind the caller: ``put_later`` queues the block for its own writer thread and
    returns at once (False: it will not be written, and is counted in ``skipped``); ``flush`` waits for
    the queue to empty (False when ``timeout`` passed first)."""

    def put_later(self, block: Block) -> bool: ...

    def flush(self, timeout: float | None = None) -> bool: ...
