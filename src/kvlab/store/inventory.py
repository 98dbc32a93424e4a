"""Listing what a store holds, tier by tier (for ``kvlab store ls``)."""

from __future__ import annotations

from kvlab.store.block import BlockHeader
from kvlab.store.store import KVStore


def list_blocks(store: KVStore) -> list[dict]:
    """One row per (tier, block): hash, parent, start position, tokens, bytes."""
    rows: list[dict] = []
    for tier in store.tiers:
        if tier.name == "memory":
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
            for h in tier.block_hashes():
                b = tier.find(h)
                if b is not None:
                    rows.append(
                        {
                            "tier": "redis",
                            "hash": h,
                            "parent": b.parent,
                            "start": b.start,
                            "tokens": b.num_tokens,
                            "bytes": b.nbytes,
                        }
                    )
    rows.sort(key=lambda r: (r["tier"], r["parent"], r["start"]))
    return rows
