"""Listing what a store holds, tier by tier (for ``kvlab store ls``)."""

from __future__ import annotations

from kvlab.store.block import read_block_meta
from kvlab.store.errors import CorruptBlockError
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
                try:
                    with open(e.path, "rb") as f:
                        n = int.from_bytes(f.read(8), "little")
                        meta, _, _ = read_block_meta(
                            n.to_bytes(8, "little") + f.read(min(max(n, 0), 50_000_000))
                        )
                except (OSError, CorruptBlockError):
                    meta = {"start": -1, "token_ids": []}
                rows.append(
                    {
                        "tier": "disk",
                        "hash": e.hash,
                        "parent": e.parent,
                        "start": meta.get("start", -1),
                        "tokens": len(meta.get("token_ids", [])),
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
