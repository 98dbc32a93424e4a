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


def list_blocks(store: KVStore) -> list[dict]:
    """One row per (tier, block): hash, parent, start position, tokens, bytes."""
    rows: list[dict] = []
    for tier in store.tiers:
        if tier.name == "memory":
            assert isinstance(tier, _MemoryListing)
            for b in tier.iter_blocks():
                rows.append(
                    {
                        "tier": "memory",
                        "hash": b.hash,
                        "parent": b.parent,
                        "start": b.start,
                        "tokens": b.num_tokens,
                        "bytes": b.nbytes,
                    }
                )
        elif tier.name == "disk":
            assert isinstance(tier, _DiskListing)
            for e in tier.entries():
                # never opens a FIFO or follows a link; a file that is not a block is listed as start -1
                header = tier.read_header(e.path) if e.regular else None
                rows.append(
                    {
                        "tier": "disk",
                        "hash": e.hash,
                        "parent": e.parent,
                        "start": header.start if isinstance(header, BlockHeader) else -1,
                        "tokens": header.num_tokens if isinstance(header, BlockHeader) else 0,
                        "bytes": e.nbytes,
                    }
                )
        elif tier.name == "redis":
            assert isinstance(tier, _RedisListing)
            for h in tier.block_hashes():
                found = tier.find(h)
                if found is not None:
                    rows.append(
                        {
                            "tier": "redis",
                            "hash": h,
                            "parent": found.parent,
                            "start": found.start,
                            "tokens": found.num_tokens,
                            "bytes": found.nbytes,
                        }
                    )
    rows.sort(key=lambda r: (r["tier"], r["parent"], r["start"]))
    return rows
