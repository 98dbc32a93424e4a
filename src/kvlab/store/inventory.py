"""Listing what a store holds, tier by tier (for ``kvlab store ls``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvlab.store.block import Block, BlockHeader
from kvlab.store.store import KVStore

if TYPE_CHECKING:
    from kvlab.store.disk import DiskEntry


# What each kind of tier offers for listing, beyond the Tier protocol (a tier's name says its kind).
@runtime_checkable
class _MemoryListing(Protocol):
    def iter_blocks(self) -> Iterator[Block]: ...


@runtime_checkable
class _DiskListing(Protocol):
    def entries(self) -> Iterator[DiskEntry]: ...

    def read_header(self, path: Path) -> BlockHeader | str | None: ...


@runtime_checkable
class _RedisListing(Protocol):
    def block_hashes(self) -> list[str]: ...


def _row(tier: str, block_hash: str, parent: str, start: int, tokens: int, nbytes: int) -> dict:
    return {
        "tier": tier,
        "hash": block_hash,
        "parent": parent,
        "start": start,
        "tokens": tokens,
        "bytes": nbytes,
    }


def list_blocks(store: KVStore) -> list[dict]:
    """One row per (tier, block): hash, parent, start position, tokens, bytes."""
    rows: list[dict] = []
    for tier in store.tiers:
        if tier.name == "memory":
            assert isinstance(tier, _MemoryListing)
            rows += [
                _row("memory", b.hash, b.parent, b.start, b.num_tokens, b.nbytes) for b in tier.iter_blocks()
            ]
        elif tier.name == "disk":
            assert isinstance(tier, _DiskListing)
            for e in tier.entries():
                # never opens a FIFO or follows a link; a file that is not a block is listed as start -1
                header = tier.read_header(e.path) if e.regular else None
                if isinstance(header, BlockHeader):
                    rows.append(_row("disk", e.hash, e.parent, header.start, header.num_tokens, e.nbytes))
                else:
                    rows.append(_row("disk", e.hash, e.parent, -1, 0, e.nbytes))
        elif tier.name == "redis":
            assert isinstance(tier, _RedisListing)
            for h in tier.block_hashes():
                found = tier.find(h)
                if found is not None:
                    rows.append(_row("redis", h, found.parent, found.start, found.num_tokens, found.nbytes))
    rows.sort(key=lambda r: (r["tier"], r["parent"], r["start"]))
    return rows
